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
import re
import shutil
import signal
import time
from pathlib import Path

import torch

import plan
from cli import UserError, injected_fault, replace_dir, write_atomic, write_json_atomic

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


MARKER = "train_run.json"  # written into OUT before anything else: the only directories train.py writes into


def check_output_dir(output_dir: str, resume: str) -> None:
    """--output_dir and --resume, checked before a checkpoint's settings are read from them."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"--output_dir {output_dir} is a file, not a directory; choose a directory")
    if out.exists() and any(out.iterdir()):
        if not resume:
            raise UserError(
                f"--output_dir {output_dir} is not empty; pass --resume auto to continue that run or "
                f"choose an empty directory"
            )
        if not is_train_run(out):
            found = ", ".join(sorted(p.name + "/" * p.is_dir() for p in out.iterdir())[:6])
            raise UserError(
                f"--output_dir {output_dir} holds {found} but no train.py run (no {MARKER}); --resume continues "
                f"and writes only into directories train.py created: choose an empty or new directory"
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


def is_train_run(out: Path) -> bool:
    """Whether OUT was created by train.py: its marker, or (runs from before the marker) train.py's config.json or a
    checkpoint with train.py's trainer_state.json. A folder that merely holds a `checkpoints/` is not enough."""

    def written_by_train_py(path: Path, key: str) -> bool:
        try:
            return key in json.loads(path.read_text())
        except (OSError, ValueError, TypeError):
            return False

    if written_by_train_py(out / MARKER, "written_by") or written_by_train_py(out / "config.json", "written_by"):
        return True
    return any(
        written_by_train_py(p / "trainer_state.json", "model_config_hash") for p in step_dirs(out / "checkpoints")
    )


