"""Every benchmark in one command, then BENCHMARKS.md from what this invocation measured.

    python bench/run_all.py [--only NAME ...]

Clears bench/results/ first, so no row carries a number from an earlier run or another machine: a benchmark that
cannot run here (no local WikiText-2, no GPU) is recorded as not measured, with the reason, and its row says so.
Takes about 80 minutes on a 2-core machine (prepare_scale 10, zero3_knobs 25).
"""

import argparse
import os
import shutil
import subprocess
import sys

from common import REPO, RESULTS, record

# Relative to the repository (the benchmarks run from its root), so that no row names this machine's paths.
WIKITEXT2 = os.path.relpath(os.environ.get("WIKITEXT2_DIR", REPO.parent / "shared" / "data" / "wikitext-2"), REPO)
# A checkout of accelerate at the installed version, for its DeepSpeed example (see bench/vs_accelerate_example.py).
ACCELERATE_REPO = os.environ.get("ACCELERATE_REPO", "")
BENCHMARKS = [  # (result name, command)
    ("prepare_vs_tokenizer", ["bench/prepare_vs_tokenizer.py"]),
    (
        "prepare_vs_tokenizer_wikitext2",
        ["bench/prepare_vs_tokenizer.py", "--dataset", WIKITEXT2, "--name", "prepare_vs_tokenizer_wikitext2"],
    ),
    ("prepare_scale", ["bench/prepare_scale.py"]),
    ("train_throughput", ["bench/train_throughput.py"]),
    ("vs_accelerate_example", ["bench/vs_accelerate_example.py", "--accelerate_repo", ACCELERATE_REPO]),
    ("strategy_vs_plan", ["bench/strategy_vs_plan.py"]),
    ("zero3_knobs", ["bench/zero3_knobs.py"]),
    ("eval_throughput", ["bench/eval_throughput.py"]),
    ("eval_vs_harness", ["bench/eval_vs_harness.py"]),
    ("moe_throughput", ["bench/moe_throughput.py"]),
    ("planner_memory", ["bench/planner_memory.py"]),
    ("precision", ["bench/precision.py"]),
    ("document_masking", ["bench/document_masking.py"]),
    ("document_masking_memory", ["bench/document_masking_memory.py"]),
]
NEEDS_WIKITEXT = {"prepare_vs_tokenizer_wikitext2", "eval_vs_harness"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=None, help="result names to run (default: all)")
    args = ap.parse_args()
    if args.only is None:
        shutil.rmtree(RESULTS, ignore_errors=True)
    for name, cmd in BENCHMARKS:
        if args.only is not None and name not in args.only:
            continue
        (RESULTS / f"{name}.json").unlink(missing_ok=True)
        if name in NEEDS_WIKITEXT and not (REPO / WIKITEXT2 / "wiki.test.raw").is_file():
            record(name, {"not_measured": f"no local WikiText-2 at {WIKITEXT2} (set WIKITEXT2_DIR)"})
            continue
        if name == "vs_accelerate_example" and not ACCELERATE_REPO:
            record(name, {"not_measured": "no accelerate checkout (set ACCELERATE_REPO, see the bench's docstring)"})
            continue
        print(f"== {name}: python {' '.join(cmd)}", flush=True)
        proc = subprocess.run([sys.executable, *cmd], cwd=REPO)
        if proc.returncode != 0:
            record(name, {"not_measured": f"`python {' '.join(cmd)}` failed with exit code {proc.returncode}"})
    subprocess.run([sys.executable, "bench/make_report.py"], cwd=REPO, check=True)


if __name__ == "__main__":
    main()
