"""eval.py: exact against brute force, consistent report, bad inputs, and WikiText end to end."""

import json
import math
import re
import sys

import pytest
import torch
from conftest import WIKITEXT2, needs_wikitext, run

import eval as ev
from deepseek_zero3.model import lmloss

EVAL = [sys.executable, "eval.py"]
DOCS = [
    "The quick brown fox jumps over the lazy dog. " * 6,
    "def f(x):\n    return x + 1\n",
    "A short one.",
    "Python's documentation is a corpus too; it has many, many words in it. " * 4,
]


@pytest.fixture(scope="module")
def small_model(docs_data, tmp_path_factory):
    """A random 2-layer Llama with the data's tokenizer, saved as a plain Hugging Face directory."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(docs_data / "tokenizer")
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=512,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
    )
    out = tmp_path_factory.mktemp("model") / "random"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def brute_force_nll(model, tok, docs, max_length, stride):
    """Each token scored alone, with exactly the context its window allows: one forward pass per token."""
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    total = 0.0
    for doc in docs:
        seq = [prefix] + tok(doc, add_special_tokens=False)["input_ids"]
        n = len(seq) - 1
        for t in range(1, n + 1):
            k = (t - 1) // stride
            end = min((k + 1) * stride + 1, n + 1)
            start = max(0, end - 1 - max_length)
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([seq[start:t]])).logits[0, -1].double()
            total -= torch.log_softmax(logits, -1)[seq[t]].item()
    return total


def test_rolling_windows_score_each_token_once():
    for n in (1, 5, 16, 17, 40):
        for length, stride in ((16, 16), (16, 5), (8, 1)):
            windows = lmloss.rolling_windows(n, length, stride)
            scored = [t for _, first, end in windows for t in range(first, end)]
            assert scored == list(range(1, n + 1))
            assert all(end - 1 - start <= length for start, _, end in windows)


@pytest.mark.parametrize("stride", [16, 5])
@pytest.mark.slow
def test_nll_equals_brute_force(small_model, stride, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    report = ev.evaluate(
        ev.Config(
            model=str(small_model),
            dataset=str(data),
            split="test",
            max_length=16,
            stride=stride,
            batch_size=3,
            dtype="float32",
        )
    )
    model = AutoModelForCausalLM.from_pretrained(small_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(small_model)
    expected = brute_force_nll(model, tok, DOCS, 16, stride)
    assert report["nll"] == pytest.approx(expected, rel=1e-5)
    assert report["tokens"] == sum(len(tok(d, add_special_tokens=False)["input_ids"]) for d in DOCS)
    assert report["documents"] == len(DOCS)


def test_loss_over_chunks_only_where_logits_are_the_output_layers(small_model, capsys):
    """score_windows (and training) take the loss over the output layer a chunk of tokens at a time only when the model
    returns that layer's result as its logits; Gemma 2 caps its logits (final_logit_softcapping), so it gets the whole
    logits, named in one note. Either way the NLL is the full logits' NLL."""
    from transformers import AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM

    llama = AutoModelForCausalLM.from_pretrained(small_model).eval()
    torch.manual_seed(0)
    gemma = Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=512,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            final_logit_softcapping=3.0,
        )
    ).eval()
    inputs = torch.randint(0, 512, (2, 12))
    targets = torch.randint(0, 512, (2, 12))
    targets[1, :4] = -100
    for model, chunked in ((llama, True), (gemma, False)):
        with torch.inference_mode():
            full = lmloss.nll_sum(model(input_ids=inputs).logits, targets)
            for _ in range(2):
                nll, n = lmloss.model_nll(model, inputs, targets, chunk_tokens=5)
                assert float(nll) == pytest.approx(float(full[0]), rel=1e-6) and n == full[1] == 20
        assert lmloss._plain[model] is chunked
    notes = [l for l in capsys.readouterr().out.splitlines() if l.startswith("note:")]
    assert notes == ["note: Gemma2ForCausalLM changes its output layer's logits; the loss takes them whole"]


