"""The LR schedules side by side: cosine, DeepSeek's multi-step and WSD, on the same tokens, model and peak LR.

    python bench/schedules.py [--data_dir data/python-docs] [--steps 300] [--lr 1e-3]

Each schedule trains train.py once from the same seed, as bench/vs_nanogpt.py runs its train.py side (one process,
one thread, fp32, 16 x 128 tokens a step, AdamW (0.9, 0.95), wd 0.1, clip 1.0, warmup --warmup steps), with
--lr_schedule and the schedule's own defaults (multistep: x0.316 after 80% and 90% of the steps; wsd: a linear decay
over the last 20%). All three end at about 0.1 x the peak (0.316^2 = 0.0999). Scored by the val_loss and val_bpb
train.py logs at its last step, over the whole validation split.
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
    ap.add_argument("--lr", type=float, default=1e-3, help="the peak LR of every schedule")
    ap.add_argument("--schedules", default="cosine,multistep,wsd")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work_dir", default="", help="where the runs go (default: a temporary directory)")
    return ap.parse_args(argv)


def last_validation(out: Path, step: int) -> dict:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in reversed(lines) if "val_loss" in r and r["step"] == step)


def main(argv=None) -> None:
    args = parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="schedules-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for schedule in args.schedules.split(","):
        out = work / schedule
        args.train_py_args = f"--lr_schedule {schedule}"
        seconds = runs.run(runs.train_py_command(args, out, args.lr, args.seed), REPO, work / f"{schedule}.log")
        last = last_validation(out, args.steps)
        lrs = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"lr"' in line]
        rows.append({"schedule": schedule, "val_loss": last["val_loss"], "val_bpb": last.get("val_bpb"),
                     "last_lr_over_peak": lrs[-1] / args.lr, "seconds": seconds})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    print(f"{args.model_config}, {args.steps} steps of {args.batch} x {args.seq_len} tokens, peak LR {args.lr:g}, "
          f"warmup {args.warmup}; {machine()}\n\n| schedule | val loss | val bpb | last LR / peak | seconds |\n"
          "|---|---|---|---|---|")  # fmt: skip
    for r in rows:
        bpb = f"{r['val_bpb']:.4f}" if r["val_bpb"] is not None else "-"
        print(f"| {r['schedule']} | {r['val_loss']:.4f} | {bpb} | {r['last_lr_over_peak']:.3f} | {r['seconds']:.0f} |")
    kept = [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # the table's wall times: not a figure
    record("schedules", {"model_config": args.model_config, "steps": args.steps, "peak_lr": args.lr, "rows": kept})


if __name__ == "__main__":
    main()
