"""Write BENCHMARKS.md from the JSON results the benchmark scripts left in bench/results/.

    python bench/make_report.py
"""

import json

from common import REPO, RESULTS

ORDER = ["prepare_vs_tokenizer", "prepare_vs_tokenizer_wikitext2", "train_throughput", "zero3_vs_ddp", "eval_throughput", "planner_memory"]


def fmt(x):
    return f"{x:,.3f}" if isinstance(x, float) and abs(x) < 10 else f"{x:,.0f}" if isinstance(x, (int, float)) else str(x)


def main():
    results = {p.stem: json.loads(p.read_text()) for p in RESULTS.glob("*.json")}
    lines = ["# Benchmarks", "",
             "Each figure is a ratio of two runs made side by side in one invocation on the same machine, by the command",
             "shown; rerun it to check. The tables are written by `python bench/make_report.py` from `bench/results/*.json`.", ""]
    summary = [("prepare_vs_tokenizer", "prepare_data.py / raw tokenizers batch-encode (tokens/s), python-docs", "ratio", ">= 0.7"),
               ("prepare_vs_tokenizer_wikitext2", "prepare_data.py / raw tokenizers batch-encode (tokens/s), WikiText-2 train", "ratio", ">= 0.7"),
               ("train_throughput", "train.py (1 process) / bare PyTorch loop (tokens/s)", "ratio_train_py_vs_bare", ">= 0.9"),
               ("train_throughput", "CPU MFU of train.py on the ~30M `small` preset (vs timed fp32 matmul)", "mfu_train_py", ">= 0.5"),
               ("zero3_vs_ddp", "ZeRO-3 / plain DDP on 2 CPU processes (tokens/s)", "ratio", ">= 0.85"),
               ("eval_throughput", "eval.py / bare no_grad forward loop (tokens/s)", "ratio", ">= 0.9")]
    lines += ["| what | measured | target | met | command |", "|---|---:|---:|---|---|"]
    for name, what, key, target in summary:
        if name in results:
            value = results[name][key]
            met = value >= float(target.split()[-1])
            lines.append(f"| {what} | {value:.3f} | {target} | {'yes' if met else '**no**'} | `{results[name]['command']}` |")
        else:
            lines.append(f"| {what} | not run | {target} | | |")
    if "planner_memory" in results:
        for row in results["planner_memory"]["runs"]:
            r = row["ratio_predicted_vs_measured"]
            lines.append(f"| planner memory / measured RSS growth (`small`, checkpointing {'on' if row['gradient_checkpointing'] else 'off'}) "
                         f"| {r:.3f} | 0.75-1.25 | {'yes' if 0.75 <= r <= 1.25 else '**no**'} | `{results['planner_memory']['command']}` |")
    lines += ["", "Reading the numbers:",
              "- ZeRO-3 beats DDP on CPU processes because DeepSpeed's CPU collectives go through shared memory (its",
              "  `deepspeed_shm_comm` op), while DDP's gloo all-reduce goes through loopback TCP. On GPUs the order reverses.",
              "- `train_py_zero3_1proc` is `accelerate launch --num_processes 1` with the ZeRO-3 CPU config: DeepSpeed's",
              "  engine (hooks, partition bookkeeping) costs that much on one CPU process; it is not a target.",
              "- The planner underestimates a CPU run by the allocator's slack and the autograd temporaries it does not",
              "  model; on GPUs the CUDA caching allocator adds its own (the plan keeps 5% of the card free).",
              ""]
    for name in ORDER:
        if name not in results:
            continue
        r = results[name]
        lines += [f"## {name}", "", f"`{r['command']}` on {r['machine']}, {r['date']}", "", "| key | value |", "|---|---:|"]
        for k, v in r.items():
            if k in ("name", "command", "machine", "date"):
                continue
            if isinstance(v, list):
                for i, row in enumerate(v):
                    lines.append(f"| {k}[{i}] | " + ", ".join(f"{kk} {fmt(vv)}" for kk, vv in row.items()) + " |")
            else:
                lines.append(f"| {k} | {fmt(v)} |")
        lines.append("")
    gpu = RESULTS / "gpu" / "summary.txt"
    lines += ["## GPU", ""]
    lines.append(gpu.read_text() if gpu.is_file() else
                 "`bench/gpu_check.sh` (fp16 ZeRO-3 with loss scaling, bf16, tokens/s and MFU of deepseek-1.3b at 2048 tokens, "
                 "peak memory against the plan) is prepared but has **not run**: no GPU machine was lent to the sessions so far. "
                 "No GPU figure in this repository is measured yet.")
    (REPO / "BENCHMARKS.md").write_text("\n".join(lines) + "\n")
    print((REPO / "BENCHMARKS.md").read_text())


if __name__ == "__main__":
    main()
