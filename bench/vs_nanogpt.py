"""Quality parity: train.py against karpathy/nanoGPT, each at its best of three peak LRs, scored on the same windows.

    git clone https://github.com/karpathy/nanoGPT
    python bench/vs_nanogpt.py --nanogpt_repo nanoGPT [--data_dir data/python-docs] [--steps 150]

The project holds none of nanoGPT's code: the peer is the checkout's own train.py, run as its README says (`python
train.py --key=value ...`, from the checkout, its configurator taking the overrides), and the checkout's model.py,
whose GPT class loads the ckpt.pt it saves. Both train on the token files prepare_data.py wrote to --data_dir
(uint16: nanoGPT memory-maps np.uint16): nanoGPT reads them through a temporary directory of links, train.bin,
val.bin -> validation.bin and a meta.pkl with the vocabulary (train.py's: the data's, padded to 64).

The same run on both sides: the model_config's depth, width and heads (nanoGPT's MLP is 4 x width with GELU; the
`mini` preset's SwiGLU 688 gives the same non-embedding parameters), --batch sequences of --seq_len tokens per step,
--steps optimizer steps, the same LR at every step (linear warmup to the peak on step --warmup - 1, then a cosine to
0.1 x peak on the last step: nanoGPT's warmup_iters=W-1, lr_decay_iters=steps-1 give train.py's Schedule exactly),
AdamW (0.9, 0.95), weight decay 0.1 on 2-D tensors, clipping at 1.0, fp32 on the CPU, one process, one thread
(OMP_NUM_THREADS=1), compile off. nanoGPT saves ckpt.pt at its eval on iter `steps` (after that many updates; it
then runs one more step, which the checkpoint does not hold).

Scoring: the validation loss of each side's final weights over all non-overlapping (seq_len + 1)-token windows of
the validation split, train.py's own windows (token_data.window, as lmloss.validation_loss takes them). train.py's is
the val_loss it logs (each packed document attending only to itself, as it trains, unless --train_py_args says
--no_document_masking); the bench also scores train.py's exported model with plain causal attention over the whole
window, as nanoGPT is scored, so the attention does not decide the comparison. What still differs, by design: the
architectures (RoPE, SwiGLU, RMSNorm, untied output layer against learned positions, GELU, LayerNorm, tied), the
inits (each project's own), the sampling (train.py: a permutation of aligned windows; nanoGPT: random offsets) and
the seeds (nanoGPT's is fixed at 1337; train.py's --seed).
"""

import argparse
import importlib.util
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common import REPO, machine, record  # noqa: I001 - common puts the repository on sys.path

from deepseek_zero3.model import models
from deepseek_zero3.model.lmloss import document_positions, nll_sum
from deepseek_zero3.training_data import token_data


def add_run_args(ap, steps: int, warmup: int) -> None:
    """The run shape train_py_command reads (also bench/schedules.py's): data, model, sequence, batch, steps, warmup."""
    ap.add_argument("--data_dir", default="data/python-docs", help="written by prepare_data.py (uint16 tokens)")
    ap.add_argument("--model_config", default="mini")
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="sequences per optimizer step")
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--warmup", type=int, default=warmup)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nanogpt_repo", required=True, help="a checkout of github.com/karpathy/nanoGPT")
    add_run_args(ap, steps=150, warmup=15)
    ap.add_argument("--lrs", default="1e-3,2e-3,4e-3", help="peak LRs each side is run at (its best is kept)")
    ap.add_argument("--seed", type=int, default=0, help="train.py's --seed (nanoGPT's is its own 1337)")
    ap.add_argument("--sides", default="nanogpt,train.py", help="which to run: nanogpt, train.py or both")
    ap.add_argument("--train_py_args", default="", help="extra train.py flags, e.g. for an ablation")
    ap.add_argument("--work_dir", default="", help="where the runs go (default: a temporary directory)")
    return ap.parse_args(argv)


