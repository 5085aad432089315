"""ZeRO-3 against plain data parallel on the same 2 CPU processes, same model and global batch.

    python bench/zero3_vs_ddp.py [--model_config small] [--steps 24]

Runs train.py twice, one after the other: `accelerate_configs/ddp_cpu.yaml` (DDP, gloo) and
`accelerate_configs/zero3_cpu.yaml --num_processes 2` (DeepSpeed ZeRO-3 with the knobs in zero3_cpu.json).
Steady-state tokens/s skips the first log interval. Target: ZeRO-3 at least 0.85 of DDP.
"""

import argparse
import tempfile
from pathlib import Path

from common import prepare_docs, record, train_py_rate


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model_config", default="small")
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_docs(tmp)
        rate = {}
        for name, config in (("ddp", ["--config_file", "accelerate_configs/ddp_cpu.yaml"]),
                             ("zero3", ["--config_file", "accelerate_configs/zero3_cpu.yaml", "--num_processes", "2"])):
            rate[name] = train_py_rate(["accelerate", "launch", *config], data, Path(tmp) / name, args.model_config,
                                       args.seq_len, args.batch, args.steps, intervals=4)["tokens_per_s"]
        ddp, zero3 = rate["ddp"], rate["zero3"]
    record("zero3_vs_ddp", {"model_config": args.model_config, "processes": 2, "micro_batch_size": args.batch, "seq_len": args.seq_len,
                            "ddp_tokens_per_s": ddp, "zero3_tokens_per_s": zero3, "ratio": zero3 / ddp, "target": 0.85})


if __name__ == "__main__":
    main()
