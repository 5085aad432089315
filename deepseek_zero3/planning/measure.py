"""What the planner times and reads on this machine: the peak FLOP/s, the model's own rate, the links between the
processes (and that they deliver what was sent), and memory."""

from __future__ import annotations

import math
import os
import statistics
import time

import torch

from deepseek_zero3 import cli
from deepseek_zero3.cli import UserError
from deepseek_zero3.distributed import Launch
from deepseek_zero3.planning.model_math import GIB, gpu_peak_flops, model_flops_per_token, param_counts


def measure_peak_flops(accelerator, launch: Launch) -> tuple[float, str]:
    """Peak FLOP/s the MFU is measured against, all processes' together: the datasheet for known GPUs, else a large
    matmul timed now, the fastest of PEAK_REPS on each process. A GPU's by the clock. A CPU's is one core's rate: the
    matmul on one thread, timed in that thread's CPU time (time.thread_time: the seconds it ran, not those it waited
    for a core), times the cores the launch's threads can use on each machine, min(processes x threads, cores). Work
    elsewhere on the machine while it is timed does not change it (by the clock it did, 5x), and a run that shares
    its cores with other work has a lower MFU. On several threads the CPU time would not do: a thread that waits for
    the others at the matmul's end spins, and counts the wait."""
    precision = launch.precision
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        flops = gpu_peak_flops(name, precision)
        if flops is not None:
            return flops * accelerator.num_processes, f"{name} datasheet, {precision}"
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)
    cpu = accelerator.device.type == "cpu"
    n = 1024 if cpu else 8192
    a = torch.randn(n, n, device=accelerator.device, dtype=dtype)
    b = torch.randn(n, n, device=accelerator.device, dtype=dtype)
    clock, threads = (time.thread_time, torch.get_num_threads()) if cpu else (time.perf_counter, 0)
    fastest = math.inf
    if cpu:
        torch.set_num_threads(1)
    try:
        a @ b
        for _ in range(PEAK_REPS):
            accelerator.wait_for_everyone()
            t0 = clock()
            a @ b
            if not cpu:
                torch.cuda.synchronize()
            fastest = min(fastest, clock() - t0)
    finally:
        if cpu:
            torch.set_num_threads(threads)
    what = f"{n}x{n} {str(dtype).replace('torch.', '')} matmul"
    if not cpu:
        local = 2 * n**3 / fastest
        source = f"{what} timed on all processes, the fastest of {PEAK_REPS}"
    else:  # the machine's cores shared out among its processes' threads
        per_machine, cores = launch.world_size // launch.nodes, cpu_cores()
        local = 2 * n**3 / fastest * threads * min(1.0, cores / (per_machine * threads))
        used = min(per_machine * threads, cores)
        source = f"{what} on one thread in CPU time, the fastest of {PEAK_REPS}: one core's rate x {used} cores per "
        source += "machine"
    total = accelerator.reduce(torch.tensor([local], device=accelerator.device), "sum")
    return float(total), source


# measure_peak_flops times this many matmuls after a warm-up (each ~25 ms on one CPU core, a few ms on a GPU).
PEAK_REPS = 5


def cpu_cores() -> int:
    """The cores this process may run on (its affinity, as taskset or a container's cpuset set it)."""
    return len(os.sched_getaffinity(0))


# A CPU run times its own model for the plan (measure_model_rate) up to this many parameters in the 2-layer copy;
# beyond it the copy would cost gigabytes and seconds, and the plan keeps --assumed_mfu of the timed matmul.
MEASURED_COPY_MAX_PARAMS = 100e6
MEASURED_RATE = "forward, loss and backward of a 2-layer copy, its layer timed, at this sequence and dtype"
# ... over at most this many tokens (whole sequences, at least one): the rate, not the run's memory, is measured.
MEASURED_TOKENS = 1024
# ... in this many passes, the first a warm-up (bench/model_rate_spread.py: how much the rate varies).
MEASURED_PASSES = 6


def in_lock_step(launch: Launch) -> bool:
    """Whether the launch's processes go through the layers together (ZeRO-3 gathers each layer's parameters on all of
    them): live_cpu_rate times them so, paper_cpu_rate gives them turns of the cores."""
    return launch.zero_stage == 3 and launch.world_size > 1


def measured_rate_source(launch: Launch, paper: bool) -> str:
    """How the plan's compute rate was measured (live_cpu_rate, or paper_cpu_rate when `paper`), for the plan line."""
    lock_step = in_lock_step(launch)
    if paper:
        turns = "; under ZeRO-3 processes beyond the cores take turns" if lock_step else ""
        return f"{MEASURED_RATE}, one process on paper, its share of the cores{turns}"
    return f"{MEASURED_RATE}, all processes at once{', in step at each layer' if lock_step else ''}"


