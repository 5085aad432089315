"""eval.py --tasks against lm-evaluation-harness's own CLI, and a training checkpoint as a model (issue #27).

The tasks are local ones (the Hub is out of reach): a multiple-choice task and a log-likelihood task written here over
the held-out python-docs text, defined in YAML for the harness's --include_path. eval.py's acc / acc_norm / perplexity
must equal what `lm_eval --model hf` gives on the same exported model, dtype and batch size, exactly. A checkpoint
OUT/checkpoints/step_N of a 3-process ZeRO-3 run must score exactly as the model exported at that step (final/, the
last step), for the Llama and the DeepSeek-V3 presets, without writing into the run."""

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest
from common import harness_command, held_out_words, multiple_choice_rows, read_harness_results
from conftest import TINY, run

import eval as ev

TASKS = "local_mc,local_ll"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
{prompt}
metric_list:
{metrics}
"""
MC_PROMPT = 'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"'
LL_PROMPT = 'doc_to_text: "{{context}}"\ndoc_to_target: "{{target}}"'


def metric_lines(*names_aggregation_better) -> str:
    return "".join(
        f"  - metric: {m}\n    aggregation: {agg}\n    higher_is_better: {better}\n"
        for m, agg, better in names_aggregation_better
    )


def write_local_tasks(docs_data: Path, directory: Path) -> Path:
    """local_mc: the first 10 words of a held-out document, then its next 6 words among 3 other documents' (4 choices,
    acc and acc_norm); local_ll: the first 12 words, then the 13th (lambada-like: perplexity and acc)."""
    words = held_out_words(docs_data)
    assert len(words) == 16
    mc = multiple_choice_rows(words)
    ll = [{"context": " ".join(w[:12]), "target": " " + w[12]} for w in words]
    directory.mkdir(parents=True, exist_ok=True)
    for name, rows, output_type, prompt, metrics in (
        ("local_mc", mc, "multiple_choice", MC_PROMPT, [("acc", "mean", "true"), ("acc_norm", "mean", "true")]),
        ("local_ll", ll, "loglikelihood", LL_PROMPT, [("perplexity", "perplexity", "false"), ("acc", "mean", "true")]),
    ):
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (directory / f"{name}.yaml").write_text(
            TASK_YAML.format(
                name=name, data=data.resolve(), output_type=output_type, prompt=prompt, metrics=metric_lines(*metrics)
            )
        )
    return directory


@pytest.fixture(scope="module")
def task_dir(docs_data, tmp_path_factory) -> Path:
    return write_local_tasks(docs_data, tmp_path_factory.mktemp("tasks"))


def scores(report_tasks: dict) -> dict:
    """{task: {metric: value}} of a harness results dict, stderrs left out."""
    return {
        task: {k.split(",")[0]: v for k, v in metrics.items() if "," in k and "_stderr" not in k}
        for task, metrics in report_tasks.items()
    }


def test_tasks_equal_the_lm_eval_cli(trained, docs_data, task_dir, tmp_path, capsys):
    """The issue's first proof: the harness's CLI and eval.py --tasks on the same model, dtype and batch size, with
    the same --num_fewshot and --limit (one shot drawn by the harness's seeded sampler, 12 of the 16 examples)."""
    model = trained / "final"
    harness_out = tmp_path / "harness"
    shots = ["--num_fewshot", "1", "--limit", "12"]
    run(harness_command(model, task_dir, TASKS, 4, harness_out) + shots, env=OFFLINE)
    harness = {name: read_harness_results(harness_out, name) for name in TASKS.split(",")}
    report = tmp_path / "report.json"
    code = ev.main(
        ["--model", str(model), "--tasks", TASKS, "--include_path", str(task_dir), "--batch_size", "4", *shots,
         "--dtype", "float32", "--dataset", str(docs_data), "--split", "validation", "--max_documents", "2",
         "--output_json", str(report)]
    )  # fmt: skip
    stdout = capsys.readouterr().out
    assert code == 0
    ours = json.loads(report.read_text())
    print(f"\nlm_eval CLI: {harness}\neval.py: {scores(ours['tasks'])}")
    for name in TASKS.split(","):
        theirs = {k: v for k, v in harness[name].items() if k in ("acc", "acc_norm", "perplexity")}
        assert theirs and scores(ours["tasks"])[name] == theirs, name
    assert set(scores(ours["tasks"])["local_mc"]) == {"acc", "acc_norm"}
    assert 0 < ours["tasks"]["local_mc"]["acc,none"] < 1 and ours["tasks"]["local_ll"]["perplexity,none"] > 1
    # One JSON: the perplexity beside the task results; the harness's table on the console.
    assert ours["documents"] == 2 and ours["token_perplexity"] > 1 and ours["task_settings"]["batch_size"] == 4
    assert ours["task_settings"]["num_fewshot"] == {"local_mc": 1, "local_ll": 1}
    assert ours["task_settings"]["n_samples"]["local_mc"] == {"original": 16, "effective": 12}
    assert "|local_mc|" in stdout and "acc_norm" in stdout and "token_perplexity" in stdout


def run_dir_state(out: Path) -> dict:
    """Every path under a run directory with its size, mtime and (files) content hash."""
    return {
        str(p.relative_to(out)): (p.stat().st_size, p.stat().st_mtime_ns)
        + ((hashlib.sha256(p.read_bytes()).hexdigest(),) if p.is_file() else ())
        for p in sorted([out, *out.rglob("*")])
    }


def evaluate(model, docs_data, task_dir, tasks=TASKS) -> dict:
    return ev.evaluate(
        ev.Config(model=str(model), dataset=str(docs_data), split="validation", max_documents=3, max_length=64,
                  tasks=tasks, include_path=str(task_dir), batch_size=4, dtype="float32")
    )  # fmt: skip


def assert_same_scores(ours: dict, export: dict) -> None:
    assert ours["tokens"] == export["tokens"] and ours["nll"] == pytest.approx(export["nll"], rel=1e-6, abs=0)
    assert ours["token_perplexity"] == pytest.approx(export["token_perplexity"], rel=1e-6, abs=0)
    assert scores(ours["tasks"]) == scores(export["tasks"])


@pytest.mark.parametrize("preset", ["llama", "deepseek-v3"])
def test_a_checkpoint_scores_as_its_export(preset, trained, moe_ref, docs_data, task_dir):
    """OUT/checkpoints/step_N (the last step, whose export is final/) of a 3-process ZeRO-3 run against final/, with
    the run directory's bytes and mtimes unchanged. Both presets train for a few steps only; an earlier checkpoint must
    score differently, so equality is not that of two untrained models."""
    out = trained if preset == "llama" else moe_ref[0]
    steps = sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*"))
    last = out / "checkpoints" / f"step_{steps[-1]}"
    assert json.loads((out / "config.json").read_text())["batch_plan"]["world_size"] == 3
    before = run_dir_state(out)
    ours = evaluate(last, docs_data, task_dir)
    export = evaluate(out / "final", docs_data, task_dir)
    assert (ours["checkpoint"], ours["step"]) == (str(last), steps[-1]) and ours["dtype"] == "float32"
    print(f"\n{preset} step {steps[-1]}: {scores(ours['tasks'])} nll {ours['nll']}\nexport: {scores(export['tasks'])}")
    assert_same_scores(ours, export)
    if preset == "llama":  # the run directory: its newest intact checkpoint
        newest = evaluate(out, docs_data, task_dir)  # the same tasks: the harness batches all tasks' requests together
        assert newest["checkpoint"] == str(last) and newest["nll"] == ours["nll"]
        assert scores(newest["tasks"]) == scores(ours["tasks"])
    else:
        earlier = evaluate(out / "checkpoints" / f"step_{steps[0]}", docs_data, task_dir, tasks="local_ll")
        assert steps[0] < steps[-1] and earlier["nll"] != ours["nll"]
        assert scores(earlier["tasks"])["local_ll"]["perplexity"] != scores(ours["tasks"])["local_ll"]["perplexity"]
    assert run_dir_state(out) == before


@pytest.mark.slow
def test_a_checkpoint_of_a_run_without_deepspeed_scores_as_its_export(docs_data, tmp_path):
    """One plain process (no DeepSpeed: Accelerate saves the weights whole, model.safetensors) scores as its export."""
    out = tmp_path / "one"
    run([sys.executable, "train.py", *TINY, "--max_steps", "2", "--save_every", "2", "--data_dir", docs_data,
         "--output_dir", out])  # fmt: skip
    (step,) = (out / "checkpoints").glob("step_*")
    assert (step / "model.safetensors").is_file() and not (step / "pytorch_model").exists()
    config = dict(dataset=str(docs_data), split="validation", max_documents=3, max_length=64, dtype="float32")
    ours, export = (ev.evaluate(ev.Config(model=str(m), **config)) for m in (step, out / "final"))  # no tasks: nll
    assert ours["step"] == 2 and ours["tokens"] == export["tokens"] and ours["nll"] == pytest.approx(export["nll"])


def damaged_runs(trained: Path, tmp_path: Path) -> dict:
    """(the --model path, what the error line says) for copies of the run with a broken newest checkpoint."""
    out = tmp_path / "out"
    shutil.copytree(trained, out, ignore=shutil.ignore_patterns("train", "final"))
    (last,) = (out / "checkpoints").glob("step_*")
    shard = next((last / "pytorch_model").glob("*optim_states.pt"))
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:100])
    writing = out / "checkpoints" / ".tmp-step_99"
    shutil.copytree(last, writing)
    no_state = out / "checkpoints" / "step_98"
    shutil.copytree(last, no_state)
    (no_state / "trainer_state.json").unlink()
    truncated = f"is not a complete checkpoint: pytorch_model/{shard.name} has 100 bytes, the manifest says {size}"
    return {
        "truncated shard": (last, truncated),
        "no trainer_state": (no_state, "is not a complete checkpoint: no trainer_state.json"),
        "being written": (writing, "is a checkpoint being written, or one a crash left half-written"),
        "run without an intact one": (out, f"the run has no intact checkpoint in {out / 'checkpoints'}"),
    }  # fmt: skip


