"""A run's directory: checkpoints that resume exactly, the exported model, and the settings a resumed run keeps.

    OUT/checkpoints/.tmp-step_N   written by every rank (accelerator.save_state), then renamed by one process per
    OUT/checkpoints/step_N        filesystem to step_N, with trainer_state.json inside; `latest` moves last
    OUT/final                     a plain Hugging Face model directory (gathered from the ZeRO-3 shards)
    OUT/metrics.jsonl             on resume, cut back to the checkpoint's step

A kill at any moment leaves the last complete checkpoint as it was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import shutil
import time
from pathlib import Path

import torch

from cli import UserError, injected_fault, replace_dir, write_atomic, write_json_atomic
from plan import lr_at

# Settings that change what a run reports or where it reads and writes, not what it trains: free to change on resume.
RESUME_CHANGEABLE = {
    "data_dir",
    "log_every",
    "eval_every",
    "eval_at_start",
    "eval_tokens",
    "save_every",
    "keep_last",
    "accelerate_config",
    "assumed_mfu",
    "interconnect_gb_s",
    "gpu_memory_gib",
    "ignore_memory_plan",
    "log_with",
    "gradient_checkpointing",
    "attn_implementation",
}
# The LR schedule's length; changing it on resume needs an explicit --lr_decay_steps (schedule_on_resume).
SCHEDULE_LENGTH = {"max_steps", "num_epochs", "lr_decay_steps"}


# ---------------------------------------------------------------------------------------------------------------------
# Before the run: the output directory and what a resumed run keeps
# ---------------------------------------------------------------------------------------------------------------------


def check_output_dir(output_dir: str, resume: str) -> None:
    """--output_dir and --resume, checked before a checkpoint's settings are read from them."""
    out = Path(output_dir)
    if out.exists() and any(out.iterdir()):
        if not resume:
            raise UserError(
                f"--output_dir {output_dir} is not empty; pass --resume auto to continue that run or "
                f"choose an empty directory"
            )
        if not written_by_train_py(out):
            raise UserError(
                f"--output_dir {output_dir} holds files but no train.py run (no checkpoints/, no "
                f"config.json of train.py); --resume continues only a train.py run: choose an empty or "
                f"new directory"
            )
    probe = out if out.exists() else next(p for p in out.absolute().parents if p.exists())
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        raise UserError(
            f"--output_dir {output_dir}: {probe} is not a writable directory; choose a directory you can write to"
        )
    if resume not in ("", "auto") and not (Path(resume) / "trainer_state.json").is_file():
        raise UserError(
            f"--resume {resume} is not a complete checkpoint (no trainer_state.json); use --resume auto "
            f"or a checkpoints/step_N directory"
        )


def written_by_train_py(out: Path) -> bool:
    """Whether OUT is a train.py output directory, the only kind whose final/ and config.json train.py replaces."""
    try:
        return (out / "checkpoints").is_dir() or json.loads((out / "config.json").read_text()).get(
            "written_by"
        ) == "train.py"
    except (OSError, ValueError, AttributeError):
        return False


def config_for_resume(cfg, given: set[str], saved: dict):
    """The settings of a resumed run: the checkpoint's for every field the command does not give. A command that
    changes a training setting is refused; the schedule's length is checked by schedule_on_resume once known.
    Returns (the run's Config, the settings taken from the checkpoint that differ from this command's)."""
    taken = {}
    for f in dataclasses.fields(cfg):
        if f.name not in saved or f.name in ("output_dir", "resume", "plan"):
            continue
        ours = getattr(cfg, f.name)
        if f.name not in given:
            if saved[f.name] != ours:
                taken[f.name] = saved[f.name]
        elif ours != saved[f.name] and f.name not in RESUME_CHANGEABLE | SCHEDULE_LENGTH:
            raise UserError(
                f"cannot resume: the run was trained with --{f.name} {saved[f.name]}, this command gives "
                f"--{f.name} {ours}; drop --{f.name} to keep the run's setting, or start a new "
                f"--output_dir with --init_from OUT/final (weights only, fresh optimizer and schedule)"
            )
    return dataclasses.replace(cfg, **taken), taken


