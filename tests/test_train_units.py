"""Arithmetic of train.py and its modules: LR schedule, batch plan, sample layout, FLOPs and MFU, memory plan,
resume settings."""

import dataclasses
import json
import math
import subprocess
import sys
import time

import pytest
import torch
from conftest import launch_cmd, run

import train
from deepseek_zero3 import cli, distributed
from deepseek_zero3.cli import UserError
from deepseek_zero3.model import models
from deepseek_zero3.planning import costs, measure, model_math
from deepseek_zero3.recipe.schedule import schedule_change_on_resume
from deepseek_zero3.run_dir import checkpoint, metrics, trackers
from deepseek_zero3.training_data import token_data

THREADS = torch.get_num_threads()


def test_lr_warmup_then_cosine_to_floor():
    # Warmup 3, schedule 10, peak 1, floor 0.1; values computed by hand: the peak is held on step 2 only, the cosine
    # runs over steps 2..9 (progress (step - 2) / 7) and its last step is the floor.
    expected = {0: 1 / 3, 1: 2 / 3, 2: 1.0, 3: 0.9554359905560886, 6: 0.44986557971965853, 9: 0.1}
    for step, lr in expected.items():
        assert train.Schedule(1.0, 3, 10, 0.1).lr(step) == pytest.approx(lr, rel=1e-12), step
    lrs = [train.Schedule(1.0, 3, 10, 0.1).lr(s) for s in range(10)]
    assert lrs.count(1.0) == 1 and all(a > b for a, b in zip(lrs[2:], lrs[3:]))
    assert train.Schedule(1.0, 3, 10, 0.1).lr(25) == pytest.approx(0.1)  # past the schedule: the floor
    assert train.Schedule(1.0, 0, 5, 0.0).lr(0) == 1.0 and train.Schedule(1.0, 0, 5, 0.0).lr(4) == 0.0  # no warmup


def test_batch_plan_and_steps():
    batch = token_data.BatchPlan(4, 8, 3, 2048)
    assert batch.sequences_per_step == 96 and batch.tokens_per_step == 96 * 2048
    assert token_data.total_steps_for(0, 1.0, 1000, 96) == math.ceil(1000 / 96)
    assert token_data.total_steps_for(50, 1.0, 1000, 96) == 50


def test_sample_layout_depends_only_on_global_batch():
    three = token_data.BatchPlan(2, 1, 3, 32)
    one = token_data.BatchPlan(6, 1, 1, 32)
    accum = token_data.BatchPlan(2, 3, 1, 32)
    for step in range(4):
        a = sorted(i for r in range(3) for i in train.sample_ids(step, 0, r, three))
        b = list(train.sample_ids(step, 0, 0, one))
        c = sorted(i for m in range(3) for i in train.sample_ids(step, m, 0, accum))
        assert a == b == c == list(range(6 * step, 6 * step + 6))


def test_flops_and_mfu():
    # DeepSeek 7B at 4096 tokens: 6 N + 12 L H T per token
    n = 6.9e9 - 102400 * 4096
    assert model_math.flops_per_token(n, 30, 4096, 4096) == pytest.approx(6 * n + 12 * 30 * 4096 * 4096)
    assert model_math.mfu(1000.0, 1e9, 4e12) == pytest.approx(0.25)


def test_round_up_vocab():
    assert models.round_up(8192, 64) == 8192 and models.round_up(50257, 64) == 50304


def _config(name):
    import json

    from transformers import AutoConfig

    d = json.loads((models.MODEL_CONFIG_DIR / f"{name}.json").read_text())
    return AutoConfig.for_model(d.pop("model_type"), **d)


@pytest.mark.slow
def test_param_count_matches_the_real_model():
    from transformers import AutoModelForCausalLM

    c = _config("mini")
    model = AutoModelForCausalLM.from_config(c)
    counts = model_math.llama_param_counts(c)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["total"] - counts["non_embedding"] == model.get_input_embeddings().weight.numel()
    assert _config("deepseek-7b") and model_math.llama_param_counts(_config("deepseek-7b"))["total"] == pytest.approx(
        6.91e9, rel=0.01
    )