def test_report_is_consistent():
    r = ev.perplexity_report(nll=1000.0, tokens=400, words=250, n_bytes=1200, documents=3)
    assert math.log(r["token_perplexity"]) * 400 == pytest.approx(1000.0)
    assert math.log(r["word_perplexity"]) * 250 == pytest.approx(1000.0)
    assert math.log(r["byte_perplexity"]) * 1200 == pytest.approx(1000.0)
    assert r["bits_per_byte"] == pytest.approx(math.log2(r["byte_perplexity"]))
    assert ev.word_count("a  b\nc ") == 4  # the harness's re.split(r"\s+"), trailing empty string included


@pytest.mark.slow
def test_bad_inputs(small_model, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny_vocab = tmp_path / "tiny_vocab"
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    ).save_pretrained(tiny_vocab)
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "ok.txt").write_text("Some text.\n\nMore text.\n")
    cases = [
        (["--model", str(tmp_path), "--dataset", str(tmp_path / "ok.txt")], "not a model directory"),
        (
            ["--model", str(tiny_vocab), "--tokenizer", str(small_model), "--dataset", str(tmp_path / "ok.txt")],
            "vocab_size is 64",
        ),
        (
            ["--model", str(small_model), "--dataset", str(tmp_path / "empty.txt")],
            "empty.txt is empty (whitespace only)",
        ),
        (
            [
                "--model",
                str(small_model),
                "--dataset",
                str(tmp_path / "ok.txt"),
                "--max_length",
                "16",
                "--stride",
                "32",
            ],
            "--stride 32 must be between 1 and --max_length 16",
        ),
    ]
    for args, message in cases:
        out = tmp_path / "report.json"
        proc = run(EVAL + args + ["--output_json", str(out)], check=False)
        assert proc.returncode == 2, (args, proc.stderr)
        assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert not out.exists()


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"])
@pytest.mark.slow
def test_offline_mode_refuses_every_hub_choice_in_one_line(variable, small_model, tmp_path):
    """Offline mode is a normal state: with each offline variable and an empty Hugging Face cache, every Hub-backed
    choice (the default WikiText, wikitext-103, a Hub model, a Hub tokenizer) is one `error:` line naming the variable
    and what to pass instead, not datasets' ConnectionError."""
    (tmp_path / "ok.txt").write_text("Some text.\n\nMore text.\n")
    env = {variable: "1", "HF_HOME": str(tmp_path / "hf")}
    cases = [
        (["--model", small_model], f"--dataset wikitext-2: {variable}=1 (offline mode)"),
        (["--model", small_model, "--dataset", "wikitext-103"], f"--dataset wikitext-103: {variable}=1 (offline mode)"),
        (["--model", small_model, "--dataset", "wikitext-2", "--tasks", "hellaswag"], f"{variable}=1 (offline mode)"),
        (
            ["--model", "gpt2", "--dataset", tmp_path / "ok.txt"],
            f"--model gpt2 is not a local directory, and {variable}",
        ),
        (["--model", small_model, "--tokenizer", "gpt2", "--dataset", tmp_path / "ok.txt"], "--tokenizer gpt2 "),
    ]
    for args, message in cases if variable == "HF_HUB_OFFLINE" else cases[0:4:3]:  # how each library reads its variable
        proc = run(EVAL + list(map(str, args)), check=False, env=env)
        assert proc.returncode == 2, (args, proc.stderr[-3000:])
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and message in errors[0], (args, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_a_report_the_disk_refuses_is_one_line(small_model, tmp_path):
    """Issue #35: the disk fills up during the evaluation (a 200-byte file size limit here): the report is printed,
    then one `error:` line says it was not saved, exit 3, no traceback."""
    import resource

    (tmp_path / "ok.txt").write_text("Some text.\n\nMore text.\n")
    out = tmp_path / "report.json"
    proc = run(EVAL + ["--model", str(small_model), "--dataset", str(tmp_path / "ok.txt"), "--output_json", str(out)],
               check=False, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200)))  # fmt: skip
    assert proc.returncode == 3 and "bits_per_byte" in proc.stdout, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --output_json {out}: File too large; the report above was not saved: free space"]
    assert "Traceback" not in proc.stderr and not out.exists()