def check_inputs(args) -> tuple[dict, object]:
    """The data's meta.json and train.py's model config for it; refuse what nanoGPT cannot read."""
    repo = Path(args.nanogpt_repo)
    missing = [f for f in ("train.py", "model.py", "configurator.py") if not (repo / f).is_file()]
    if missing:
        raise SystemExit(f"--nanogpt_repo {repo} lacks {', '.join(missing)}: pass a checkout of karpathy/nanoGPT")
    meta = token_data.read_meta(args.data_dir)
    if meta["dtype"] != "uint16":
        raise SystemExit(f"{args.data_dir} holds {meta['dtype']} tokens; nanoGPT memory-maps uint16 (vocab < 65536)")
    return meta, models.load_model_config(args.model_config, "", args.seq_len, meta)


def nanogpt_data(data_dir: Path, vocab_size: int, into: Path) -> Path:
    """A directory nanoGPT's get_batch and vocabulary lookup read: links to the token files and a meta.pkl."""
    into.mkdir(parents=True, exist_ok=True)
    for name, target in (("train.bin", "train.bin"), ("val.bin", "validation.bin")):
        link = into / name
        if not link.exists():
            link.symlink_to(token_data.split_file(data_dir.resolve(), target.removesuffix(".bin")).resolve())
    (into / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": vocab_size}))
    return into


def run(cmd: list[str], cwd: Path, log: Path) -> float:
    """Run one training to its end, one thread, output to `log`; its wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
    return time.perf_counter() - start


def nanogpt_command(args, config, data: Path, out: Path, lr: float) -> list[str]:
    """nanoGPT's train.py with the overrides that make its run train.py's (module docstring)."""
    overrides = {
        "out_dir": out, "dataset": data, "init_from": "scratch", "device": "cpu", "dtype": "float32",
        "compile": False, "batch_size": args.batch, "block_size": args.seq_len, "gradient_accumulation_steps": 1,
        "n_layer": config.num_hidden_layers, "n_head": config.num_attention_heads, "n_embd": config.hidden_size,
        "bias": False, "dropout": 0.0, "learning_rate": lr, "min_lr": 0.1 * lr, "max_iters": args.steps,
        "warmup_iters": args.warmup - 1, "lr_decay_iters": args.steps - 1, "weight_decay": 0.1, "beta1": 0.9,
        "beta2": 0.95, "grad_clip": 1.0, "eval_interval": args.steps, "eval_iters": 1, "log_interval": 50,
        "always_save_checkpoint": True,
    }  # fmt: skip
    return [sys.executable, "train.py", *(f"--{k}={v}" for k, v in overrides.items())]


def train_py_command(args, out: Path, lr: float, seed: int) -> list[str]:
    flags = {
        "data_dir": Path(args.data_dir).resolve(), "model_config": args.model_config, "output_dir": out,
        "seq_len": args.seq_len, "micro_batch_size": args.batch, "max_steps": args.steps,
        "warmup_steps": args.warmup, "lr": lr, "min_lr_ratio": 0.1, "weight_decay": 0.1, "adam_beta1": 0.9,
        "adam_beta2": 0.95, "max_grad_norm": 1.0, "seed": seed, "eval_tokens": 0, "eval_every": 0,
        "save_every": 0, "log_every": 50, "optimizer": "adamw",
    }  # fmt: skip
    cmd = [sys.executable, "train.py", "--no_eval_at_start"]
    for k, v in flags.items():
        cmd += [f"--{k}", str(v)]
    return cmd + args.train_py_args.split()


@torch.no_grad()
def windows_loss(logits_of, tokens: np.ndarray, seq_len: int, batch: int) -> float:
    """Mean next-token loss over all non-overlapping windows of `tokens` (train.py's validation windows);
    logits_of(inputs, targets) returns the logits of every position."""
    total = torch.zeros(2, dtype=torch.float64)
    n = token_data.num_windows(len(tokens), seq_len)
    for start in range(0, n, batch):
        ids = range(start, min(n, start + batch))
        rows = torch.from_numpy(np.stack([token_data.window(tokens, w, seq_len) for w in ids]))
        inputs, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        total += torch.stack(nll_sum(logits_of(inputs, targets), targets))
    return float(total[0] / total[1])


def score_nanogpt(repo: Path, ckpt: Path, tokens: np.ndarray, seq_len: int, batch: int) -> float:
    """The validation loss of a nanoGPT ckpt.pt, loaded into the checkout's own GPT class."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", repo / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    model = module.GPT(module.GPTConfig(**saved["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in saved["model"].items()})
    model.eval()
    return windows_loss(lambda x, y: model(x, y)[0], tokens, seq_len, batch)


def score_train_py(final: Path, tokens: np.ndarray, seq_len: int, batch: int, eos_id: int | None) -> float:
    """The validation loss of train.py's exported model; with eos_id each document attends only to itself."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()

    def logits_of(x, _):
        positions = document_positions(x, eos_id) if eos_id is not None else None
        return model(input_ids=x, position_ids=positions, use_cache=False).logits

    return windows_loss(logits_of, tokens, seq_len, batch)


def logged_val_loss(out: Path, step: int) -> float:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return next(r["val_loss"] for r in reversed(lines) if "val_loss" in r and r["step"] == step)


def run_side(side: str, args, config, meta, work: Path, lr: float) -> dict:
    """One training of one side at one peak LR, and its scores."""
    val = token_data.load_split(args.data_dir, "validation", meta)
    out = work / f"{side}-lr{lr:g}-seed{args.seed}"
    if side == "nanogpt":
        repo = Path(args.nanogpt_repo).resolve()
        data = nanogpt_data(Path(args.data_dir), config.vocab_size, work / "nanogpt-data")
        seconds = run(nanogpt_command(args, config, data, out, lr), repo, work / f"{out.name}.log")
        loss = score_nanogpt(repo, out / "ckpt.pt", val, args.seq_len, args.batch)
        return {"side": side, "lr": lr, "val_loss": loss, "val_loss_causal": loss, "seconds": seconds}
    seconds = run(train_py_command(args, out, lr, args.seed), REPO, work / f"{out.name}.log")
    causal = score_train_py(out / "final", val, args.seq_len, args.batch, None)
    return {"side": side, "lr": lr, "seed": args.seed, "val_loss": logged_val_loss(out, args.steps),
            "val_loss_causal": causal, "seconds": seconds}  # fmt: skip


def table(rows: list[dict], args, windows: int) -> str:
    best = {s: min((r for r in rows if r["side"] == s), key=lambda r: r["val_loss"]) for s in {r["side"] for r in rows}}
    lines = [
        f"{args.model_config}, {args.steps} steps of {args.batch} x {args.seq_len} tokens, warmup {args.warmup} + "
        f"cosine to 0.1x, AdamW (0.9, 0.95), wd 0.1, clip 1.0, fp32, 1 process, 1 thread; val loss over all "
        f"{windows} windows of {args.data_dir}'s validation split; {machine()}",
        "",
        "| side | peak LR | val loss | val loss, plain causal | seconds | best |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        mark = "yes" if r is best[r["side"]] else ""
        lines.append(f"| {r['side']} | {r['lr']:g} | {r['val_loss']:.4f} | {r['val_loss_causal']:.4f} | "
                     f"{r['seconds']:.0f} | {mark} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    meta, config = check_inputs(args)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="vs_nanogpt-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for side in [s for s in ("nanogpt", "train.py") if s in args.sides.split(",")]:
        for lr in [float(x) for x in args.lrs.split(",")]:
            rows.append(run_side(side, args, config, meta, work, lr))
            print(json.dumps(rows[-1]), flush=True)
    windows = token_data.num_windows(len(token_data.load_split(args.data_dir, "validation", meta)), args.seq_len)
    print(table(rows, args, windows))
    best = {s: min(r["val_loss"] for r in rows if r["side"] == s) for s in {r["side"] for r in rows}}
    if set(best) == {"nanogpt", "train.py"} and not args.train_py_args:
        kept = [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # the table's wall times: not a figure
        commit = subprocess.run(["git", "-C", args.nanogpt_repo, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "unknown (not a git checkout)"  # fmt: skip
        record("vs_nanogpt", {"rows": kept, "best": best, "train_py_at_or_below": best["train.py"] <= best["nanogpt"],
                              "nanogpt_commit": commit})  # fmt: skip


if __name__ == "__main__":
    main()