def measure_model_rate(c, micro: int, seq_len: int, precision: str, attn: str, chunk: int, sync=None) -> float | None:
    """FLOP/s this process reaches on the model itself, for the plan's compute time on CPUs (where small models reach
    a fraction of a big matmul's rate, and no fixed MFU fits them all): a copy of the model with 2 decoder layers, in
    the run's dtype, timed over forward, the run's loss (lmloss.model_nll, `chunk` tokens at a time) and backward at
    the run's sequence and micro-batch, capped at MEASURED_TOKENS, with its second layer's forward and backward timed
    inside each pass (time_layer); the whole model's pass read as the copy's + (layers - 2) x that layer's, each the
    median of the passes after a warm-up (a run's typical step, not its best). The layer is timed, not taken as the
    difference of a 1- and a 2-layer copy's passes: that difference, times the layers, magnified the machine's noise
    (bench/model_rate_spread.py measures both). sync: called at each layer's start and backward's end (lock_step), and
    at the timed layer's forward end and backward start, on every process at once. It leaves out what ZeRO moves (the
    plan's link and copy terms) and the optimizer. Call it on every process at once: on a CPU they share the cores.
    A model whose decoder layers are not one list (decoder_layers) is read as the copy's pass per 2 layers (embedding
    and head counted for each: a lower rate), without lock step. A DeepSeek config's copy keeps one dense layer, so
    that the layer timed is an MoE layer, as most of the model's are. None for a copy over MEASURED_COPY_MAX_PARAMS.
    The copy runs without activation checkpointing whatever the run's: the rate is model FLOP/s of passes that recompute
    no layer (the loss's chunks aside), and a checkpointed run's plan adds the recomputed forward at that rate
    (costs.step_costs)."""
    import copy

    from transformers import AutoModelForCausalLM

    from deepseek_zero3.model import lmloss

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)
    two = copy.deepcopy(c)
    two.num_hidden_layers = 2
    if getattr(two, "first_k_dense_replace", 0) > 1:  # the timed layer is one of the MoE layers most of the model has
        two.first_k_dense_replace = 1
    if param_counts(two)["total"] > MEASURED_COPY_MAX_PARAMS:
        return None
    passes = []
    with torch.random.fork_rng():  # the run's random state stays as it was
        torch.manual_seed(0)
        micro = max(1, min(micro, MEASURED_TOKENS // seq_len))
        ids = torch.randint(0, c.vocab_size, (micro, seq_len))
        # Timed without document positions: every kernel but eager's then takes SDPA's causal path.
        attn = "eager" if attn == "eager" else "sdpa"
        try:
            model = AutoModelForCausalLM.from_config(two, attn_implementation=attn, dtype=dtype)
        except (ValueError, TypeError, IndexError):  # a config whose per-layer lists do not shrink: not timed
            return None
        layers = decoder_layers(model, 2)  # the same on every process: same config
        if sync is not None:
            lock_step(model, sync, 2)
        layer_s = time_layer(layers[1], sync) if layers is not None else []
        for _ in range(MEASURED_PASSES):
            t0 = time.perf_counter()
            nll, n = lmloss.model_nll(model, ids, ids, chunk)
            (nll / n).backward()
            passes.append(time.perf_counter() - t0)
    if len(layer_s) != len(passes):  # no layer timed (not found, or its backward not seen): the copy's pass per layer
        whole = statistics.median(passes[1:]) * c.num_hidden_layers / 2
    else:
        whole = statistics.median(passes[1:]) + (c.num_hidden_layers - 2) * statistics.median(layer_s[1:])
    return model_flops_per_token(c, seq_len) * micro * seq_len / whole


def decoder_layers(model, layers: int):
    """The model's decoder layers: the one ModuleList of `layers` modules (by its name when several are that long);
    None when that is not one. A list of experts, which ranks call differently, must never be taken (a sync in one
    would hang the others)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == layers]
    if len(lists) > 1:
        lists = [(name, m) for name, m in lists if name.rsplit(".", 1)[-1] in ("layers", "h", "blocks")]
    return lists[0][1] if len(lists) == 1 else None


def first_tensor(values):
    return next((x for x in values if isinstance(x, torch.Tensor)), None)


def lock_step(model, sync, layers: int) -> None:
    """Calls sync() as each decoder layer (decoder_layers; none when not found, the same on every process) starts its
    forward and as its backward ends: where ZeRO-3 gathers and reduces that layer's parameters, and so where its
    processes wait for the slowest. Processes that outnumber the cores finish a layer in turns there (3 on 2 cores: a
    layer takes two turns, not 1.5), which timing them apart misses."""
    found = decoder_layers(model, layers)

    def before(module, args, kwargs):
        sync()
        hidden = first_tensor((*args, *kwargs.values()))
        if hidden is not None and hidden.requires_grad:
            hidden.register_hook(lambda grad: (sync(), grad)[1])

    for layer in found if found is not None else ():
        layer.register_forward_pre_hook(before, with_kwargs=True)


def time_layer(layer, sync=None) -> list:
    """Hooks that time `layer`'s forward and backward in each pass: the list they append each pass's seconds to (when
    its backward ends). With sync (lock step), sync() also at its forward's end and as its backward starts, so that
    the layer's time holds the wait for the slowest process that the next layer's start would have."""
    wait, marks, seconds = sync or (lambda: None), {}, []

    def backward_ended(grad):
        seconds.append(marks["forward"] + time.perf_counter() - marks["backward"])
        return grad

    def backward_started(grad):
        wait()
        marks["backward"] = time.perf_counter()
        return grad

    def started(module, args, kwargs):
        marks["start"] = time.perf_counter()
        hidden = first_tensor((*args, *kwargs.values()))
        if hidden is not None and hidden.requires_grad:
            hidden.register_hook(backward_ended)

    def ended(module, args, kwargs, out):
        wait()
        marks["forward"] = time.perf_counter() - marks["start"]
        hidden = first_tensor(out if isinstance(out, (tuple, list)) else (out,))
        if hidden is not None and hidden.requires_grad:
            hidden.register_hook(backward_started)

    layer.register_forward_pre_hook(started, with_kwargs=True)
    layer.register_forward_hook(ended, with_kwargs=True)
    return seconds


def live_cpu_rate(accelerator, cfg, c, launch: Launch) -> float | None:
    """measure_model_rate on every process of a CPU run at once; the mean over processes. Under ZeRO-3 the processes
    run the copy in lock step (a one-element all-reduce at each layer's start and backward's end, and at the timed
    layer's forward end and backward start), as the gathers keep the run: on 3 processes sharing 2 cores, timing them
    apart planned ~2x the tokens/s the run reached. The copy is a plain model: transformers builds every model
    partitioned while Accelerate's DeepSpeed config is registered with it (Accelerate's
    zero3_init_context_manager(enable=False) re-registers it, so it does not stop that)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    plugin = accelerator.state.deepspeed_plugin
    hf_deepspeed.unset_hf_deepspeed_config()
    one = torch.zeros(1)
    sync = (lambda: torch.distributed.all_reduce(one)) if in_lock_step(launch) else None
    try:
        rate = measure_model_rate(c, cfg.micro_batch_size, cfg.seq_len, launch.precision, cfg.attn_implementation,
                                  cfg.loss_chunk_tokens, sync)  # fmt: skip
    finally:
        if plugin is not None and plugin.dschf is not None:
            hf_deepspeed.set_hf_deepspeed_config(plugin.dschf)
    found = accelerator.gather(torch.tensor([rate or 0.0], device=accelerator.device))
    return float(found.mean()) if bool((found > 0).all()) else None


def paper_cpu_rate(cfg, c, launch: Launch) -> float | None:
    """measure_model_rate for a CPU launch planned on paper, in this one process: as the launcher runs it, one thread
    per process when there are several (torchrun's default), and the processes' share of this machine's cores. Under
    ZeRO-3, where the processes go through the layers in lock step (see live_cpu_rate), processes that outnumber the
    cores get one core in ceil(processes / cores) turns, not cores / processes of one."""
    threads = torch.get_num_threads()
    if launch.world_size > 1:
        torch.set_num_threads(1)
    try:
        rate = measure_model_rate(c, cfg.micro_batch_size, cfg.seq_len, launch.precision, cfg.attn_implementation,
                                  cfg.loss_chunk_tokens)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    per_machine, cores = launch.world_size // launch.nodes, cpu_cores()
    if not rate or per_machine <= cores:
        return rate
    return rate / math.ceil(per_machine / cores) if in_lock_step(launch) else rate * cores / per_machine


def host_memory_gib() -> float:
    """This machine's RAM."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def process_rss_gib() -> float:
    """This process's resident memory now (the base a plan adds the model to)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GIB


# The smallest buffer measure_links times a collective on (float32 elements: 256 kB).
LINK_MIN_NUMEL = 2**16
# Passes of each timed link operation, the first a warm-up; the plan takes the median of the rest: a run's collectives
# meet the machine's typical load, not its quietest moment.
LINK_PASSES = 6


def measure_links(accelerator, model_numel: int | None = None) -> dict:
    """What moving bytes costs this run, measured in a second or two on the real process group and device: the bus
    bandwidth (GB/s) of each collective ZeRO and DDP use (all-reduce, all-gather, reduce-scatter; none for one
    process) and the device's copy rate (GB/s read + written), after checking that what every process sends arrives
    unchanged. The collectives move a buffer of the model's `model_numel` parameters (no message of the run is
    larger: ZeRO gathers a layer, reduces a bucket, DDP a bucket of the gradients), at least LINK_MIN_NUMEL and at most
    16 MB (64 MB on a GPU), where bus bandwidth has reached its plateau; the copies 4x that. A small model's messages
    meet the link's latency more than its bandwidth, and so does the rate measured for it (and the tests' tiny
    model, 0.17M parameters, spent 3.3 s timing 16 MB buffers on 3 gloo processes sharing 2 EPYC cores).

    The check: an all-gather of rank-stamped integers, compared on every rank. On some RTX 40-series drivers NCCL's
    P2P copies between cards return wrong data without an error; training would then go on with corrupted gradients.
    Bus bandwidth as nccl-tests defines it: bytes x 2 (n-1)/n (all-reduce) or (n-1)/n (the others) / seconds, the median
    of the passes after a warm-up; the backends differ in each (gloo's reduce-scatter runs at a fraction of its
    all-reduce)."""
    n, device = accelerator.num_processes, accelerator.device
    numel = (64 if device.type == "cuda" else 16) * 2**20 // 4  # the collectives' buffer; the copy's is 4x that
    numel = min(numel, max(LINK_MIN_NUMEL, model_numel or numel))

    def typical_s(op) -> float:
        times = []
        for _ in range(LINK_PASSES):
            accelerator.wait_for_everyone()
            t0 = time.perf_counter()
            op()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    # Two copy rates: into memory the process already holds (the optimizer step, persistent buckets), and as the
    # frameworks flatten many tensors into a fresh buffer (a bucket to reduce, a gather); on a CPU the fresh pages cost
    # more than the bytes (3.9 GB/s here against 13.5).
    pieces = list(torch.ones(numel * 4, device=device).chunk(16))
    held, into = torch.ones(numel * 4, device=device), torch.zeros(numel * 4, device=device)
    links = {
        "memory": 2 * numel * 4 * 4 / typical_s(lambda: into.copy_(held)) / 1e9,
        "memory_fresh": 2 * numel * 4 * 4 / typical_s(lambda: torch.cat(pieces)) / 1e9,
    }
    buf, out = torch.ones(numel, device=device), torch.empty(numel, device=device)
    if n == 1:
        return links
    check_link_content(accelerator, numel)
    shard = torch.ones(numel // n, device=device)
    ring = (n - 1) / n * numel * 4 / 1e9
    links["all_reduce"] = 2 * ring / typical_s(lambda: torch.distributed.all_reduce(buf))
    links["all_gather"] = ring / typical_s(
        lambda: torch.distributed.all_gather_into_tensor(out[: shard.numel() * n], shard)
    )
    links["reduce_scatter"] = ring / typical_s(
        lambda: torch.distributed.reduce_scatter_tensor(shard, buf[: shard.numel() * n])
    )
    return links


def check_link_content(accelerator, numel: int) -> None:
    """Stop the run when an all-gather of rank-stamped integers arrives changed anywhere (see measure_links)."""
    n, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    stamp = torch.arange(numel, dtype=torch.int32, device=device)
    got = [torch.empty_like(stamp) for _ in range(n)]
    torch.distributed.all_gather(got, stamp * (rank + 1))
    if cli.fault("corrupt_link", rank, 0):
        got[(rank + 1) % n][numel // 2] += 1
    wrong = torch.zeros(n, n, device=device)  # [receiver, sender]
    wrong[rank] = torch.tensor([float(not torch.equal(g, stamp * (r + 1))) for r, g in enumerate(got)])
    pairs = accelerator.reduce(wrong, "sum").nonzero().tolist()
    if pairs:
        raise UserError(
            f"data sent between the processes arrived changed (an all-gather of {numel * 4 // 2**20} MiB per process; "
            + ", ".join(f"rank {sender}'s on rank {receiver}" for receiver, sender in pairs)
            + "): some RTX 40-series drivers' P2P copies return wrong data; launch with NCCL_P2P_DISABLE=1 in the "
            "environment, or update the driver"
        )
