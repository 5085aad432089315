"""train.py for real: `accelerate launch` of several CPU processes under DeepSpeed ZeRO-3 (gloo, fp32).

The reference run (3 processes x micro-batch 2 = global batch 6, 10 steps) is compared against one process with
the same global batch, against a run stopped and resumed, and against runs hit by SIGTERM and SIGKILL (a NaN
step, a hang and a killed rank: test_resilience.py).
"""

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from conftest import (
    REPO,
    assert_same_ema,
    TINY,
    launch,
    launch_cmd,
    metrics,
    reloaded_model,
    run,
    tracker_env,
    trackio_history,
    train_records,
    wandb_history,
)

from deepseek_zero3.cli import UserError
from deepseek_zero3.run_dir import checkpoint
from deepseek_zero3.run_dir.trackers import wandb_offline_history

STEPS = ["--max_steps", "10"]


def weights(out_dir, name="final") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(Path(out_dir) / name / "model.safetensors")


def assert_same_weights(a_dir, b_dir, rel=1e-6, name="final"):
    a, b = weights(a_dir, name), weights(b_dir, name)
    assert a.keys() == b.keys()
    for name in a:
        diff = (a[name] - b[name]).norm() / a[name].norm()
        assert diff < rel, f"{name}: relative difference {diff:.2e}"


def assert_same_losses(a_dir, b_dir, rel, steps=range(1, 11)):
    a, b = train_records(a_dir), train_records(b_dir)
    for s in steps:
        assert abs(a[s]["loss"] - b[s]["loss"]) / a[s]["loss"] < rel, (s, a[s]["loss"], b[s]["loss"])
        assert a[s]["lr"] == pytest.approx(b[s]["lr"], rel=1e-12)


@pytest.fixture(scope="module")
def ref(ref_run):
    return ref_run  # conftest's: test_resilience.py compares against it too


def test_three_processes_partition_the_parameters(ref):
    out, proc = ref
    held = [
        float(x) / 100
        for x in re.search(r"parameters held per process: ([\d.% ]+)", proc.stdout).group(1).replace("%", "").split()
    ]
    assert len(held) == 3
    assert all(0.30 < h < 0.40 for h in held), held  # each rank about a third, not the whole model
    assert "DEEPSPEED, fp32" in proc.stdout and "2 micro x 1 accumulation x 3 processes = 6 sequences" in proc.stdout
    assert "; loss: output layer + cross-entropy in chunks of 1024 tokens" in proc.stdout  # the default loss path
    # gloo's collectives and the copy rate, timed at start
    link = re.search(r"all-reduce ([\d.]+), all-gather ([\d.]+), reduce-scatter ([\d.]+) GB/s, measured\)", proc.stdout)
    assert link and min(map(float, link.groups())) > 0, proc.stdout[-3000:]


@pytest.fixture(scope="module")
def one_process(docs_data, tmp_path_factory):
    """1 process x micro-batch 6 (the reference's global batch), with the full logits (--loss_chunk_tokens 0) and the
    documents kept apart by the dense mask (--attn_implementation sdpa), where the reference's 3 ZeRO-3 processes take
    `auto`'s varlen_sdpa (no mask)."""
    out = tmp_path_factory.mktemp("one") / "out"
    args = ("--micro_batch_size", "6", "--loss_chunk_tokens", "0", "--data_dir", docs_data, "--output_dir", out,
            "--attn_implementation", "sdpa")  # fmt: skip
    return out, launch(1, *TINY, *STEPS, *args)


def test_one_process_same_global_batch_gives_same_losses(ref, one_process):
    """... and with the full logits against the reference's chunked loss, the dense document mask against the
    reference's varlen_sdpa."""
    out1, proc = one_process
    assert "; loss: full logits (--loss_chunk_tokens 0)" in proc.stdout
    # each a line of its own (the first, when nothing printed at import comes before it: script_server.py)
    assert "\nattention: sdpa, a dense (batch, 1, T, T) document mask: the fallback" in "\n" + proc.stdout
    assert "\nattention: varlen_sdpa, SDPA's causal kernel on each document alone" in "\n" + ref[1].stdout
    # 3 ZeRO-3 processes without a mask against 1 with the dense mask: 2e-7 apart at most over the 10 steps (AMD EPYC)
    assert_same_losses(ref[0], out1, rel=1e-5)


