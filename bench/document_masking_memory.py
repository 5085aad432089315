"""Peak memory of document masking at a long sequence: train.py masked with each kernel against unmasked.

    python bench/document_masking_memory.py [--seq_len 4096] [--micro_batch_size 8] [--steps 2]

The `tiny` preset with its context raised to --seq_len (a copy of its config.json), one process, fp32 on the CPU,
python-docs with a BPE of 512; each setting a fresh process, its peak resident set as train.py logs it (peak_mem_gib,
the largest over the steps). Settings: masked with varlen_sdpa (what --attn_implementation auto takes on a CPU),
masked with the dense sdpa fallback (a (batch, 1, T, T) mask), and --no_document_masking. Also recorded: the plan's
count of what each kernel keeps to mask (the run's own plan line, "document mask").
"""

import argparse
import json
import re
import tempfile
from pathlib import Path

from common import REPO, record, sh


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq_len", type=int, default=4096)
    ap.add_argument("--micro_batch_size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    settings = {
        "masked_varlen_sdpa": ["--attn_implementation", "varlen_sdpa"],
        "masked_dense_sdpa": ["--attn_implementation", "sdpa"],
        "unmasked": ["--no_document_masking"],
    }
    peaks, planned = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        config = json.loads((REPO / "model_configs" / "tiny.json").read_text())
        config["max_position_embeddings"] = args.seq_len
        (Path(tmp) / "tiny-long.json").write_text(json.dumps(config))
        data = Path(tmp) / "data"
        sh(["python", "prepare_data.py", "--dataset", "python-docs", "--tokenizer", "bpe:512", "--output_dir", data])
        for name, extra in settings.items():
            out = Path(tmp) / name
            proc = sh(["python", "train.py", "--data_dir", str(data), "--model_config", str(Path(tmp) / "tiny-long.json"),
                       "--output_dir", str(out), "--seq_len", str(args.seq_len), "--micro_batch_size",
                       str(args.micro_batch_size), "--max_steps", str(args.steps), "--log_every", "1", "--eval_every",
                       "0", "--eval_tokens", str(args.seq_len), "--no_eval_at_start", "--save_every", "0", *extra])  # fmt: skip
            steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            peaks[name] = max(r["peak_mem_gib"] for r in steps if "peak_mem_gib" in r) * 1024
            mask = re.search(r"\+ document mask ([\d.]+)", proc.stdout)
            planned[name] = float(mask.group(1)) * 1024 if mask else 0.0
            print(f"{name}: peak {peaks[name]:,.0f} MiB, planned mask {planned[name]:,.0f} MiB")
    record(
        "document_masking_memory",
        {
            "model_config": f"tiny, context {args.seq_len}",
            "seq_len": args.seq_len,
            "micro_batch_size": args.micro_batch_size,
            "processes": 1,
            "peak_mib": {k: round(v) for k, v in peaks.items()},
            "planned_mask_mib": {k: round(v) for k, v in planned.items()},
            "varlen_over_unmasked": peaks["masked_varlen_sdpa"] / peaks["unmasked"],
            "dense_over_unmasked": peaks["masked_dense_sdpa"] / peaks["unmasked"],
        },
    )


if __name__ == "__main__":
    main()
