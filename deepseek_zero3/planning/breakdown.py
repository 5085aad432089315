"""Where a step's time goes, measured and planned, by the planner's components (train.py --profile_steps, train.py
--plan --from_run, bench/strategy_vs_plan.py --breakdown).

Measured: torch's profiler over --profile_steps optimizer steps of each process (after the first step, which warms
up), the training thread's time sorted into the plan's components (split_events):
    compute     what the training thread runs that is none of the below (forward, loss, backward, the rest)
    copies      aten copy_/cat/clone/zero_/fill_/add_/_to_copy outside the optimizer and the collectives: gradient
                buckets, flattening, gathered parameters
    optimizer   everything under the optimizer's step (torch's "Optimizer.step#..." range)
    all_reduce, all_gather, reduce_scatter, reduce, broadcast
                the time the training thread spends inside the collective's c10d op (and its copies: gloo runs
                reduce_scatter as an all-reduce and a copy) or waits, idle, while a gloo worker runs it
    unattributed  the step's wall time less the above: Python between ops, waits no collective covers
Seconds per optimizer step, the mean over the profiled steps, written to OUT/profile/rank<R>.json with the ops that
took the most, and the timeline beside it (rank<R>.trace.json, for Perfetto or chrome://tracing).

On a GPU (device_split) the components are the device's timeline: each kernel (and Memcpy/Memset) goes to a
component by its name and by the CPU op that launched it (the profiler links the two by correlation id: the kernel's
linked_correlation_id is its op's id, as torch's own _parse_kineto_results attaches kernels to ops), that op's
ancestors included: a kernel under the optimizer's step range (or named as Adam's: FusedAdamMathFunctor, DeepSpeed's
AdamFunctor) is the optimizer, one launched by a copy op (COPY_OPS) or named as a copy (COPY_KERNELS) is a copy,
NCCL's kernels their collective. Kernels on several streams run at once (NCCL's beside the compute stream, which
ZeRO-3's overlap_comm makes the rule): each instant of the steps goes to one component, the first busy in DEVICE_ORDER
(compute, optimizer, copies, then the collectives), so a collective counts only where it is exposed (nothing else
runs), as on the CPU, where it counts only while the training thread waits; the time each collective ran hidden is
in top_ops ("hidden: all_gather"). Where the device runs nothing while the training thread is in the optimizer's
step, that is the optimizer (a host optimizer: DeepSpeed's CPU Adam with the optimizer offloaded); the rest of the
idle device time is unattributed, never negative. Tested on a synthetic trace of FunctionEvents shaped as a GPU's
(no GPU here).

Planned: costs.step_costs's terms split the same way (planned); both side by side (table) for a run (from_run) and
in bench/strategy_vs_plan.py --breakdown.
"""

from __future__ import annotations

import atexit
import bisect
import json
import re
from pathlib import Path

import torch

from deepseek_zero3.cli import UserError
from deepseek_zero3.run_dir.metrics import read_metrics

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "reduce", "broadcast")
COMPONENTS = ("compute", "copies", "optimizer", *COLLECTIVES, "unattributed")
TOP_OPS = 12
COPY_OPS = ("aten::copy_", "aten::cat", "aten::clone", "aten::zero_", "aten::fill_", "aten::add_", "aten::_to_copy")
# CUDA kernels that copy or fill memory whatever launched them: the copy engine's, PyTorch's elementwise copy (copy_,
# .to(), .contiguous()), torch.cat's batched copy, fill_/zero_'s functor.
COPY_KERNELS = ("Memcpy", "Memset", "direct_copy_kernel", "CatArrayBatchedCopy", "FillFunctor")
# Adam's fused kernels: torch's fused AdamW (FusedAdamMathFunctor), DeepSpeed's FusedAdam (AdamFunctor); a lower-case
# match, so that a launch the profiler did not link to its op still counts.
OPTIMIZER_KERNELS = ("adamfunctor", "adammathfunctor", "fused_adam")
# On a GPU an instant where several components' kernels run goes to the first of these (device_split).
DEVICE_ORDER = ("compute", "optimizer", "copies", *COLLECTIVES)
# How each backend names its collectives: gloo's worker-thread ranges, NCCL's kernels, c10d's own ops.
COLLECTIVE_NAMES = {
    "all_reduce": ("gloo:all_reduce", "AllReduce", "allreduce"),
    "all_gather": ("gloo:all_gather", "AllGather", "allgather"),
    "reduce_scatter": ("gloo:reduce_scatter", "ReduceScatter", "reduce_scatter"),
    "reduce": ("gloo:reduce", "ncclKernel_Reduce", "ncclDevKernel_Reduce", "c10d::reduce_"),
    "broadcast": ("gloo:broadcast", "Broadcast", "broadcast"),
}


