"""The planner's entry points: a live run's plan (`plan_run`, the one call train.py's setup makes) and a plan on paper
(`print_plan`, for `train.py --plan [--compare]`, with no process group and no GPU).

The parts it answers from: the launch (distributed.py), model arithmetic (model_math.py), what this machine measures
(measure.py) and what a strategy costs in memory, traffic and time (costs.py).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from deepseek_zero3.cli import UserError
from deepseek_zero3.distributed import read_launch
from deepseek_zero3.planning import breakdown, costs, measure, model_math
from deepseek_zero3.planning.model_math import GIB
from deepseek_zero3.recipe import optimizer, scaling
from deepseek_zero3.training_data import mixture
from deepseek_zero3.training_data.token_data import num_windows


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What a live run's plan tells the rest of setup and the loop."""

    counts: dict  # model_math.param_counts of the model config
    flops_per_token: float  # training FLOPs per token, what MFU counts (model_math.model_flops_per_token)
    peak_flops: float  # what MFU is measured against: all processes' together
    peak_source: str  # where peak_flops comes from (a datasheet, or a matmul timed in this run)
    record: dict  # for OUT/plan.json: the launch, the measured machine and the planned seconds per component
    hardware_flops_per_token: float = 0.0  # with what the run recomputes, what HFU counts (0 or equal: no HFU)


def check_plan_flags(cfg) -> None:
    """The planner's own flags, in --plan and in a real run."""
    for name in ("assumed_mfu", "interconnect_gb_s", "pcie_gb_s", "nvme_gb_s", "gpu_memory_gib"):
        if not getattr(cfg, name) > 0:
            raise UserError(f"--{name} {getattr(cfg, name)} must be positive")
    if cfg.assumed_mfu > 1:
        raise UserError(f"--assumed_mfu {cfg.assumed_mfu} must be at most 1 (a share of the peak: 0.35 is 35%)")
    for name in ("host_memory_gib", "gradient_accumulation_steps"):
        if getattr(cfg, name) < 0:
            raise UserError(f"--{name} {getattr(cfg, name)} must not be negative (0: the default)")
    for name in ("compare", "from_run"):
        if getattr(cfg, name) and not cfg.plan:
            raise UserError(f"--{name} is a --plan option: python train.py --plan --{name} ...")


def check_assumed_mfu(cfg, c) -> None:
    """--assumed_mfu is MFU, as the run logs it; with recomputation the hardware runs more FLOPs in the same time (HFU =
    MFU x hardware / model FLOPs), and no device runs above its peak: refused where that HFU would be over 1."""
    depth = model_math.mtp_depth(cfg, c)
    ratio = model_math.run_hardware_flops(cfg, c, depth, cfg.micro_batch_size) / (
        model_math.model_flops_per_token(c, cfg.seq_len, depth))  # fmt: skip
    if cfg.assumed_mfu * ratio > 1:
        again = model_math.recomputed(cfg, c, depth, cfg.micro_batch_size)
        raise UserError(
            f"--assumed_mfu {cfg.assumed_mfu} is MFU; with {again} run again the hardware would run {ratio:.3f}x those "
            f"FLOPs, {cfg.assumed_mfu * ratio:.0%} of its peak: "
            f"give at most {math.floor(100 / ratio) / 100:g}"
        )