def test_memory_plan_agrees_with_deepspeed_estimator():
    c = _config("deepseek-7b")
    counts = model_math.llama_param_counts(c)
    # No offload: ours (16 B/param + the gathered largest tensor) vs DeepSpeed's (18 B/param + 4 B x largest).
    zero3 = distributed.Launch(3, 1, "fp16", 1, "none", False, True, 3)
    ours = costs.memory_plan(c, zero3, 1, 2048, True, "sdpa")
    model_states = sum(
        ours["gpu"][k] for k in ("parameters", "gradients", "optimizer_states", "gathered_largest_tensor")
    )
    _, ds_gpu = costs.deepspeed_estimate(counts, zero3)
    assert 0.85 < model_states / ds_gpu < 1.0
    assert model_states / 2**30 > 24  # 7B does not fit 24 GB per GPU without offload, whatever the activations
    # Optimizer and parameters offloaded: host RAM is DeepSpeed's 18 B/param times its 1.5 buffer factor.
    offload = dataclasses.replace(zero3, offload_optimizer="cpu", offload_params=True)
    off = costs.memory_plan(c, offload, 1, 2048, True, "sdpa")
    ds_host, _ = costs.deepspeed_estimate(counts, offload)
    assert off["host_per_process"] * 3 * 1.5 == pytest.approx(ds_host, rel=1e-6)
    assert off["gpu"]["parameters"] == 0 and off["gpu"]["optimizer_states"] == 0


@pytest.mark.slow
def test_plan_command_names_the_optimizer_offload_config():
    import subprocess
    import sys

    cmd = [sys.executable, "train.py", "--plan", "--data_dir", "no-such-dir", "--model_config", "deepseek-7b",
           "--seq_len", "2048", "--micro_batch_size", "1", "--host_memory_gib", "256",
           "--accelerate_config"]  # fmt: skip
    no = subprocess.run(
        cmd + ["accelerate_configs/zero3_3gpu.yaml"], cwd=models.MODEL_CONFIG_DIR.parent, capture_output=True, text=True
    )
    assert no.returncode == 0 and "does NOT fit" in no.stdout and "zero3_offload_opt_3gpu.yaml" in no.stdout, (
        no.stdout + no.stderr
    )
    yes = subprocess.run(
        cmd + ["accelerate_configs/zero3_offload_opt_3gpu.yaml", "--gradient_checkpointing"],
        cwd=models.MODEL_CONFIG_DIR.parent,
        capture_output=True,
        text=True,
    )
    assert "fits:" in yes.stdout and "host RAM" in yes.stdout and "offload" in yes.stdout, yes.stdout + yes.stderr


def test_gpu_peak_by_name_and_precision():
    assert model_math.gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert model_math.gpu_peak_flops("NVIDIA H100 PCIe", "fp16") == 756e12  # not the SXM figure
    assert model_math.gpu_peak_flops("NVIDIA GeForce RTX 4090", "fp16") == pytest.approx(165.2e12)
    # fp32 is timed, not the 16-bit datasheet
    assert model_math.gpu_peak_flops("NVIDIA GeForce RTX 4090", "fp32") is None
    assert model_math.gpu_peak_flops("Some Future GPU", "bf16") is None