@needs_wikitext
def test_wikitext_test_split_end_to_end(trained, tmp_path):
    """The CLI on WikiText-2's test file, its first 6 pages (tests/test_harness.py scores all 62 against the harness):
    the harness's transform, a trained model's perplexity, and --raw_text with the same words and bytes but another
    token stream."""
    out = tmp_path / "wt2.json"
    model, wiki = str(trained / "final"), str(WIKITEXT2 / "wiki.test.raw")
    proc = run(EVAL + ["--model", model, "--dataset", wiki, "--max_documents", "6", "--batch_size", "16",
                       "--output_json", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    assert report["documents"] == 6 and report["text_transform"] == ev.HARNESS_TRANSFORM
    assert "text transform: lm-eval wikitext_detokenizer" in proc.stdout
    assert 1 < report["token_perplexity"] < 512  # a trained model beats uniform over its 512-token vocabulary
    raw = ev.evaluate(ev.Config(model=model, dataset=str(WIKITEXT2), split="test", batch_size=16, max_documents=6,
                                raw_text=True))  # fmt: skip
    assert raw["text_transform"] == "none" and (raw["words"], raw["bytes"]) == (report["words"], report["bytes"])
    assert raw["tokens"] != report["tokens"] and raw["documents"] == 6  # the detokenized text is another token stream


@pytest.mark.slow
def test_wikitext_errors_name_the_file_and_the_splits(small_model, tmp_path):
    wiki = tmp_path / "wiki"
    wiki.mkdir()
    (wiki / "wiki.test.raw").write_text(" \n Just a paragraph with no title line . \n")
    cases = [
        (
            ["--dataset", str(wiki / "wiki.test.raw")],
            f"{wiki / 'wiki.test.raw'} is named like a WikiText file but has no article title",
        ),
        (["--dataset", str(wiki), "--split", "validation"], "has no 'validation' split (it has ['test'])"),
    ]
    for args, message in cases:
        proc = run(EVAL + ["--model", str(small_model), *args], check=False)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_documents_split_over_processes_give_the_same_nll(trained, docs_data, tmp_path):
    """Two real processes (torchrun; `accelerate launch --cpu` would start one), each scoring half the documents."""
    from pathlib import Path

    from conftest import free_port

    torchrun = str(Path(sys.executable).with_name("torchrun"))
    args = [
        "eval.py",
        "--model",
        str(trained / "final"),
        "--dataset",
        str(docs_data),
        "--split",
        "validation",
        "--max_length",
        "64",
    ]
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    run([sys.executable, *args, "--output_json", str(one)])
    proc = run(
        [torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), *args, "--output_json", str(two)],
        env={"ACCELERATE_USE_CPU": "1"},
    )
    assert ", 2 processes" in proc.stdout
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert (a["processes"], b["processes"]) == (1, 2)
    assert a["tokens"] == b["tokens"] and a["documents"] == b["documents"]
    # Each process batches its own windows, so padding and batch shapes differ: fp32 sums agree to ~1e-9, not bitwise.
    assert b["nll"] == pytest.approx(a["nll"], rel=1e-7)


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory):
    """A random 2-layer Llama with a 300-token BPE trained here: a model directory without prepare_data.py."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(
        DOCS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], initial_alphabet=alphabet)
    )
    out = tmp_path_factory.mktemp("model") / "bare"
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>").save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def _edit_config(**changes):
    def edit(model_dir):
        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps({**config, **changes}))

    return edit


def _truncate(name, n_bytes):
    return lambda model_dir: (model_dir / name).write_bytes((model_dir / name).read_bytes()[:n_bytes])


def _remove(*names):
    return lambda model_dir: [(model_dir / name).unlink() for name in names]


# (how the copy of the model directory is damaged, what the one error line says). Before issue #20 most were a
# traceback, and a config.json with one layer too many was scored with that layer at random.
DAMAGED_MODELS = {
    "torn config.json": (_truncate("config.json", 100), "config.json is not valid JSON ("),
    "empty config.json": (_truncate("config.json", 0), "config.json is empty"),
    "config.json a list": (lambda d: (d / "config.json").write_text("[]"), "config.json holds a JSON list"),
    "truncated weights": (_truncate("model.safetensors", 5000), "model.safetensors is damaged (Error while deserial"),
    "empty weights": (_truncate("model.safetensors", 0), "model.safetensors is damaged ("),
    "torn tokenizer.json": (_truncate("tokenizer.json", 300), "tokenizer.json is not valid JSON ("),
    "foreign tokenizer.json": (
        lambda d: (d / "tokenizer.json").write_text('{"version": "1.0", "added_tokens": [], "model": {"type": "x"}}'),
        "its tokenizer cannot be loaded (data did not match any variant",
    ),
    "no tokenizer": (_remove("tokenizer.json", "tokenizer_config.json"), "its tokenizer cannot be loaded ("),
    "a layer more than the weights": (
        _edit_config(num_hidden_layers=3),
        "its config.json and its weights do not belong together: 9 tensors missing from the weights",
    ),
    "another FFN width than the weights": (
        _edit_config(intermediate_size=48),
        "do not belong together: 6 tensors of another shape than the config says",
    ),
    "a layer less than the weights": (_edit_config(num_hidden_layers=1), "9 tensors the config has no place for"),
    # Issue #59: a StrictDataclassClassValidationError traceback, and a RuntimeError in the first forward pass.
    "heads not dividing hidden_size": (
        _edit_config(num_attention_heads=3),
        "config.json has num_attention_heads=3, which does not divide hidden_size=16",
    ),
    "KV heads not dividing the heads": (
        _edit_config(num_key_value_heads=3),
        "config.json has num_key_value_heads=3, which does not divide num_attention_heads=2",
    ),
    "a field of the wrong type": (
        _edit_config(num_key_value_heads="2"),
        "config.json is refused by transformers: Validation error for field 'num_key_value_heads'",
    ),
}


@pytest.mark.parametrize("case", DAMAGED_MODELS, ids=str)
def test_damaged_model_directories_are_refused_in_one_line(case, bare_model, tmp_path, capsys):
    import shutil

    damage, message = DAMAGED_MODELS[case]
    model = tmp_path / "model"
    shutil.copytree(bare_model, model)
    damage(model)
    (tmp_path / "ok.txt").write_text("Some text.\n\nMore text.\n")
    out = tmp_path / "report.json"
    code = ev.main(["--model", str(model), "--dataset", str(tmp_path / "ok.txt"), "--output_json", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and f"error: --model {model}" in err and message in err, err
    assert not out.exists()


def _output_cases(tmp_path):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "read_only").mkdir(mode=0o555)
    return {
        "parent is a file": (tmp_path / "a_file" / "x.json", f"{tmp_path / 'a_file'} is a file, not a directory"),
        "deeper under a file": (tmp_path / "a_file" / "sub" / "x.json", "a_file is a file, not a directory"),
        "a directory": (tmp_path / "a_dir", "is a directory; name a file in it"),
        "read-only directory": (tmp_path / "read_only" / "x.json", "cannot write in"),
    }


@pytest.mark.parametrize("case", ["parent is a file", "deeper under a file", "a directory", "read-only directory"])
def test_unwritable_output_json_is_refused_before_the_evaluation(case, bare_model, tmp_path, capsys):
    import os

    if case == "read-only directory" and os.geteuid() == 0:
        pytest.skip("root writes into a mode 555 directory")
    path, message = _output_cases(tmp_path)[case]
    (tmp_path / "ok.txt").write_text("Some text.\n\nMore text.\n")
    code = ev.main(["--model", str(bare_model), "--dataset", str(tmp_path / "ok.txt"), "--output_json", str(path)])
    captured = capsys.readouterr()
    assert code == 2 and f"error: --output_json {path}" in captured.err and message in captured.err, captured.err
    assert "perplexity" not in captured.out  # refused before the work, not after it


def test_output_json_directories_are_created(bare_model, tmp_path, capsys):
    (tmp_path / "ok.txt").write_text("Some text.\n\nMore text.\n")
    out = tmp_path / "new" / "dirs" / "report.json"
    assert ev.main(["--model", str(bare_model), "--dataset", str(tmp_path / "ok.txt"), "--output_json", str(out)]) == 0
    assert json.loads(out.read_text())["documents"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "ok.txt"]  # the write check left nothing behind


@pytest.mark.parametrize("where", ["empty directory", "no such path"])
def test_a_bad_tokenizer_is_named_as_the_tokenizer(where, bare_model, tmp_path, capsys):
    tokenizer = tmp_path / "tok"
    if where == "empty directory":
        tokenizer.mkdir()
    (tmp_path / "ok.txt").write_text("Some text.\n\nMore text.\n")
    args = ["--model", str(bare_model), "--tokenizer", str(tokenizer), "--dataset", str(tmp_path / "ok.txt")]
    assert ev.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --tokenizer {tokenizer}") and err.count("\n") == 1, err


@pytest.mark.parametrize("flag", ["--model", "--output_json"])
def test_a_name_past_the_filesystems_limit_is_one_line(flag, bare_model, tmp_path, capsys):
    """A --model or --output_json with a name of 300 bytes (over NAME_MAX): one line before the work, not the
    OSError traceback of Python's own existence checks (issue #59, the class "a file's name is whatever bytes the
    filesystem allows")."""
    (tmp_path / "ok.txt").write_text("Some text.\n\nMore text.\n")
    long_name = str(tmp_path / ("n" * 300))
    paths = {"--model": str(bare_model), "--output_json": str(tmp_path / "report.json")}
    paths[flag] = long_name
    code = ev.main(["--model", paths["--model"], "--dataset", str(tmp_path / "ok.txt"), "--output_json",
                    paths["--output_json"]])  # fmt: skip
    err = capsys.readouterr().err
    # The path is printed shortened in its middle when long (a tmp_path may be long itself): its start and its end.
    assert code == 2 and err.startswith(f"error: {flag} {str(tmp_path)[:20]}") and err.count("\n") == 1, err
    assert f"{'n' * 20} (" in err, err
    assert "a name of 300 bytes, over the 255 bytes a name may have" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.txt"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a process that sees a GPU scores on it")
