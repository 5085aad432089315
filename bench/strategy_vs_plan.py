"""The strategy planner against measurement: DDP, ZeRO-2 and ZeRO-3 on the same 2 CPU processes, same model and
global batch, measured tokens/s beside the tokens/s each run's own plan line predicted at start (from the all-reduce
bandwidth it measured over gloo and the matmul rate it timed).

    python bench/strategy_vs_plan.py [--model_config small] [--steps 24] [--rounds 2]

Runs train.py in alternation, `--rounds` times each:
  DDP:    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 train.py      (Accelerate MULTI_CPU, gloo all-reduce)
  ZeRO-2: accelerate launch --config_file accelerate_configs/zero2_cpu.yaml --num_processes 2 train.py
  ZeRO-3: accelerate launch --config_file accelerate_configs/zero3_cpu.yaml --num_processes 2 train.py
Each run must say "x 2 processes" in its own batch-plan line, and the DDP run MULTI_CPU, or the benchmark stops:
`accelerate launch` with a MULTI_CPU config starts ONE process. Steady-state tokens/s skips the first log interval.
Exits non-zero when a predicted ratio (ZeRO-2/DDP, ZeRO-3/DDP) is more than 25% off the measured one, or the
predicted ranking of the three differs from the measured one: on GPUs nobody here can test, the planner's comparison
is only as good as it is on the machine that can measure it.
"""

import argparse
import statistics
import tempfile
from pathlib import Path

from common import add_zero3_vs_ddp_args, free_port, prepare_docs, record, train_py_rate


def accelerate(config: str) -> tuple:
    def launcher():
        return ["accelerate", "launch", "--config_file", config, "--num_processes", "2",
                "--main_process_port", str(free_port())]  # fmt: skip

    return launcher, {}, "DEEPSPEED"


LAUNCHERS = {
    "ddp": (
        lambda: ["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port())],
        {"ACCELERATE_USE_CPU": "1"},
        "MULTI_CPU",
    ),
    "zero2": accelerate("accelerate_configs/zero2_cpu.yaml"),
    "zero3": accelerate("accelerate_configs/zero3_cpu.yaml"),
}
TOLERANCE = 0.25


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_zero3_vs_ddp_args(ap)
    args = ap.parse_args()
    measured = {name: [] for name in LAUNCHERS}
    planned = {name: [] for name in LAUNCHERS}
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_docs(tmp)
        for r in range(args.rounds):
            for name, (launcher, env, expected) in LAUNCHERS.items():
                run = train_py_rate(launcher(), data, Path(tmp) / f"{name}{r}", args.model_config, args.seq_len,
                                    args.batch, args.steps, processes=2, intervals=4, env=env)  # fmt: skip
                if run["distributed_type"] != expected:
                    raise SystemExit(f"{name}: expected {expected}, train.py ran {run['distributed_type']}")
                measured[name].append(run["tokens_per_s"])
                planned[name].append(run["planned_tokens_per_s"])
    result = {"model_config": args.model_config, "processes": 2, "micro_batch_size": args.batch,
              "seq_len": args.seq_len}  # fmt: skip
    failures = []
    for name in ("zero2", "zero3"):
        m = statistics.median(a / b for a, b in zip(measured[name], measured["ddp"]))
        p = statistics.median(a / b for a, b in zip(planned[name], planned["ddp"]))
        result[f"{name}_vs_ddp_measured"] = m
        result[f"{name}_vs_ddp_planned"] = p
        result[f"{name}_planned_over_measured"] = p / m
        if abs(p / m - 1) > TOLERANCE:
            failures.append(f"{name}/DDP planned {p:.3f}, measured {m:.3f}")
    rank = lambda rates: sorted(rates, key=lambda n: -statistics.median(rates[n]))  # noqa: E731
    result.update(
        {
            **{f"{n}_tokens_per_s": measured[n] for n in LAUNCHERS},
            **{f"{n}_planned_tokens_per_s": planned[n] for n in LAUNCHERS},
            "ranking_measured": " > ".join(rank(measured)),
            "ranking_planned": " > ".join(rank(planned)),
            "tolerance": TOLERANCE,
        }
    )
    if rank(measured) != rank(planned):
        failures.append(f"ranking planned {result['ranking_planned']}, measured {result['ranking_measured']}")
    result["verdict"] = "pass" if not failures else "FAIL: " + "; ".join(failures)
    record("strategy_vs_plan", result)
    if failures:
        raise SystemExit(result["verdict"])


if __name__ == "__main__":
    main()