def collective_of(name: str) -> str | None:
    for kind, names in COLLECTIVE_NAMES.items():
        if any(n in name for n in names):
            return kind
    return None


def ancestors(e):
    while e is not None:
        yield e
        e = e.cpu_parent


def split_events(events, steps: int) -> tuple[dict, dict]:
    """Seconds per step of each component from a profile's events (see the module's docstring), and of the training
    thread's ops that took the most (by component: "copies: aten::copy_").

    On the CPU each op of the training thread counts its own time (children apart) to its component; an op inside a
    collective's c10d op, to that collective. Where the training thread runs nothing, it waits: that time goes to the
    collective a backend worker runs meanwhile (gloo:all_reduce, ...), and what no worker covers is unattributed. A
    collective that overlaps the training thread's work (DDP's bucket all-reduce during backward) costs nothing here,
    as it costs the step nothing. A profile with CUDA kernels is split on the device's timeline instead
    (device_split)."""
    found, ops = dict.fromkeys(COMPONENTS, 0.0), {}
    step_events = sorted((e for e in events if e.name.startswith("ProfilerStep")), key=lambda e: e.time_range.start)
    step_events = step_events[:steps]  # a run that stopped inside the profile: the steps it completed
    if not step_events:
        return found, ops
    cpu = torch.autograd.DeviceType.CPU
    main = step_events[0].thread
    steps_span = sorted((e.time_range.start, e.time_range.end) for e in step_events)
    wall = sum(end - start for start, end in steps_span)
    n = len(step_events)
    if any(e.device_type == torch.autograd.DeviceType.CUDA for e in events):  # the training thread only launches
        found, top = device_split(events, main, steps_span)
        return {k: v / 1e6 / n for k, v in found.items()}, {k: v / 1e6 / n for k, v in top.items()}
    inside = lambda e: any(start <= e.time_range.start < end for start, end in steps_span)  # the steps kept
    events = [e for e in events if inside(e)]
    mine = [e for e in events if e.thread == main and e.device_type == cpu and not e.name.startswith("ProfilerStep")]
    for e in mine:
        names = [a.name for a in ancestors(e)]
        c10d = next((n for n in names if n.startswith("c10d::")), None)
        if c10d is not None:
            key = collective_of(c10d) or "compute"
        elif any(n.startswith("Optimizer.step") for n in names):
            key = "optimizer"
        elif e.name in COPY_OPS:
            key = "copies"
        else:
            key = "compute"
        found[key] += e.self_cpu_time_total
        ops[f"{key}: {e.name}"] = ops.get(f"{key}: {e.name}", 0.0) + e.self_cpu_time_total
    for kind, waited in waits(mine, events, main, steps_span).items():
        found[kind] += waited
    found["unattributed"] = wall - sum(v for k, v in found.items() if k != "unattributed")
    top = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:TOP_OPS])
    return {k: v / 1e6 / n for k, v in found.items()}, {k: v / 1e6 / n for k, v in top.items()}


def kernel_component(kernel, op) -> str:
    """The component of a device kernel launched by CPU op `op` (None: not linked): see the module's docstring."""
    kind = collective_of(kernel.name)
    if kind is not None:
        return kind
    names = [a.name for a in ancestors(op)]
    c10d = next((n for n in names if n.startswith("c10d::")), None)
    if c10d is not None:  # a collective's own copies (flattening, unpacking), as on the CPU
        return collective_of(c10d) or "compute"
    lower = kernel.name.lower()
    if any(n.startswith("Optimizer.step") for n in names) or any(k in lower for k in OPTIMIZER_KERNELS):
        return "optimizer"
    if (op is not None and op.name in COPY_OPS) or any(k in kernel.name for k in COPY_KERNELS):
        return "copies"
    return "compute"