def test_the_first_line_names_device_and_dtype_and_a_hidden_gpu_is_said(bare_model, tmp_path, capsys, monkeypatch):
    """README once said `CUDA_VISIBLE_DEVICES=3 python eval.py ...` for a machine of 3 GPUs (0, 1, 2): CUDA then shows
    the process none, and eval.py scored on the CPU in fp32 without a word. Its first line now names the device and
    dtype, and a CUDA_VISIBLE_DEVICES that leaves no GPU is said, with how to pick one; --device cuda is refused in one
    line. This torch has no CUDA: a CUDA build is stood in for by its version string (torch.version.cuda), the one
    part not real here. Seen failing before: no such lines."""
    (tmp_path / "ok.txt").write_text("Some text.\n\nMore text.\n")
    args = ["--model", str(bare_model), "--dataset", str(tmp_path / "ok.txt")]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def first_lines(*extra) -> list[str]:
        assert ev.main([*args, *extra]) == 0
        return capsys.readouterr().out.splitlines()[:2]

    assert first_lines()[0] == "scoring on cpu in float32" and "CUDA_VISIBLE_DEVICES" not in first_lines()[1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    lines = first_lines()
    assert lines[0] == "scoring on cpu in float32", lines
    assert lines[1].startswith("warning: CUDA_VISIBLE_DEVICES='3' leaves this process no GPU (CUDA numbers"), lines
    assert "`nvidia-smi -L`" in lines[1] and "--device cpu" in lines[1]
    assert "CUDA_VISIBLE_DEVICES" not in first_lines("--device", "cpu")[1]  # the CPU on purpose
    assert ev.main([*args, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device cuda: this process sees no CUDA device (CUDA_VISIBLE_DEVICES='3'"), err
    assert err.count("\n") == 1
    monkeypatch.setattr(torch.version, "cuda", None)  # this torch as it is: built without CUDA
    assert first_lines()[1].startswith("note: CUDA_VISIBLE_DEVICES='3' is set, but this torch")


# Every layout of weights that transformers reads: one safetensors file (what the fixtures save), pytorch_model.bin,
# and either of them in shards with an index naming each tensor's shard. Each is rewritten from model.safetensors.
def _relayout(fmt: str, shards: int):
    def relayout(model_dir):
        from safetensors.torch import load_file, save_file

        weights = load_file(str(model_dir / "model.safetensors"))
        (model_dir / "model.safetensors").unlink()
        if shards == 1:
            return torch.save(weights, model_dir / "pytorch_model.bin")
        stem, suffix = ("model", ".safetensors") if fmt == "safetensors" else ("pytorch_model", ".bin")
        weight_map = {}
        for i in range(shards):
            name = f"{stem}-{i + 1:05d}-of-{shards:05d}{suffix}"
            part = {k: v for k, v in sorted(weights.items())[i::shards]}
            save_file(part, str(model_dir / name), {"format": "pt"}) if fmt == "safetensors" else torch.save(
                part, model_dir / name
            )
            weight_map.update(dict.fromkeys(part, name))
        index = {"metadata": {"total_size": sum(t.nbytes for t in weights.values())}, "weight_map": weight_map}
        (model_dir / f"{stem}{suffix}.index.json").write_text(json.dumps(index))

    return relayout


LAYOUTS = {
    "model.safetensors": lambda model_dir: None,
    "pytorch_model.bin": _relayout("bin", 1),
    "sharded safetensors": _relayout("safetensors", 3),
    "sharded bin": _relayout("bin", 3),
}
ST_INDEX, BIN_INDEX = "model.safetensors.index.json", "pytorch_model.bin.index.json"
ST_SHARD, BIN_SHARD = "model-{:05d}-of-00003.safetensors", "pytorch_model-{:05d}-of-00003.bin"


def _edit_index(name, edit):
    def edit_index(model_dir):
        index = json.loads((model_dir / name).read_text())
        edit(index)
        (model_dir / name).write_text(json.dumps(index))

    return edit_index


def _misplace_a_tensor(index):
    tensor = sorted(index["weight_map"])[0]
    index["weight_map"][tensor] = ST_SHARD.format(2 if index["weight_map"][tensor] != ST_SHARD.format(2) else 1)


# (layout, damage, what the one error line says). Before issue #59 those marked * were a traceback, those marked ~
# named no file or blamed another one (the config.json, for a tensor the index misplaced).
DAMAGED_WEIGHTS = {
    "sharded safetensors, a shard missing": (
        "sharded safetensors", _remove(ST_SHARD.format(2)), f"{ST_INDEX} names {ST_SHARD.format(2)}, which is missing"
    ),
    "sharded safetensors, the index names a shard that is not there": (
        "sharded safetensors",
        _edit_index(ST_INDEX, lambda i: i["weight_map"].update({"lm_head.weight": "model-00004-of-00003.safetensors"})),
        f"{ST_INDEX} names model-00004-of-00003.safetensors, which is missing",
    ),
    "sharded safetensors, an index without weight_map *": (
        "sharded safetensors",
        _edit_index(ST_INDEX, lambda i: i.pop("weight_map")),
        f"{ST_INDEX} has no weight_map",
    ),
    "sharded safetensors, a tensor in another shard than the index says ~": (
        "sharded safetensors",
        _edit_index(ST_INDEX, _misplace_a_tensor),
        f"{ST_INDEX} places lm_head.weight in {ST_SHARD.format(2)}, which does not hold it",
    ),
    "sharded safetensors, a truncated shard": (
        "sharded safetensors", _truncate(ST_SHARD.format(1), 100), f"{ST_SHARD.format(1)} is damaged ("
    ),
    "pytorch_model.bin truncated *": ("pytorch_model.bin", _truncate("pytorch_model.bin", 3000),
                                      "pytorch_model.bin is damaged ("),  # fmt: skip
    "pytorch_model.bin empty *": ("pytorch_model.bin", _truncate("pytorch_model.bin", 0),
                                  "pytorch_model.bin is damaged ("),  # fmt: skip
    "pytorch_model.bin not a checkpoint *": (
        "pytorch_model.bin",
        lambda d: (d / "pytorch_model.bin").write_bytes(bytes(range(256)) * 20),
        "pytorch_model.bin is damaged (",
    ),
    "pytorch_model.bin holds a list ~": (
        "pytorch_model.bin",
        lambda d: torch.save([torch.zeros(2)], d / "pytorch_model.bin"),
        "pytorch_model.bin holds a list, not tensors by name",
    ),
    "sharded bin, a truncated shard ~": ("sharded bin", _truncate(BIN_SHARD.format(1), 3000),
                                         f"{BIN_SHARD.format(1)} is damaged ("),  # fmt: skip
    "sharded bin, an empty shard *": ("sharded bin", _truncate(BIN_SHARD.format(2), 0),
                                      f"{BIN_SHARD.format(2)} is damaged ("),  # fmt: skip
    "sharded bin, a shard missing": (
        "sharded bin", _remove(BIN_SHARD.format(3)), f"{BIN_INDEX} names {BIN_SHARD.format(3)}, which is missing"
    ),
    "sharded bin, a torn index ~": ("sharded bin", _truncate(BIN_INDEX, 50), f"{BIN_INDEX} is not valid JSON ("),
    "sharded bin, an index without weight_map *": (
        "sharded bin", _edit_index(BIN_INDEX, lambda i: i.pop("weight_map")), f"{BIN_INDEX} has no weight_map"
    ),
    "sharded bin, a foreign tensor set": (
        "sharded bin",
        lambda d: [torch.save({"encoder.weight": torch.zeros(2)}, d / BIN_SHARD.format(i)) for i in (1, 2, 3)],
        "its config.json and its weights do not belong together: 21 tensors missing",
    ),
    "no weights ~": (
        "model.safetensors",
        _remove("model.safetensors"),
        "holds no weights (model.safetensors, model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.ind",
    ),
}


def test_every_weight_layout_scores_the_same(bare_model, tmp_path):
    """No layout is refused by the checks below: each scores the same NLL as the safetensors file it was made from."""
    import shutil

    (tmp_path / "ok.txt").write_text("Some text.\n\nMore text.\n")
    nll = {}
    for layout, relayout in LAYOUTS.items():
        model = tmp_path / layout.replace(" ", "_")
        shutil.copytree(bare_model, model)
        relayout(model)
        nll[layout] = ev.evaluate(ev.Config(model=str(model), dataset=str(tmp_path / "ok.txt")))["nll"]
    assert len(set(nll.values())) == 1, nll


@pytest.mark.parametrize("case", DAMAGED_WEIGHTS, ids=str)
def test_damaged_weights_in_every_layout_are_refused_in_one_line(case, bare_model, tmp_path, capsys):
    import shutil

    layout, damage, message = DAMAGED_WEIGHTS[case]
    model = tmp_path / "model"
    shutil.copytree(bare_model, model)
    LAYOUTS[layout](model)
    damage(model)
    (tmp_path / "ok.txt").write_text("Some text.\n\nMore text.\n")
    out = tmp_path / "report.json"
    code = ev.main(["--model", str(model), "--dataset", str(tmp_path / "ok.txt"), "--output_json", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: --model {model}") and message in err, err
    assert err.count("\n") == 1 and not out.exists(), err


def test_packed_data_of_another_tokenizer_is_refused(small_model, docs_data, tmp_path, capsys):
    """Issue #59: --packed_seq_len scored the token ids of data prepared with another 512-token BPE as if they were the
    model's (a val_bpb, exit 0), and those of a 1,024-token BPE ended in an IndexError in the embedding (a device-side
    assert on a GPU). The data's tokenizer must be the model's, as the text path and train.py --init_from require."""
    import prepare_data

    for vocab, differ in ((512, "the model's 512 tokens, the data's 512"), (1024, "the data's 1024")):
        data = tmp_path / f"bpe{vocab}"  # the web text alone: another BPE than docs_data's python-docs + web one
        assert prepare_data.main(["--dataset", str(docs_data.parent / "web.jsonl"), "--tokenizer", f"bpe:{vocab}",
                                  "--output_dir", str(data), "--num_proc", "1"]) == 0  # fmt: skip
        capsys.readouterr()
        out = tmp_path / "report.json"
        code = ev.main(["--model", str(small_model), "--dataset", str(data), "--split", "validation",
                        "--packed_seq_len", "32", "--output_json", str(out)])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and not out.exists(), err
        assert err.startswith(f"error: --dataset {data} was tokenized with another tokenizer than the model's"), err
        assert differ in err, err


def test_text_without_spaces_reports_an_overflowing_perplexity_as_null(bare_model, tmp_path, capsys):
    """Issue #59: Chinese has no spaces, so a document is one word, and exp(NLL / words) overflowed at the very end: an
    OverflowError traceback, the evaluation and its JSON lost. The report keeps every total and the perplexities that
    fit a float; the one that does not is null in the JSON, with a note saying why, and inf on the console."""
    (tmp_path / "zh.txt").write_text("语言模型的评估需要很多文字" * 20 + "\n\n" + "今天天气很好我们去公园散步" * 20 + "\n")
    out = tmp_path / "report.json"
    assert ev.main(["--model", str(bare_model), "--dataset", str(tmp_path / "zh.txt"), "--output_json", str(out)]) == 0
    console = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["words"] == 2 and report["nll"] / report["words"] > 710  # past exp's range (709.78)
    assert report["word_perplexity"] is None and math.isfinite(report["token_perplexity"])
    assert report["bits_per_byte"] == pytest.approx(report["nll"] / report["bytes"] / math.log(2))
    assert any(note.startswith("word_perplexity: exp(NLL / words) = exp(") for note in report["notes"]), report
    assert re.search(r"word_perplexity +inf", console), console


@pytest.mark.parametrize("update_card", [False, True])
def test_a_float16_overflow_is_an_error_not_a_nan_report(bare_model, tmp_path, capsys, update_card):
    """Issue #59: a model whose activations exceed float16's range (65504), scored with --dtype float16, reported NaN
    with exit 0, and --update_card said it added the scores while writing an empty table. Now one `error:` line says
    why and what to use, exit 2, no JSON, the card untouched; bfloat16 scores the same model."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(bare_model, model)
    weights = load_file(str(model / "model.safetensors"))
    norm = weights["model.layers.0.post_attention_layernorm.weight"]
    weights["model.layers.0.post_attention_layernorm.weight"] = torch.full_like(norm, 1e4)  # the MLP's inner ~1e6
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, str(model / "model.safetensors"))
    card = "---\nlicense: unknown\n---\n# a model\n"
    (model / "README.md").write_text(card)
    (tmp_path / "ok.txt").write_text("Some text.\n\nMore text.\n")
    out = tmp_path / "report.json"
    args = ["--model", str(model), "--dataset", str(tmp_path / "ok.txt"), "--output_json", str(out)]
    code = ev.main([*args, "--dtype", "float16", *(["--update_card"] if update_card else [])])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: the NLL is nan in float16: the model's activations overflow float16's range"), err
    assert "--dtype bfloat16 or float32" in err and not out.exists()
    assert (model / "README.md").read_text() == card
    assert ev.main([*args, "--dtype", "bfloat16"]) == 0 and math.isfinite(json.loads(out.read_text())["nll"])


def test_special_token_text_in_a_document_is_scored_as_text(docs_data):
    """Issue #59: the text path tokenized a literal `<|endoftext|>` inside a document as the EOS token, as
    prepare_data.py did; it is text (the model was trained on it as text)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(docs_data / "tokenizer")
    doc = "A model card may say: documents end with <|endoftext|> in GPT-2's training data."
    windows = lmloss.make_windows([doc], tok, tok.eos_token_id, 1024, 1024)
    assert len(windows) == 1 and tok.eos_token_id not in windows[0][0][1:]  # only the conditioning prefix
    assert tok.decode(windows[0][1]) == doc


def test_packed_data_prepared_before_special_token_text_was_text_carries_a_note(small_model, docs_data, tmp_path,
                                                                                 capsys):  # fmt: skip
    """Such data (meta.json without special_tokens_in_documents) is still scored, as train.py still trains on it,
    with one note saying what may be wrong in it and how to rebuild it."""
    import shutil

    data = tmp_path / "old"
    shutil.copytree(docs_data, data)
    meta = json.loads((data / "meta.json").read_text())
    del meta["special_tokens_in_documents"]
    (data / "meta.json").write_text(json.dumps(meta))
    args = ["--model", str(small_model), "--dataset", str(data), "--split", "validation", "--packed_seq_len", "32",
            "--eval_tokens", "256"]  # fmt: skip
    assert ev.main(args) == 0
    err = capsys.readouterr().err
    assert f"note: {data} was prepared before special tokens' text in documents was tokenized as text" in err, err
    assert ev.main([*args[:3], str(docs_data), *args[4:]]) == 0 and "note:" not in capsys.readouterr().err