@pytest.mark.slow
def test_the_cpu_peak_is_a_cores_rate_in_cpu_time_times_the_cores_the_launch_can_use():
    one = type("OneCpuProcess", (), {"device": torch.device("cpu"), "num_processes": 1})()
    one.wait_for_everyone, one.reduce = lambda: None, lambda t, op: t
    alone, cores, threads = distributed.Launch(1, 1, "fp32", 1, "none", False, False, 0), measure.cpu_cores(), 1
    torch.set_num_threads(threads)  # as the CPU configs run each process
    try:
        quiet, source = measure.measure_peak_flops(one, alone)
        assert "one core's rate x 1 cores per machine" in source, source
        # Other work on every core while it is timed (by the clock the rate fell to ~1/3 here): the peak stands.
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * cores + 1)]
        try:
            time.sleep(0.5)
            busy, _ = measure.measure_peak_flops(one, alone)
        finally:
            for spinner in spinners:
                spinner.kill()
        # 4 processes a core: each process's threads get a quarter of one.
        crowded, source = measure.measure_peak_flops(one, dataclasses.replace(alone, world_size=4 * cores))
        assert f"x {cores} cores per machine" in source, source
        torch.set_num_threads(2)  # a process's threads: a core each, as far as there are cores
        two, source = measure.measure_peak_flops(one, alone)
        assert f"x {min(2, cores)} cores per machine" in source and torch.get_num_threads() == 2, source
    finally:
        torch.set_num_threads(THREADS)
    assert busy > quiet / 2, (busy, quiet)
    assert crowded == pytest.approx(quiet / 4, rel=0.5) and two == pytest.approx(quiet * min(2, cores), rel=0.5)


def test_fp16_loss_scale_with_and_without_a_scaler():
    import torch

    assert metrics.fp16_loss_scale(None, None) is None  # fp16 without DeepSpeed and without a scaler: nothing to log
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # Accelerate's scaler
    assert metrics.fp16_loss_scale(None, scaler) == 1024.0


SAVED = {
    **{f.name: f.default for f in __import__("dataclasses").fields(train.Config)},
    "data_dir": "/data/docs",
    "model_config": "mini",
    "seq_len": 128,
    "lr": 2e-3,
    "max_steps": 300,
}


def test_resume_takes_what_the_command_does_not_give():
    cfg = train.Config(output_dir="runs/q", max_steps=600, lr_decay_steps=600, resume="auto")
    merged, taken, _ = checkpoint.config_for_resume(cfg, {"output_dir", "max_steps", "lr_decay_steps", "resume"}, SAVED)
    assert (merged.seq_len, merged.lr, merged.model_config, merged.data_dir) == (128, 2e-3, "mini", "/data/docs")
    assert (merged.max_steps, merged.lr_decay_steps, merged.output_dir) == (600, 600, "runs/q")
    assert taken == {"data_dir": "/data/docs", "model_config": "mini", "seq_len": 128, "lr": 2e-3}


@pytest.mark.parametrize("flag,value", [("seq_len", 256), ("weight_decay", 0.0), ("seed", 1), ("adam_beta2", 0.99)])
def test_resume_refuses_a_changed_training_setting(flag, value, tmp_path):
    cfg = train.Config(**{flag: value}, output_dir=str(tmp_path))
    with pytest.raises(UserError, match=f"--{flag}.*start a new --output_dir \\(this run has no final/ model"):
        checkpoint.config_for_resume(cfg, {flag}, SAVED)
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    with pytest.raises(UserError, match=f"--init_from {tmp_path / 'final'} "):  # only where it exists
        checkpoint.config_for_resume(cfg, {flag}, SAVED)
    checkpoint.config_for_resume(
        train.Config(eval_every=7, log_every=3), {"eval_every", "log_every"}, SAVED
    )  # runtime: allowed