def device_split(events, main, steps_span) -> tuple[dict, dict]:
    """Microseconds of each component on a GPU's timeline over the profiled steps (steps_span: their (start, end) on
    the training thread, main), and of the kernels that took the most (their own time, by component and name) with
    the time each collective ran hidden behind other kernels. See the module's docstring."""
    device = {torch.autograd.DeviceType.CUDA}
    ops = {e.id: e for e in events if e.device_type not in device and e.linked_correlation_id == 0}
    rank = {kind: i for i, kind in enumerate(DEVICE_ORDER)}
    spans, own, collectives = [], {}, {kind: [] for kind in COLLECTIVES}
    for e in events:
        if e.device_type in device:
            kind = kernel_component(e, ops.get(e.linked_correlation_id))
            for start, end in clipped(e.time_range.start, e.time_range.end, steps_span):
                spans.append((start, end, rank[kind]))
                own[f"{kind}: {e.name}"] = own.get(f"{kind}: {e.name}", 0.0) + end - start
                collectives.get(kind, []).append((start, end, 0))
        elif e.thread == main and e.name.startswith("Optimizer.step"):  # the host's optimizer: last in line
            host = clipped(e.time_range.start, e.time_range.end, steps_span)
            spans += [(start, end, len(DEVICE_ORDER)) for start, end in host]
    taken = first_busy(spans, len(DEVICE_ORDER) + 1)
    found = dict.fromkeys(COMPONENTS, 0.0)
    for kind, i in rank.items():
        found[kind] = taken[i]
    found["optimizer"] += taken[-1]
    found["unattributed"] = sum(end - start for start, end in steps_span) - sum(taken)
    top = dict(sorted(own.items(), key=lambda kv: -kv[1])[:TOP_OPS])
    for kind, spans_of in collectives.items():
        hidden = first_busy(spans_of, 1)[0] - found[kind]
        if hidden > 0:
            top[f"hidden: {kind}"] = hidden
    return found, top


def clipped(start: float, end: float, steps_span) -> list[tuple[float, float]]:
    """The parts of [start, end) inside the profiled steps."""
    return [(max(start, s), min(end, e)) for s, e in steps_span if min(end, e) > max(start, s)]


def first_busy(spans, ranks: int) -> list[float]:
    """Time of each rank on a timeline of (start, end, rank) spans that may overlap: each instant where any span runs
    goes to the lowest rank running there, once; so the sum is the union of the spans."""
    points = sorted([(start, 1, r) for start, _, r in spans] + [(end, -1, r) for _, end, r in spans])
    running, taken, last = [0] * ranks, [0.0] * ranks, None
    for at, change, r in points:
        if last is not None and at > last:
            busy = next((i for i, count in enumerate(running) if count), None)
            if busy is not None:
                taken[busy] += at - last
        running[r] += change
        last = at
    return taken


def kind_at(calls, starts, worker) -> str:
    """The collective of the last call (start, kind) the training thread made before `worker` began; else its name's."""
    i = bisect.bisect_right(starts, worker.time_range.start) - 1
    return calls[i][1] if i >= 0 else collective_of(worker.name) or "all_reduce"


def waits(mine, events, main, steps_span) -> dict:
    """Microseconds the training thread ran nothing (inside the profiled steps) while a backend worker ran a
    collective, by collective."""
    busy = sorted((e.time_range.start, e.time_range.end) for e in mine if e.cpu_parent is None
                  or e.cpu_parent.name.startswith("ProfilerStep"))  # fmt: skip
    gaps = []
    for start, end in steps_span:
        cursor = start
        for b_start, b_end in busy:
            if b_end <= cursor or b_start >= end:
                continue
            if b_start > cursor:
                gaps.append((cursor, b_start))
            cursor = max(cursor, b_end)
        if cursor < end:
            gaps.append((cursor, end))
    # A worker's collective is the one the training thread last called (gloo runs a reduce-scatter as an all-reduce)
    calls = sorted((e.time_range.start, collective_of(e.name)) for e in mine if e.name.startswith("c10d::")
                   and collective_of(e.name) and not any(a.name.startswith("c10d::") for a in ancestors(e.cpu_parent)))
    starts = [start for start, _ in calls]
    workers = sorted((e.time_range.start, e.time_range.end, kind_at(calls, starts, e)) for e in events
                     if e.thread != main and e.name.startswith("gloo:"))  # fmt: skip
    waited = dict.fromkeys(COLLECTIVES, 0.0)
    for g_start, g_end in gaps:
        at = g_start
        for w_start, w_end, kind in workers:
            if w_end <= at or w_start >= g_end:
                continue
            piece = min(g_end, w_end) - max(at, w_start)
            if piece > 0:
                waited[kind] += piece
                at = min(g_end, w_end)
    return waited


