"""prepare_data.py's tokenization rate against the raw `tokenizers` batch-encode rate, same text, same cores.

    python bench/prepare_vs_tokenizer.py [--dataset python-docs] [--repeats 3]
    python bench/prepare_vs_tokenizer.py --dataset ../shared/data/wikitext-2 --name prepare_vs_tokenizer_wikitext2

Both sides encode the same training documents with the same trained BPE; prepare_data's side is its real
tokenize_split (datasets.map over --num_proc processes, EOS appended, packed and written to disk).
Target: at least 0.7 of the raw rate.
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

from common import record, sh

import lmdata
import prepare_data


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="python-docs")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num_proc", type=int, default=os.cpu_count())
    ap.add_argument("--name", default="prepare_vs_tokenizer", help="result name (one per corpus)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        sh(["python", "prepare_data.py", "--dataset", args.dataset, "--tokenizer", "bpe:8192", "--output_dir", str(data)])
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(data / "tokenizer")
        by_split, _ = lmdata.load_source(args.dataset)
        docs = [d for d in by_split["train"] if d.strip()]
        n_bytes = sum(len(d.encode()) for d in docs)
        raw, ours = [], []
        for _ in range(args.repeats):  # interleaved, so drift on a noisy machine hits both sides alike
            os.environ["TOKENIZERS_PARALLELISM"] = "true"
            t0 = time.perf_counter()
            n_raw = sum(len(e.ids) for e in tok.backend_tokenizer.encode_batch(docs, add_special_tokens=False))
            raw.append(n_raw / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            counts = prepare_data.tokenize_split(prepare_data.as_dataset([docs]), tok, lmdata.token_dtype(len(tok)), Path(tmp) / "bench.bin", args.num_proc)
            ours.append(counts["tokens"] / (time.perf_counter() - t0))
        assert counts["tokens"] == n_raw + len(docs)
    best_raw, best_ours = max(raw), max(ours)
    record(args.name, {"dataset": args.dataset, "documents": len(docs), "bytes": n_bytes, "tokens": n_raw,
                                    "raw_tokens_per_s": best_raw, "prepare_tokens_per_s": best_ours,
                                    "ratio": best_ours / best_raw, "target": 0.7})


if __name__ == "__main__":
    main()