@pytest.mark.launch
def test_gradient_accumulation_equals_a_bigger_micro_batch(one_process, docs_data, tmp_path):
    """3 processes x accumulation 2 x micro-batch 1 trains on the same 6 sequences per step as 1 process x 6."""
    one, accum = one_process[0], tmp_path / "accum"
    launch(3, *TINY, *STEPS, "--micro_batch_size", "1", "--data_dir", docs_data, "--output_dir", accum, accum=2)
    assert_same_losses(one, accum, rel=1e-4)
    # Not 1e-6: fp32 sums in another order differ in the last bits, and Adam's m / sqrt(v) turns those into full-size
    # updates where a gradient is near zero. 3 processes without accumulation differ from 1 by as much (5e-5 at most,
    # measured), so the bound is set by reduction order, not by accumulation; a dropped or repeated micro-batch
    # moves the weights by orders of magnitude more.
    assert_same_weights(one, accum, rel=2e-4)


@pytest.mark.launch
def test_resume_is_exact(ref, docs_data, tmp_path):
    """The second command gives only what changes: every other setting comes from the checkpoint, --log_with too.
    Each tracker holds one run across the stop and the resume, its steps logged once with metrics.jsonl's losses, and
    the run's settings logged once (seen to fail with the tracker's run id not kept: two W&B ids, two trackio runs)."""
    out, env = tmp_path / "resumed", tracker_env(tmp_path)
    launch(3, *TINY, "--micro_batch_size", "2", "--data_dir", docs_data, "--output_dir", out, "--lr_decay_steps", "10",
           "--max_steps", "5", "--log_with", "wandb,trackio,tensorboard", "--ema_decay", "0.9", "--sample_tokens", "2",
           env=env)  # fmt: skip
    proc = launch(3, "--output_dir", out, "--max_steps", "10", "--resume", "auto", "--log_every", "5", env=env)
    assert "resumed from" in proc.stdout and "step_5" in proc.stdout
    taken = next(l for l in proc.stdout.splitlines() if l.startswith("settings from step_5:"))
    assert "--seq_len 32" in taken and "--lr 0.003" in taken and "--lr_decay_steps 10" in taken
    records = [r for r in metrics(out) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 10]
    assert records[5]["samples_seen"] == 10 * 6  # the resumed run starts at sample 30: no batch is read twice
    assert_same_losses(ref[0], out, rel=1e-6, steps=range(1, 6))
    # A log line carries the mean loss of its interval, not the loss of its last step.
    ref_losses = train_records(ref[0])
    assert records[5]["loss"] == pytest.approx(sum(ref_losses[s]["loss"] for s in range(6, 11)) / 5, rel=1e-6)
    assert_same_weights(ref[0], out)
    # The EMA of the weights (ref_run's too) resumes exactly and its export is a model eval.py scores.
    assert_same_ema(ref[0] / "checkpoints" / "step_10", out / "checkpoints" / "step_10", rel=1e-6)
    assert_same_weights(ref[0], out, name="final_ema")
    report = tmp_path / "ema.json"
    run([sys.executable, "eval.py", "--model", out / "final_ema", "--dataset", docs_data, "--split", "validation",
         "--max_length", "32", "--max_documents", "2", "--output_json", report])  # fmt: skip
    assert json.loads(report.read_text())["token_perplexity"] > 1
    logged = [(r["step"], r["loss"]) for r in records]
    ids, rows, configs = wandb_history(out)
    assert len(ids) == 1 and [row for row in rows if row[1] is not None] == logged, (ids, rows)
    assert not (REPO / "wandb").exists()  # W&B started on the other processes too: seen once, runs in ./wandb
    first = configs[0]
    assert first["parameters"] > 0 and first["batch_plan/micro_batch_size"] == 2 and first["data_fingerprint"], first
    assert configs[1:] == [{}], configs  # the resumed segment logs no settings again
    (trackio_run,) = trackio_history(tmp_path / "trackio").values()
    assert [row for row in trackio_run if row[1] is not None] == logged, trackio_run
    # TensorBoard: one directory; the resumed segment hid the first's events (purge_step) and wrote them again.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(out / "deepseek-zero3"))
    board.Reload()
    scalars = [(e.step, e.value) for e in board.Scalars("loss")]
    assert [s for s, _ in scalars] == [s for s, _ in logged], scalars
    assert [v for _, v in scalars] == pytest.approx([v for _, v in logged], rel=1e-6)  # stored as float32
    # The samples of each validation (steps 0, 5 and 10) as text: TensorBoard's text tab, W&B's and trackio's tables.
    # (this reader hides a resumed segment's rewritten steps for scalars only: the text of steps 0 and 5 is there twice)
    assert sorted({e.step for e in board.Tensors("samples/text_summary")}) == [0, 5, 10]
    tables = [(step, row["samples/_type"]) for step, row in wandb_offline_history(out / "wandb")[1] if "samples/_type" in row]
    assert tables == [(0, "table-file"), (5, "table-file"), (10, "table-file")], tables
    code = ("import json; from trackio.sqlite_storage import SQLiteStorage as S; p = 'deepseek-zero3'; print(json.dumps("
            "[l['step'] for r in S.get_runs(p) for l in S.get_logs(p, r) if 'samples' in l]))")  # fmt: skip
    held = run([sys.executable, "-c", code], env={"TRACKIO_DIR": str(tmp_path / "trackio")}).stdout.splitlines()[-1]
    assert json.loads(held) == [0, 5, 10]


