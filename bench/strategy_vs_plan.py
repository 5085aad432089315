"""The strategy planner against measurement: DDP, ZeRO-2 and ZeRO-3 on the same 2 CPU processes, same model and
global batch, measured tokens/s beside the planner's prediction (costs.step_costs) from the collectives' bandwidths,
copy rates and compute rate on the model the runs measured at start (medians over all runs, so that every strategy
is planned on the same figures).

    python bench/strategy_vs_plan.py [--model_config small] [--steps 16] [--rounds 2] [--seq_len 32 --batch 1 --accum 4]
    python bench/strategy_vs_plan.py --breakdown     # and where each strategy's step goes, planned beside measured

Runs train.py in alternation, `--rounds` times each:
  DDP:    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 train.py      (Accelerate MULTI_CPU, gloo all-reduce)
  ZeRO-2: accelerate launch --config_file accelerate_configs/zero2_cpu.yaml --num_processes 2 train.py
  ZeRO-3: accelerate launch --config_file accelerate_configs/zero3_cpu.yaml --num_processes 2 train.py
Each run must say "x 2 processes" in its own batch-plan line, and the DDP run MULTI_CPU, or the benchmark stops:
`accelerate launch` with a MULTI_CPU config starts ONE process. Steady-state tokens/s skips the first log interval.
Exits non-zero when a predicted ratio (ZeRO-2/DDP, ZeRO-3/DDP) is more than 25% off the measured one, or the
predicted ranking of the three differs from the measured one: on GPUs nobody here can test, the planner's comparison
is only as good as it is on the machine that can measure it.

--breakdown: every run profiles its steps 2-4 (train.py --profile_steps 3, inside the first log interval, which the
rate skips) and the bench prints, per strategy, the planned seconds per step of each component (compute, copies, the
optimizer, each collective) beside the measured ones, the mean over its rounds and processes (planning/breakdown.py).
"""

import argparse
import dataclasses
import statistics
import tempfile
from pathlib import Path
from types import SimpleNamespace

from common import add_zero3_vs_ddp_args, free_port, prepare_docs, record, train_py_rate

from deepseek_zero3 import distributed
from deepseek_zero3.model import models
from deepseek_zero3.model.lmloss import DEFAULT_CHUNK_TOKENS
from deepseek_zero3.planning import breakdown, costs
from deepseek_zero3.training_data import token_data


