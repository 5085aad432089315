"""prepare_data.py at scale: peak memory and temporary disk at two corpus sizes, and its tokens/s against the raw
`tokenizers` batch encode on the same number of processes; and peak memory for one long document at two sizes.

    python bench/prepare_scale.py [--sizes_mb 200 1000] [--num_proc 2] [--long_doc_mb 200] [--rows all]

The corpus is synthetic web-like text (common.py's synthetic_web_documents: Zipf-distributed words, varied lengths,
Unicode) written as .jsonl; the tokenizer a byte-level BPE of 8,192 tokens trained on 20 MB of the same kind of text.
prepare_data.py runs as a user runs it; this script samples the summed RSS of its process tree (main process and
tokenizer processes) and the bytes in its partial and output directories every 0.1 s.
Targets: peak RSS at the larger size at most 1.25x the smaller and under 2 GiB; temporary disk beyond the output at
most 10% of it; tokens/s at least 0.8 of the raw rate.
The long-document row (recorded as prepare_long_document) is one .txt file of --long_doc_mb MB and one of 5x that, each
a single document (--doc_separator file, the default); target: the larger one's peak RSS at most 1.25x the smaller's
(whole-document tokenization took ~100-180x the document's size).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from common import REPO, raw_tokenizer_rate, record, sh, synthetic_web_documents

from deepseek_zero3.training_data import token_data


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def dir_bytes(*dirs: Path) -> int:
    total = 0
    for d in dirs:
        for root, _, files in os.walk(d):
            for f in files:
                try:
                    total += os.stat(os.path.join(root, f)).st_size
                except FileNotFoundError:
                    pass
    return total


def write_corpus(path: Path, n_bytes: int) -> int:
    docs = 0
    with open(path, "w", encoding="utf-8") as f:
        for doc in synthetic_web_documents(n_bytes, seed=0):
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
            docs += 1
    return docs


def run_prepare(corpus: Path, tokenizer: Path, out: Path, num_proc: int, cache: Path) -> dict:
    cmd = [
        sys.executable,
        "prepare_data.py",
        "--dataset",
        str(corpus),
        "--tokenizer",
        str(tokenizer),
        "--output_dir",
        str(out),
        "--num_proc",
        str(num_proc),
    ]
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_HOME": str(cache)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ps, peak_rss, peak_disk = psutil.Process(proc.pid), 0, 0
    partial = out.parent / f".{out.name}.partial"
    while proc.poll() is None:
        peak_rss = max(peak_rss, tree_rss(ps))
        peak_disk = max(peak_disk, dir_bytes(partial, out))
        time.sleep(0.1)
    stdout = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{stdout[-3000:]}")
    line = stdout.strip().splitlines()[-1]
    rate = float(re.search(r"tokenized at ([\d,]+) tokens/s", line).group(1).replace(",", ""))
    meta = token_data.read_meta(out)
    output = dir_bytes(out)
    return {
        "tokens": sum(s["tokens"] for s in meta["splits"].values()),
        "tokens_per_s": rate,
        "peak_rss_mib": peak_rss / 2**20,
        "output_bytes": output,
        "temp_disk_bytes": max(0, peak_disk - output),
        "hf_cache_bytes": dir_bytes(cache),
        "summary": line,
    }


def write_long_document(path: Path, n_bytes: int) -> None:
    """One document of about n_bytes: web-like paragraphs in one .txt file (no WikiText titles, one document per
    file)."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(doc + "\n\n" for doc in synthetic_web_documents(n_bytes, seed=1))


def long_document_rows(tmp: Path, tokenizer: Path, mb: int, num_proc: int) -> None:
    rows = {}
    for size in (mb, 5 * mb):
        path = tmp / f"one-{size}mb.txt"
        write_long_document(path, size * 1_000_000)
        out, cache = tmp / f"long-{size}", tmp / f"cache-long-{size}"
        rows[size] = {"document_bytes": path.stat().st_size, **run_prepare(path, tokenizer, out, num_proc, cache)}
        print(json.dumps(rows[size]), flush=True)
        sh(["rm", "-rf", str(out), str(path)])
    small, large = rows[mb], rows[5 * mb]
    record(
        "prepare_long_document",
        {
            "long_doc_mb": [mb, 5 * mb],
            "num_proc": num_proc,
            "rows": {str(k): v for k, v in rows.items()},
            "ratio_peak_rss_large_over_small": large["peak_rss_mib"] / small["peak_rss_mib"],
            "peak_rss_large_mib": large["peak_rss_mib"],
        },
    )


def corpus_rows(tmp: Path, tokenizer: Path, sizes_mb: list[int], num_proc: int) -> None:
    rows = {}
    for mb in sizes_mb:
        corpus = tmp / f"web-{mb}mb.jsonl"
        docs = write_corpus(corpus, mb * 1_000_000)
        rows[mb] = {
            "corpus_bytes": corpus.stat().st_size,
            "documents": docs,
            **run_prepare(corpus, tokenizer, tmp / f"out-{mb}", num_proc, tmp / f"cache-{mb}"),
        }
        print(json.dumps(rows[mb]), flush=True)
        if mb == sizes_mb[0]:
            texts = [json.loads(line)["text"] for line in corpus.open(encoding="utf-8")]
            raw_rate, raw_tokens = raw_tokenizer_rate(tokenizer / "tokenizer.json", texts, num_proc)
            assert raw_tokens + docs == rows[mb]["tokens"], (raw_tokens, docs, rows[mb]["tokens"])
            del texts
        (tmp / f"out-{mb}").rename(tmp / "done")  # free the disk before the next size
        sh(["rm", "-rf", str(tmp / "done"), str(corpus)])
    small, large = (rows[mb] for mb in sizes_mb)
    record(
        "prepare_scale",
        {
            "sizes_mb": sizes_mb,
            "num_proc": num_proc,
            "rows": {str(k): v for k, v in rows.items()},
            "raw_tokens_per_s": raw_rate,
            "ratio_tokens_per_s": small["tokens_per_s"] / raw_rate,
            "ratio_peak_rss_large_over_small": large["peak_rss_mib"] / small["peak_rss_mib"],
            "peak_rss_large_mib": large["peak_rss_mib"],
            "temp_disk_fraction": max(r["temp_disk_bytes"] / r["output_bytes"] for r in rows.values()),
            "hf_cache_bytes": max(r["hf_cache_bytes"] for r in rows.values()),
        },
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes_mb", type=int, nargs=2, default=[200, 1000])
    ap.add_argument("--num_proc", type=int, default=2)
    ap.add_argument("--long_doc_mb", type=int, default=200, help="the smaller long document; the other is 5x")
    ap.add_argument("--rows", choices=["all", "corpus", "long_document"], default="all")
    ap.add_argument("--workdir", default=None, help="where the corpora go (default: a temporary directory)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        tmp = Path(tmp)
        write_corpus(tmp / "tok.jsonl", 20_000_000)
        sh(
            [
                sys.executable,
                "prepare_data.py",
                "--dataset",
                str(tmp / "tok.jsonl"),
                "--tokenizer",
                "bpe:8192",
                "--output_dir",
                str(tmp / "tok"),
            ]
        )
        tokenizer = tmp / "tok" / "tokenizer"
        if args.rows in ("all", "corpus"):
            corpus_rows(tmp, tokenizer, args.sizes_mb, args.num_proc)
        if args.rows in ("all", "long_document"):
            long_document_rows(tmp, tokenizer, args.long_doc_mb, args.num_proc)


if __name__ == "__main__":
    main()
