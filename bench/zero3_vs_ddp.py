"""ZeRO-3 against plain data parallel on the same 2 CPU processes, same model and global batch.

    python bench/zero3_vs_ddp.py [--model_config small] [--steps 24]

Runs train.py twice, one after the other: `accelerate_configs/ddp_cpu.yaml` (DDP, gloo) and
`accelerate_configs/zero3_cpu.yaml --num_processes 2` (DeepSpeed ZeRO-3 with the knobs in zero3_cpu.json).
Steady-state tokens/s skips the first log interval. Target: ZeRO-3 at least 0.85 of DDP.
"""

import argparse
import json
import tempfile
from pathlib import Path

from common import record, sh


def run(config: list[str], data: Path, out: Path, args) -> float:
    log_every = max(1, args.steps // 4)
    sh(["accelerate", "launch", *config, "train.py", "--data_dir", str(data), "--model_config", args.model_config,
        "--output_dir", str(out), "--seq_len", str(args.seq_len), "--micro_batch_size", str(args.batch),
        "--max_steps", str(args.steps), "--log_every", str(log_every), "--eval_every", "0", "--eval_tokens", "4096", "--save_every", "0"])
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in l][1:]
    return sum(r["tokens_per_s"] for r in records) / len(records)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model_config", default="small")
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        sh(["python", "prepare_data.py", "--dataset", "python-docs", "--tokenizer", "bpe:8192", "--output_dir", str(data)])
        ddp = run(["--config_file", "accelerate_configs/ddp_cpu.yaml"], data, Path(tmp) / "ddp", args)
        zero3 = run(["--config_file", "accelerate_configs/zero3_cpu.yaml", "--num_processes", "2"], data, Path(tmp) / "zero3", args)
    record("zero3_vs_ddp", {"model_config": args.model_config, "processes": 2, "micro_batch_size": args.batch, "seq_len": args.seq_len,
                            "ddp_tokens_per_s": ddp, "zero3_tokens_per_s": zero3, "ratio": zero3 / ddp, "target": 0.85})


if __name__ == "__main__":
    main()
