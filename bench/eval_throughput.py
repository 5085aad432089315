"""eval.py's scoring rate against a bare `torch.no_grad()` forward loop over the same windows.

    python bench/eval_throughput.py [--model_config small] [--max_length 256]

A randomly initialised model of the preset (speed does not depend on the weights), the same windows (made by
lmloss.make_windows, as eval.py makes them, over the WikiText-2 test pages when the local copy is present, else the
python-docs held-out text), the same batches. eval.py's side is lmloss.score_windows (forward, masked NLL sums); the
bare side is the forward pass alone.
Target: at least 0.9 of the bare loop.
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from common import REPO, prepare_docs, record

from deepseek_zero3.model import lmloss, models
from deepseek_zero3.prepare import documents
from deepseek_zero3.training_data import token_data


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model_config", default="small")
    ap.add_argument("--max_length", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--max_documents", type=int, default=8)
    args = ap.parse_args()
    wikitext = Path(os.environ.get("WIKITEXT2_DIR", REPO.parent / "shared" / "data" / "wikitext-2")) / "wiki.test.raw"
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_docs(tmp)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        meta = token_data.read_meta(data)
        tok = AutoTokenizer.from_pretrained(data / "tokenizer")
        mc = models.load_model_config(args.model_config, "", args.max_length, meta)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(mc, attn_implementation="sdpa", dtype=torch.float32).eval()
        source = wikitext if wikitext.is_file() else data / "validation.jsonl"
        texts = (
            documents.harness_wikitext_pages(wikitext.read_text(encoding="utf-8"))
            if wikitext.is_file()
            else list(documents.jsonl_documents(source, "text", documents.SourceStats()))
        )[: args.max_documents]
        windows = lmloss.make_windows(texts, tok, tok.eos_token_id, args.max_length, args.max_length)
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
        batches = []
        for b in range(0, len(order), args.batch_size):
            chunk = [windows[i] for i in order[b : b + args.batch_size]]
            width = len(chunk[0][0])
            batches.append(torch.tensor([w[0] + [0] * (width - len(w[0])) for w in chunk]))
        n_tokens = sum(sum(t != -100 for t in w[1]) for w in windows)
        bare, ours = [], []
        for _ in range(3):  # interleaved repeats; the best of each side
            t0 = time.perf_counter()
            with torch.no_grad():
                for x in batches:
                    model(input_ids=x, use_cache=False)
            bare.append(n_tokens / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            lmloss.score_windows(model, windows, args.batch_size, torch.device("cpu"), tok.eos_token_id, progress=False)
            ours.append(n_tokens / (time.perf_counter() - t0))
    record(
        "eval_throughput",
        {
            "model_config": args.model_config,
            "source": Path(source).name,
            "documents": len(texts),
            "windows": len(windows),
            "tokens": n_tokens,
            "bare_forward_tokens_per_s": max(bare),
            "eval_py_tokens_per_s": max(ours),
            "ratio": max(ours) / max(bare),
            "target": 0.9,
        },
    )


if __name__ == "__main__":
    main()