def schedule_on_resume(cfg, given: set[str], total_steps: int, state: dict) -> str | None:
    """A resumed run keeps its LR schedule unless the command re-plans it with --lr_decay_steps. Returns a line saying
    how the LR at the resume step changes when it does; raises when --max_steps or --num_epochs alone would stretch
    it."""
    saved = state.get("config", {})
    old_len = saved.get("lr_decay_steps") or state["total_steps"]
    new_len = cfg.lr_decay_steps or total_steps
    if new_len == old_len:
        return None
    step = state["step"]
    old_lr = lr_at(step, cfg.lr, cfg.warmup_steps, old_len, cfg.min_lr_ratio)
    new_lr = lr_at(step, cfg.lr, cfg.warmup_steps, new_len, cfg.min_lr_ratio)
    if "lr_decay_steps" not in given:
        raise UserError(
            f"cannot resume: this command makes the LR schedule {new_len} steps long, the run's is "
            f"{old_len} (the LR at step {step} would jump from {old_lr:.3g} to {new_lr:.3g}); give "
            f"--lr_decay_steps {new_len} to re-plan the schedule, or --lr_decay_steps {old_len} to keep it "
            f"and train on at its floor"
        )
    return (
        f"re-planned LR schedule: {old_len} -> {new_len} steps; the LR at step {step} goes from {old_lr:.3g} "
        f"to {new_lr:.3g}"
    )


def config_hash(model_config) -> str:
    """What identifies a model's architecture in trainer_state.json: its config without names and versions."""
    d = model_config.to_diff_dict() if hasattr(model_config, "to_diff_dict") else dict(model_config)
    ignored = ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures")
    d = {k: v for k, v in d.items() if k not in ignored}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_resume_compatible(state: dict, current: dict, ckpt: Path) -> None:
    """A checkpoint only continues the same run: ZeRO-3 shards are per rank, and the data order and schedule depend on
    the global batch, sequence length, data and seed."""
    for key, value in current.items():
        if state.get(key) != value:
            raise UserError(
                f"cannot resume {ckpt}: it was made with {key}={state.get(key)!r}, this run has "
                f"{key}={value!r}; relaunch with the original setting, or start a new --output_dir with "
                f"--init_from OUT/final (weights only, fresh optimizer and schedule)"
            )


