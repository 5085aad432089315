"""Resume on another number of processes (issue #38): a ZeRO-3 checkpoint of 3 processes continues on 2 and on 1, one
of 2 on 3, each exactly as the straight run went on (losses and gradient norms to 1e-5 at every step after the
checkpoint, so optimizer moments reset at the resume would show from its second step on); a global batch the new
launch cannot keep is refused naming settings that can, another split of it (accumulation) continues exactly; a kill
while the checkpoint is converted leaves nothing a rerun would use, the checkpoint itself is never written to, and a
universal copy that does not match its checkpoint (made from another, or cut short) is converted anew. ZeRO-2:
test_strategies.py; DeepSeek-V3 tiny (the routers' biases): test_moe.py; bf16/fp16: test_precision.py.

The straight run is conftest's ref_run (3 processes x micro-batch 2, 10 steps), and its step-4 checkpoint the one
resumed here (explicitly: its later checkpoints are set aside, as a roll-back does).
"""

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import assert_same_ema, launch, train_records

from deepseek_zero3.cli import UserError
from deepseek_zero3.run_dir import checkpoint, reshard
from deepseek_zero3.training_data.token_data import BatchPlan


def digest(directory: Path) -> str:
    """Every file's name and bytes under `directory`."""
    h = hashlib.sha256()
    for p in sorted(directory.rglob("*")):
        h.update(str(p.relative_to(directory)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def assert_continues(straight: Path, resumed: Path, steps) -> None:
    """The resumed run's losses and gradient norms at `steps` equal the straight run's to 1e-5 (measured: 5e-8 and
    2e-8; with the moments of the step-count slip DeepSpeed's ZeRO-3 loader makes, 7e-5 by the 4th step)."""
    a, b = train_records(straight), train_records(resumed)
    assert set(steps) <= set(b) and max(b) == max(steps), sorted(b)
    for s in steps:
        for key in ("loss", "grad_norm"):
            assert b[s][key] == pytest.approx(a[s][key], rel=1e-5), (s, key, a[s][key], b[s][key])
        assert b[s]["lr"] == pytest.approx(a[s]["lr"], rel=1e-12) and b[s]["samples_seen"] == a[s]["samples_seen"]


@pytest.fixture(scope="module")
def three_to_two(ref_run, tmp_path_factory):
    """ref_run's OUT, copied, resumed from its step 4 on 2 processes: first with the micro-batch as it was (refused),
    then with the converting process killed mid-conversion, then as the error line advises, to step 8 with
    checkpoints at 6 and 8. Returns (OUT, the step-4 checkpoint's digest before, the three launches)."""
    out = tmp_path_factory.mktemp("reshard") / "two"
    shutil.copytree(ref_run[0], out)
    before = digest(out / "checkpoints" / "step_4")
    resume = ["--output_dir", out, "--resume", out / "checkpoints" / "step_4", "--max_steps", "8", "--save_every", "2",
              "--lr_decay_steps", "10"]  # fmt: skip
    refused = launch(2, *resume, check=False)
    kill = {"TRAIN_TEST_FAULT": "sigkill_in_reshard:0:4", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}
    killed = launch(2, *resume, "--micro_batch_size", "3", check=False, env=kill)
    left = sorted(p.name for p in (out / "checkpoints").iterdir())
    alive = subprocess.run(["pgrep", "-f", f"ds_to_universal.*{out}"], capture_output=True, text=True).stdout
    resumed = launch(2, *resume, "--micro_batch_size", "3")
    return out, before, {"refused": refused, "killed": killed, "left": left, "alive": alive, "resumed": resumed}


def test_a_global_batch_the_launch_cannot_keep_is_refused_naming_what_can(three_to_two):
    refused = three_to_two[2]["refused"]
    assert refused.returncode != 0
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: cannot resume {three_to_two[0]}/checkpoints/step_4 on 2 process(es): its run trains on 6 sequences "
        "per step (2 micro x 1 accumulation x 3 processes), this launch on 4 (2 x 1 x 2); keep it with "
        "--micro_batch_size 3 or --micro_batch_size 1 with accelerate launch --gradient_accumulation_steps 3"
    ], refused.stderr[-3000:]


def test_the_other_ways_to_keep_a_global_batch_are_named():
    state = {"micro_batch_size": 4, "grad_accum_steps": 2, "world_size": 3, "step": 4}  # 24 sequences
    accum_1 = "with accelerate launch --gradient_accumulation_steps 1"
    with pytest.raises(UserError, match=f"keep it with --micro_batch_size 3 or --micro_batch_size 6 {accum_1} or --m"):
        reshard.check_global_batch(state, BatchPlan(4, 2, 4, 32), Path("ckpt"))
    with pytest.raises(UserError, match=r"no setting keeps 24 on 5 processes: resume on 1, 2, 3, 4, 6, 8, 12, 24$"):
        reshard.check_global_batch(state, BatchPlan(4, 2, 5, 32), Path("ckpt"))
    reshard.check_global_batch(state, BatchPlan(1, 4, 6, 32), Path("ckpt"))  # another split of 24: no error


def test_a_kill_mid_conversion_leaves_nothing_used_and_the_checkpoint_unchanged(three_to_two):
    out, before, runs = three_to_two
    assert runs["killed"].returncode != 0
    assert "converting step_4 (3 processes' shards)" in runs["killed"].stdout, runs["killed"].stdout[-3000:]
    assert ".tmp-step_4.universal" in runs["left"] and "step_4.universal" not in runs["left"], runs["left"]
    assert runs["alive"] == "", "the converter outlived the process that started it"
    assert "converted step_4 in" in runs["resumed"].stdout  # redone from the start, the half-made copy deleted
    assert not (out / "checkpoints" / ".tmp-step_4.universal").exists()
    assert digest(out / "checkpoints" / "step_4") == before


def test_three_processes_continue_on_two(ref_run, three_to_two):
    out, _, runs = three_to_two
    assert "resumed from" in runs["resumed"].stdout
    assert "written by 3 processes, this run has 2" in runs["resumed"].stdout
    assert_continues(ref_run[0], out, range(5, 9))
    # The EMA (checkpoint state of train.py's own, per ZeRO-3 partition) cut again for 2 processes: two shares now,
    # the average at step 8 the straight run's (seen failing with reshard() taking process 0's share for all).
    assert len(list((out / "checkpoints" / "step_8").glob("state-ema-rank*.pt"))) == 2
    assert_same_ema(ref_run[0] / "checkpoints" / "step_8", out / "checkpoints" / "step_8", rel=1e-5)


def test_two_processes_continue_on_three(ref_run, three_to_two, tmp_path):
    """The 2-process run's own step-6 checkpoint (written after a resharded resume) on 3 processes, in a new OUT, next
    to a complete step_6.universal made from another step_6 (as a roll-back leaves one): converted anew, and the two
    processes that wait for the conversion load the new one."""
    ckpt = tmp_path / "copy" / "step_6"
    shutil.copytree(three_to_two[0] / "checkpoints" / "step_6", ckpt)
    shutil.copytree(three_to_two[0] / "checkpoints" / "step_4.universal", tmp_path / "copy" / "step_6.universal")
    out = tmp_path / "three"
    proc = launch(3, "--resume", ckpt, "--output_dir", out, "--max_steps", "10", "--micro_batch_size", "2")
    assert "written by 2 processes, this run has 3" in proc.stdout
    assert "converting step_6 again: the step_6.universal there cannot be used (it was made from another" in proc.stdout
    assert_continues(ref_run[0], out, range(7, 11))
    assert (tmp_path / "copy" / "step_6.universal" / "made_of.json").is_file()  # beside the checkpoint it converts


def test_three_processes_continue_on_one_with_accumulation(ref_run, three_to_two, tmp_path):
    """The global batch split anew (micro-batch 2 x accumulation 3 on 1 process: Accelerate's restored micro-step count
    would end the first step's accumulation early), next to a step_4.universal without its manifest (redone)."""
    ckpt = tmp_path / "copy" / "step_4"
    shutil.copytree(ref_run[0] / "checkpoints" / "step_4", ckpt)
    shutil.copytree(three_to_two[0] / "checkpoints" / "step_4.universal", tmp_path / "copy" / "step_4.universal")
    (tmp_path / "copy" / "step_4.universal" / "manifest.json").unlink()
    out = tmp_path / "one"
    proc = launch(1, "--resume", ckpt, "--output_dir", out, "--max_steps", "8", "--lr_decay_steps", "10",
                  "--micro_batch_size", "2", accum=3)  # fmt: skip
    assert "written by 3 processes, this run has 1" in proc.stdout
    assert "converting step_4 again: the step_4.universal there cannot be used (it has no manifest" in proc.stdout
    assert_continues(ref_run[0], out, range(5, 9))
    assert_same_ema(ref_run[0] / "checkpoints" / "step_8", out / "checkpoints" / "step_8", rel=1e-5)


def test_a_universal_copy_given_to_resume_names_its_checkpoint(tmp_path):
    copy = tmp_path / "checkpoints" / "step_4.universal"
    with pytest.raises(UserError, match=rf"train.py's universal copy of a checkpoint; --resume {copy.parent}/step_4$"):
        checkpoint.find_resume_checkpoint(str(copy), tmp_path / "out" / "checkpoints", None)
