"""Resuming on another number of processes, through DeepSpeed's universal checkpoints.

A ZeRO checkpoint holds each rank's flat shard of the fp32 weights and the optimizer's moments, cut for the number of
processes that wrote it: DeepSpeed refuses to load it on any other ("DP world size of 3 but ... 2"). DeepSpeed's own
converter (deepspeed.checkpoint.ds_to_universal) rewrites it as one file per parameter and state, whole, which its
engine loads on any number of processes ("checkpoint": {"load_universal": true}), re-cutting the shards as it loads.
train.py does both steps by itself when the number of processes changed:

    OUT/checkpoints/step_N                    as the N-process run wrote it: only ever read
    OUT/checkpoints/.tmp-step_N.universal     being converted (a kill leaves it; the next attempt deletes it first)
    OUT/checkpoints/step_N.universal          complete: the universal shards, the run's own files, a manifest

The sample order is a function of the global sample number, so the data continues as long as the global batch
(micro-batch x accumulation x processes) does; the run refuses a resume that changes it (check_global_batch).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from deepseek_zero3.cli import UserError, fault, remove, replace_dir
from deepseek_zero3.run_dir import checkpoint

POLL_S = 2.0  # how often a process waiting for another's conversion looks, and beats its watchdog


def saved_world_size(state: dict) -> int:
    return int(state["world_size"])


def global_batch(state: dict) -> int:
    """Sequences per optimizer step of the run that wrote trainer_state.json `state`."""
    return int(state["micro_batch_size"]) * int(state["grad_accum_steps"]) * saved_world_size(state)


def check_launch(state: dict, launch, batch, path: Path) -> None:
    """Refuse a launch that cannot continue the checkpoint: Muon's state on another number of ZeRO processes (before
    anything is written), then another global batch (check_global_batch)."""
    if state.get("config", {}).get("optimizer") == "muon" and needs_conversion(state, launch.world_size,
                                                                                 launch.zero_stage):  # fmt: skip
        raise UserError(
            f"cannot resume {path} on {launch.world_size} processes: it holds Muon's momentum, which DeepSpeed's "
            f"universal checkpoint does not carry (it reshards Adam's state only); resume on "
            f"{saved_world_size(state)} processes"
        )
    check_global_batch(state, batch, path)


def check_global_batch(state: dict, batch, path: Path) -> None:
    """Refuse a launch (batch: its token_data.BatchPlan) that does not continue the checkpoint's global batch, naming
    the settings that would. Accumulation is accelerate launch's --gradient_accumulation_steps."""
    micro, accum, world = batch.micro_batch_size, batch.grad_accum_steps, batch.world_size
    want, have = global_batch(state), micro * accum * world
    if want == have:
        return
    ran = f"{state['micro_batch_size']} micro x {state['grad_accum_steps']} accumulation x {saved_world_size(state)}"
    head = (
        f"cannot resume {path} on {world} process(es): its run trains on {want} sequences per step ({ran} "
        f"processes), this launch on {have} ({micro} x {accum} x {world})"
    )
    if want % world:
        works = [n for n in range(1, want + 1) if want % n == 0]
        raise UserError(f"{head}; no setting keeps {want} on {world} processes: resume on {', '.join(map(str, works))}")
    per_process = want // world
    ways = [(per_process // a, a) for a in range(1, per_process + 1) if per_process % a == 0]
    ways.sort(key=lambda w: (w[1] != accum, w[1]))  # this launch's accumulation first, then the fewest micro-steps
    said = [f"--micro_batch_size {m}" + (f" with accelerate launch --gradient_accumulation_steps {a}" if a != accum
                                         else "") for m, a in ways[:3]]  # fmt: skip
    raise UserError(f"{head}; keep it with {' or '.join(said)}")


def needs_conversion(state: dict, world_size: int, zero_stage: int) -> bool:
    """A DeepSpeed (ZeRO) checkpoint written by another number of processes. DDP checkpoints hold whole tensors."""
    return zero_stage > 0 and saved_world_size(state) != world_size


def universal_dir(ckpt: Path) -> Path:
    return ckpt.parent / f"{ckpt.name}.universal"


def shard_dir(ckpt: Path) -> Path:
    """The engine's folder inside an Accelerate checkpoint (pytorch_model/ for the one model)."""
    found = sorted(p.parent for p in ckpt.glob("*/*_optim_states.pt"))
    if not found:
        raise UserError(f"cannot reshard {ckpt}: it holds no DeepSpeed optimizer shards (*/*_optim_states.pt)")
    return found[0]


def tmp_dir(ckpt: Path) -> Path:
    return ckpt.parent / f".tmp-{ckpt.name}.universal"


def source_digest(ckpt: Path) -> str:
    """What step_N.universal records of the step_N it was made from: its manifest (every file and size; trainer_state
    for a checkpoint from before manifests). A step_N rewritten since (a roll-back's new branch) no longer matches."""
    made_of = ckpt / "manifest.json" if (ckpt / "manifest.json").is_file() else ckpt / "trainer_state.json"
    return hashlib.sha256(made_of.read_bytes()).hexdigest()


def universal_problem(final: Path, ckpt: Path) -> str | None:
    """Why an existing step_N.universal cannot be used for `ckpt` (None: it can)."""
    if not (final / "manifest.json").is_file():
        return "it has no manifest (not written by this version, or cut short)"
    problem = checkpoint.checkpoint_problem(final)
    if problem is not None:
        return problem
    try:
        made_of = json.loads((final / "made_of.json").read_text())["digest"]
    except (OSError, ValueError, KeyError, TypeError):
        return "made_of.json is missing or unreadable"
    return None if made_of == source_digest(ckpt) else f"it was made from another {ckpt.name} (since rewritten)"


def tree_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def plural(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}es"


def exit_reason(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}" + (" (out of memory?)" if returncode == -9 else "")
    return f"exit status {returncode}"


PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child between fork and exec only calls it


def die_with_parent() -> None:
    """In the converter's process: die when train.py does (a kill mid-conversion must not leave it writing on)."""
    PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def convert(ckpt: Path, zero_stage: int, rank: int, beat) -> Path:
    """Write step_N.universal beside `ckpt` with DeepSpeed's converter (a separate process: its memory goes when it
    ends, and it dies with this one), copy the run's own files (trainer state, model config, custom objects, random
    states) next to it, add a manifest and rename it into place. An existing complete one is reused. beat(): called
    every few seconds while the converter runs (the watchdog's)."""
    final, tmp = universal_dir(ckpt), tmp_dir(ckpt)
    if final.is_dir() and universal_problem(final, ckpt) is None:
        return final
    remove(tmp)  # a conversion a kill interrupted, before the free space is measured
    state = checkpoint.read_trainer_state(ckpt)
    source, ranks = shard_dir(ckpt), saved_world_size(state)
    optim_shards = list(source.glob("*_optim_states.pt"))
    if len(optim_shards) != ranks:
        raise UserError(
            f"cannot reshard {ckpt}: {source} holds the optimizer shards of {len(optim_shards)} processes, the run "
            f"had {ranks}; copy every machine's shards into it (a shared filesystem does this), or resume on {ranks} "
            f"processes"
        )
    # The converter holds its per-parameter fragments until it has written the result from them, and the result
    # repeats the first process's optimizer shard: measured 2.7x the shards at the peak for a 1-process checkpoint.
    optim = sum(p.stat().st_size for p in optim_shards)
    needed, free = tree_bytes(source) + optim * (1 + 1 / ranks), shutil.disk_usage(ckpt.parent).free
    if needed * 1.1 > free:
        raise UserError(
            f"cannot reshard {ckpt}: converting it needs up to {size(needed)} on disk and {ckpt.parent} has "
            f"{size(free)} free; free some space, or resume on {ranks} processes"
        )
    print(
        f"converting {ckpt.name} ({plural(ranks, 'process')}' shards) to DeepSpeed's universal checkpoint in "
        f"{final.name}: up to {size(needed)} on disk while it converts ({size(free)} free), the original only read",
        flush=True,
    )
    tmp.mkdir()
    started = time.monotonic()
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source),
           "--output_folder", str(tmp / source.name), "--num_extract_workers", "1",
           "--num_merge_workers", "1"]  # fmt: skip
    if zero_stage < 3:  # ZeRO-1/2 engines do not record the (empty, for us) tensor-parallel layout it asks for
        cmd.append("--inject_missing_state")
    log = tmp / "converter.log"
    with open(log, "w") as out:
        # preexec_fn in a process with threads: safe here, it takes no lock
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)  # noqa: PLW1509
        while proc.poll() is None:
            beat()
            if (tmp / source.name).is_dir():  # the converter has begun to write
                fault("sigkill_in_reshard", rank, int(state["step"]))
            time.sleep(POLL_S / 4)
    fault("sigkill_in_reshard", rank, int(state["step"]))  # or it was quicker than a poll: before the rename
    if proc.returncode != 0:
        said = [line for line in log.read_text(errors="replace").splitlines() if line.strip() and "%|" not in line]
        last = f": {said[-1].strip()[:300]}" if said else ""
        raise UserError(
            f"cannot reshard {ckpt}: DeepSpeed's converter failed ({exit_reason(proc.returncode)}{last}; its output "
            f"is in {log} until the next start); resume on {ranks} processes, or fix it and start again"
        )
    log.unlink()
    (tmp / "made_of.json").write_text(json.dumps({"checkpoint": ckpt.name, "digest": source_digest(ckpt)}) + "\n")
    for p in ckpt.iterdir():
        if p.is_file() and p.name not in ("manifest.json", "latest") and not p.name.endswith(".py"):
            shutil.copy2(p, tmp / p.name)
    checkpoint.write_manifest(tmp)
    replace_dir(tmp, final)
    print(f"converted {ckpt.name} in {time.monotonic() - started:.1f} s ({size(tree_bytes(final))} in {final})")
    return final