def test_incomplete_checkpoints_are_refused_in_one_line(trained, tmp_path, capsys):
    for case, (model, message) in damaged_runs(trained, tmp_path).items():
        assert ev.main(["--model", str(model)]) == 2, case
        err = capsys.readouterr().err
        assert f"error: --model {model}" in err and message in err and "Traceback" not in err, (case, err)
        assert err.splitlines()[-1].startswith("error:") and len(err.splitlines()) <= 3, (case, err)


def test_checkpoint_rotated_away_while_read(trained, docs_data, tmp_path, monkeypatch, capsys):
    """A running train.py may delete the checkpoint eval.py is reading (--keep_last): the error says so and what to
    do, not that the shards are damaged. The deletion is timed by wrapping DeepSpeed's consolidation; the read is
    real."""
    from deepspeed.utils import zero_to_fp32

    out = tmp_path / "out"
    shutil.copytree(trained, out, ignore=shutil.ignore_patterns("train", "final"))
    (step,) = (out / "checkpoints").glob("step_*")
    consolidate = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint

    def rotated(path, **kw):
        shutil.rmtree(step)
        return consolidate(path, **kw)

    monkeypatch.setattr(zero_to_fp32, "get_fp32_state_dict_from_zero_checkpoint", rotated)
    local = ["--dataset", str(docs_data), "--split", "validation", "--max_documents", "1"]
    assert ev.main(["--model", str(step), *local]) == 2
    err = capsys.readouterr().err
    assert f"error: --model {step} was removed while it was read: the run rotated it away" in err, err
    # Deleted after it was found complete and before its config was read (a review found that called unreadable).
    from deepseek_zero3.run_dir import checkpoint

    shutil.copytree(trained / "checkpoints", out / "checkpoints", dirs_exist_ok=True)
    read_config = checkpoint.read_model_config
    monkeypatch.setattr(checkpoint, "read_model_config", lambda path: shutil.rmtree(path) or read_config(path))
    assert ev.main(["--model", str(step), *local]) == 2
    err = capsys.readouterr().err
    assert f"error: --model {step} was removed while it was read: the run rotated it away" in err, err


