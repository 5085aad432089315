"""Muon against AdamW in loss per token, the speedrun's way: each at its best of three peak LRs on the same tokens, and
the tokens Muon needs to reach AdamW's final validation loss.

    python bench/muon.py [--model_config mini] [--steps 300] [--warmup 30] [--parallel 2]
    python bench/muon.py --model_config small --steps 100 --warmup 10

Each run is train.py on one process, one thread, fp32 (as bench/vs_nanogpt.py runs it: 16 x 128 tokens a step, the
same seed, so the same initial weights and data order on every run; cosine to 0.1 x the peak after --warmup steps).
AdamW: (0.9, 0.95), weight decay 0.1, clipping at 1.0, at each of --adamw_lrs. Muon: --optimizer muon at each of
--muon_lrs (momentum 0.95, no weight decay on its matrices, unclipped), its AdamW groups (embedding, head, norms) at the
AdamW side's best LR. Validation over the whole split every --steps/10 steps; a run's curve is read at those points
and the tokens to reach a loss interpolated linearly between the two evaluations around it. --parallel runs go at once
(each one thread); the machine's cores bound it.
"""

import argparse
import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import vs_nanogpt as runs
from common import REPO, machine, record  # noqa: I001 - common puts the repository on sys.path


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runs.add_run_args(ap, steps=300, warmup=30)
    ap.add_argument("--adamw_lrs", default="1e-3,2e-3,4e-3", help="AdamW's peak LRs (its best is kept)")
    ap.add_argument("--muon_lrs", default="0.01,0.02,0.04", help="Muon's peak LRs, --muon_lr (its best is kept)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parallel", type=int, default=2, help="runs at once, one thread each")
    ap.add_argument("--work_dir", default="", help="where the runs go (default: a temporary directory)")
    return ap.parse_args(argv)


def curve(out: Path) -> list[tuple[int, float]]:
    """(step, val_loss) of every validation of a run, in order."""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["val_loss"]) for r in lines if "val_loss" in r]


def steps_to_reach(points: list[tuple[int, float]], target: float) -> float | None:
    """The first step at which the curve reaches `target`, linear between evaluations; None if it never does."""
    for (s0, l0), (s1, l1) in zip(points, points[1:]):
        if l1 <= target:
            return s1 if l0 == l1 else s0 + (s1 - s0) * (l0 - target) / (l0 - l1)
    return None


def train(args, work: Path, name: str, lr: float, extra: str) -> dict:
    out = work / name
    args_one = argparse.Namespace(**{**vars(args), "train_py_args": f"--eval_every {args.steps // 10} {extra}"})
    cmd = runs.train_py_command(args_one, out, lr, args.seed)
    cmd = [c for c in cmd if c != "--no_eval_at_start"]  # the curve starts at step 0
    if "--optimizer muon" in extra:  # Muon runs unclipped (train.py refuses --max_grad_norm with it)
        i = cmd.index("--max_grad_norm")
        del cmd[i : i + 2]
    seconds = runs.run(cmd, REPO, work / f"{name}.log")
    points = curve(out)
    result = {"run": name, "lr": lr, "val_loss": points[-1][1], "curve": points, "seconds": round(seconds)}
    print(json.dumps({k: v for k, v in result.items() if k != "curve"}), flush=True)
    return result


def sweep(args, work: Path, jobs: list[tuple]) -> list[dict]:
    with ThreadPoolExecutor(args.parallel) as pool:
        return list(pool.map(lambda job: train(args, work, *job), jobs))


def main(argv=None) -> None:
    args = parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="muon-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    adamw_lrs = [float(x) for x in args.adamw_lrs.split(",")]
    muon_lrs = [float(x) for x in args.muon_lrs.split(",")]
    adamw = sweep(args, work, [(f"adamw-lr{lr:g}", lr, "") for lr in adamw_lrs])
    best_adamw = min(adamw, key=lambda r: r["val_loss"])
    muon = sweep(args, work, [(f"muon-lr{m:g}", best_adamw["lr"], f"--optimizer muon --muon_lr {m}") for m in muon_lrs])
    best_muon = min(muon, key=lambda r: r["val_loss"])
    tokens_per_step = args.batch * args.seq_len
    reach = steps_to_reach(best_muon["curve"], best_adamw["val_loss"])
    ratio = reach / args.steps if reach is not None else None
    print(f"{args.model_config}, {args.steps} steps of {args.batch} x {args.seq_len} tokens; {machine()}")
    print(f"AdamW best: lr {best_adamw['lr']:g}, val_loss {best_adamw['val_loss']:.4f}; Muon best: muon_lr "
          f"{float(best_muon['run'].split('lr')[1]):g}, val_loss {best_muon['val_loss']:.4f}; Muon reaches AdamW's "
          f"final loss at " + (f"{ratio:.2f}x its tokens" if ratio is not None else "no point of its run"))  # fmt: skip
    record(
        f"muon_{args.model_config}" + ("" if args.seed == 0 else f"_seed{args.seed}"),
        {
            "model_config": args.model_config,
            "tokens": args.steps * tokens_per_step,
            "adamw_val_loss_by_lr": {f"{r['lr']:g}": r["val_loss"] for r in adamw},
            "muon_val_loss_by_muon_lr": {r["run"].split("lr")[1]: r["val_loss"] for r in muon},
            "muon_adamw_groups_lr": best_adamw["lr"],
            "adamw_best_val_loss": best_adamw["val_loss"],
            "muon_best_val_loss": best_muon["val_loss"],
            "muon_tokens_to_adamw_loss": reach * tokens_per_step if reach is not None else None,
            "muon_tokens_ratio": ratio,
            "seconds_adamw_best": best_adamw["seconds"],
            "seconds_muon_best": best_muon["seconds"],
        },
    )


if __name__ == "__main__":
    main()