def plan_run(run, accelerator) -> RunPlan:
    """The plan of this launch (run: train.py's RunSettings, past its checks and its resume's): prints the batch plan
    and the plan of memory and time, which the processes measure together (peak FLOP/s, the links, on a CPU the model's
    rate); refuses to start when it does not fit the GPUs or the host RAM (unless --ignore_memory_plan)."""
    cfg, launch, batch = run.cfg, run.launch, run.batch
    check_plan_flags(cfg)
    check_assumed_mfu(cfg, run.model_config)
    if cfg.gradient_accumulation_steps not in (0, launch.grad_accum_steps):
        raise UserError(
            f"--gradient_accumulation_steps {cfg.gradient_accumulation_steps} is for --plan; a run takes it from the "
            f"accelerate config ({launch.grad_accum_steps} here): accelerate launch --gradient_accumulation_steps "
            f"{cfg.gradient_accumulation_steps} ... train.py ..."
        )
    threads = f", torch threads per process: {torch.get_num_threads()}" if accelerator.device.type == "cpu" else ""
    accelerator.print(
        f"batch plan: {batch.micro_batch_size} micro x {launch.grad_accum_steps} accumulation x "
        f"{launch.world_size} processes = {batch.sequences_per_step} sequences = {batch.tokens_per_step:,} tokens "
        f"per step; {run.total_steps} steps ({run.total_steps * batch.sequences_per_step / run.data.n_windows:.2f} "
        f"epochs of {run.data.n_windows:,} windows); {accelerator.distributed_type.value}, {launch.precision}, "
        f"on {accelerator.device.type}{threads}" + source_passes(run)
    )
    accelerator.print(run.schedule.describe())
    deepseek = scaling.deepseek_lines(run.model_config, cfg.seq_len, cfg.lr, batch.tokens_per_step, run.total_steps)
    accelerator.print("\n".join(deepseek))
    peak_flops, peak_source = measure.measure_peak_flops(accelerator, launch)
    links = measure.measure_links(accelerator, model_math.param_counts(run.model_config)["total"])
    device_gib = torch.cuda.get_device_properties(accelerator.device).total_memory / GIB if launch.gpu else 0.0
    base = measure.process_rss_gib() * GIB  # before the timing below, whose copies' memory the process may keep
    rate = None if launch.gpu else measure.live_cpu_rate(accelerator, cfg, run.model_config, launch)
    machine = costs.machine_for(cfg, launch, peak_flops / launch.world_size, links, device_gib, rate)
    lines, fits = costs.plan_report(cfg, run.model_config, launch, machine, base, run.total_steps)
    accelerator.print("\n".join(lines))
    # Each process plans on its own memory use: one verdict for all, or one would start while another stops.
    fits = accelerator.reduce(torch.tensor([float(not fits)], device=accelerator.device), "sum").item() == 0
    if not fits and not cfg.ignore_memory_plan:
        raise UserError(
            "the plan above does not fit this machine's GPU memory or host RAM; follow its advice where it gives "
            "one, lower --micro_batch_size or --seq_len, or pass --ignore_memory_plan to try anyway"
        )
    depth = model_math.mtp_depth(cfg, run.model_config)
    counts = model_math.param_counts(run.model_config, depth)
    step = costs.step_costs(run.model_config, cfg, launch, batch.micro_batch_size, machine, base)
    strategy = f"ZeRO-{launch.zero_stage}" if launch.zero_stage else "DDP" if launch.world_size > 1 else "one process"
    offloaded = f", optimizer offloaded to {launch.offload_optimizer}" if launch.offload_optimizer != "none" else ""
    record = {"strategy": strategy + offloaded, "launch": dataclasses.asdict(launch),
              "micro_batch_size": batch.micro_batch_size, "tokens_per_step": batch.tokens_per_step,
              "machine": dataclasses.asdict(machine), "planned_s": breakdown.planned(step, machine),
              "planned_mfu": step["mfu"], "planned_hfu": step["hfu"]}  # fmt: skip
    return RunPlan(counts, step["model_flops_per_token"], peak_flops, peak_source, record,
                   step["hardware_flops_per_token"])  # fmt: skip


def source_passes(run) -> str:
    """A mixture's share of the samples and passes over each source's training windows in the whole run."""
    if len(run.data.sources) < 2:
        return ""
    given = mixture.counts(run.total_steps * run.batch.sequences_per_step, run.data.weights)
    unvalidated = " (no validation window: not in val_loss)"
    return "\ndata mix: " + "; ".join(
        f"{s.name}: {float(w):.3g} of the samples, {n / s.n_windows if s.n_windows else 0:.3g} passes"
        + ("" if num_windows(len(s.val_tokens), run.batch.seq_len) else unvalidated)
        for s, w, n in zip(run.data.sources, run.data.weights, given)
    )


