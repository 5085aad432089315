"""What document masking costs on the CPU: train.py with it (the default) and with --no_document_masking.

    python bench/document_masking.py [--model_config mini] [--seq_len 512] [--steps 24] [--rounds 2]

3 CPU processes under accelerate_configs/zero3_cpu.yaml (DeepSpeed ZeRO-3, fp32), python-docs with a BPE of 8192,
micro-batch 4, the two settings alternated for --rounds rounds; steady-state tokens/s skips the first log interval.
With masking, the kernel `--attn_implementation auto` takes (on a CPU varlen_sdpa: SDPA's causal kernel on each
document; before it, a dense block-causal mask that took SDPA off its `is_causal` fast path); without, SDPA runs plain
causal attention. Also recorded: the share of training windows that
hold more than one document (where the mask changes anything).
"""

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np
from common import free_port, prepare_docs, record, train_py_rate


def windows_with_several_documents(data: Path, seq_len: int) -> float:
    from deepseek_zero3.training_data import token_data

    meta = token_data.read_meta(data)
    tokens = np.asarray(token_data.load_split(data, "train", meta))
    n = token_data.num_windows(len(tokens), seq_len)
    inputs = tokens[: n * seq_len].reshape(n, seq_len)  # each window's inputs (its last target aside)
    return float((inputs[:, :-1] == meta["eos_id"]).any(axis=1).mean())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model_config", default="mini")
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    settings = {"masked": [], "unmasked": ["--no_document_masking"]}
    rates = {name: [] for name in settings}
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_docs(tmp)
        several = windows_with_several_documents(data, args.seq_len)
        for r in range(args.rounds):
            for name, extra in settings.items():
                launcher = ["accelerate", "launch", "--config_file", "accelerate_configs/zero3_cpu.yaml",
                            "--num_processes", "3", "--main_process_port", str(free_port())]  # fmt: skip
                out = Path(tmp) / f"{name}{r}"
                run = train_py_rate(launcher, data, out, args.model_config, args.seq_len, 4, args.steps, 3, extra=extra)
                rates[name].append(run["tokens_per_s"])
                print(f"round {r} {name}: {run['tokens_per_s']:,.0f} tokens/s")
    ratios = [m / u for m, u in zip(rates["masked"], rates["unmasked"])]
    record(
        "document_masking",
        {
            "model_config": args.model_config,
            "seq_len": args.seq_len,
            "processes": 3,
            "windows_with_several_documents": several,
            "tokens_per_s_masked": [round(x) for x in rates["masked"]],
            "tokens_per_s_unmasked": [round(x) for x in rates["unmasked"]],
            "ratio_masked_over_unmasked_per_round": ratios,
            "ratio_masked_over_unmasked": statistics.median(ratios),
        },
    )


if __name__ == "__main__":
    main()
