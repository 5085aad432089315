"""ZeRO-3 against plain data parallel (DDP) on the same 2 CPU processes, same model and global batch.

    python bench/zero3_vs_ddp.py [--model_config small] [--steps 24] [--rounds 2]

Runs train.py in alternation, `--rounds` times each:
  DDP:    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 train.py      (Accelerate MULTI_CPU, gloo all-reduce)
  ZeRO-3: accelerate launch --config_file accelerate_configs/zero3_cpu.yaml --num_processes 2 train.py
Each run must say "x 2 processes" in its own batch-plan line, and the DDP run MULTI_CPU, or the benchmark stops:
`accelerate launch` with a MULTI_CPU config starts ONE process. Steady-state tokens/s skips the first log interval.
Target: ZeRO-3 at least 0.85 of DDP.
"""

import argparse
import statistics
import tempfile
from pathlib import Path

from common import add_zero3_vs_ddp_args, free_port, prepare_docs, record, train_py_rate

LAUNCHERS = {
    "ddp": (
        lambda: ["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port())],
        {"ACCELERATE_USE_CPU": "1"},
        "MULTI_CPU",
    ),
    "zero3": (
        lambda: [
            "accelerate",
            "launch",
            "--config_file",
            "accelerate_configs/zero3_cpu.yaml",
            "--num_processes",
            "2",
            "--main_process_port",
            str(free_port()),
        ],
        {},
        "DEEPSPEED",
    ),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_zero3_vs_ddp_args(ap)
    args = ap.parse_args()
    rates = {name: [] for name in LAUNCHERS}
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_docs(tmp)
        for r in range(args.rounds):
            for name, (launcher, env, expected) in LAUNCHERS.items():
                run = train_py_rate(
                    launcher(),
                    data,
                    Path(tmp) / f"{name}{r}",
                    args.model_config,
                    args.seq_len,
                    args.batch,
                    args.steps,
                    processes=2,
                    intervals=4,
                    env=env,
                )
                if run["distributed_type"] != expected:
                    raise SystemExit(f"{name}: expected {expected}, train.py ran {run['distributed_type']}")
                rates[name].append(run["tokens_per_s"])
    ratios = [z / d for z, d in zip(rates["zero3"], rates["ddp"])]
    record(
        "zero3_vs_ddp",
        {
            "model_config": args.model_config,
            "processes": 2,
            "micro_batch_size": args.batch,
            "seq_len": args.seq_len,
            "ddp_tokens_per_s": rates["ddp"],
            "zero3_tokens_per_s": rates["zero3"],
            "ratio_per_round": ratios,
            "ratio": statistics.median(ratios),
            "target": 0.85,
        },
    )


if __name__ == "__main__":
    main()