def test_unknown_task_and_dataset_out_of_reach(trained, task_dir, tmp_path, capsys):
    args = ["--model", str(trained / "final"), "--include_path", str(task_dir)]
    assert ev.main([*args, "--tasks", "local_mc,hellaswg,arc_easyy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --tasks hellaswg,arc_easyy: no task") and "did you mean hellaswag" in err, err
    assert "arc_easyy: did you mean arc_easy" in err and err.count("\n") == 1, err
    # Tasks of one's own whose data file is gone, or does not parse: each named, as such, not as a Hub problem.
    moved = tmp_path / "moved_tasks"
    moved.mkdir()
    gone, bad = tmp_path / "gone.jsonl", tmp_path / "bad.jsonl"
    bad.write_text('{"question": "torn')
    for name, data in (("local_gone", gone), ("local_bad", bad)):
        yaml = (task_dir / "local_mc.yaml").read_text().replace("task: local_mc", f"task: {name}")
        (moved / f"{name}.yaml").write_text(yaml.replace(str((task_dir / "local_mc.jsonl").resolve()), str(data)))
    code = ev.main(["--model", str(trained / "final"), "--include_path", str(moved), "--tasks", "local_gone,local_bad"])
    err = capsys.readouterr().err  # before the one error line, datasets' own progress and parse-error log lines
    assert code == 2 and [line for line in err.splitlines() if line.startswith("error:")] == [err.splitlines()[-1]]
    err = err.splitlines()[-1]
    assert err.startswith(f"error: --tasks: datasets cannot be loaded (local_gone: json: no file {gone}; "), err
    assert "local_bad: json: a data file cannot be parsed (" in err and "check dataset_path and data_files" in err
    assert "Hub" not in err, err
    # A fresh datasets cache and offline: the harness's own ARC task names its Hub dataset and how to get it.
    proc = run(
        [sys.executable, "eval.py", *args, "--tasks", "arc_easy,local_mc"],
        check=False,
        env={**OFFLINE, "HF_DATASETS_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(
        "error: --tasks: datasets cannot be loaded (arc_easy: allenai/ai2_arc (ARC-Easy): not cached, and the Hub out "
    ), line
    assert "HF_DATASETS_OFFLINE=0" in line and "--include_path" in line, line


def test_tasks_of_the_include_path_alone_skip_the_harness_index(docs_data, tmp_path):
    """Names that are all tasks of --include_path's own are built from that directory's registry alone (the harness's
    index of ~14,700 task files takes ~10 s to read); a harness task or a group among them takes the whole registry,
    --include_path's definitions first. test_tasks_equal_the_lm_eval_cli scores the directory's tasks against the
    harness's CLI, which reads the whole registry."""
    from deepseek_zero3.evaluation import harness_tasks

    tasks = write_local_tasks(docs_data, tmp_path / "tasks")
    (tasks / "local_pair.yaml").write_text("group: local_pair\ntask:\n  - local_mc\n  - local_ll\n")
    own = harness_tasks.task_manager(str(tasks), ("local_mc", "local_ll"))
    assert set(own.all_tasks) == {"local_mc", "local_ll", "local_pair"}
    for names in (("local_mc", "hellaswag"), ("local_pair",)):
        whole = harness_tasks.task_manager(str(tasks), names)
        assert "hellaswag" in whole.all_tasks and {"local_mc", "local_pair"} <= set(whole.all_tasks), names


def test_what_counts_as_a_checkpoint(tmp_path):
    """A directory named like a checkpoint (checkpoints/step_N) but holding a Hugging Face model is a model; without
    one it is a checkpoint that died before its trainer_state.json, and refused."""
    from deepseek_zero3.cli import UserError
    from deepseek_zero3.run_dir import run_model

    step = tmp_path / "checkpoints" / "step_5"
    step.mkdir(parents=True)
    (step / "config.json").write_text("{}")
    assert run_model.find_checkpoint(str(step)) is None
    (step / "config.json").unlink()
    with pytest.raises(UserError, match="step_5 is not a complete checkpoint: no trainer_state.json"):
        run_model.find_checkpoint(str(step))


def test_tokenizer_flag_is_the_tokenizer_of_a_checkpoint(trained, docs_data):
    """A run whose data directory moved can still be scored: --tokenizer names the tokenizer (a review found the
    flag ignored for checkpoints, the error's own advice not working)."""
    from deepseek_zero3.run_dir import run_model

    own = run_model.find_checkpoint(str(trained))
    assert own.tokenizer_dir == docs_data / "tokenizer"
    given = run_model.find_checkpoint(str(own.path), str(trained / "final"))
    assert given.tokenizer_dir == trained / "final" and given.path == own.path