def mark_train_run(out: Path) -> None:
    """OUT's marker, written once, before train.py writes anything else into OUT."""
    out.mkdir(parents=True, exist_ok=True)
    if not (out / MARKER).is_file():  # a temporary name of its own: each machine's first process may write it at once
        tmp = out / f".{MARKER}.{os.getpid()}-{os.urandom(4).hex()}"
        tmp.write_text(json.dumps({"written_by": "train.py", "created": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
        os.replace(tmp, out / MARKER)


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
    old_lr = plan.lr_at(step, cfg.lr, cfg.warmup_steps, old_len, cfg.min_lr_ratio)
    new_lr = plan.lr_at(step, cfg.lr, cfg.warmup_steps, new_len, cfg.min_lr_ratio)
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


def read_model_config(ckpt: Path):
    """The model config a checkpoint was trained with (saved beside its shards): a resume needs nothing else."""
    where = str(ckpt / "model_config.json")
    d = plan.read_config_json(ckpt / "model_config.json", where)
    plan.check_model_fields(d, where)
    return plan.build_model_config(d, where)


def check_resume_compatible(state: dict, current: dict, ckpt: Path) -> None:
    """A checkpoint only continues the same run: ZeRO-3 shards are per rank, the data order and schedule depend on
    the global batch, sequence length, data and seed, and DeepSpeed's files are named by precision. Keys a checkpoint
    from an older train.py lacks are not compared."""
    for key, value in current.items():
        if key in state and state[key] != value:
            where = " (the accelerate config's mixed_precision, or --mixed_precision at launch)" * (key == "precision")
            raise UserError(
                f"cannot resume {ckpt}: it was made with {key}={state[key]!r}, this run has "
                f"{key}={value!r}{where}; relaunch with the original setting, or start a new --output_dir with "
                f"--init_from OUT/final (weights only, fresh optimizer and schedule)"
            )


# ---------------------------------------------------------------------------------------------------------------------
# Finding the checkpoint to resume from
# ---------------------------------------------------------------------------------------------------------------------


STEP_DIR = re.compile(r"step_(\d+)")


def step_of(path: Path) -> int | None:
    """N of a `step_N` directory name; None for any other name (a user's step_2.bak is not a checkpoint)."""
    match = STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


def step_dirs(ckpt_root: Path) -> list[Path]:
    """The step_N directories, oldest first, complete or not; other names are never parsed or touched."""
    if not ckpt_root.is_dir():
        return []
    return sorted((p for p in ckpt_root.iterdir() if p.is_dir() and step_of(p) is not None), key=step_of)


def write_manifest(ckpt: Path) -> None:
    """manifest.json: every file of the checkpoint with its size, written last, so a checkpoint that lost or truncated
    a shard afterwards (a full disk, a partial copy, a user's rm) is recognised before DeepSpeed reads it."""
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json")
    write_json_atomic(ckpt / "manifest.json", {"files": {str(p.relative_to(ckpt)): p.stat().st_size for p in files}})


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why a checkpoint cannot be resumed from (None: it is intact). Checkpoints from before manifests are taken on
    their trainer_state.json alone."""
    try:
        state = json.loads((ckpt / "trainer_state.json").read_text())
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            return "trainer_state.json has no step"
    except FileNotFoundError:
        return "no trainer_state.json (a run died while writing it)"
    except (OSError, ValueError) as e:
        return f"trainer_state.json is unreadable ({type(e).__name__})"
    manifest = ckpt / "manifest.json"
    if not manifest.exists():
        return None
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "manifest.json is unreadable"
    for name, size in files.items():
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {size}"
    return None


def read_trainer_state(ckpt: Path) -> dict:
    problem = checkpoint_problem(ckpt)
    if problem is not None:
        older = [p.name for p in step_dirs(ckpt.parent) if p != ckpt and checkpoint_problem(p) is None]
        fix = f"resume from {ckpt.parent / older[-1]}" if older else "start a new --output_dir"
        raise UserError(f"cannot resume {ckpt}: {problem}; {fix}")
    return json.loads((ckpt / "trainer_state.json").read_text())


def newest_intact_checkpoint(ckpt_root: Path, say) -> Path | None:
    """What `--resume auto` continues on this machine: the newest checkpoint that verifies; each newer one that does
    not is named with the reason and left where it is."""
    for ckpt in reversed(step_dirs(ckpt_root)):
        problem = checkpoint_problem(ckpt)
        if problem is None:
            return ckpt
        say(f"warning: skipping checkpoint {ckpt}: {problem}")
    return None


def find_resume_checkpoint(resume: str, ckpt_root: Path, accelerator) -> Path | None:
    """The checkpoint to resume from, the same on every rank. With node-local disks each machine sees only its own
    copies, and a kill between two machines' renames leaves them at different steps: all take the oldest."""
    for partial in sorted(ckpt_root.glob(".tmp-step_*")):
        accelerator.print(f"warning: ignoring incomplete checkpoint {partial} (a run died while writing it)")
    if resume not in ("", "auto"):
        read_trainer_state(Path(resume))  # refuses a damaged checkpoint before anything moves or loads
        return Path(resume)
    if resume != "auto":
        return None
    mine = newest_intact_checkpoint(ckpt_root, accelerator.print)
    step = step_of(mine) if mine is not None else -1
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
    missing = torch.tensor([float(checkpoint_problem(chosen) is not None)], device=accelerator.device)
    if float(accelerator.reduce(missing, "sum")) > 0:
        raise UserError(
            f"--resume auto: {chosen} is not complete on every machine; copy it there or resume from an "
            f"older checkpoint"
        )
    return chosen


def set_aside_newer(ckpt_root: Path, resume_from: Path) -> str | None:
    """An explicit --resume from an older checkpoint starts a new branch: the checkpoints after it move to
    checkpoints/abandoned-<time>/ (kept until the run finishes, out of pruning's and --resume auto's way) and `latest`
    names resume_from. Called only once resume_from has loaded. Returns a line saying what moved where."""
    if not ckpt_root.is_dir() or resume_from.parent.resolve() != ckpt_root.resolve():
        return None
    newer = [p for p in step_dirs(ckpt_root) if step_of(p) > step_of(resume_from)]
    if not newer:
        return None
    aside = ckpt_root / time.strftime("abandoned-%Y%m%d-%H%M%S")
    aside.mkdir(exist_ok=True)
    for p in newer:
        os.replace(p, aside / p.name)
    write_atomic(ckpt_root / "latest", resume_from.name + "\n")
    return (
        f"moved the checkpoints after {resume_from.name} ({', '.join(p.name for p in newer)}) to {aside}: this run "
        f"continues from {resume_from.name}"
    )


def remove_leftovers(ckpt_root: Path, finished: bool) -> list[str]:
    """What earlier runs in OUT left that nothing will read: half-written checkpoints (.tmp-step_N), old copies a
    crash left beside their replacement (.step_N.stale, when step_N is there), markers of crashed starts; once the
    run has finished, also the branches an explicit --resume set aside. Returns the names removed."""
    doomed = list(ckpt_root.glob(".tmp-step_*")) + list(ckpt_root.glob(".rank0-*"))
    doomed += [p for p in ckpt_root.glob(".step_*.stale") if (ckpt_root / p.name[1 : -len(".stale")]).is_dir()]
    if finished:
        doomed += list(ckpt_root.glob("abandoned-*"))
    for p in doomed:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return sorted(p.name for p in doomed)


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


class CheckpointWriteError(Exception):
    """A checkpoint could not be written (exit 3): the message names the directory, the likely cause and the fix."""


def write_failure(tmp: Path, error: BaseException, last_good: Path | None) -> CheckpointWriteError:
    import resource

    free_gib = shutil.disk_usage(tmp if tmp.exists() else tmp.parent).free / 2**30
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    why = f"{free_gib:.1f} GiB free on that disk" + (
        f", file size limit (ulimit -f) {limit} bytes" if limit != resource.RLIM_INFINITY else ""
    )
    keep = f"the last complete checkpoint, {last_good}, is intact" if last_good else "no earlier checkpoint exists"
    return CheckpointWriteError(
        f"writing checkpoint {tmp} failed: {type(error).__name__}: {error} ({why}); {keep}: free space or raise "
        f"the limit, then rerun with --resume auto"
    )


def save_checkpoint(
    accelerator,
    ckpt_root: Path,
    step: int,
    state: dict,
    keep_last: int,
    resumed_from: Path | None,
    finaliser: bool,
    model_config,
) -> Path:
    """Every rank writes its shards into .tmp-step_N; once all have, the finaliser of each filesystem (see
    first_process_on_disk) adds trainer_state.json, the model config and the manifest, renames it to step_N, moves
    `latest` and prunes. Raises CheckpointWriteError, with step_N untouched, when the disk refuses a write."""
    final = ckpt_root / f"step_{step}"
    tmp = ckpt_root / f".tmp-step_{step}"
    last_good = newest_intact_checkpoint(ckpt_root, lambda _: None) if finaliser else None
    try:
        if finaliser:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died while writing this step
            tmp.mkdir(parents=True, exist_ok=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        if finaliser and not accelerator.is_main_process:  # node-local disk: Accelerate saves these on rank 0 only
            for i, obj in enumerate(accelerator._custom_objects):
                torch.save(obj.state_dict(), tmp / f"custom_checkpoint_{i}.pkl")
        for kind, sig in (("sigkill_in_save", signal.SIGKILL), ("sigterm_in_save", signal.SIGTERM)):
            if injected_fault(kind, accelerator.process_index, step):
                os.kill(os.getpid(), sig)
        accelerator.wait_for_everyone()
        if finaliser:
            write_json_atomic(tmp / "trainer_state.json", state)
            model_config.to_json_file(tmp / "model_config.json")
            write_manifest(tmp)
            replace_dir(tmp, final)  # a step_N of an earlier attempt at this step is replaced whole
            write_atomic(ckpt_root / "latest", final.name + "\n")
    except (OSError, RuntimeError) as e:  # torch reports a full disk as "basic_ios::clear: iostream error"
        raise write_failure(tmp, e, last_good) from None
    if finaliser:
        intact = [p for p in step_dirs(ckpt_root) if checkpoint_problem(p) is None]
        for old in intact[:-keep_last]:
            if old != final and (resumed_from is None or old.resolve() != resumed_from.resolve()):
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def read_metrics(metrics_path: Path) -> tuple[list[dict], int]:
    """The records of metrics.jsonl and the number of lines that are not one: a kill or a full disk while appending
    tears the last line, which is dropped; no line is ever fatal."""
    records, bad = [], 0
    for line in metrics_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
            elif line.strip():
                bad += 1
        except ValueError:
            bad += 1
    return records, bad


def truncate_metrics(metrics_path: Path, step: int) -> int:
    """Lines logged after the checkpoint by the run that died would be logged again: drop them, and any torn line.
    Returns the number of torn lines dropped."""
    records, bad = read_metrics(metrics_path)
    write_atomic(metrics_path, "".join(json.dumps(r) + "\n" for r in records if r["step"] <= step))
    return bad


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
