"""What the model writes (issue #63): eval.py --prompt continues text with transformers' generate, from an export, a
run directory or a ZeRO-3 checkpoint; train.py writes greedy samples at each validation (test_train.py's launches)."""

import json

import pytest
from conftest import metrics
from test_eval import bare_model  # noqa: F401 - the fixture: a random Llama and its BPE, no data needed

import eval as ev
from deepseek_zero3.evaluation import generate


def generated(capsys, *args) -> tuple[int, str, str]:
    code = ev.main([*map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def continuations(stdout: str) -> list[str]:
    """The continuations eval.py prints, one per prompt: what follows a `--- continuation` line up to the next
    prompt's `=== prompt` line (or the end)."""
    import re

    parts = re.split(r"^--- continuation \(.*\)\n", stdout, flags=re.MULTILINE)[1:]
    return [re.split(r"\n(?:=== prompt \d+\n|wrote )", p)[0].removesuffix("\n") for p in parts]


def test_a_prompt_is_continued_and_the_same_seed_gives_the_same_text(bare_model, tmp_path, capsys):  # noqa: F811
    """Two runs with --seed 1 print the same sampled text; --seed 2 another; greedy (temperature 0) is the model's
    argmax, which generate with the KV cache must equal token by token (a full forward over the whole text each
    time, no cache). Seen failing: with the seed set once for all prompts instead of per prompt, prompt 2's text
    depended on prompt 1's and --prompt_file's order changed it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown\nfox\n\n\nPython's documentation\n")
    common = ["--model", bare_model, "--prompt_file", prompts, "--max_new_tokens", 12, "--dtype", "float32"]
    code, first, err = generated(capsys, *common, "--seed", 1, "--prompt", "The lazy dog", "--output_json",
                                 tmp_path / "g.json")  # fmt: skip
    assert code == 0, err
    assert "generating on cpu in float32" in first and "continues 3 prompt(s): temperature 0.8, seed 1" in first
    report = json.loads((tmp_path / "g.json").read_text())["generation"]
    assert [s["prompt"] for s in report["samples"]] == [
        "The lazy dog",
        "The quick brown\nfox",
        "Python's documentation",
    ]
    assert all(s["new_tokens"] == 12 and s["continuation"] for s in report["samples"])
    assert continuations(first) == [s["continuation"] for s in report["samples"]]
    assert "nll" not in json.loads((tmp_path / "g.json").read_text())  # --prompt alone: no scores
    again = generated(capsys, *common, "--seed", 1, "--prompt", "The lazy dog")[1]
    assert continuations(again) == continuations(first)
    # the prompts' order does not change a prompt's text: the seed is set before each one
    code, alone, _ = generated(capsys, *common[:2], "--prompt", "Python's documentation", *common[4:], "--seed", 1)
    assert continuations(alone) == continuations(first)[2:]
    other = generated(capsys, *common, "--seed", 2, "--prompt", "The lazy dog")[1]
    assert continuations(other) != continuations(first)

    code, greedy, _ = generated(capsys, *common, "--temperature", 0, "--prompt", "The lazy dog")
    model = AutoModelForCausalLM.from_pretrained(bare_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(bare_model)
    ids = generate.prompt_ids(tokenizer, "The lazy dog", "prompt")
    import torch

    with torch.no_grad():
        for _ in range(12):  # argmax of a full forward each time, no KV cache
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    assert "greedy, seed 0, up to 12 new tokens" in greedy
    assert continuations(greedy)[0] == tokenizer.decode(ids[-12:])


@pytest.mark.parametrize(
    "args, said",
    [
        (["--prompt", ""], "--prompt '' (prompt 1) is empty"),
        (["--prompt", "ok", "--prompt", "abc\udcff", "--max_new_tokens", "8"], "prompt 2 (abc\\udcff) is not valid UTF-8"),  # \xff on a command line
        (["--prompt", "ok", "--temperature", "-0.5"], "--temperature -0.5 must be 0 (greedy) or a positive finite"),
        (["--prompt", "ok", "--temperature", "inf"], "--temperature inf must be 0 (greedy) or a positive finite"),
        (["--prompt", "ok", "--seed", str(10**20)], f"--seed {10**20} must be within [0, 2^63)"),
        (["--prompt", "ok", "--top_p", "0"], "--top_p 0.0 must be in (0, 1]"),
        (["--prompt", "ok", "--top_p", "1.01"], "--top_p 1.01 must be in (0, 1]"),
        (["--prompt", "ok", "--top_k", "-1"], "--top_k -1 must be 0 (off)"),
        (["--prompt", "ok", "--max_new_tokens", "0"], "--max_new_tokens 0 must be at least 1"),
        (["--prompt", "The quick brown fox " * 20], "which leaves no room in the model's context of 64 tokens"),
        (["--prompt", "ok", "--max_new_tokens", "62"], "is past the model's context of 64 tokens; lower it to at most"),
        (["--prompt_file", "missing.txt"], "--prompt_file missing.txt: no such file"),
        (["--prompt_file", "blank.txt"], "--prompt_file blank.txt holds no prompt"),
    ],
)
def test_bad_generation_input_is_one_line(args, said, bare_model, tmp_path, capsys, monkeypatch):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    code, _, err = generated(capsys, "--model", bare_model, *args)
    assert code == 2 and said in err, err
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err


@pytest.mark.launch
def test_a_checkpoint_writes_what_its_export_writes(ref_run, capsys):
    """The issue's check: the run's last checkpoint (3 ZeRO-3 shards consolidated in memory), the run directory (its
    newest checkpoint) and the export final/ continue a prompt alike, greedy and sampled with one seed; an earlier
    checkpoint (other weights) writes something else, so equality is not that of two models that write nothing."""
    trained = ref_run[0]
    steps = sorted(int(p.name.split("_")[1]) for p in (trained / "checkpoints").glob("step_*"))
    prompt = ["--prompt", "The module", "--prompt", "def main", "--max_new_tokens", 20, "--dtype", "float32"]
    texts = {}
    for name, model in (("final", trained / "final"), ("last", trained / "checkpoints" / f"step_{steps[-1]}"),
                        ("run", trained)):  # fmt: skip
        for temperature in (0, 0.8):
            code, out, err = generated(capsys, "--model", model, *prompt, "--temperature", temperature, "--seed", 1)
            assert code == 0, err
            texts[name, temperature] = continuations(out)
    print(f"\ngreedy: {texts['final', 0]}\nsampled: {texts['final', 0.8]}")
    assert texts["final", 0] == texts["last", 0] == texts["run", 0] and all(texts["final", 0])
    assert texts["final", 0.8] == texts["last", 0.8] == texts["run", 0.8]
    earlier = generated(capsys, "--model", trained / "checkpoints" / f"step_{steps[0]}", *prompt, "--temperature", 0)
    assert steps[0] < steps[-1] and continuations(earlier[1]) != texts["final", 0]


def test_prompt_files_are_blank_line_separated_blocks(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("first line\nsecond line\n\n\n  \nanother\n")
    assert generate.read_prompt_file(str(path)) == ["first line\nsecond line", "another"]


def test_held_out_prompts_take_document_starts_from_each_source_in_turn():
    import dataclasses

    import numpy as np

    @dataclasses.dataclass
    class Source:
        val_tokens: np.ndarray

    eos, n = 0, generate.PROMPT_TOKENS
    a = np.array([*range(1, 30), eos, *range(40, 45), eos, *range(50, 80), eos, *range(90, 95)])  # 2nd doc too short
    b = np.array([*range(100, 140), eos])
    prompts = generate.held_out_prompts([Source(a), Source(b)], eos)
    assert prompts == [[eos, *range(1, 1 + n)], [eos, *range(100, 100 + n)], [eos, *range(50, 50 + n)]]
    # a validation window that cuts its one long document (no EOS in it) still gives that document's start
    assert generate.held_out_prompts([Source(np.arange(1, 40))], eos) == [[eos, *range(1, 1 + n)]]


@pytest.mark.launch
def test_samples_at_each_validation_of_a_zero3_run(ref_run):
    """conftest's ref_run (3 ZeRO-3 processes, --eval_every 5 --sample_tokens 4): metrics.jsonl's validation records at
    steps 0, 5 and 10 each hold the 3 held-out prompts' greedy continuations and the seconds they took, the console
    shows them, and the model card shows the last ones. That they change nothing in training is test_train.py's
    test_resume_is_exact (a run without samples at step 5 equals this one to 1e-6) and test_reshard.py's."""
    out, proc = ref_run
    validations = [r for r in metrics(out) if "val_loss" in r]
    assert [r["step"] for r in validations] == [0, 5, 10]
    for record in validations:
        assert len(record["samples"]) == 3 and record["sample_s"] > 0, record
        assert all(s["prompt"] and 1 <= s["new_tokens"] <= 4 for s in record["samples"]), record["samples"]
    assert [s["prompt"] for s in validations[0]["samples"]] == [s["prompt"] for s in validations[-1]["samples"]]
    assert proc.stdout.count("\n  sample 1: [") == 3 and "| samples " in proc.stdout
    card = (out / "final" / "README.md").read_text()
    assert "## Samples (step 10)" in card and "greedy decoding" in card and "up to 4 tokens" in card
    last = validations[-1]["samples"][0]
    assert f"{last['prompt']}{last['continuation']}" in card
    # what the run wrote at its end, eval.py writes from its export (greedy, the same 4 tokens, the same prompt ids)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    prompt = [tokenizer.eos_token_id, *tokenizer(last["prompt"], add_special_tokens=False)["input_ids"]]
    again = generate.continue_prompts(final, tokenizer, [prompt], generate.Sampling(max_new_tokens=4), "cpu")
    assert again[0]["continuation"] == last["continuation"]


def test_metrics_jsonl_keeps_a_validation_record_with_samples(tmp_path):
    """Seen failing with the reader's old rule (every value a scalar): the record was dropped as a torn line, and a
    resume's cut-back (truncate_metrics) deleted it."""
    from deepseek_zero3.run_dir import metrics as metrics_lib

    path = tmp_path / "metrics.jsonl"
    sample = {"prompt": "def f", "continuation": "(x):", "new_tokens": 3, "ended": False}
    metrics_lib.append(path, {"step": 5, "val_loss": 2.0, "samples": [sample], "sample_s": 0.5})
    metrics_lib.append(path, {"step": 6, "loss": 1.0, "bad": [[1]]})
    records, bad = metrics_lib.read_metrics(path)
    assert records == [{"step": 5, "val_loss": 2.0, "samples": [sample], "sample_s": 0.5}] and bad == 1


def test_mtp_modules_beside_an_export_are_said_unused(bare_model, tmp_path, capsys):  # noqa: F811
    """An export with DeepSeek-V3's MTP modules beside it (final/mtp.safetensors) continues with the main model, and
    one line says so; the text is the main model's alone (the same as without the file)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    model = tmp_path / "with_mtp"
    shutil.copytree(bare_model, model)
    save_file({"model.layers.2.eh_proj.weight": torch.zeros(16, 32)}, model / "mtp.safetensors")
    args = ["--prompt", "The lazy dog", "--max_new_tokens", 8, "--temperature", 0]
    code, out, err = generated(capsys, "--model", model, *args)
    assert code == 0, err
    assert out.count("MTP modules are not used for sampling") == 1
    assert continuations(out) == continuations(generated(capsys, "--model", bare_model, *args)[1])
