"""Which ZeRO-3 settings bring ZeRO-3 closest to plain data parallel on CPU processes: each variant of
accelerate_configs/zero3_cpu.json against DDP, side by side, same model, batch and 2 processes.

    python bench/zero3_knobs.py [--model_config small] [--steps 24] [--rounds 2]

Every run skips the step-0 validation (--no_eval_at_start) except `shipped + step-0 eval`, which shows what that
validation costs ZeRO-3 (see NOTES.md). Each round runs DDP, then every variant, in a fixed order; the ratio of a
variant is its tokens/s over the same round's DDP run, and the table gives the median over rounds. Each run must
say "x 2 processes" in its own batch-plan line.
"""

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from common import REPO, add_zero3_vs_ddp_args, free_port, prepare_docs, record, train_py_rate

SHIPPED = json.loads((REPO / "accelerate_configs" / "zero3_cpu.json").read_text())
VARIANTS = {  # name -> changes to zero_optimization (None: the step-0 validation left on)
    "shipped": {},
    "shipped + step-0 eval": None,
    "persistence 1e5": {"stage3_param_persistence_threshold": 100_000},
    "persistence 1e6": {"stage3_param_persistence_threshold": 1_000_000},
    "overlap_comm": {"overlap_comm": True},
    "buckets 5e8": {"reduce_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 500_000_000},
}


def zero3_launcher(tmp: Path, name: str, changes: dict) -> list[str]:
    config = {**SHIPPED, "zero_optimization": {**SHIPPED["zero_optimization"], **changes}}
    js = tmp / f"{name.replace(' ', '_')}.json"
    js.write_text(json.dumps(config, indent=2))
    yaml_text = (REPO / "accelerate_configs" / "zero3_cpu.yaml").read_text()
    yml = js.with_suffix(".yaml")
    yml.write_text(
        yaml_text.replace("deepspeed_config_file: accelerate_configs/zero3_cpu.json", f"deepspeed_config_file: {js}")
    )
    return [
        "accelerate",
        "launch",
        "--config_file",
        str(yml),
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_zero3_vs_ddp_args(ap)
    args = ap.parse_args()
    rates = {name: [] for name in ["ddp", *VARIANTS]}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = prepare_docs(str(tmp))
        for r in range(args.rounds):
            for name in rates:
                if name == "ddp":
                    launcher, env, expected = (
                        ["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port())],
                        {"ACCELERATE_USE_CPU": "1"},
                        "MULTI_CPU",
                    )
                else:
                    launcher, env, expected = zero3_launcher(tmp, name, VARIANTS[name] or {}), {}, "DEEPSPEED"
                extra = [] if VARIANTS.get(name, {}) is None else ["--no_eval_at_start"]
                run = train_py_rate(
                    launcher,
                    data,
                    tmp / f"run-{r}-{len(rates[name])}-{name.replace(' ', '_')}",
                    args.model_config,
                    args.seq_len,
                    args.batch,
                    args.steps,
                    processes=2,
                    intervals=4,
                    env=env,
                    extra=extra,
                )
                if run["distributed_type"] != expected:
                    raise SystemExit(f"{name}: expected {expected}, train.py ran {run['distributed_type']}")
                rates[name].append(run["tokens_per_s"])
                print(f"round {r} {name}: {run['tokens_per_s']:,.0f} tokens/s", flush=True)
    table = [
        {
            "variant": name,
            "changes": json.dumps(VARIANTS[name]) if VARIANTS[name] is not None else "step-0 validation on",
            "tokens_per_s": statistics.median(rates[name]),
            "ratio_vs_ddp": statistics.median(z / d for z, d in zip(rates[name], rates["ddp"])),
        }
        for name in VARIANTS
    ]
    record(
        "zero3_knobs",
        {
            "model_config": args.model_config,
            "processes": 2,
            "micro_batch_size": args.batch,
            "seq_len": args.seq_len,
            "rounds": args.rounds,
            "ddp_tokens_per_s": rates["ddp"],
            "variants": table,
            "best": max(table, key=lambda row: row["ratio_vs_ddp"])["variant"],
            "best_ratio_vs_ddp": max(row["ratio_vs_ddp"] for row in table),
            "target": 0.85,
        },
    )


if __name__ == "__main__":
    main()
