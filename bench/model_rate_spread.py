"""How much the plan's compute rate on a CPU varies between measurements of the same model on the same machine: the
timed layer train.py uses (measure.measure_model_rate: a 2-layer copy, its second layer timed inside each pass, the
median of 5 passes) beside the estimate it replaced (the difference of a 1- and a 2-layer copy's passes, best of 2
after a warm-up, times the layers), in alternation, on 2 processes at once as a 2-process run measures it.

    python bench/model_rate_spread.py [--model_config small] [--seq_len 32] [--trials 6] [--vocab 8192]

The spread is the largest over the smallest of all trials of both processes. Exits non-zero unless the timed layer's
spread is the smaller; says whether it is within the planner's tolerance (bench/strategy_vs_plan.py's 25%): a rate
that varies more than that cannot hold a plan to it.
"""

import argparse
import copy
import time
from multiprocessing import get_context

from common import record

from deepseek_zero3.model import lmloss, models
from deepseek_zero3.planning import measure
from deepseek_zero3.planning.model_math import model_flops_per_token

TOLERANCE = 0.25  # bench/strategy_vs_plan.py's


def difference_rate(c, seq_len: int) -> float:
    """The replaced estimate: 1- and 2-layer copies, best of 2 passes after a warm-up each; t1 + (L-1)(t2-t1)."""
    import torch
    from transformers import AutoModelForCausalLM

    seconds = []
    ids = torch.randint(0, c.vocab_size, (1, seq_len))
    for layers in (1, 2):
        small = copy.deepcopy(c)
        small.num_hidden_layers = layers
        model = AutoModelForCausalLM.from_config(small, attn_implementation="sdpa")
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            nll, n = lmloss.model_nll(model, ids, ids, lmloss.DEFAULT_CHUNK_TOKENS)
            (nll / n).backward()
            times.append(time.perf_counter() - t0)
        seconds.append(min(times[1:]))
    whole = seconds[0] + (c.num_hidden_layers - 1) * max(seconds[1] - seconds[0], 0.0)
    return model_flops_per_token(c, seq_len) * seq_len / whole


def worker(args, results) -> None:
    import torch

    torch.set_num_threads(1)  # as torchrun and accelerate launch run each of several processes
    c = models.load_model_config(args.model_config, "", args.seq_len, None)
    c.vocab_size = args.vocab
    rows = []
    for _ in range(args.trials):
        timed = measure.measure_model_rate(c, 1, args.seq_len, "fp32", "sdpa", lmloss.DEFAULT_CHUNK_TOKENS)
        rows.append((timed, difference_rate(c, args.seq_len)))
    results.put(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model_config", default="small")
    ap.add_argument("--seq_len", type=int, default=32)
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192, help="as bench/strategy_vs_plan.py's prepared data")
    args = ap.parse_args()
    ctx = get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(args, results)) for _ in range(2)]
    for p in procs:
        p.start()
    rows = [row for _ in procs for row in results.get()]
    for p in procs:
        p.join()
    gflops = {name: sorted(r[i] / 1e9 for r in rows) for i, name in enumerate(("timed_layer", "difference"))}
    result = {"model_config": args.model_config, "seq_len": args.seq_len, "vocab": args.vocab, "processes": 2,
              "trials_per_process": args.trials}  # fmt: skip
    for name, values in gflops.items():
        result[f"{name}_gflop_s"] = [round(v, 1) for v in values]
        result[f"{name}_spread"] = values[-1] / values[0]
    ok = result["timed_layer_spread"] < result["difference_spread"]
    result["within_planner_tolerance"] = result["timed_layer_spread"] <= 1 + TOLERANCE
    result["verdict"] = "pass" if ok else (
        f"FAIL: the timed layer's rate spread {result['timed_layer_spread']:.2f}x, the difference's "
        f"{result['difference_spread']:.2f}x"
    )
    record("model_rate_spread", result)
    if not ok:
        raise SystemExit(result["verdict"])


if __name__ == "__main__":
    main()