def universal_checkpoint(ckpt: Path, zero_stage: int, rank: int, converts: bool, watchdog) -> Path:
    """The universal form of `ckpt`, converted by one process per filesystem (`converts`) while the others wait on the
    disk, not in a collective (a 7B conversion can outlast the process group's timeout); all beat the watchdog."""
    final, failed = universal_dir(ckpt), tmp_dir(ckpt) / "FAILED"
    if converts:
        try:
            return convert(ckpt, zero_stage, rank, lambda: watchdog.beat(0, "startup"))
        except UserError as e:
            try:  # the waiting processes end with the same message
                failed.parent.mkdir(exist_ok=True)
                failed.write_text(str(e))
            except OSError:  # a full or read-only disk: they end on the collective's timeout instead
                pass
            raise
    while not (final / "manifest.json").is_file():  # prepare() removed an unusable one before they came here
        if failed.is_file():
            raise UserError(failed.read_text())
        watchdog.beat(0, "startup")
        time.sleep(POLL_S)
    return final


def restore_optimizer_groups(engine, universal: Path) -> None:
    """Two slips of DeepSpeed's ZeRO-3 universal load, undone: it gives every param group the first group's settings
    (weight decay 0.1 on the norms), and one step-count tensor to all of them, which fused AdamW then advances once per
    group and step (the second group's bias correction runs ahead). Each group gets its own back."""
    saved = torch.load(universal / "pytorch_model" / "zero" / "optimizer_state.pt", weights_only=False)["param_groups"]
    base = engine.optimizer.optimizer
    if len(saved) != len(base.param_groups):
        raise UserError(f"cannot reshard: {universal} has {len(saved)} optimizer groups, this model has "
                        f"{len(base.param_groups)}; resume on the original number of processes")  # fmt: skip
    for group, saved_group in zip(base.param_groups, saved):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    for state in base.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def prepare(run, accelerator, watchdog) -> Path | None:
    """Before the model is built (run: train.py's RunSettings): when the checkpoint to resume was written by another
    number of processes, its universal form (converted if need be), and the DeepSpeed config told to load that form;
    else None."""
    if run.resume is None or not needs_conversion(run.resume.state, run.launch.world_size, run.launch.zero_stage):
        return None
    ckpt, ranks = run.resume.path, saved_world_size(run.resume.state)
    if run.launch.offload_optimizer == "nvme" or (ckpt / "pytorch_model" / "offloaded_tensors").is_dir():
        raise UserError(
            f"cannot resume {ckpt} on {run.launch.world_size} processes: with the optimizer state offloaded to NVMe, "
            f"DeepSpeed keeps it per rank outside the checkpoint's shards, so it cannot be resharded; resume on "
            f"{ranks} processes"
        )
    accelerator.print(
        f"{ckpt} was written by {ranks} processes, this run has "
        f"{run.launch.world_size}: resharding it through DeepSpeed's universal checkpoint"
    )
    if not os.access(ckpt.parent, os.W_OK):
        raise UserError(
            f"cannot resume {ckpt} on {run.launch.world_size} processes: resharding writes its universal copy beside "
            f"it, and {ckpt.parent} is not writable; copy {ckpt.name} into a writable directory and --resume the copy, "
            f"or resume on {ranks} processes"
        )
    converts = checkpoint.first_process_on_disk(accelerator, ckpt.parent)
    if converts:
        (tmp_dir(ckpt) / "FAILED").unlink(missing_ok=True)  # a failed attempt's word, not this one's
        final = universal_dir(ckpt)
        why = universal_problem(final, ckpt) if final.exists() else None
        if why is not None:  # gone before the others look for it: they wait for the one this attempt writes
            print(f"converting {ckpt.name} again: the {final.name} there cannot be used ({why})")
            remove(final)
    accelerator.wait_for_everyone()
    universal = universal_checkpoint(ckpt, run.launch.zero_stage, accelerator.process_index, converts, watchdog)
    accelerator.wait_for_everyone()
    accelerator.state.deepspeed_plugin.deepspeed_config["checkpoint"] = {"load_universal": True}
    return universal


def after_load(engine, universal: Path | None, zero_stage: int) -> None:
    if universal is not None and zero_stage == 3:
        restore_optimizer_groups(engine, universal)