def test_validation_loss_falls_and_final_model_loads(trained, docs_data):
    out = trained
    val = [r for r in metrics(out) if "val_loss" in r]
    assert [r["step"] for r in val] == [0, 15, 30]
    # 6.25 -> 5.44 measured in 30 steps (two sources, documents masked; python-docs alone, unmasked: a larger fall)
    assert val[-1]["val_loss"] < val[0]["val_loss"] - 0.6, val
    assert all(val[-1][f"val_loss/{s}"] < val[0][f"val_loss/{s}"] - 0.3 for s in ("python-docs", "web.jsonl")), val
    assert (out / "loss_curve.png").stat().st_size > 10_000
    assert list(out.rglob("events.out.tfevents.*")), "--log_with tensorboard wrote no event file"
    # OUT/final in a fresh process: its validation loss equals the one the training processes logged.
    fresh = reloaded_model(out / "final", docs_data)["val_loss"]
    assert fresh == pytest.approx(val[-1]["val_loss/python-docs"], rel=1e-5)


def steps_in(ckpts: Path) -> set[int]:
    return {int(p.name.split("_")[1]) for p in ckpts.glob("step_*")}


def left(before: set[int], saved, resumed: int) -> set[int]:
    """The checkpoints --keep_last 2 leaves after a launch that saved the steps `saved`: the two newest, and the one
    the launch resumed from."""
    return {*sorted({*before, *saved})[-2:], resumed}