def test_resume_may_change_what_the_messages_advise():
    """A diverged or hung run's advice (a lower LR, a longer warmup, a longer watchdog limit) is a resume that works;
    the changes are returned for metrics.jsonl, and the LR at the resume step is said."""
    flags_given = {
        "lr": 1e-3,
        "warmup_steps": 60,
        "max_grad_norm": 0.5,
        "step_timeout_s": 900.0,
        "max_skipped_steps": 5,
    }
    merged, _, changed = checkpoint.config_for_resume(train.Config(**flags_given), set(flags_given), SAVED)
    assert changed == {k: [SAVED[k], v] for k, v in flags_given.items()}
    assert (merged.lr, merged.step_timeout_s, merged.seq_len) == (1e-3, 900.0, 128)
    state = {"step": 100, "total_steps": 300, "config": SAVED}
    line = schedule_change_on_resume(train.schedule_for(merged, 300), state, set(flags_given))
    before, after = train.Schedule(2e-3, 30, 300, 0.1).lr(100), train.Schedule(1e-3, 60, 300, 0.1).lr(100)
    assert line == f"changed LR schedule: the LR of step 101 goes from {before:.3g} to {after:.3g}"


def test_resume_keeps_the_schedule_unless_replanned():
    state = {"step": 300, "total_steps": 300, "config": SAVED}
    stretched = train.schedule_for(train.Config(**{**SAVED, "max_steps": 600}), 600)
    with pytest.raises(UserError, match="--lr_decay_steps 600"):
        schedule_change_on_resume(stretched, state, {"max_steps"})  # --max_steps alone would re-stretch the cosine
    line = schedule_change_on_resume(stretched, state, {"max_steps", "lr_decay_steps"})
    assert "300 -> 600 steps" in line and f"{train.Schedule(2e-3, 30, 600, 0.1).lr(300):.3g}" in line
    long = {"step": 50, "total_steps": 100, "config": {**SAVED, "lr_decay_steps": 1000}}
    kept = train.schedule_for(train.Config(**{**SAVED, "lr_decay_steps": 1000, "max_steps": 200}), 200)
    assert schedule_change_on_resume(kept, long, {"max_steps"}) is None


def test_flags_given_in_sees_abbreviations_and_bools():
    assert cli.flags_given_in(train.Config, ["--max_steps", "5", "--gradient_checkpointing", "--lr=1e-3"]) == {
        "max_steps",
        "gradient_checkpointing",
        "lr",
    }
    assert cli.flags_given_in(train.Config, []) == set()


def test_optimizer_stays_fused_after_loading_an_older_checkpoint():
    """A checkpoint saved before AdamW was fused holds fused=None in its groups; loading it must not turn it off (a
    review found resumed runs back on the per-element loop)."""
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.LayerNorm(4))
    optimizer = train.make_optimizer(model, train.Config())
    older = optimizer.state_dict()
    for group in older["param_groups"]:
        group["fused"] = None
    optimizer.load_state_dict(older)
    assert [g["fused"] for g in optimizer.param_groups] == [True, True]


