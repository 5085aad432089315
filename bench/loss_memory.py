"""Peak memory and speed of the loss at DeepSeek's vocabulary (102,400): chunked (the default) against the full logits.

    python bench/loss_memory.py [--chunks 2048] [--rounds 2] [--steps 8]

As a user runs it: a word-level tokenizer of exactly 102,400 entries (the words of a synthetic web-like corpus, by
frequency, then unused filler words) saved as a tokenizer directory, `prepare_data.py --tokenizer DIR` (uint32 token
files), then `train.py` on one CPU process under accelerate_configs/zero3_cpu.yaml (ZeRO-3, fp32), `tiny` preset, seq
512 x micro-batch 8 (4,096 tokens per micro-step), step-0 validation on as by default. For each loss path
(`--loss_chunk_tokens` N for each of --chunks, and 0 = the full logits): the peak RSS of the training process
(train.py's peak_mem_gib, ru_maxrss) and its extra over the same path at seq 32 (the model, optimizer and runtime
without the long sequence), and tokens/s of the steps after the first log interval. The 512 runs go in rounds
(chunked, full, chunked, full, ...) so that both see the same machine; each round's ratio is reported. Target
(issue #25): chunked extra <= 0.3x full's, tokens/s >= 0.95x full's; the first losses equal to 1e-5. The planner's
count of the same extra (costs.memory_plan at seq 512 minus seq 32, per path) is recorded beside each measurement.
"""

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

from common import free_port, record, sh, synthetic_web_documents, train_py_rate

VOCAB = 102_400
SPECIALS = ["[UNK]", "</s>"]


def word_level_tokenizer(texts: list[str], out: Path) -> None:
    """A word-level tokenizer of exactly VOCAB entries: specials, the corpus's words by frequency, then fillers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    split = pre_tokenizers.Whitespace()
    counts = Counter(w for t in texts for w, _ in split.pre_tokenize_str(t))
    words = SPECIALS + [w for w, _ in counts.most_common(VOCAB - len(SPECIALS))]
    words += [f"<unused{i}>" for i in range(VOCAB - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = split, decoders.WordPiece(prefix="")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>")
    assert len(fast) == VOCAB
    fast.save_pretrained(out)


def run(data: Path, out: Path, seq_len: int, chunk: int, steps: int) -> dict:
    launcher = ["accelerate", "launch", "--config_file", "accelerate_configs/zero3_cpu.yaml", "--num_processes", "1",
                "--main_process_port", str(free_port())]  # fmt: skip
    rate = train_py_rate(launcher, data, out, "tiny", seq_len, 8, steps, 1, extra=["--loss_chunk_tokens", str(chunk)])
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "peak_rss_gib": max(r.get("peak_mem_gib", 0) for r in lines),
        "tokens_per_s": rate["tokens_per_s"],
        "first_loss": next(r["loss"] for r in lines if "loss" in r),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", default="", help="comma-separated --loss_chunk_tokens values (default: train.py's)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    from deepseek_zero3 import distributed
    from deepseek_zero3.model import lmloss, models
    from deepseek_zero3.planning import costs

    chunks = [int(c) for c in args.chunks.split(",")] if args.chunks else [lmloss.DEFAULT_CHUNK_TOKENS]
    paths = chunks + [0]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        texts = list(synthetic_web_documents(3_000_000))
        corpus = tmp / "corpus.jsonl"
        corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        word_level_tokenizer(texts, tmp / "tokenizer")
        data = tmp / "data"
        sh(["python", "prepare_data.py", "--dataset", str(corpus), "--tokenizer", str(tmp / "tokenizer"),
            "--output_dir", str(data), "--num_proc", "1"])  # fmt: skip
        meta = json.loads((data / "meta.json").read_text())
        baseline = {c: run(data, tmp / f"short-{c}", 32, c, args.steps) for c in paths}
        rounds = [{c: run(data, tmp / f"long-{c}-{i}", 512, c, args.steps) for c in paths} for i in range(args.rounds)]
    full_extra = rounds[0][0]["peak_rss_gib"] - baseline[0]["peak_rss_gib"]
    mc = models.load_model_config("tiny", "", 512, meta)

    one = distributed.Launch(1, 1, "fp32", 1, "none", False, False, 3)  # the runs: one process, ZeRO-3, fp32

    def predicted_extra_gib(chunk: int) -> float:  # the planner's count: activations and loss, seq 512 over seq 32
        at = [costs.memory_plan(mc, one, 8, s, False, "sdpa", chunk)["gpu_total"] for s in (512, 32)]
        return (at[0] - at[1]) / 2**30

    results = {}
    for c in paths:
        extra = rounds[0][c]["peak_rss_gib"] - baseline[c]["peak_rss_gib"]
        results["full" if c == 0 else f"chunk_{c}"] = {
            "peak_rss_gib_seq512": rounds[0][c]["peak_rss_gib"],
            "peak_rss_gib_seq32": baseline[c]["peak_rss_gib"],
            "extra_gib": extra,
            "extra_over_full_extra": extra / full_extra,
            "planner_extra_gib": predicted_extra_gib(c),
            "planner_over_measured": predicted_extra_gib(c) / extra,
            "tokens_per_s": [r[c]["tokens_per_s"] for r in rounds],
            "tokens_per_s_over_full": [r[c]["tokens_per_s"] / r[0]["tokens_per_s"] for r in rounds],
            "first_loss_rel_diff_vs_full": abs(rounds[0][c]["first_loss"] - rounds[0][0]["first_loss"])
            / rounds[0][0]["first_loss"],
        }
    main_chunk = results[f"chunk_{chunks[0]}"]
    record(
        "loss_memory",
        {
            "vocab_size": meta["vocab_size"],
            "token_dtype": meta["dtype"],
            "model_config": "tiny",
            "seq_len_x_micro_batch": "512 x 8 (baseline 32 x 8)",
            "launch": "1 CPU process, accelerate_configs/zero3_cpu.yaml (ZeRO-3, fp32)",
            "paths": results,
            "ratio_extra_chunked_over_full": main_chunk["extra_over_full_extra"],
            "ratio_tokens_per_s_chunked_over_full": min(main_chunk["tokens_per_s_over_full"]),
            "target": "extra <= 0.3x full's; tokens/s >= 0.95x full's (worst round); first losses equal to 1e-5",
        },
    )


if __name__ == "__main__":
    main()