@pytest.mark.launch
def test_sigkill_while_saving_and_sigterm_keep_checkpoints_that_resume_exactly(ref, docs_data, tmp_path):
    """One run stopped twice, each stop's proofs on the launches it needs (a 3-process launch is ~40 s of CPU):
    1. SIGKILL on rank 1 while step 4 is saved: step_2 stays the last good checkpoint, .tmp-step_4 is left unused.
    2. --resume auto passes over the incomplete step and resumes from step_2; a SIGTERM to the launcher after step 6
       (a preemption) saves the step the run stopped after and ends it without final/.
    3. --resume auto from that checkpoint ends with the reference run's losses and weights. --keep_last 2 prunes the
       others, never the checkpoint a launch resumed from.
    4. An explicit --resume of an older checkpoint moves the newer ones aside, pruning keeps the new branch,
       --resume auto would follow it, and the finished run keeps the abandoned branch for the user to delete, saying
       so (it used to delete it: issue #59)."""
    out = tmp_path / "killed"
    ckpts = out / "checkpoints"
    args = [*TINY, *STEPS, "--micro_batch_size", "2", "--save_every", "2", "--data_dir", docs_data, "--output_dir", out]
    proc = launch(
        3, *args, check=False, env={"TRAIN_TEST_FAULT": "sigkill_in_save:1:4", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}
    )
    assert proc.returncode != 0
    assert (ckpts / "step_2" / "trainer_state.json").is_file()
    assert (ckpts / ".tmp-step_4").is_dir() and not (ckpts / "step_4").exists()
    assert (ckpts / "latest").read_text().strip() == "step_2"

    proc = launch(3, *args, "--resume", "auto", check=False, env={"TRAIN_TEST_FAULT": "sigterm_launcher:0:6"})
    assert "ignoring incomplete checkpoint" in proc.stdout and "resumed from" in proc.stdout and "step_2" in proc.stdout
    stopped = re.search(r"stopped by signal after step (\d+)", proc.stdout)
    assert stopped, proc.stdout[-3000:] + proc.stderr[-3000:]
    step = int(stopped.group(1))
    assert 6 <= step < 10
    assert (ckpts / f"step_{step}" / "trainer_state.json").is_file()
    assert (ckpts / "latest").read_text().strip() == f"step_{step}"
    assert not (out / "final").exists() and not list(ckpts.glob(".tmp-*"))
    kept = left({2}, [*range(4, step + 1, 2), step], resumed=2)
    assert steps_in(ckpts) == kept

    proc = launch(3, *args, "--resume", "auto")
    assert f"resumed from {ckpts / f'step_{step}'}" in proc.stdout, proc.stdout[-3000:]
    assert_same_losses(ref[0], out, rel=1e-6)
    assert_same_weights(ref[0], out)
    kept = left(kept, range(step + 2 - step % 2, 11, 2), resumed=step)
    assert steps_in(ckpts) == kept and not list(ckpts.glob(".tmp-*"))

    newer = [f"step_{s}" for s in sorted(kept) if s > step]
    proc = launch(3, "--output_dir", out, "--resume", ckpts / f"step_{step}", "--save_every", "4")
    moved = re.search(rf"moved the checkpoints after step_{step} \(([^)]*)\) to .*/(abandoned-[\d-]+)", proc.stdout)
    assert moved and moved.group(1) == ", ".join(newer), proc.stdout
    assert f"kept in {ckpts}: {moved.group(2)}, the checkpoints explicit --resume commands set aside" in proc.stdout
    assert sorted(p.name for p in (ckpts / moved.group(2)).iterdir()) == sorted(["metrics.jsonl", *newer])
    assert steps_in(ckpts) == left({step}, [s for s in range(step + 1, 11) if s % 4 == 0 or s == 10], resumed=step)
    assert (ckpts / "latest").read_text().strip() == "step_10"
    assert_same_weights(ref[0], out)