class Profiler:
    """train.py's --profile_steps: profiles steps 2 to N + 1 of this process (the first warms up) and writes the
    split to OUT/profile/rank<R>.json when they are done, or when the run ends or stops before (the steps it
    completed). A no-op for N = 0."""

    def __init__(self, steps: int, out: Path, rank: int, first_step: int):
        self.steps, self.path, self.prof, self.calls = steps, Path(out) / "profile" / f"rank{rank}.json", None, 0
        self.first_step = first_step
        if steps <= 0:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
        self.prof = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self.write)
        self.prof.start()
        atexit.register(self.close)  # a run that raises: a profiler left running crashes the interpreter's teardown

    def step(self, last: bool = False) -> None:
        """After each optimizer step; last: the run ends or stops after it."""
        if self.prof is None:
            return
        self.prof.step()
        self.calls += 1
        if last or self.calls > self.steps:
            self.close()

    def close(self) -> None:
        prof, self.prof = self.prof, None
        if prof is not None:
            prof.stop()  # inside the profiled steps: write() gets the ones completed

    def write(self, prof) -> None:
        done = min(self.calls - 1, self.steps)  # the first call ends the warm-up step
        if done < 1:
            return
        split, top = split_events(prof.events(), done)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"steps": done, "first_step": self.first_step + 2, "seconds_per_step": split, "top_ops": top}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(self.path)
        prof.export_chrome_trace(str(self.path.with_suffix(".trace.json")))  # for Perfetto or chrome://tracing


def planned(step: dict, machine) -> dict:
    """costs.step_costs's seconds per step (step) split into COMPONENTS: the optimizer's own pass over its state (28
    B per parameter it updates, at the held-memory rate), the host Adam and Muon's Newton-Schulz are the optimizer;
    the rest of the held and fresh copies, and offload's transfers, are copies; each collective its bytes over its
    measured bandwidth (DDP's all-reduce less what its backward hides, costs.ddp_hidden_s)."""
    moved = step["traffic"]
    optimizer = moved["memory_optimizer"] / machine.memory_gb_s / 1e9
    split = dict.fromkeys(COMPONENTS, 0.0)
    split.update(
        compute=step["compute_s"],
        copies=step["copies_s"] - optimizer + step["offload_s"],
        optimizer=optimizer + step["host_adam_s"] + step["newton_schulz_s"],
        all_reduce=moved["all_reduce"] / machine.link_gb_s / 1e9 - step["all_reduce_hidden_s"],
        all_gather=moved["all_gather"] / machine.gather_gb_s / 1e9,
        reduce_scatter=moved["reduce_scatter"] / machine.scatter_gb_s / 1e9,
    )
    return split


def profile_files(out) -> list[Path]:
    """OUT/profile/rank<R>.json of every process (not the timelines beside them)."""
    return sorted(f for f in (Path(out) / "profile").glob("rank*.json") if re.fullmatch(r"rank\d+\.json", f.name))


def measured(out: Path) -> dict | None:
    """The mean over the processes of OUT/profile/rank*.json's seconds per step; None when the run was not profiled."""
    splits = [read_profile(f)["seconds_per_step"] for f in profile_files(out)]
    if not splits:
        return None
    return {k: sum(s.get(k, 0.0) for s in splits) / len(splits) for k in COMPONENTS}


NUMBER_MAPS = ("seconds_per_step", "planned_s")  # {component: seconds}


