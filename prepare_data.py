"""Tokenize corpora once and cache them as packed token files that train.py memory-maps.

    # offline: the built-in corpus (this Python's own documentation) with a freshly trained byte-level BPE
    python prepare_data.py --dataset python-docs --tokenizer bpe:8192 --output_dir data/python-docs

    # a local WikiText copy (wiki.train.* / wiki.valid.* / wiki.test.*), files, directories or globs
    python prepare_data.py --dataset path/to/wikitext-2 --tokenizer bpe:8192 --output_dir data/wt2

    # the real thing (online): WikiText-103 + OpenWebText with the DeepSeek tokenizer (vocab 102400 -> uint32)
    python prepare_data.py --dataset wikitext-103 --dataset openwebtext \
        --tokenizer deepseek-ai/deepseek-llm-7b-base --output_dir data/wt103-owt --num_proc 16

Output (DIR): train.bin / validation.bin / test.bin (flat token ids, EOS after every document), tokenizer/,
meta.json, and validation.jsonl / test.jsonl (the held-out documents' text, for eval.py). The directory appears only when complete; an identical second run returns at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

import lmdata
from lmdata import DataError

BPE_EOS = "<|endoftext|>"


@dataclasses.dataclass
class Config:
    dataset: list[str] = dataclasses.field(
        default_factory=list,
        metadata={"action": "extend", "help": "source, repeatable: wikitext-103 | wikitext-2 | openwebtext | python-docs | a file, directory or glob of .txt/.raw/.tokens/.jsonl/.parquet"},
    )
    tokenizer: str = dataclasses.field(default="bpe:8192", metadata={"help": "Hub id or local directory (AutoTokenizer), or bpe:VOCAB to train a byte-level BPE on the training split"})
    output_dir: str = dataclasses.field(default="data/python-docs", metadata={"help": "where the token files, tokenizer/ and meta.json go"})
    text_field: str = dataclasses.field(default="text", metadata={"help": "field holding the text in .jsonl records and .parquet files"})
    validation_fraction: float = dataclasses.field(default=0.02, metadata={"help": "share of documents held out as the validation split for sources that have none"})
    num_proc: int = dataclasses.field(default=max(1, os.cpu_count() or 1), metadata={"help": "tokenizer processes (datasets map); splits under 32 MB of text per process use one process and the tokenizer's threads"})
    overwrite: bool = dataclasses.field(default=False, metadata={"help": "rebuild even if --output_dir is up to date or was built from other inputs"})


# ---------------------------------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------------------------------


def parse_bpe_spec(spec: str) -> int | None:
    """Vocabulary size of a `bpe:VOCAB` tokenizer spec, None for any other spec."""
    if not spec.startswith("bpe:"):
        return None
    value = spec[4:]
    if not value.isdigit() or not 257 <= int(value) <= 1 << 20:
        raise DataError(f"--tokenizer {spec!r}: bpe: takes a vocabulary size between 257 and {1 << 20}, e.g. bpe:8192")
    return int(value)


def fingerprint(cfg: Config, sources: list[dict], tokenizer_id: dict) -> str:
    """Hash of every input that changes the output: same fingerprint -> the prepared directory is up to date."""
    inputs = {
        "format_version": lmdata.FORMAT_VERSION,
        "sources": sources,
        "tokenizer": tokenizer_id,
        "text_field": cfg.text_field,
        "validation_fraction": cfg.validation_fraction,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def tokenizer_identity(spec: str) -> dict:
    path = Path(spec).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file())
        return {"spec": spec, "sha256": lmdata.sha256_files(files)}
    return {"spec": spec}


def encode_batch(batch: dict, tokenizer, eos_id: int) -> dict:
    """datasets.map body: token ids of each document followed by EOS, and the document's UTF-8 byte count."""
    texts = batch["text"]
    if tokenizer.is_fast:
        ids = [enc.ids for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
    else:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return {"input_ids": [x + [eos_id] for x in ids], "n_bytes": [len(t.encode("utf-8")) for t in texts]}


# ---------------------------------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------------------------------


def validate(cfg: Config) -> None:
    """Everything that can be checked before reading any corpus."""
    if not cfg.dataset:
        raise DataError("no --dataset given; e.g. --dataset python-docs (offline) or --dataset path/to/texts")
    if not 0 < cfg.validation_fraction < 0.5:
        raise DataError(f"--validation_fraction {cfg.validation_fraction} must be between 0 and 0.5 (exclusive)")
    if cfg.num_proc < 1:
        raise DataError(f"--num_proc {cfg.num_proc} must be at least 1")
    parse_bpe_spec(cfg.tokenizer)
    for spec in cfg.dataset:
        if spec not in lmdata.HUB_PRESETS and spec not in lmdata.BUILTIN_SOURCES:
            lmdata.resolve_local_files(spec)


def load_corpus(cfg: Config, identities: list[dict]) -> tuple[dict, list[dict]]:
    """Documents per split over all sources (each source's own splits, or a held-out slice of its training split)."""
    splits: dict[str, list] = {}
    records = []
    for spec, identity in zip(cfg.dataset, identities):
        by_split, record = lmdata.load_source(spec, cfg.text_field, identity=identity)
        by_split = {name: [d for d in docs if d.strip()] if isinstance(docs, list) else docs for name, docs in by_split.items()}
        if not by_split.get("train"):
            raise DataError(f"--dataset {spec!r} has no training documents (empty corpus); point it at text")
        for name, docs in by_split.items():
            if len(docs) == 0:
                raise DataError(f"--dataset {spec!r}: the {name} split is empty; give it text or remove it")
        if "validation" not in by_split:
            by_split["train"], by_split["validation"] = lmdata.split_held_out(by_split["train"], cfg.validation_fraction)
        for name, docs in by_split.items():
            if len(docs):
                splits.setdefault(name, []).append(docs)
        record["documents"] = {name: len(docs) for name, docs in by_split.items()}
        if record["replaced_bytes"]:
            print(f"warning: {spec}: {record['replaced_bytes']} undecodable bytes were replaced by U+FFFD", file=sys.stderr)
        records.append(record)
    if "validation" not in splits:
        raise DataError("no validation documents: each source has a single document; add documents or a source with a validation split")
    return splits, records


def as_dataset(parts: list):
    import datasets

    pieces = [p if isinstance(p, datasets.Dataset) else datasets.Dataset.from_dict({"text": p}) for p in parts]
    return pieces[0] if len(pieces) == 1 else datasets.concatenate_datasets(pieces)


def load_tokenizer(spec: str, train_docs):
    """An AutoTokenizer from the Hub / a directory, or a byte-level BPE trained here on the training documents."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = parse_bpe_spec(spec)
    if vocab is None:
        if not Path(spec).expanduser().is_dir():
            reason = lmdata.hub_unreachable_reason()
            if reason:
                raise DataError(f"--tokenizer {spec}: not a local directory and {reason}; pass a downloaded tokenizer directory or bpe:VOCAB")
        try:
            tok = AutoTokenizer.from_pretrained(spec)
        except (OSError, ValueError) as e:
            raise DataError(f"--tokenizer {spec}: cannot be loaded with AutoTokenizer ({str(e).splitlines()[0]})") from None
        if tok.eos_token_id is None:
            raise DataError(f"--tokenizer {spec} has no EOS token; documents must be separated by one")
        return tok
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[BPE_EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True
    )
    # Hub corpora stay Arrow-backed: stream their text in batches instead of materialising a 40 GB column.
    texts = (t for part in train_docs for t in (part if isinstance(part, list) else
                                                 (x for batch in part.iter(batch_size=1000) for x in batch["text"])))
    bpe.train_from_iterator(texts, trainer=trainer, length=sum(len(p) for p in train_docs))
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=BPE_EOS, bos_token=BPE_EOS, clean_up_tokenization_spaces=False, model_max_length=1 << 30
    )


def tokenize_split(docs, tokenizer, dtype: np.dtype, out_path: Path, num_proc: int) -> dict:
    """Tokenize one split with datasets.map and append its ids to out_path. Returns the split's counts."""
    if tokenizer.is_fast:
        tokenizer.backend_tokenizer.no_truncation()
        tokenizer.backend_tokenizer.no_padding()
    # A worker process costs ~0.3 s to start and to receive the tokenizer; below ~32 MB of text per process the
    # tokenizer's own threads (one process, TOKENIZERS_PARALLELISM on) are faster. datasets turns those threads off
    # in forked workers.
    num_proc = min(num_proc, max(1, docs.data.nbytes // (32 << 20)))
    mapped = docs.map(
        encode_batch,
        fn_kwargs={"tokenizer": tokenizer, "eos_id": tokenizer.eos_token_id},
        batched=True,
        batch_size=1000,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=docs.column_names,
        desc=f"tokenizing {out_path.stem}",
    )
    n_tokens = 0
    with open(out_path, "wb") as f:
        for chunk in mapped.data.column("input_ids").chunks:
            ids = np.asarray(chunk.flatten())
            if ids.size and int(ids.max()) > np.iinfo(dtype).max:
                raise DataError(f"token id {int(ids.max())} does not fit {dtype.name}; the tokenizer's vocabulary is larger than it says")
            ids.astype(dtype).tofile(f)
            n_tokens += ids.size
        f.flush()
        os.fsync(f.fileno())
    return {"tokens": n_tokens, "documents": len(mapped), "bytes": int(np.sum(mapped.data.column("n_bytes")))}


def prepare(cfg: Config, argv: list[str]) -> Path:
    out_dir = Path(cfg.output_dir).expanduser().resolve()
    validate(cfg)
    sources = [lmdata.source_identity(spec) for spec in cfg.dataset]
    tok_id = tokenizer_identity(cfg.tokenizer)
    fp = fingerprint(cfg, sources, tok_id)

    if out_dir.exists():
        if (out_dir / "meta.json").is_file():
            try:
                meta = lmdata.read_meta(out_dir)
                for split in meta["splits"]:
                    lmdata.load_split(out_dir, split, meta)
                up_to_date = meta.get("fingerprint") == fp
            except DataError:
                up_to_date = False
            if up_to_date and not cfg.overwrite:
                print(f"{out_dir} is up to date (same sources, tokenizer and settings); nothing to do (--overwrite rebuilds)")
                return out_dir
            if not cfg.overwrite:
                raise DataError(f"{out_dir} holds data prepared from other inputs; pass --overwrite to rebuild it or choose another --output_dir")
        elif any(out_dir.iterdir()):
            raise DataError(f"{out_dir} exists and is not a prepared data directory; choose another --output_dir")

    t0 = time.perf_counter()
    splits, records = load_corpus(cfg, sources)
    print(f"loaded {', '.join(f'{name}: {sum(len(p) for p in parts)} documents' for name, parts in splits.items())} "
          f"from {len(records)} source(s) in {time.perf_counter() - t0:.1f}s")

    tmp_dir = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp_dir.mkdir()
        tokenizer = load_tokenizer(cfg.tokenizer, splits["train"])
        tokenizer.save_pretrained(tmp_dir / "tokenizer")
        vocab_size = len(tokenizer)
        dtype = lmdata.token_dtype(vocab_size)
        t1 = time.perf_counter()
        split_meta = {}
        for name in lmdata.SPLITS:
            if name in splits:
                docs = as_dataset(splits[name])
                split_meta[name] = tokenize_split(docs, tokenizer, dtype, lmdata.split_file(tmp_dir, name), cfg.num_proc)
                if name != "train":  # eval.py scores held-out text by document, so it keeps its original text
                    docs.to_json(tmp_dir / f"{name}.jsonl", lines=True, force_ascii=False)
        tok_s = time.perf_counter() - t1
        meta = {
            "format_version": lmdata.FORMAT_VERSION,
            "dtype": dtype.name,
            "vocab_size": vocab_size,
            "eos_id": tokenizer.eos_token_id,
            "tokenizer": cfg.tokenizer,
            "splits": split_meta,
            "sources": records,
            "fingerprint": fp,
            "command": ["prepare_data.py", *argv],
        }
        (tmp_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if out_dir.exists():
            old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
            out_dir.rename(old)
            tmp_dir.rename(out_dir)
            shutil.rmtree(old)
        else:
            tmp_dir.rename(out_dir)
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir)

    total = sum(s["tokens"] for s in split_meta.values())
    for name, s in split_meta.items():
        print(f"  {name:<10} {s['documents']:>9,} docs {s['tokens']:>13,} tokens {s['bytes']:>14,} bytes "
              f"({s['bytes'] / max(1, s['tokens'] - s['documents']):.2f} bytes/token)")
    print(f"wrote {out_dir} ({dtype.name}, vocab {vocab_size}): {total:,} tokens, tokenized at {total / tok_s:,.0f} tokens/s, "
          f"{time.perf_counter() - t0:.1f}s in all")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    from transformers import HfArgumentParser

    argv = sys.argv[1:] if argv is None else argv
    (cfg,) = HfArgumentParser(Config, description=__doc__.split("\n\n")[0]).parse_args_into_dataclasses(argv)
    try:
        prepare(cfg, argv)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