@pytest.mark.parametrize(
    "command, said",
    [
        (["train.py", "--max_stepz", "5"], "--max_stepz: no such flag of train.py (did you mean --max_steps?"),
        (["train.py", "--no_eval_at_startt"], "(did you mean --no_eval_at_start?"),  # not --eval_at_start
        (["train.py", "--num-processes", "3"], "a flag of accelerate launch, not of train.py: put it before train.py"),
        (["prepare_data.py", "--tokeniser=bpe:512"], "did you mean --tokenizer?"),
        (["eval.py", "--model", "m", "stray"], "'stray': a word no flag of eval.py takes"),
        (["train.py", "cpu"], "'cpu': a word no flag of train.py takes"),  # not accelerate's --cpu
        (["train.py", "--max", "2"], "ambiguous option: --max could match --max_steps"),  # argparse's own refusals
        (["train.py", "--max_steps", "abc"], "invalid int value: 'abc'; python train.py --help lists the flags"),
    ],
)
@pytest.mark.slow
def test_an_unknown_flag_is_one_error_line(command, said):
    proc = run([sys.executable, *command], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("error:") == 1 and said in proc.stderr, proc.stderr


@pytest.mark.parametrize("flag, value, said", [("--mixed_precision", "fp16", "put it before train.py"),
                                               ("--max_steps", "abc", "invalid int value")])  # fmt: skip
@pytest.mark.launch
def test_an_unknown_flag_under_the_launcher_is_said_once(tmp_path, flag, value, said):
    """Every process parses the same command line: rank 0 alone says what is wrong, and the launch fails."""
    proc = run(launch_cmd(2, "--output_dir", tmp_path, flag, value), check=False)
    assert proc.returncode != 0 and 'train.py", line' not in proc.stderr, proc.stderr[-3000:]  # the launcher's own
    assert "usage:" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and said in lines[0], proc.stderr[-3000:]
    assert not tmp_path.joinpath("checkpoints").exists()


@pytest.mark.launch
def test_help_under_the_launcher_is_printed_once():
    proc = run(launch_cmd(2, "--help"))
    assert proc.stdout.count("usage: train.py") == 1, proc.stdout[-3000:]


@pytest.mark.slow
def test_trackers_are_checked_before_the_run_starts(monkeypatch):
    """--log_with: an unknown name, a tracker whose run a resume cannot continue, a tracker whose package is missing
    and a name given twice are refused in one line, not Accelerate's ValueError or a warning and a run without it."""
    import importlib.util

    with pytest.raises(UserError, match="--log_with 'bogus': name one or more of wandb, trackio, tensorboard, mlflow"):
        trackers.check("tensorboard,bogus")
    with pytest.raises(UserError, match="--log_with 'aim': name one or more of"):
        trackers.check("aim")  # Accelerate knows it; a resumed run would open a second aim run
    with pytest.raises(UserError, match="names a tracker twice"):
        trackers.check("tensorboard, tensorboard")
    monkeypatch.setenv("WANDB_MODE", "offline")  # online needs a key: the next test
    assert trackers.check("tensorboard, wandb,trackio") == ["tensorboard", "wandb", "trackio"]  # requirements.txt
    if importlib.util.find_spec("mlflow") is None:
        with pytest.raises(UserError, match="the mlflow package is not installed; pip install mlflow"):
            trackers.check("tensorboard,mlflow")
        # train.py itself: refused before the process group and before the data is looked at.
        proc = run([sys.executable, "train.py", "--log_with", "mlflow", "--data_dir", "nowhere"], check=False)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
            "error: --log_with mlflow: the mlflow package is not installed; pip install mlflow"
        ), proc.stderr