def startup_cases(docs_data, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    small_vocab = tmp_path / "small_vocab_model"
    small_vocab.mkdir()
    cfg = json.loads((REPO / "model_configs" / "tiny.json").read_text())
    (small_vocab / "config.json").write_text(json.dumps({**cfg, "vocab_size": 100}))
    for f in (docs_data / "tokenizer").iterdir():  # the data's own tokenizer: only the model's vocab_size is wrong
        (small_vocab / f.name).write_bytes(f.read_bytes())
    # Weights --init_from cannot start from (issue #59): a torn pytorch_model.bin was a traceback once the run had
    # built its model, and a foreign tensor set trained from random weights with a warning.
    torn_weights, foreign_weights = tmp_path / "torn_weights", tmp_path / "foreign_weights"
    for model in (torn_weights, foreign_weights):
        model.mkdir()
        (model / "config.json").write_text(json.dumps(cfg))
        for f in (docs_data / "tokenizer").iterdir():
            (model / f.name).write_bytes(f.read_bytes())
    torch.save({"model.embed_tokens.weight": torch.zeros(512, 64)}, torn_weights / "pytorch_model.bin")
    (torn_weights / "pytorch_model.bin").write_bytes((torn_weights / "pytorch_model.bin").read_bytes()[:5000])
    save_file({"encoder.weight": torch.zeros(2, 2)}, str(foreign_weights / "model.safetensors"))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    project = tmp_path / "project"
    project.mkdir()
    (project / "meta.json").write_text("{}")
    d = str(docs_data)
    return {
        "missing data": (["--data_dir", str(tmp_path / "nope")], "does not exist"),
        "foreign data": (["--data_dir", str(foreign)], "not a prepared data directory"),
        "seq_len over context": (["--data_dir", d, "--seq_len", "1024"], "max_position_embeddings=512"),
        "vocab mismatch": (["--data_dir", d, "--init_from", str(small_vocab)], "vocab_size 100"),
        "init_from torn weights": (
            ["--data_dir", d, "--init_from", str(torn_weights)],
            f"--init_from {torn_weights}: pytorch_model.bin is damaged (",
        ),
        "init_from foreign weights": (
            ["--data_dir", d, "--init_from", str(foreign_weights)],
            f"--init_from {foreign_weights}: its config.json and its weights do not belong together: 21 tensors "
            "missing from the weights",
        ),
        "batch size": (["--data_dir", d, "--micro_batch_size", "0"], "--micro_batch_size 0 must be at least 1"),
        "non-empty output": (["--data_dir", d, "--output_dir", str(busy)], "is not empty; pass --resume auto"),
        "unwritable output": (["--data_dir", d, "--output_dir", str(a_file / "out")], "not a writable directory"),
        "bad resume path": (["--data_dir", d, "--resume", str(foreign)], "not a complete checkpoint"),
        "resume into a foreign dir": (
            ["--data_dir", d, "--output_dir", str(project), "--resume", "auto"],
            "no train.py run",
        ),
        "eval_tokens under seq_len": (
            ["--data_dir", d, "--seq_len", "64", "--eval_tokens", "32"],
            "--eval_tokens 32 is less than",
        ),
        "negative bias speed": (
            ["--data_dir", d, "--moe_bias_update_speed", "-0.001"],
            "--moe_bias_update_speed -0.001 must not be negative",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing data",
        "foreign data",
        "seq_len over context",
        "vocab mismatch",
        "init_from torn weights",
        "init_from foreign weights",
        "batch size",
        "non-empty output",
        "unwritable output",
        "bad resume path",
        "resume into a foreign dir",
        "eval_tokens under seq_len",
        "negative bias speed",
    ],
)
@pytest.mark.slow
def test_startup_errors(docs_data, tmp_path, case):
    args, message = startup_cases(docs_data, tmp_path)[case]
    out = tmp_path / "out"
    if "--output_dir" not in args:
        args = args + ["--output_dir", str(out)]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    proc = run([sys.executable, "train.py", "--model_config", "tiny", *args], check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written


def test_init_from_loads_weights_under_zero3(trained, docs_data, tmp_path):
    """--init_from builds the model from a Hugging Face directory under zero.Init: its step-0 validation loss is
    the loss the source run ended with, so the weights really arrived in the shards."""
    out = tmp_path / "continued"
    launch(
        2,
        *TINY,
        "--max_steps",
        "2",
        "--micro_batch_size",
        "4",
        "--data_dir",
        docs_data,
        "--output_dir",
        out,
        "--init_from",
        trained / "final",
    )
    start = next(r for r in metrics(out) if r["step"] == 0)["val_loss"]
    source = [r for r in metrics(trained) if "val_loss" in r][-1]["val_loss"]
    assert start == pytest.approx(source, rel=1e-5)


@pytest.mark.parametrize(
    "key",
    ["seq_len", "seed", "data_fingerprint", "model_config_hash", "precision", "zero_stage"],
)
def test_resume_refuses_any_difference(key):
    """The identity a checkpoint must match (the number of processes and the split of the global batch may change:
    test_reshard.py)."""
    state = {
        "seq_len": 32,
        "seed": 0,
        "data_fingerprint": "abc",
        "model_config_hash": "def",
        "precision": "fp32",
        "zero_stage": 3,
        "step": 5,
    }
    current = {k: v for k, v in state.items() if k != "step"}
    checkpoint.check_resume_compatible(state, current, Path("ckpt"))
    changed = {**current, key: "other"}
    with pytest.raises(UserError, match=f"{key}="):
        checkpoint.check_resume_compatible(state, changed, Path("ckpt"))


@pytest.mark.launch
def test_torchrun_without_accelerate_use_cpu_is_refused(docs_data, tmp_path):
    """torchrun on CPUs without ACCELERATE_USE_CPU=1 gives Accelerate DistributedType.NO beside a 2-rank process group:
    two unsynchronised copies. train.py refuses to start and says what to set."""
    from conftest import free_port

    torchrun = str(Path(sys.executable).with_name("torchrun"))
    out = tmp_path / "out"
    cmd = [
        torchrun,
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "train.py",
        *TINY,
        "--max_steps",
        "2",
        "--data_dir",
        docs_data,
        "--output_dir",
        out,
    ]
    proc = run(cmd, check=False, env={"ACCELERATE_USE_CPU": "0"})
    assert proc.returncode != 0
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "2 processes were started" in errors[0] and "ACCELERATE_USE_CPU=1" in errors[0], (
        proc.stderr
    )
    assert not out.exists()


@pytest.mark.launch
def test_cpu_config_runs_any_accelerate_script(docs_data):
    """zero3_cpu.json says "auto" where Accelerate fills values in, so a plain Accelerate script with a DataLoader runs
    on it too (before, it stopped: "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")."""
    from conftest import launch_cmd

    proc = run(
        launch_cmd(
            2,
            "--data_dir",
            docs_data,
            "--model_config",
            "tiny",
            "--seq_len",
            "32",
            "--micro_batch_size",
            "2",
            "--steps",
            "4",
            script="bench/bare_accelerate_loop.py",
            accum=2,
        )
    )
    result = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("{")))
    assert (result["processes"], result["grad_accum_steps"], result["distributed_type"]) == (2, 2, "DEEPSPEED")
    assert result["final_loss"] > 0 and result["tokens_per_s"] > 0


@pytest.mark.launch
def test_bf16_on_cpu_processes(docs_data, tmp_path):
    """The CPU config's JSON leaves precision to the launch: `--mixed_precision bf16` trains in bf16 under ZeRO-3 (fast
    only on CPUs with AMX or AVX512-BF16; here it only has to run and learn nothing wrong). Where the CPU has those
    units test_precision.py's bf16 runs prove this and more."""
    from test_precision import UNITS

    if UNITS["bf16"][0]:
        pytest.skip("this CPU has bf16 units: test_precision.py's bf16 runs cover it")
    out = tmp_path / "bf16"
    cmd = launch_cmd(
        2, *TINY, "--max_steps", "3", "--micro_batch_size", "2", "--data_dir", docs_data, "--output_dir", out
    )
    proc = run(cmd[:2] + ["--mixed_precision", "bf16"] + cmd[2:])
    assert "x 2 processes" in proc.stdout and "DEEPSPEED, bf16" in proc.stdout
    assert all(math.isfinite(r["loss"]) for r in train_records(out).values())
