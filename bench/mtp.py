"""What DeepSeek-V3's multi-token prediction costs and gives: deepseek-v3-mini trained with and without one MTP module
on the same tokens, its main validation loss and tokens/s.

    python bench/mtp.py [--data_dir data/python-docs] [--steps 300] [--lr 2e-3] [--seed 0]

Each side trains train.py once from the same seed, as bench/vs_nanogpt.py runs its train.py side (one process, one
thread, fp32, 16 x 128 tokens a step, AdamW (0.9, 0.95), wd 0.1, clip 1.0, cosine to 0.1 x the peak after --warmup
steps), with --mtp_depth 1 (lambda 0.3, the report's) or 0; the main model's initial weights are the same on both sides
(the MTP module draws from a stream of its own). Scored by the main val_loss train.py logs at its last step, over the
whole validation split, and by the mean tokens/s of the log intervals after the first. Each --seed is recorded as a
result of its own (mtp, mtp_seed1, ...): the seed moves the baseline's loss by as much as MTP does.
"""

import argparse
import json
import tempfile
from pathlib import Path

import vs_nanogpt as runs
from common import REPO, machine, record  # noqa: I001 - common puts the repository on sys.path


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runs.add_run_args(ap, steps=300, warmup=30)
    ap.set_defaults(model_config="deepseek-v3-mini")
    ap.add_argument("--lr", type=float, default=2e-3, help="the peak LR of both sides")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work_dir", default="", help="where the runs go (default: a temporary directory)")
    return ap.parse_args(argv)


def summary(out: Path, steps: int) -> dict:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = next(r for r in reversed(lines) if "val_loss" in r and r["step"] == steps)
    rates = [r["tokens_per_s"] for r in lines if "tokens_per_s" in r]
    rates = rates[1:] or rates  # the first interval holds the warm-up
    return {"val_loss": last["val_loss"], "val_mtp_loss_1": last.get("val_mtp_loss_1"),
            "tokens_per_s": sum(rates) / len(rates)}  # fmt: skip


def main(argv=None) -> None:
    args = parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mtp-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    sides = {}
    for depth in (0, 1):
        out = work / f"mtp{depth}"
        args.train_py_args = f"--mtp_depth {depth}"
        runs.run(runs.train_py_command(args, out, args.lr, args.seed), REPO, work / f"mtp{depth}.log")
        sides[depth] = summary(out, args.steps)
        print(json.dumps({"mtp_depth": depth, **sides[depth]}), flush=True)
    print(f"{args.model_config}, {args.steps} steps of {args.batch} x {args.seq_len} tokens, peak LR {args.lr:g}; "
          f"{machine()}")  # fmt: skip
    record(
        "mtp" if args.seed == 0 else f"mtp_seed{args.seed}",  # each seed its own result
        {
            "model_config": args.model_config,
            "tokens": args.steps * args.batch * args.seq_len,
            "val_loss_without_mtp": sides[0]["val_loss"],
            "val_loss_with_mtp": sides[1]["val_loss"],
            "val_mtp_loss_1": sides[1]["val_mtp_loss_1"],
            "tokens_per_s_without_mtp": round(sides[0]["tokens_per_s"]),
            "tokens_per_s_with_mtp": round(sides[1]["tokens_per_s"]),
            "tokens_per_s_ratio_with_over_without": sides[1]["tokens_per_s"] / sides[0]["tokens_per_s"],
            "val_loss_ratio_with_over_without": sides[1]["val_loss"] / sides[0]["val_loss"],
        },
    )


if __name__ == "__main__":
    main()