# ---------------------------------------------------------------------------------------------------------------------
# Finding the checkpoint to resume from
# ---------------------------------------------------------------------------------------------------------------------


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    found = [p for p in ckpt_root.glob("step_*") if p.is_dir() and (p / "trainer_state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def newest_checkpoint(ckpt_root: Path) -> Path | None:
    """What `--resume auto` continues: the checkpoint `latest` names, else the newest complete one."""
    latest = ckpt_root / "latest"
    if latest.is_file():
        named = ckpt_root / latest.read_text().strip()
        if (named / "trainer_state.json").is_file():
            return named
    done = complete_checkpoints(ckpt_root)
    return done[-1] if done else None


def find_resume_checkpoint(resume: str, ckpt_root: Path, accelerator) -> Path | None:
    """The checkpoint to resume from, the same on every rank. With node-local disks each machine sees only its own
    copies, and a kill between two machines' renames leaves them at different steps: all take the oldest."""
    incomplete = [p for p in ckpt_root.glob("step_*") if not (p / "trainer_state.json").is_file()]
    for partial in sorted(ckpt_root.glob(".tmp-step_*")) + incomplete:
        accelerator.print(f"warning: ignoring incomplete checkpoint {partial} (a run died while writing it)")
    if resume not in ("", "auto"):
        return Path(resume)
    if resume != "auto":
        return None
    mine = newest_checkpoint(ckpt_root)
    step = int(mine.name.split("_")[1]) if mine is not None else -1
    lowest, highest = step, step
    if accelerator.num_processes > 1:
        steps = torch.tensor([step, -step], device=accelerator.device)
        torch.distributed.all_reduce(steps, op=torch.distributed.ReduceOp.MIN)
        lowest, highest = int(steps[0]), -int(steps[1])
    if highest < 0:
        return None
    if lowest < 0:
        raise UserError(
            f"--resume auto: some machines have no complete checkpoint in {ckpt_root} while others reach "
            f"step {highest}; copy the checkpoints to every machine or start a new --output_dir"
        )
    if lowest != highest:
        accelerator.print(
            f"warning: machines disagree on the newest checkpoint (steps {lowest} to {highest}); "
            f"all resume from step {lowest}"
        )
    chosen = ckpt_root / f"step_{lowest}"
    missing = torch.tensor([float(not (chosen / "trainer_state.json").is_file())], device=accelerator.device)
    if float(accelerator.reduce(missing, "sum")) > 0:
        raise UserError(
            f"--resume auto: {chosen} is not complete on every machine; copy it there or resume from an "
            f"older checkpoint"
        )
    return chosen


def set_aside_newer(ckpt_root: Path, resume_from: Path) -> Path | None:
    """An explicit --resume from an older checkpoint starts a new branch: the checkpoints after it move to
    checkpoints/abandoned-<time>/ (kept, but out of pruning's and --resume auto's way) and `latest` names
    resume_from."""
    if not ckpt_root.is_dir() or resume_from.parent.resolve() != ckpt_root.resolve():
        return None
    step = int(resume_from.name.split("_")[1])
    newer = [p for p in ckpt_root.glob("step_*") if p.is_dir() and int(p.name.split("_")[1]) > step]
    if not newer:
        return None
    aside = ckpt_root / time.strftime("abandoned-%Y%m%d-%H%M%S")
    aside.mkdir(exist_ok=True)
    for p in newer:
        os.replace(p, aside / p.name)
    write_atomic(ckpt_root / "latest", resume_from.name + "\n")
    return aside


def first_process_on_disk(accelerator, directory: Path) -> bool:
    """True on exactly one process per filesystem holding `directory`: global rank 0, and on node-local disks (where
    rank 0's marker file is invisible) the first process of each other machine. These processes finalise checkpoints."""
    from accelerate.utils import broadcast_object_list

    nonce = broadcast_object_list([os.urandom(8).hex()])[0]
    marker = directory / f".rank0-{nonce}"
    if accelerator.is_local_main_process:
        directory.mkdir(parents=True, exist_ok=True)
    if accelerator.is_main_process:
        marker.touch()
    accelerator.wait_for_everyone()
    sees_rank0 = marker.exists()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        marker.unlink()
    return accelerator.is_main_process or (accelerator.is_local_main_process and not sees_rank0)


# ---------------------------------------------------------------------------------------------------------------------
# Writing: checkpoints, the metrics a resumed run keeps, the final model
# ---------------------------------------------------------------------------------------------------------------------


def save_checkpoint(
    accelerator, ckpt_root: Path, step: int, state: dict, keep_last: int, resumed_from: Path | None, finaliser: bool
) -> Path:
    """Every rank writes its shards into .tmp-step_N; once all have, the finaliser of each filesystem (see
    first_process_on_disk) adds trainer_state.json, renames it to step_N, moves `latest` and prunes."""
    final = ckpt_root / f"step_{step}"
    tmp = ckpt_root / f".tmp-step_{step}"
    if finaliser:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died while writing this step
        tmp.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if injected_fault("sigkill_in_save", accelerator.process_index, step):
        os.kill(os.getpid(), signal.SIGKILL)
    accelerator.wait_for_everyone()
    if finaliser:
        write_json_atomic(tmp / "trainer_state.json", state)
        replace_dir(tmp, final)  # a step_N of an earlier attempt at this step is replaced whole
        write_atomic(ckpt_root / "latest", final.name + "\n")
        for old in complete_checkpoints(ckpt_root)[:-keep_last]:
            if old != final and (resumed_from is None or old.resolve() != resumed_from.resolve()):
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def truncate_metrics(metrics_path: Path, step: int) -> None:
    """Lines logged after the checkpoint by the run that died would be logged again: drop them."""
    kept = [line for line in metrics_path.read_text().splitlines() if json.loads(line)["step"] <= step]
    write_atomic(metrics_path, "".join(line + "\n" for line in kept))


def export_final(accelerator, model, tokenizer, out_dir: Path) -> Path:
    """OUT/final: a plain Hugging Face model directory, weights gathered from the ZeRO-3 shards."""
    state_dict = accelerator.get_state_dict(model)  # collective: every rank takes part
    final, tmp = out_dir / "final", out_dir / ".tmp-final"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        replace_dir(tmp, final)
    accelerator.wait_for_everyone()
    return final
