"""train.py's training throughput against what a user would write instead, and its CPU MFU against a timed matmul.

    python bench/train_throughput.py [--model_config small] [--steps 30] [--rounds 2] [--deepspeed_only]

Two comparisons, each run side by side in this invocation:
1. Under DeepSpeed, the real setup: train.py and bench/bare_accelerate_loop.py (a bare Accelerate + DeepSpeed loop:
   DataLoader, forward, accelerator.backward, optimizer.step, nothing else), both through `accelerate launch` with
   the ZeRO-3 CPU config on --ds_processes processes, the `mini` preset at 8 x 128 tokens, in alternation for
   --rounds rounds. Target: train.py >= 0.97 of the bare loop (median over rounds).
2. One process without DeepSpeed: the ~30M `small` preset at 8 x 256 tokens, a bare PyTorch loop (forward,
   cross-entropy, backward, AdamW step) and `python train.py`; also `accelerate launch --num_processes 1` with the
   ZeRO-3 CPU config, to show what DeepSpeed's engine costs on one process. Targets: train.py >= 0.9 of the bare
   loop; MFU >= 50%, with MFU = 6 N + 12 L H T FLOPs per token x tokens/s over a 2048 x 2048 fp32 matmul timed here.
Steady-state tokens/s skips the first log interval of train.py and the first third of the bare loops' steps.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import free_port, prepare_docs, record, sh, train_py_rate

from deepseek_zero3.model import models
from deepseek_zero3.planning import model_math
from deepseek_zero3.training_data import token_data


def bare_loop(data_dir: Path, model_config: str, seq_len: int, batch: int, steps: int) -> float:
    from transformers import AutoModelForCausalLM

    meta = token_data.read_meta(data_dir)
    mc = models.load_model_config(model_config, "", seq_len, meta)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(mc, attn_implementation="sdpa", dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    tokens = token_data.load_split(data_dir, "train", meta)
    n = token_data.num_windows(len(tokens), seq_len)
    times = []
    for step in range(steps):
        rows = torch.from_numpy(
            __import__("numpy").stack(
                [token_data.window(tokens, (step * batch + j) % n, seq_len) for j in range(batch)]
            )
        )
        t0 = time.perf_counter()
        logits = model(input_ids=rows[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    steady = times[steps // 3 :]
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
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ds_processes", type=int, default=3)
    ap.add_argument("--ds_steps", type=int, default=45)
    ap.add_argument("--deepspeed_only", action="store_true", help="only comparison 1 (train.py vs the bare loop)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_docs(tmp)
        ds = deepspeed_rounds(data, Path(tmp), args)
        record("train_throughput_deepspeed", {**ds, "targets": {"ratio_vs_bare_accelerate_deepspeed": 0.97}})
        if args.deepspeed_only:
            return
        peak = matmul_peak()
        bare = bare_loop(data, args.model_config, args.seq_len, args.batch, args.steps)
        plain = train_py_rate(
            ["python"], data, Path(tmp) / "plain", args.model_config, args.seq_len, args.batch, args.steps, processes=1
        )
        zero3 = train_py_rate(
            ["accelerate", "launch", "--config_file", "accelerate_configs/zero3_cpu.yaml", "--num_processes", "1"],
            data,
            Path(tmp) / "zero3",
            args.model_config,
            args.seq_len,
            args.batch,
            args.steps,
            processes=1,
        )
        peak_after = matmul_peak()
    c = models.load_model_config(args.model_config, "", args.seq_len, {"vocab_size": 8192, "eos_id": 0})
    counts = model_math.llama_param_counts(c)
    flops_tok = model_math.flops_per_token(counts["non_embedding"], c.num_hidden_layers, c.hidden_size, args.seq_len)
    peak = max(peak, peak_after)
    record(
        "train_throughput",
        {
            "model_config": args.model_config,
            "parameters": counts["total"],
            "tokens_per_step": args.batch * args.seq_len,
            "bare_loop_tokens_per_s": bare,
            "train_py_tokens_per_s": plain["tokens_per_s"],
            "train_py_zero3_1proc_tokens_per_s": zero3["tokens_per_s"],
            "ratio_train_py_vs_bare": plain["tokens_per_s"] / bare,
            "ratio_zero3_1proc_vs_bare": zero3["tokens_per_s"] / bare,
            "matmul_peak_flops": peak,
            "mfu_bare_loop": bare * flops_tok / peak,
            "mfu_train_py": plain["tokens_per_s"] * flops_tok / peak,
            "mfu_train_py_logged": plain["mfu"],
            **ds,
            "targets": {"ratio": 0.9, "mfu": 0.5, "ratio_vs_bare_accelerate_deepspeed": 0.97},
        },
    )


def deepspeed_rounds(data: Path, tmp: Path, args) -> dict:
    """train.py against bench/bare_accelerate_loop.py, both under `accelerate launch` with the ZeRO-3 CPU config:
    train.py with its defaults (a validation at step 0), without it, and with two validations mid-run (the timed
    steps exclude the validations themselves, so a slowdown they leave behind shows); the bare loop with and without
    no-grad forwards before the first step (DeepSpeed's own behaviour, without train.py's workaround, issue #22)."""
    n, model, seq, batch = args.ds_processes, "mini", 128, 8
    rates = {
        "bare": [],
        "bare_eval_first": [],
        "train_py_no_eval_at_start": [],
        "train_py": [],
        "train_py_mid_evals": [],
    }
    for r in range(args.rounds):
        for name in rates:
            launch = [
                "accelerate",
                "launch",
                "--config_file",
                "accelerate_configs/zero3_cpu.yaml",
                "--num_processes",
                str(n),
                "--main_process_port",
                str(free_port()),
            ]
            if name.startswith("bare"):
                proc = sh(
                    launch
                    + [
                        "bench/bare_accelerate_loop.py",
                        "--data_dir",
                        str(data),
                        "--model_config",
                        model,
                        "--seq_len",
                        str(seq),
                        "--micro_batch_size",
                        str(batch),
                        "--steps",
                        str(args.ds_steps),
                    ]
                    + (["--eval_first"] if name == "bare_eval_first" else [])
                )
                bare = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("{")))
                if bare["processes"] != n:
                    raise SystemExit(f"the bare loop ran {bare['processes']} processes, not {n}")
                rates[name].append(bare["tokens_per_s"])
            else:
                extra = {
                    "train_py_no_eval_at_start": ["--no_eval_at_start"],
                    "train_py_mid_evals": ["--no_eval_at_start", "--eval_every", str(args.ds_steps // 3)],
                }.get(name, [])
                rates[name].append(
                    train_py_rate(
                        launch,
                        data,
                        tmp / f"{name}{r}",
                        model,
                        seq,
                        batch,
                        args.ds_steps,
                        processes=n,
                        intervals=4,
                        extra=extra,
                    )["tokens_per_s"]
                )

    def ratio(a, b):
        return statistics.median(x / y for x, y in zip(rates[a], rates[b]))

    return {
        "ds_setup": f"{n} processes, ZeRO-3 CPU config, {model}, {batch} x {seq} tokens, {args.ds_steps} steps, "
        f"{args.rounds} rounds",
        **{f"ds_{k}_tokens_per_s": v for k, v in rates.items()},
        "ratio_train_py_vs_bare_accelerate_deepspeed": ratio("train_py", "bare"),
        "ratio_train_py_vs_train_py_no_eval_at_start": ratio("train_py", "train_py_no_eval_at_start"),
        "ratio_train_py_mid_evals_vs_no_evals": ratio("train_py_mid_evals", "train_py_no_eval_at_start"),
        "ratio_bare_eval_first_vs_bare": ratio("bare_eval_first", "bare"),
    }


if __name__ == "__main__":
    main()