def read_json(path: Path, keys: dict) -> dict:
    """A JSON object with `keys` of the given types, or a UserError naming the file."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} is missing: a run of train.py writes plan.json at start (and profile/ with "
                        f"--profile_steps N)") from None  # fmt: skip
    except (OSError, ValueError) as e:
        raise UserError(f"{path} cannot be read ({e}); a run of train.py writes it anew at its start") from None
    wrong = [k for k, kind in keys.items() if not isinstance(data, dict) or not isinstance(data.get(k), kind)]
    wrong = wrong or [k for k in keys if k in NUMBER_MAPS and not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in data[k].values())]  # fmt: skip
    if wrong:
        raise UserError(f"{path} is not as train.py writes it: {', '.join(wrong)} missing or of another kind")
    return data


def read_profile(path: Path) -> dict:
    return read_json(path, {"steps": int, "first_step": int, "seconds_per_step": dict})


def table(plan: dict, got: dict | None, measured_step_s: float | None, title: str) -> list[str]:
    """Planned beside measured seconds per step, by component, and the totals (the profiled steps run slower than the
    others: the profiler's own cost, so the unprofiled step time is shown too)."""
    lines = [title, f"  {'component':<15}{'planned s':>11}{'measured s':>12}{'measured/planned':>18}"]
    for k in COMPONENTS:
        p, m = plan.get(k, 0.0), (got or {}).get(k)
        if p == 0 and not m:
            continue
        ratio = f"{m / p:.2f}" if m is not None and p > 0 else "-"
        lines.append(f"  {k:<15}{p:>11.4f}{(f'{m:.4f}' if m is not None else '-'):>12}{ratio:>18}")
    total_m = sum(got.values()) if got else None
    lines.append(f"  {'step (profiled)':<15}{sum(plan.values()):>11.4f}"
                 f"{(f'{total_m:.4f}' if total_m is not None else '-'):>12}")  # fmt: skip
    if measured_step_s is not None:
        ratio = f"{measured_step_s / sum(plan.values()):.2f}" if sum(plan.values()) > 0 else "-"
        lines.append(f"  {'step (not profiled)':<22}{measured_step_s:>16.4f}   measured/planned {ratio}")
    return lines


def step_seconds(out: Path, tokens_per_step: int, profiled_until: int) -> float | None:
    """Seconds per step the run logged (OUT/metrics.jsonl), over the log intervals after the first (the warm-up) that
    hold no profiled step; None when there is none."""
    logged = read_metrics(Path(out) / "metrics.jsonl")[0]  # (torn lines dropped)
    records = [r for r in logged if isinstance(r.get("tokens_per_s"), (int, float)) and r["tokens_per_s"] > 0]
    kept = [r for prev, r in zip(records, records[1:]) if prev["step"] >= max(profiled_until, 1)]
    return tokens_per_step / (sum(r["tokens_per_s"] for r in kept) / len(kept)) if kept else None


def from_run(out: str) -> list[str]:
    """`train.py --plan --from_run OUT`: the plan the run made at start (OUT/plan.json: its launch, the figures it
    measured, the planned seconds per component) beside what it measured: its profile (--profile_steps) and its
    logged step time."""
    plan = read_json(Path(out) / "plan.json", {"strategy": str, "launch": dict, "micro_batch_size": int,
                                              "tokens_per_step": int, "machine": dict, "planned_s": dict})  # fmt: skip
    profiles = [read_profile(f) for f in profile_files(out)]
    until = max((p["first_step"] + p["steps"] - 1 for p in profiles), default=0)
    try:
        step_s = step_seconds(out, plan["tokens_per_step"], until)
    except OSError as e:
        raise UserError(f"--from_run {out}: {e.filename or 'metrics.jsonl'} cannot be read ({e.strerror or e})") \
            from None
    m, launch = plan["machine"], plan["launch"]
    try:
        title = (f"{out}: {plan['strategy']}, {launch['world_size']} processes, {launch['precision']}, micro-batch "
                 f"{plan['micro_batch_size']} x {launch['grad_accum_steps']} accumulation; seconds per optimizer step, "
                 f"planned from what the run found at start (all-reduce {m['link_gb_s']:.3g}, all-gather "
                 f"{m['gather_gb_s']:.3g}, reduce-scatter {m['scatter_gb_s']:.3g} GB/s {m.get('link_source', '')}, "
                 f"copies {m['memory_gb_s']:.3g} "
                 f"/ {m['fresh_memory_gb_s']:.3g} GB/s, compute {m['flops_per_device'] / 1e12:.3g} TFLOP/s per "
                 f"process)")
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{Path(out) / 'plan.json'} is not as train.py writes it: its launch or machine lacks {e}") \
            from None
    lines = table(plan["planned_s"], measured(out), step_s, title)
    if not profiles:
        lines.append(f"  (no profile in {out}/profile: run with --profile_steps 3 for the measured components)")
    elif step_s is None:
        lines.append("  (no log interval after the profiled steps and the first: --log_every smaller, or more steps)")
    return lines