def launchers(accum: int) -> dict:
    """name: (launch command, environment, the distributed type the run must report)."""

    def accelerate(config: str):
        return lambda: ["accelerate", "launch", "--config_file", config, "--num_processes", "2",
                        "--gradient_accumulation_steps", str(accum),
                        "--main_process_port", str(free_port())]  # fmt: skip

    return {
        "ddp": (
            lambda: ["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port())],
            {"ACCELERATE_USE_CPU": "1", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": str(accum)},
            "MULTI_CPU",
        ),
        "zero2": (accelerate("accelerate_configs/zero2_cpu.yaml"), {}, "DEEPSPEED"),
        "zero3": (accelerate("accelerate_configs/zero3_cpu.yaml"), {}, "DEEPSPEED"),
    }


TOLERANCE = 0.25


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_zero3_vs_ddp_args(ap)
    ap.add_argument("--accum", type=int, default=4, help="gradient accumulation steps (ZeRO pays traffic for each)")
    # Few tokens per micro-step: the traffic, which the strategies differ in, outweighs the compute, which they share
    # (at seq 256 x micro 4 the three are within the rounds' spread of each other and nothing is tested).
    ap.add_argument("--breakdown", action="store_true", help="profile each run; planned beside measured per component")
    ap.set_defaults(seq_len=32, batch=1, steps=16)
    args = ap.parse_args()
    profile = ["--profile_steps", "3"] if args.breakdown else []
    runs_by_name = launchers(args.accum)
    measured = {name: [] for name in runs_by_name}
    planned, seen, profiles, splits = {}, [], {name: [] for name in runs_by_name}, {}
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_docs(tmp)
        for r in range(args.rounds):
            for name, (launcher, env, expected) in runs_by_name.items():
                out = Path(tmp) / f"{name}{r}"
                run = train_py_rate(launcher(), data, out, args.model_config, args.seq_len, args.batch, args.steps,
                                    processes=2, intervals=4, env=env, extra=profile)  # fmt: skip
                if (run["distributed_type"], run["accum"]) != (expected, args.accum):
                    raise SystemExit(f"{name}: expected {expected} with accumulation {args.accum}, train.py ran "
                                     f"{run['distributed_type']} with {run['accum']}")  # fmt: skip
                measured[name].append(run["tokens_per_s"])
                seen.append(run)
                if args.breakdown:
                    profiles[name].append(breakdown.measured(out))
        mc = models.load_model_config(args.model_config, "", args.seq_len, token_data.read_meta(data))
    # What costs.step_costs reads of train.py's Config, at its defaults (loss in chunks); compute: the runs' rate.
    cfg = SimpleNamespace(seq_len=args.seq_len, gradient_checkpointing=False, attn_implementation="sdpa",
                          loss_chunk_tokens=DEFAULT_CHUNK_TOKENS, assumed_mfu=0.35, gpu_memory_gib=24.0,
                          host_memory_gib=0.0, interconnect_gb_s=1.0, pcie_gb_s=1.0, nvme_gb_s=1.0)  # fmt: skip
    links = {k: statistics.median(r["links"][k] for r in seen) for k in seen[0]["links"]}
    peak = statistics.median(r["peak_tflops"] for r in seen) * 1e12 / 2
    rate = statistics.median(r["planned_compute_tflops"] for r in seen) * 1e12  # the runs' own, measured on the model
    launch = distributed.Launch(2, 1, "fp32", args.accum, "none", False, False, 3)
    machine = dataclasses.replace(costs.machine_for(cfg, launch, peak, links, model_rate=rate), host_memory_gib=1e6)
    for name, stage in (("ddp", 0), ("zero2", 2), ("zero3", 3)):
        launch = distributed.Launch(2, 1, "fp32", args.accum, "none", False, False, stage)
        step = costs.step_costs(mc, cfg, launch, args.batch, machine, 0)
        planned[name] = [step["tokens_per_s"]] * args.rounds
        splits[name] = breakdown.planned(step, machine)
    result = {"model_config": args.model_config, "processes": 2, "micro_batch_size": args.batch,
              "seq_len": args.seq_len, "accum": args.accum, "measured_gb_s_medians": links,
              "matmul_tflops_median": 2 * peak / 1e12, "model_tflops_per_process_median": rate / 1e12,
              "compute_source": seen[0]["planned_compute_source"]}  # fmt: skip
    failures = []
    for name in ("zero2", "zero3"):
        m = statistics.median(a / b for a, b in zip(measured[name], measured["ddp"]))
        p = statistics.median(a / b for a, b in zip(planned[name], planned["ddp"]))
        result[f"{name}_vs_ddp_measured"] = m
        result[f"{name}_vs_ddp_planned"] = p
        result[f"{name}_planned_over_measured"] = p / m
        if abs(p / m - 1) > TOLERANCE:
            failures.append(f"{name}/DDP planned {p:.3f}, measured {m:.3f}")
    rank = lambda rates: sorted(rates, key=lambda n: -statistics.median(rates[n]))
    result.update(
        {
            **{f"{n}_tokens_per_s": measured[n] for n in runs_by_name},
            **{f"{n}_planned_tokens_per_s": planned[n] for n in runs_by_name},
            "ranking_measured": " > ".join(rank(measured)),
            "ranking_planned": " > ".join(rank(planned)),
            "tolerance": TOLERANCE,
        }
    )
    if rank(measured) != rank(planned):
        failures.append(f"ranking planned {result['ranking_planned']}, measured {result['ranking_measured']}")
    result["verdict"] = "pass" if not failures else "FAIL: " + "; ".join(failures)
    if args.breakdown:
        tokens = 2 * args.batch * args.accum * args.seq_len
        for name in runs_by_name:
            got = {k: statistics.mean(p[k] for p in profiles[name]) for k in breakdown.COMPONENTS}
            step_s = tokens / statistics.median(measured[name])
            print("\n".join(breakdown.table(splits[name], got, step_s, f"{name}: seconds per optimizer step")))
            result[f"{name}_breakdown"] = {"planned": splits[name], "measured": got, "measured_step_s": step_s}
    record("strategy_vs_plan", result)
    if failures:
        raise SystemExit(result["verdict"])


if __name__ == "__main__":
    main()