def test_wandb_online_without_a_key_is_refused_before_the_run(monkeypatch, tmp_path):
    """W&B online with no API key would prompt after the model is built, which a run with no terminal cannot answer:
    refused in one line at start. Offline needs no key; `wandb login`'s netrc entry is a key."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.org login user password secret\n")
    monkeypatch.setenv("NETRC", str(netrc))
    with pytest.raises(UserError, match="--log_with wandb: no W&B API key .*WANDB_MODE=offline"):
        trackers.check("wandb")
    netrc.write_text("machine api.wandb.ai login user password 0123456789\n")
    assert trackers.check("wandb") == ["wandb"]
    netrc.unlink()
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "settings").write_text("[default]\nmode = offline\n")  # what `wandb offline` writes
    assert trackers.check("wandb") == ["wandb"]
    (tmp_path / "config" / "settings").write_text("[default\n\xff")  # unreadable: no offline there
    with pytest.raises(UserError, match="no W&B API key"):
        trackers.check("wandb")
    monkeypatch.setenv("WANDB_MODE", "OFFLINE")
    assert trackers.check("wandb") == ["wandb"]


def test_a_failing_tracker_does_not_end_the_run(capsys):
    """A tracker that raises (its disk full, its server gone) is dropped with one warning, also from what
    end_training finishes; the others go on, each sent a record once (training and validation records each by their
    own last step held), MLflow's names without the "/" its file store cannot hold beside the bare name, a skipped
    step's NaN loss not at all, a resume's fields with the next record. A fake accelerator (a real tracker that fails
    on cue is not at hand)."""
    sent, finished = {"wandb": [], "mlflow": []}, []

    class Tracker:
        def __init__(self, name):
            self.name = name

        def log(self, values, step):
            if self.name == "wandb" and step == 2:
                raise OSError(28, "No space left on device")
            sent[self.name].append((step, values))

        def finish(self):
            finished.append(self.name)

    class Accelerator:
        trackers = [Tracker("wandb"), Tracker("mlflow")]

        def get_tracker(self, name, unwrap=False):
            return next(t for t in self.trackers if t.name == name)

        def end_training(self):
            finished.append("process group")

    log = trackers.Trackers(Accelerator(), {"wandb": {"train": -1, "validation": -1},
                                            "mlflow": {"train": 2, "validation": 0}})  # fmt: skip

    def records(step):
        log.log({"step": step, "loss": float("nan") if step == 3 else 1.0 / (step + 1), "lr": 0.1, "note": "text"})
        log.log({"step": step, "val_loss": 2.0, "val_loss/web": 2.5})

    log.replaying = True  # metrics.jsonl up to the checkpoint (step 1), as start sends it
    log.log({"step": 0, "event": "resume", "restart": 0, "lost_steps": 0})  # an earlier one: mlflow holds what follows
    records(0), records(1)
    log.log({"step": 1, "event": "resume", "restart": 1, "lost_steps": 2})  # this segment's, last in the file
    log.replaying = False
    records(2), records(3)  # mlflow holds step 2's training record (the stopped segment's): its marker waits
    log.log({"step": 3, "event": "stop", "signal": "SIGTERM"})
    assert [s for s, _ in sent["wandb"]] == [0, 0, 1, 1] and [s for s, _ in sent["mlflow"]] == [1, 2, 3, 3]
    marker = {"resumed_at_step": 1, "lost_steps": 2, "launcher_restart": 1}
    assert sent["mlflow"][0][1] == {"val_loss": 2.0, "val_loss.web": 2.5}
    assert sent["mlflow"][1][1] == {**marker, "val_loss": 2.0, "val_loss.web": 2.5}
    assert sent["mlflow"][2][1] == {"lr": 0.1}  # a skipped interval: no loss
    assert sent["wandb"][0][1] == {"resumed_at_step": 0, "lost_steps": 0, "launcher_restart": 0, "loss": 1.0, "lr": 0.1}
    assert sent["wandb"][1][1] == {"val_loss": 2.0, "val_loss/web": 2.5}
    log.end_training()
    assert finished == ["mlflow", "process group"]
    out = capsys.readouterr().out
    assert out.count("warning: --log_with wandb failed at step 2 (OSError") == 1 and "metrics.jsonl has every" in out


def test_a_tracker_that_fails_to_start_is_dropped(tmp_path, capsys):
    """A real one: TensorBoard whose directory is taken by a file. One warning, no tracker left to log or finish,
    and OUT/trackers.json already written (a kill during the start leaves no run the next segment would not know)."""
    from accelerate import Accelerator

    out = tmp_path / "out"
    out.mkdir()
    (out / trackers.PROJECT).write_text("a file where TensorBoard's directory goes")
    accelerator = Accelerator(project_dir=str(out), cpu=True)
    log = trackers.start(accelerator, ["tensorboard"], out, [{"step": 1, "lr": 1e-3}], 0, {"parameters": 1})
    assert log.floors == {} and accelerator.trackers == []
    assert "warning: --log_with tensorboard failed to start (FileExistsError" in capsys.readouterr().out
    kept = json.loads((out / trackers.FILE).read_text())
    assert kept == {"output_dir": str(out.resolve()), "runs": {"tensorboard": {}}}
    log.log({"step": 2, "lr": 1e-3})
    log.end_training()


@pytest.mark.parametrize(
    "text",
    ['{"output_dir": "OUT", "runs": {"wandb": {"id": "ab', "[]", '{"output_dir": "OUT", "runs": []}', "\xff\xfe",
     '{"runs": {}}'],
)  # fmt: skip
def test_a_damaged_trackers_file_starts_new_tracker_runs(text, tmp_path, capsys):
    """OUT/trackers.json torn, foreign or odd: a warning and new tracker runs, not a traceback that ends the run."""
    path = tmp_path / trackers.FILE
    path.write_text(text.replace("OUT", str(tmp_path)), encoding="latin-1")
    assert trackers._kept(tmp_path) == {}
    assert f"warning: {path} is damaged" in capsys.readouterr().out


def test_trackers_file_entries_are_checked_one_by_one(tmp_path, capsys):
    """A bad entry costs that tracker's continuity only; a copied run directory starts new runs of every tracker."""
    good = {"wandb": {"id": "ab12cd34"}, "trackio": {"name": "out-ab12cd34"}, "tensorboard": {}, "mlflow": {}}
    bad = {"wandb": {"id": "x/y"}, "trackio": {"name": None}, "mlflow": {"run_id": 5}, "comet_ml": {}}
    for runs, kept in ((good, good), ({**good, **bad}, {"tensorboard": {}})):
        (tmp_path / trackers.FILE).write_text(json.dumps({"output_dir": str(tmp_path), "runs": runs}))
        assert trackers._kept(tmp_path) == kept
    out = capsys.readouterr().out
    assert [line.split(": its ")[1].split(" ")[0] for line in out.splitlines()] == ["'comet_ml'", "'mlflow'",
                                                                                   "'trackio'", "'wandb'"]  # fmt: skip
    (tmp_path / trackers.FILE).write_text(json.dumps({"output_dir": "/elsewhere/run", "runs": good}))
    assert trackers._kept(tmp_path) == {}
    assert "names the tracker runs of /elsewhere/run; this run directory is a copy" in capsys.readouterr().out


