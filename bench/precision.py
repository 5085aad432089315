"""train.py in fp32, bf16 and fp16 on the same machine: tokens/s, final validation loss, and what the planner assumed.

    python bench/precision.py [--model_config small] [--steps 30] [--rounds 2]

3 CPU processes under accelerate_configs/zero3_cpu.yaml (DeepSpeed ZeRO-3), `--mixed_precision` given at launch,
python-docs with a BPE of 8192, 4 x 128 tokens per process and step, the precisions alternated for --rounds rounds.
A precision the CPU lacks is left out and the row says why (fp16: oneDNN without fp16, where DeepSpeed refuses it;
bf16: no AMX/AVX512-BF16, where it runs ~100x slower than fp32). Steady-state tokens/s skips the first log interval;
the final validation loss is the run's last (the same 4,096 tokens in every precision). Beside them: the peak the run
measured (a 1024x1024 matmul in the run's dtype, what MFU is reported against), the compute rate the plan measured on
the model itself (measure.measure_model_rate) and the tokens/s the plan line predicted from it, over the measured.
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from common import cpu_bf16_units, free_port, prepare_docs, record, train_py_rate


def precisions() -> tuple[list[str], dict[str, str]]:
    present, missing = ["fp32"], {}
    if cpu_bf16_units():
        present.append("bf16")
    else:
        missing["bf16"] = "no bf16 units (AMX or AVX512-BF16): ~100x slower than fp32"
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        present.append("fp16")
    else:
        missing["fp16"] = "oneDNN has no fp16 on this CPU: DeepSpeed refuses fp16"
    return present, missing


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model_config", default="small")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    present, missing = precisions()
    runs = {p: [] for p in present}
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_docs(tmp)
        for r in range(args.rounds):
            for p in present:
                launcher = ["accelerate", "launch", "--config_file", "accelerate_configs/zero3_cpu.yaml",
                            "--num_processes", "3", "--main_process_port", str(free_port()),
                            "--mixed_precision", "no" if p == "fp32" else p]  # fmt: skip
                run = train_py_rate(launcher, data, Path(tmp) / f"{p}{r}", args.model_config, 128, 4, args.steps, 3)
                if run["distributed_type"] != "DEEPSPEED" or run["precision"] != p:
                    sys.exit(f"{p}: train.py ran {run['distributed_type']}, {run['precision']}")
                runs[p].append(run)
                print(f"round {r} {p}: {run['tokens_per_s']:,.0f} tokens/s, val loss {run['final_val_loss']:.4f}")
    rows = {
        p: {
            "tokens_per_s": [round(x["tokens_per_s"]) for x in rs],
            "median_tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
            "final_val_loss": [x["final_val_loss"] for x in rs],
            "measured_peak_tflops": rs[0]["peak_tflops"],
            "planned_compute_tflops_per_process": rs[0]["planned_compute_tflops"],
            "planned_tokens_per_s": rs[0]["planned_tokens_per_s"],
            "planned_over_measured": statistics.median(x["planned_tokens_per_s"] / x["tokens_per_s"] for x in rs),
        }
        for p, rs in runs.items()
    }
    fp32 = rows["fp32"]["median_tokens_per_s"]
    record(
        "precision",
        {
            "setup": f"3 CPU processes, ZeRO-3, {args.model_config}, 4 x 128 tokens per process, {args.steps} steps, "
            f"{args.rounds} rounds alternated",
            **{f"{p}": row for p, row in rows.items()},
            **{f"{p}_vs_fp32": row["median_tokens_per_s"] / fp32 for p, row in rows.items() if p != "fp32"},
            **{f"{p}_planned_over_measured": row["planned_over_measured"] for p, row in rows.items()},
            "left_out": missing,
        },
    )


if __name__ == "__main__":
    main()
