"""eval.py against lm-evaluation-harness on WikiText-2 test: whole-process wall time, same model, pages and dtype.

    python bench/eval_vs_harness.py [--model_config mini] [--harness_batch_sizes 4 8 16] [--rounds 2]

The model is the quickstart's shape (the `mini` preset with a 4096-token BPE trained on python-docs), randomly
initialised: speed does not depend on the weights. Both sides score the 62 pages of the local wiki.test.raw in fp32
on this machine's CPU: eval.py with its defaults, the harness through a task YAML that reads the pages from a local
JSONL with the harness's own detokenizer and process_results (the Hub is out of reach). The harness runs at each
--harness_batch_sizes in the first round and at its fastest in the next --rounds - 1, alternating with eval.py; the
fastest run of each side counts. Both report the same word perplexity (checked here to 1e-6).
Target: eval.py at least 1.2x faster than the harness at its best batch size.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, harness_command, prepare_docs, read_harness_results, record, sh, write_harness_wikitext_task

from deepseek_zero3.prepare import documents
from deepseek_zero3.training_data import token_data


def timed(cmd: list[str], env: dict | None = None) -> float:
    t0 = time.perf_counter()
    sh(cmd, env=env)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model_config", default="mini")
    ap.add_argument("--harness_batch_sizes", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    raw = Path(os.environ.get("WIKITEXT2_DIR", REPO.parent / "shared" / "data" / "wikitext-2")) / "wiki.test.raw"
    if not raw.is_file():
        raise SystemExit(f"{raw} not found: this benchmark needs a local WikiText-2 test file (set WIKITEXT2_DIR)")
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = make_model(prepare_docs(str(tmp), vocab=4096), args.model_config, tmp / "model")
        task = tmp / "task"
        name = write_harness_wikitext_task(documents.harness_wikitext_pages(raw.read_text(encoding="utf-8")), task)
        eval_cmd = [sys.executable, "eval.py", "--model", str(model_dir), "--dataset", str(raw), "--dtype", "float32",
                    "--output_json", str(tmp / "eval.json")]  # fmt: skip
        eval_s, harness_s, harness = [], {}, {}
        for r in range(args.rounds):  # alternated, so the machine's drift reaches both sides
            eval_s.append(timed(eval_cmd))
            sizes = args.harness_batch_sizes if r == 0 else [min(harness_s, key=lambda bs: min(harness_s[bs]))]
            for bs in sizes:
                out = tmp / f"harness{bs}-round{r}"
                harness_s.setdefault(bs, []).append(timed(harness_command(model_dir, task, name, bs, out), offline))
                harness[bs] = read_harness_results(out, name)["word_perplexity"]
        ours = json.loads((tmp / "eval.json").read_text())
    best = min(harness_s, key=lambda bs: min(harness_s[bs]))
    for bs, ppl in harness.items():
        if abs(ppl - ours["word_perplexity"]) > 1e-6 * ppl:
            raise SystemExit(
                f"harness at batch size {bs} gives word perplexity {ppl}, eval.py {ours['word_perplexity']}"
            )
    record("eval_vs_harness", {
        "model_config": args.model_config, "pages": ours["documents"], "tokens": ours["tokens"], "dtype": "float32",
        "eval_py_s_rounds": eval_s, "harness_s_by_batch_size": harness_s, "harness_best_batch_size": best,
        "word_perplexity": ours["word_perplexity"],
        "ratio_harness_best_s_over_eval_py_s": min(harness_s[best]) / min(eval_s), "target": 1.2,
    })  # fmt: skip


def make_model(data: Path, model_config: str, out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    meta = token_data.read_meta(data)
    preset = json.loads((REPO / "model_configs" / f"{model_config}.json").read_text())
    config = AutoConfig.for_model(
        preset.pop("model_type"),
        **{
            **preset,
            "vocab_size": -(-meta["vocab_size"] // 64) * 64,
            "bos_token_id": meta["eos_id"],
            "eos_token_id": meta["eos_id"],
        },
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(data / "tokenizer").save_pretrained(out)
    return out


if __name__ == "__main__":
    main()