def plan_on_paper(cfg, check_flags, flags_given: set[str] = frozenset()) -> int:
    """`train.py --plan [--compare]` (cfg: its Config, checked by its check_flags; flags_given: the flags its command
    line set): the plan of a config on paper, with the data's vocabulary where the data is prepared. Returns the exit
    code."""
    from pathlib import Path

    from deepseek_zero3 import cli
    from deepseek_zero3.model import models
    from deepseek_zero3.training_data import token_data

    try:
        if cfg.from_run:
            print("\n".join(breakdown.from_run(cfg.from_run)))
            return 0
        check_flags(cfg)
        first = Path((token_data.data_dirs(cfg.data_dir) or [""])[0])  # its vocabulary size, shared by all
        meta = token_data.read_meta(first) if (first / "meta.json").is_file() else None
        print_plan(cfg, models.load_model_config(cfg.model_config, cfg.init_from, cfg.seq_len, meta), flags_given)
    except (OSError, KeyError, UserError) as e:
        cli.print_error(str(e))
        return 2
    return 0


def print_plan(cfg, model_config, flags_given: set[str] = frozenset()) -> None:
    """`train.py --plan [--compare]`: the plan on paper for --accelerate_config (default: the CPU config, or the 3-GPU
    ZeRO-3 config with --compare), with no process group and no GPU. flags_given: the flags the command line set."""
    check_plan_flags(cfg)
    default = "accelerate_configs/zero3_3gpu.yaml" if cfg.compare else "accelerate_configs/zero3_cpu.yaml"
    path = cfg.accelerate_config or default
    launch = read_launch(path)
    # As a run resolves it: by preset, Muon unclipped.
    resolved = optimizer.resolve(cfg, flags_given, None if cfg.compare else launch)
    if not cfg.compare:  # (--compare resolves --optimizer auto for each row's launch: costs.largest_fitting)
        cfg = resolved
        optimizer.check(cfg, launch)
    if cfg.gradient_accumulation_steps:
        launch = dataclasses.replace(launch, grad_accum_steps=cfg.gradient_accumulation_steps)
    check_assumed_mfu(cfg, model_config)
    if cfg.compare and (not launch.gpu or launch.nodes != 1 or launch.world_size != 3):
        raise UserError(
            f"--compare weighs the 3-GPU configs (accelerate_configs/*_3gpu.yaml); {path} is "
            f"{launch.world_size} {'GPU' if launch.gpu else 'CPU'} processes on {launch.nodes} machine(s): give "
            "one of those configs (default zero3_3gpu.yaml) for its global batch"
        )
    # the target card; a CPU core at ~100 GFLOP/s
    peak = model_math.GPU_PEAK_FLOPS["RTX 4090"] if launch.gpu else 0.1e12
    base = costs.GPU_PROCESS_HOST_GIB * GIB if launch.gpu else measure.process_rss_gib() * GIB  # before the timing
    rate = None if launch.gpu else measure.paper_cpu_rate(cfg, model_config, launch)
    machine = costs.machine_for(cfg, launch, peak, model_rate=rate, paper=True)
    if cfg.compare:
        lines, _ = costs.compare(model_config, cfg, launch, machine, base)
    else:
        lines, _ = costs.plan_report(cfg, model_config, launch, machine, base, cfg.max_steps)
        tokens_per_step = cfg.micro_batch_size * launch.grad_accum_steps * launch.world_size * cfg.seq_len
        lines += scaling.deepseek_lines(model_config, cfg.seq_len, cfg.lr, tokens_per_step, cfg.max_steps)
    print("\n".join(lines))