def test_init_from_a_run_directory_names_its_final_model(tmp_path):
    (tmp_path / "train_run.json").write_text('{"written_by": "train.py"}')
    (tmp_path / "config.json").write_text('{"written_by": "train.py"}')  # train.py's settings, not a model's
    with pytest.raises(UserError, match=f"is a train.py run directory; pass .* --init_from {tmp_path / 'final'} "):
        models.check_init_from(str(tmp_path), None, 0)


@pytest.mark.parametrize("flag", ["max_grad_norm", "max_skipped_steps"])
def test_a_negative_clip_or_skip_limit_is_refused(flag):
    """A negative --max_grad_norm flipped every gradient's sign (clip_grad_norm_ scales by max_norm / norm)."""
    with pytest.raises(UserError, match=f"--{flag} -1 must not be negative"):
        train.check_flags(train.Config(**{flag: -1}))


@pytest.mark.parametrize("preset", ["mini", "deepseek-v3-tiny"])
def test_residual_outputs_drawn_with_depth_scaled_std(preset):
    """The weights that write into the residual stream (o_proj, down_proj: dense, shared and routed experts) have std
    initializer_range / sqrt(2 x layers); every other matrix keeps initializer_range."""
    from transformers import AutoModelForCausalLM

    c = _config(preset)
    c.vocab_size = 4096
    torch.manual_seed(0)
    model = models.scale_residual_init(AutoModelForCausalLM.from_config(c))
    scaled = c.initializer_range / math.sqrt(2 * c.num_hidden_layers)
    seen = 0
    for name, p in model.named_parameters():
        if p.dim() < 2:  # norms, biases
            continue
        residual = name.endswith(models.RESIDUAL_OUTPUTS)
        seen += residual
        rel = 0.05 if p.numel() >= 10_000 else 0.15  # the spread of a small tensor's sample std (the router's)
        assert p.std().item() == pytest.approx(scaled if residual else c.initializer_range, rel=rel), name
    assert seen >= 2 * c.num_hidden_layers
