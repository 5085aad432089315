"""The weights as code after train.py's update line sees them, the same way under every strategy.

DDP, one process, ZeRO-1 and ZeRO-2 keep every parameter whole on every process. ZeRO-3 keeps each parameter as a
flat partition per process (`p.ds_tensor`: process r holds elements [r*s, (r+1)*s) of the flattened parameter,
s = ceil(numel / processes), the last one padded), and `p.data` is empty outside a forward or backward. So:

    local_weights(model)      each process's own share of every parameter: the partition under ZeRO-3, else the whole
                              tensor. Elementwise work (an EMA, an update's size) runs on it with no communication.
    global_sum(x, ...)        a per-process sum made global: summed over processes under ZeRO-3, as it is otherwise.
    full_weights(model)       every parameter whole, gathered under ZeRO-3 for the block (an all-gather of the whole
                              model: on a 1.3B model 2.6 GB in bf16 per process, so not every step).
    repartition(...)          a flat partition of a tensor written by N processes, cut again for M.

The weights seen after the update line are the updated ones: DeepSpeed's engine.step() (ZeRO-3) writes each
partition back in place, ZeRO-1/2 all-gather the updated partitions into the whole parameters, DDP's optimizer
updates them in place.
"""

from __future__ import annotations

import contextlib
import weakref

import torch


def is_sharded(model) -> bool:
    """Whether the model's parameters are ZeRO-3 partitions."""
    return any(hasattr(p, "ds_tensor") for p in model.parameters())


# core_model's answers, per wrapper: what a wrapper holds does not change during a run.
_CORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def core_model(model):
    """The model inside its distributed wrappers (DeepSpeed's engine, DDP): Accelerate's extract_model_from_parallel,
    once per wrapper. Each call of it asks importlib.metadata whether DeepSpeed is installed, parsing its METADATA file:
    ~3 ms of CPU, which the loss paid at every micro-step and validation batch (cProfile of a 10-step tiny run: 1,826
    calls, 5.2 s of its 21 s)."""
    known = _CORES.get(model)
    core = known() if known is not None else None
    if core is None:
        from accelerate.utils import extract_model_from_parallel

        core = extract_model_from_parallel(model)
        _CORES[model] = weakref.ref(core)  # a weak value too: a plain model is its own core, and would never be freed
    return core


def local_weights(model) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every trainable parameter: this process's ZeRO-3 partition (1-D; the last process's share
    without DeepSpeed's padding, so shorter), else the parameter itself. The tensors are the live weights: read, don't
    write."""
    core = core_model(model)
    return [(n, _own_share(p) if hasattr(p, "ds_tensor") else p.data)
            for n, p in core.named_parameters() if p.requires_grad]  # fmt: skip


def _own_share(p) -> torch.Tensor:
    """The elements of a ZeRO-3 partition that belong to the parameter: DeepSpeed pads the last share to the size of the
    others, and what the padding holds is not defined (it differs between a run and its resume)."""
    size = p.ds_tensor.numel()
    start = torch.distributed.get_rank() * size if torch.distributed.is_initialized() else 0
    return p.ds_tensor.narrow(0, 0, max(0, min(size, int(p.ds_numel) - start)))


def full_numel(model) -> dict[str, int]:
    """Every trainable parameter's number of elements, whole (what a partition is a share of)."""
    core = core_model(model)
    return {n: int(getattr(p, "ds_numel", p.numel())) for n, p in core.named_parameters() if p.requires_grad}


def global_sum(value: torch.Tensor, sharded: bool) -> torch.Tensor:
    """A sum over this process's local_weights made the sum over the whole model: all-reduced when the weights are
    partitions, unchanged when every process holds them whole (and so the same value)."""
    if sharded and torch.distributed.is_available() and torch.distributed.is_initialized():
        value = value.clone()
        torch.distributed.all_reduce(value)
    return value


@contextlib.contextmanager
def full_weights(model):
    """{name: whole parameter} for the block; under ZeRO-3 every parameter is all-gathered on entry and partitioned
    again on exit (changes made inside are kept only by process 0's copy: DeepSpeed's GatheredParameters rule)."""
    core = core_model(model)
    params = [(n, p) for n, p in core.named_parameters() if p.requires_grad]
    if not is_sharded(core):
        yield {n: p.data for n, p in params}
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
        yield {n: p.data for n, p in params}


def partition_size(numel: int, world: int) -> int:
    return -(-numel // world)


def repartition(shards: list[torch.Tensor], numel: int, rank: int, world: int) -> torch.Tensor:
    """This process's partition, for `world` processes, of a flat tensor of `numel` elements that was written as
    `shards` (one per process that wrote it, in rank order, in ZeRO-3's layout)."""
    whole = torch.cat([s.reshape(-1) for s in shards])[:numel]
    size = partition_size(numel, world)
    return whole[rank * size : (rank + 1) * size].clone()  # the last share unpadded, as local_weights gives it


def gather_whole(local: torch.Tensor, numel: int, shape, sharded: bool) -> torch.Tensor:
    """The whole tensor of shape `shape` from every process's partition `local` (collective under ZeRO-3: every
    process calls it); unchanged when not sharded."""
    if not sharded:
        return local.reshape(shape)
    world = torch.distributed.get_world_size()
    size = partition_size(numel, world)
    padded = torch.cat([local.reshape(-1), local.new_zeros(size - local.numel())])  # all_gather takes equal sizes
    parts = [torch.empty_like(padded) for _ in range(world)]
    torch.distributed.all_gather(parts, padded)
    return torch.cat(parts)[:numel].reshape(shape)
