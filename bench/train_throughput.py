"""train.py's training throughput against a bare PyTorch loop, and its CPU MFU against a timed fp32 matmul.

    python bench/train_throughput.py [--model_config small] [--steps 30]

Same model (the ~30M `small` preset), same batch (8 x 256 tokens), same threads, one process each, run one after
the other in this invocation: a bare loop (forward, cross-entropy, backward, AdamW step) and `python train.py`
(no launcher: Accelerate without DeepSpeed) and `accelerate launch --num_processes 1` with the ZeRO-3 CPU config.
Steady-state tokens/s skips the first log interval (warm-up). MFU = 6 N + 12 L H T FLOPs per token x tokens/s over
the peak of a 2048 x 2048 fp32 matmul timed in this process. Targets: train.py >= 0.9 of the bare loop; MFU >= 50%.
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import prepare_docs, record, train_py_rate

import lmdata
import train


def bare_loop(data_dir: Path, model_config: str, seq_len: int, batch: int, steps: int) -> float:
    from transformers import AutoModelForCausalLM

    cfg = train.Config(data_dir=str(data_dir), model_config=model_config, seq_len=seq_len)
    meta = lmdata.read_meta(data_dir)
    mc = train.load_model_config(cfg, meta)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(mc, attn_implementation="sdpa", dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    tokens = lmdata.load_split(data_dir, "train", meta)
    n = lmdata.num_windows(len(tokens), seq_len)
    times = []
    for step in range(steps):
        rows = torch.from_numpy(__import__("numpy").stack([lmdata.window(tokens, (step * batch + j) % n, seq_len) for j in range(batch)]))
        t0 = time.perf_counter()
        logits = model(input_ids=rows[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    steady = times[steps // 3:]
    return batch * seq_len * len(steady) / sum(steady)


def matmul_peak(n: int = 2048, reps: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model_config", default="small")
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_docs(tmp)
        peak = matmul_peak()
        bare = bare_loop(data, args.model_config, args.seq_len, args.batch, args.steps)
        plain = train_py_rate(["python"], data, Path(tmp) / "plain", args.model_config, args.seq_len, args.batch, args.steps)
        zero3 = train_py_rate(["accelerate", "launch", "--config_file", "accelerate_configs/zero3_cpu.yaml", "--num_processes", "1"],
                         data, Path(tmp) / "zero3", args.model_config, args.seq_len, args.batch, args.steps)
        peak_after = matmul_peak()
    c = train.load_model_config(train.Config(model_config=args.model_config, seq_len=args.seq_len), {"vocab_size": 8192, "eos_id": 0})
    counts = train.llama_param_counts(c)
    flops_tok = train.flops_per_token(counts["non_embedding"], c.num_hidden_layers, c.hidden_size, args.seq_len)
    peak = max(peak, peak_after)
    record("train_throughput", {
        "model_config": args.model_config, "parameters": counts["total"], "tokens_per_step": args.batch * args.seq_len,
        "bare_loop_tokens_per_s": bare, "train_py_tokens_per_s": plain["tokens_per_s"], "train_py_zero3_1proc_tokens_per_s": zero3["tokens_per_s"],
        "ratio_train_py_vs_bare": plain["tokens_per_s"] / bare, "ratio_zero3_1proc_vs_bare": zero3["tokens_per_s"] / bare,
        "matmul_peak_flops": peak, "mfu_bare_loop": bare * flops_tok / peak, "mfu_train_py": plain["tokens_per_s"] * flops_tok / peak,
        "mfu_train_py_logged": plain["mfu"], "targets": {"ratio": 0.9, "mfu": 0.5},
    })


if __name__ == "__main__":
    main()
