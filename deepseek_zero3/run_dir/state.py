"""The state a checkpoint holds beside the model, the optimizer and the data position: train.py's checkpoint_state(),
a dict {name: object}, each object with state_dict() and load_state_dict() (torch's protocol). This module saves and
loads them; the dict is the one place a forker adds a piece (an EMA, a balancer, a counter).

    replicated (default)  every process holds the same state: saved once per filesystem as state-<name>.pt, loaded by
                          every process. Saving checks that the processes really agree (a digest of each process's
                          state, compared): a piece that differs is refused in one line naming it, instead of being
                          resumed as process 0's copy everywhere.
    sharded               the object says `sharded = True`: each process saves its own state-<name>-rank<R>.pt; a
                          resume on the same number of processes loads its own; on another number the object's
                          reshard(states, rank, world) cuts its state from all the saved ones (model/weights.repartition
                          does it for ZeRO-3 partitions), and an object without reshard is refused in one line naming
                          it. Every process's file must then be readable from every process (a shared filesystem).

A checkpoint that lacks a piece (saved before the piece existed) is said once, and the piece starts afresh: its
restart() where it has one (an EMA starts from the resumed weights), else the state it was built with. Checkpoints from before this registry hold the MoE balancer in Accelerate's custom_checkpoint_0.pkl: read
as the piece `moe_balancer`.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import torch

from deepseek_zero3.cli import UserError

LEGACY = {"moe_balancer": "custom_checkpoint_0.pkl"}  # Accelerate's register_for_checkpointing, before this module


def replicated_file(ckpt: Path, name: str) -> Path:
    return ckpt / f"state-{name}.pt"


def shard_file(ckpt: Path, name: str, rank: int) -> Path:
    return ckpt / f"state-{name}-rank{rank}.pt"


def digest(state) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return hashlib.sha256(buffer.getvalue()).digest()


def save(ckpt: Path, pieces: dict, accelerator, finalises_checkpoints: bool) -> None:
    """Every process writes its sharded pieces; the process that finalises checkpoints on its filesystem
    (finalises_checkpoints) the replicated ones, once the processes were found to agree on them. Collective: every
    process calls it, before the checkpoint is finalised."""
    from accelerate.utils import gather_object

    rank = accelerator.process_index
    for name, obj in pieces.items():
        if obj is None:
            continue
        state = obj.state_dict()
        if getattr(obj, "sharded", False):
            torch.save({"world_size": accelerator.num_processes, "rank": rank, "state": state},
                       shard_file(ckpt, name, rank))  # fmt: skip
            continue
        if accelerator.num_processes > 1 and len(set(gather_object([digest(state)]))) > 1:
            raise UserError(
                f"checkpoint state {name!r} differs between processes, so saving one copy would resume every process "
                f"with process 0's; give its object `sharded = True` (each process saves its own) or keep it equal "
                f"on every process (train.py's checkpoint_state)"
            )
        if finalises_checkpoints:
            torch.save(state, replicated_file(ckpt, name))


def saved_names(ckpt: Path) -> set[str]:
    """The pieces a checkpoint holds (from its files' names)."""
    return {p.name[len("state-"):].rsplit(".pt", 1)[0].split("-rank")[0] for p in ckpt.glob("state-*.pt")}


def load(ckpt: Path, pieces: dict, accelerator, say=print) -> None:
    """Each piece's state from checkpoint `ckpt` (the original, never a universal copy). A piece the checkpoint holds
    that this run does not keep (an EMA resumed with --ema_decay 0) is said: the next checkpoints will not have it."""
    rank, world = accelerator.process_index, accelerator.num_processes
    for name in sorted(saved_names(ckpt) - {n for n, obj in pieces.items() if obj is not None}):
        say(f"note: {ckpt.name} holds state {name!r}, which this run does not keep (its flag is off): it is not "
            f"carried on, and checkpoints from here on will not have it ({ckpt} still does)")  # fmt: skip
    for name, obj in pieces.items():
        if obj is None:
            continue
        try:
            state = _read(ckpt, name, obj, rank, world)
            if state is None:
                say(f"note: {ckpt.name} holds no state {name!r} (saved before it existed, or by a run without it): it "
                    f"starts fresh")  # fmt: skip
                if hasattr(obj, "restart"):  # from the resumed weights, say, not those the model was built with
                    obj.restart()
                continue
            obj.load_state_dict(state)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - torch.load and a piece's own checks raise many kinds
            raise UserError(
                f"cannot load checkpoint state {name!r} from {ckpt}: {type(e).__name__}: {str(e)[:300]}; resume "
                f"from an older checkpoint with --resume {ckpt.parent}/step_N"
            ) from None


def _read(ckpt: Path, name: str, obj, rank: int, world: int):
    if not getattr(obj, "sharded", False):
        path = replicated_file(ckpt, name)
        if not path.is_file() and name in LEGACY and (ckpt / LEGACY[name]).is_file():
            path = ckpt / LEGACY[name]
        return torch.load(path, weights_only=False) if path.is_file() else None
    files = sorted(ckpt.glob(f"state-{name}-rank*.pt"))
    if not files:
        return None
    first = _shard(ckpt, name, 0)
    saved_world = int(first["world_size"])
    if saved_world == world:
        return _shard(ckpt, name, rank)["state"] if rank else first["state"]
    if not hasattr(obj, "reshard"):
        raise UserError(
            f"cannot resume {ckpt} on {world} processes: its state {name!r} is one share per process of "
            f"{saved_world} and its object has no reshard(); resume on {saved_world} processes"
        )
    missing = [r for r in range(saved_world) if not shard_file(ckpt, name, r).is_file()]
    if missing:
        raise UserError(
            f"cannot resume {ckpt} on {world} processes: its state {name!r} lacks the shares of processes {missing} "
            f"(node-local disks: copy every machine's state-{name}-rank*.pt into it)"
        )
    states = [first["state"]] + [_shard(ckpt, name, r)["state"] for r in range(1, saved_world)]
    return obj.reshard(states, rank, world)


def _shard(ckpt: Path, name: str, rank: int) -> dict:
    """Process `rank`'s file of a sharded piece; a file another process wrote (copied or renamed between processes or
    machines) is refused, not resumed as this process's share."""
    path = shard_file(ckpt, name, rank)
    saved = torch.load(path, weights_only=False)
    if saved.get("rank", rank) != rank:
        raise UserError(f"{path} holds process {saved['rank']}'s share of {name!r}, not process {rank}'s (copied or "
                        f"renamed?): put each process's own file back, or resume from another checkpoint")  # fmt: skip
    return saved
