"""prepare_data.py's tokenization rate against the raw `tokenizers` batch-encode rate, same text, same processes.

    python bench/prepare_vs_tokenizer.py [--dataset python-docs] [--repeats 3]
    python bench/prepare_vs_tokenizer.py --dataset ../shared/data/wikitext-2 --name prepare_vs_tokenizer_wikitext2

Both sides encode every document of the corpus with the same trained BPE (8,192 tokens) on all cores.
prepare_data.py runs as a user runs it, with that tokenizer's directory and its default --num_proc (for these
corpora, under 32 MB a core: its own process, with the tokenizer's threads), and reports its own rate ("tokenized
at N tokens/s": reading, encoding, EOS, writing); the raw side is `encode_batch_fast` in one process with the
tokenizer's threads. bench/prepare_scale.py compares several processes on each side.
Target: at least 0.7 of the raw rate.
"""

import argparse
import re
import sys
import tempfile
from pathlib import Path

from common import raw_tokenizer_rate, record, sh

from deepseek_zero3.prepare import corpora
from deepseek_zero3.training_data import token_data


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="python-docs")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="prepare_vs_tokenizer", help="result name (one per corpus)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        first = Path(tmp) / "first"
        sh(
            [
                sys.executable,
                "prepare_data.py",
                "--dataset",
                args.dataset,
                "--tokenizer",
                "bpe:8192",
                "--output_dir",
                str(first),
            ]
        )
        tokenizer = Path(tmp) / "tokenizer"
        (first / "tokenizer").rename(tokenizer)
        source = corpora.open_source(args.dataset)
        docs = [text for text, _ in corpora.routed_documents(source, corpora.VALIDATION_FRACTION)]
        raw, ours = [], []
        for i in range(args.repeats):  # interleaved, so drift on a noisy machine hits both sides alike
            rate, n_raw = raw_tokenizer_rate(tokenizer / "tokenizer.json", docs, 1)
            raw.append(rate)
            proc = sh(
                [
                    sys.executable,
                    "prepare_data.py",
                    "--dataset",
                    args.dataset,
                    "--tokenizer",
                    str(tokenizer),
                    "--output_dir",
                    str(Path(tmp) / f"run{i}"),
                ]
            )
            ours.append(float(re.search(r"tokenized at ([\d,]+) tokens/s", proc.stdout).group(1).replace(",", "")))
        tokens = sum(s["tokens"] for s in token_data.read_meta(Path(tmp) / "run0")["splits"].values())
        assert tokens == n_raw + len(docs), (tokens, n_raw, len(docs))
    best_raw, best_ours = max(raw), max(ours)
    record(
        args.name,
        {
            "dataset": args.dataset,
            "documents": len(docs),
            "bytes": sum(len(d.encode()) for d in docs),
            "tokens": n_raw,
            "raw_tokens_per_s": best_raw,
            "prepare_tokens_per_s": best_ours,
            "ratio": best_ours / best_raw,
            "target": 0.7,
        },
    )


if __name__ == "__main__":
    main()
