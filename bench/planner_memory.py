"""The planner's predicted memory against the measured peak RSS growth of a real CPU run.

    python bench/planner_memory.py [--model_config small] [--micro_batch_size 8] [--seq_len 256] [--loss_chunk_tokens N]

One process, `python train.py` (fp32, no ZeRO: the whole model, gradients and AdamW states in this process), a
few steps. Measured: peak RSS during training minus the peak RSS before the model was built (train.py records
both). Predicted: train.py's memory_plan for the same model, batch, sequence length, precision and loss path
(--loss_chunk_tokens, default train.py's; 0: the full logits) on 1 process. Target: within 25%. The loss's own count
at vocabulary 102,400, where it dominates, is checked by bench/loss_memory.py.
"""

import argparse
import json
import tempfile
from pathlib import Path

from common import prepare_docs, record, sh

from deepseek_zero3 import distributed
from deepseek_zero3.model import lmloss, models
from deepseek_zero3.planning import costs
from deepseek_zero3.training_data import token_data

ONE_PROCESS = distributed.Launch(1, 1, "fp32", 1, "none", False, False, 3)  # what the runs below are


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model_config", default="small")
    ap.add_argument("--micro_batch_size", type=int, default=8)
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--gradient_checkpointing", action="store_true")
    ap.add_argument("--loss_chunk_tokens", type=int, default=lmloss.DEFAULT_CHUNK_TOKENS)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_docs(tmp)
        for ckpt in (False, True):
            out = Path(tmp) / f"run-{ckpt}"
            sh(
                [
                    "python",
                    "train.py",
                    "--optimizer",
                    "adamw",  # the plan's AdamW state against the run's
                    "--data_dir",
                    str(data),
                    "--model_config",
                    args.model_config,
                    "--output_dir",
                    str(out),
                    "--seq_len",
                    str(args.seq_len),
                    "--micro_batch_size",
                    str(args.micro_batch_size),
                    "--max_steps",
                    "6",
                    "--log_every",
                    "1",
                    "--eval_every",
                    "0",
                    "--eval_tokens",
                    "2048",
                    "--save_every",
                    "0",
                    "--loss_chunk_tokens",
                    str(args.loss_chunk_tokens),
                ]
                + (["--gradient_checkpointing"] if ckpt else [])
            )
            before = json.loads((out / "config.json").read_text())["peak_mem_before_model_gib"]
            peak = max(json.loads(l).get("peak_mem_gib", 0) for l in (out / "metrics.jsonl").read_text().splitlines())
            mc = models.load_model_config(args.model_config, "", args.seq_len, token_data.read_meta(data))
            estimate = costs.memory_plan(
                mc, ONE_PROCESS, args.micro_batch_size, args.seq_len, ckpt, "sdpa", args.loss_chunk_tokens
            )
            predicted = (
                estimate["gpu_total"] - estimate["gpu"]["gathered_largest_tensor"]
            )  # no ZeRO: nothing is gathered
            measured = (peak - before) * 2**30
            rows.append(
                {
                    "gradient_checkpointing": ckpt,
                    "predicted_gib": predicted / 2**30,
                    "measured_growth_gib": measured / 2**30,
                    "peak_rss_gib": peak,
                    "rss_before_model_gib": before,
                    "ratio_predicted_vs_measured": predicted / measured,
                }
            )
    record(
        "planner_memory",
        {
            "model_config": args.model_config,
            "micro_batch_size": args.micro_batch_size,
            "seq_len": args.seq_len,
            "loss_chunk_tokens": args.loss_chunk_tokens,
            "runs": rows,
            "target": "predicted within 25% of measured",
        },
    )


if __name__ == "__main__":
    main()
