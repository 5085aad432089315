"""Tokenize corpora once and cache them as packed token files that train.py memory-maps.

    # offline: the built-in corpus (this Python's own documentation) with a freshly trained byte-level BPE
    python prepare_data.py --dataset python-docs --tokenizer bpe:8192 --output_dir data/python-docs

    # a local WikiText copy (wiki.train.* / wiki.valid.* / wiki.test.*), files, directories or globs
    python prepare_data.py --dataset path/to/wikitext-2 --tokenizer bpe:8192 --output_dir data/wt2

    # one big text file with blank lines between documents
    python prepare_data.py --dataset owt_sample.txt --doc_separator blank_line --tokenizer bpe:4096 \
        --output_dir data/owt

    # the real thing (online): WikiText-103 + OpenWebText with the DeepSeek tokenizer (vocab 102400 -> uint32)
    python prepare_data.py --dataset wikitext-103 --dataset openwebtext \
        --tokenizer deepseek-ai/deepseek-llm-7b-base --output_dir data/wt103-owt --num_proc 16

Documents stream from the sources through --num_proc tokenizer processes into the token files in bounded batches, long
documents in pieces cut where the tokenizer cannot join them (the same token ids as whole): memory stays flat whatever
the corpus or document size, and the output is the same bytes for any --num_proc. Sources without a validation split
hold out the documents whose text hashes below --validation_fraction. A directory or glob source never reads
prepare_data.py's own output or work directories (nor --output_dir), wherever they lie in it.

Output (DIR): train.bin / validation.bin / test.bin (flat token ids, EOS after every document), tokenizer/,
meta.json, and validation.jsonl / test.jsonl (the held-out documents' text, for eval.py). The work happens in
.DIR.partial, checkpointed every --checkpoint_mb of text: run a killed command again and it continues from the last
checkpoint. DIR appears only when complete; an identical second run returns at once. A tokenizer process that dies
(the out-of-memory killer, kill -9) stops the run at once with exit status 3, the partial output kept for a rerun.

This script checks and decides; the work lives in the deepseek_zero3 package: reading sources (prepare/corpora.py,
prepare/documents.py), the tokenizing pass (prepare/token_writer.py) and its processes (prepare/tokenizer_pool.py), the token
format (training_data/token_data.py).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from deepseek_zero3 import cli
from deepseek_zero3.cli import UserError, field, write_json_atomic
from deepseek_zero3.prepare import corpora, token_writer
from deepseek_zero3.prepare.tokenizer_pool import PIECE_CHARS, PIECE_CUT, SPECIAL_TOKENS_IN_DOCUMENTS, WorkerDied
from deepseek_zero3.prepare.tokenizer_pool import document_pieces
from deepseek_zero3.training_data import token_data

BPE_EOS = "<|endoftext|>"
BPE_SAMPLE_CHARS = 1 << 30  # bpe:VOCAB trains on at most the first ~1 GB of training text
OWN_FILES = {"train.bin", "validation.bin", "test.bin", "validation.jsonl", "test.jsonl", "meta.json", "tokenizer"}
SPLIT_RULE = "blake2b-64 of the document text < fraction; single-document sources: last fraction, cut at a line end"


# fmt: off
@dataclasses.dataclass
class Config:
    dataset: list[str] = dataclasses.field(default_factory=list, metadata={
        "action": "extend", "help": "source, repeatable: wikitext-103 | wikitext-2 | openwebtext | python-docs | a "
        "file, "
                                    "directory or glob of .txt/.raw/.tokens/.jsonl/.parquet"})
    tokenizer: str = field("bpe:8192", "Hub id or local directory (AutoTokenizer), or bpe:VOCAB to train a byte-level "
                                       "BPE on (the first 1 GB of) the training split")
    output_dir: str = field("data/python-docs", "where the token files, tokenizer/ and meta.json go")
    text_field: str = field("text", "field holding the text in .jsonl records and .parquet files")
    doc_separator: str = field("file", "how a .txt/.raw file splits into documents: file (one per file; WikiText "
                                       "files into articles), blank_line, or a literal string such as '<|endoftext|>'")
    validation_fraction: float = field(corpora.VALIDATION_FRACTION, "share of documents held out as the validation "
                                                                    "split for sources that have none")
    num_proc: int = field(0, "tokenizer processes; 1: this process, with the tokenizer's own threads; 0 (default): "
                             "one per core, or 1 for corpora under 32 MB a core")
    checkpoint_mb: int = field(256, "make the partial output resumable after every this many MB of text")
    overwrite: bool = field(False, "replace --output_dir when it holds data this script prepared from other inputs, "
                                   "or damaged data (an up-to-date one is kept)")
# fmt: on


# ---------------------------------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------------------------------


def parse_bpe_spec(spec: str) -> int | None:
    """Vocabulary size of a `bpe:VOCAB` tokenizer spec, None for any other spec."""
    if not spec.startswith("bpe:"):
        return None
    value = spec[4:]
    if not value.isdigit() or not 257 <= int(value) <= 1 << 20:
        raise UserError(f"--tokenizer {spec!r}: bpe: takes a vocabulary size between 257 and {1 << 20}, e.g. bpe:8192")
    return int(value)


def fingerprint(cfg: Config, sources: list[dict], tokenizer_id: dict) -> str:
    """Hash of every input that changes the output: same fingerprint -> the prepared directory is up to date."""
    inputs = {
        "format_version": token_data.FORMAT_VERSION,
        "split_rule": SPLIT_RULE,
        "sources": sources,
        "tokenizer": tokenizer_id,
        "text_field": cfg.text_field,
        "doc_separator": cfg.doc_separator,
        "validation_fraction": cfg.validation_fraction,
        "special_tokens_in_documents": SPECIAL_TOKENS_IN_DOCUMENTS,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def tokenizer_identity(spec: str) -> dict:
    """What the tokenizer is: a local directory's file hash, or a Hub id with the commit it resolves to. Online that is
    the Hub's answer; offline (HF_HUB_OFFLINE=1, or the Hub out of reach) the commit the local cache holds for the main
    branch, which is what AutoTokenizer loads then; None when neither can tell (see recorded_identity)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file())
        return {"spec": spec, "sha256": corpora.sha256_files(files)}
    if parse_bpe_spec(spec) is not None:
        return {"spec": spec}
    from huggingface_hub import constants

    if not constants.is_offline_mode() and corpora.hub_unreachable_reason() is None:
        from huggingface_hub import HfApi

        with contextlib.suppress(Exception):  # a private repository, a rate limit, ...: the local cache may still know
            return {"spec": spec, "revision": HfApi().model_info(spec).sha}
    return {"spec": spec, "revision": cached_revision(spec)}


def cached_revision(repo_id: str) -> str | None:
    """The commit of the main branch that the local Hugging Face cache (HF_HUB_CACHE) holds a tokenizer file of."""
    from huggingface_hub import try_to_load_from_cache

    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        try:
            found = try_to_load_from_cache(repo_id, name)
        except ValueError:  # not a valid repository id: load_tokenizer says so
            return None
        if isinstance(found, str):
            return Path(found).parent.name  # .../snapshots/<commit>/<name>
    return None


def recorded_identity(tok_id: dict, out_dir: Path, tmp_dir: Path) -> dict:
    """A Hub tokenizer whose commit cannot be looked up (offline and not in this cache) is taken to be the one that the
    existing output or partial output recorded: without it an up-to-date directory would look foreign, and a
    resumable partial be wiped, only because the Hub is out of reach."""
    if tok_id.get("revision", "") is not None:
        return tok_id
    for path in (out_dir / "meta.json", tmp_dir / "progress.json"):
        try:
            recorded = json.loads(path.read_text()).get("tokenizer_identity")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(recorded, dict) and recorded.get("spec") == tok_id["spec"] and recorded.get("revision"):
            print(
                f"note: --tokenizer {tok_id['spec']}: its commit cannot be looked up here (offline, not in the local "
                f"cache); taking the one {path} records, {recorded['revision']}"
            )
            return recorded
    return tok_id


def peak_rss_mib() -> float:
    """This process's peak resident memory, MiB: VmHWM on Linux (ru_maxrss would carry over the peak of the process
    that started this one, through fork and exec), else ru_maxrss."""
    try:
        line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------------------------------


# How deep this script writes below --output_dir (and its work directory), in bytes, with room to spare: the deepest
# is tokenizer/tokenizer_config.json, 31.
OUTPUT_DEPTH = 64


def validate(cfg: Config) -> None:
    """Everything that can be checked before reading any corpus."""
    if not cfg.dataset:
        raise UserError("no --dataset given; e.g. --dataset python-docs (offline) or --dataset path/to/texts")
    if not 0 < cfg.validation_fraction < 0.5:
        raise UserError(f"--validation_fraction {cfg.validation_fraction} must be between 0 and 0.5 (exclusive)")
    if cfg.num_proc < 0:
        raise UserError(f"--num_proc {cfg.num_proc} must be 0 (one per core) or more")
    if cfg.checkpoint_mb < 1:
        raise UserError(f"--checkpoint_mb {cfg.checkpoint_mb} must be at least 1")
    if not cfg.doc_separator:
        raise UserError("--doc_separator is empty; use file, blank_line or a literal string such as '<|endoftext|>'")
    # Names the filesystem or the tokenizer cannot take, refused before the checks below trip on them (Python 3.11's
    # Path.exists raises on a name past the filesystem's limit) and before anything is written.
    cli.check_path("--output_dir", cfg.output_dir, OUTPUT_DEPTH, beside=".{}.partial")
    for spec in cfg.dataset:
        if spec not in corpora.HUB_PRESETS and spec not in corpora.BUILTIN_SOURCES:
            cli.check_path("--dataset", spec)
    if parse_bpe_spec(cfg.tokenizer) is None:
        cli.check_path("--tokenizer", cfg.tokenizer)
    out_dir = Path(cfg.output_dir).expanduser().resolve()
    existing_output(out_dir)
    probe = nearest_existing(out_dir)
    try:  # a real write answers for permissions and read-only mounts alike, before any input is read
        tempfile.TemporaryFile(dir=probe if probe.is_dir() else probe.parent).close()
    except OSError as e:
        raise UserError(
            f"--output_dir {out_dir}: cannot write in {probe} ({e.strerror}); choose a writable one"
        ) from None
    if parse_bpe_spec(cfg.tokenizer) is None and not Path(cfg.tokenizer).expanduser().is_dir():
        reason = corpora.hub_unreachable_reason()  # offline mode: the cache is asked when the tokenizer loads
        if reason:
            raise UserError(
                f"--tokenizer {cfg.tokenizer}: not a local directory and {reason}; pass a downloaded tokenizer "
                "directory or bpe:VOCAB"
            )
    for spec in cfg.dataset:
        if spec not in corpora.HUB_PRESETS and spec not in corpora.BUILTIN_SOURCES:
            corpora.resolve_local_files(spec, own_dirs(Path(cfg.output_dir).expanduser().resolve()))


def nearest_existing(path: Path) -> Path:
    """path, or the nearest of its parents that exists: where the output directory will be created."""
    return next(p for p in (path, *path.parents) if p.exists())


def own_dirs(out_dir: Path) -> tuple[Path, Path]:
    """The output directory and its work directory: never read as a source, wherever a --dataset directory is."""
    return out_dir, out_dir.parent / f".{out_dir.name}.partial"


def existing_output(out_dir: Path) -> dict | None:
    """The meta.json of an output directory prepare_data.py wrote (None: there is none, or it is empty). Refuses to
    replace anything prepare_data.py did not write: --overwrite deletes only a directory with its own meta.json and
    nothing but its own files. Checked before any input is read."""
    if not out_dir.exists():
        return None
    if not out_dir.is_dir():
        raise UserError(f"--output_dir {out_dir} is a file; choose a directory path")
    entries = sorted(p.name for p in out_dir.iterdir())
    if not entries:
        return None
    foreign = [name for name in entries if name not in OWN_FILES]
    meta, why = None, "no meta.json of prepare_data.py"
    try:
        meta = json.loads((out_dir / "meta.json").read_text())
    except ValueError as e:
        why = f"its meta.json is not valid JSON ({e}), so nothing shows prepare_data.py wrote it"
    except OSError:
        pass
    ours = isinstance(meta, dict) and "fingerprint" in meta and (meta.get("command") or [""])[:1] == ["prepare_data.py"]
    if foreign or not ours:
        held = (
            f"{len(foreign)} other entries: {', '.join(foreign[:4])}{', ...' if len(foreign) > 4 else ''}"
            if foreign
            else why
        )
        raise UserError(
            f"--output_dir {out_dir} exists and is not a directory prepare_data.py wrote ({held}); nothing was "
            f"deleted, even with --overwrite: choose a new or empty --output_dir"
        )
    return meta


def check_output_dir(out_dir: Path, fp: str, overwrite: bool) -> bool:
    """True when out_dir is already this exact preparation, intact; refuses to replace another one without
    --overwrite (existing_output has refused what is not prepare_data.py's)."""
    meta = existing_output(out_dir)
    if meta is None:
        return False
    try:
        token_data.read_meta(out_dir)
        for split in meta["splits"]:
            token_data.load_split(out_dir, split, meta)
        intact = True
    except UserError:
        intact = False
    if intact and meta["fingerprint"] == fp:
        print(f"{out_dir} is up to date (same sources, tokenizer and settings); nothing to do")
        return True
    if not overwrite:
        why = "holds data prepared from other inputs" if intact else "holds damaged prepared data"
        if intact and "special_tokens_in_documents" not in meta:
            why = ("was prepared before special tokens' text in documents was tokenized as text (a literal "
                   "<|endoftext|> in a document became an end of document there)")  # fmt: skip
        raise UserError(f"{out_dir} {why}; pass --overwrite to rebuild it or choose another --output_dir")
    return False


def load_tokenizer(spec: str, train_texts: Iterator[str]):
    """An AutoTokenizer from the Hub / a directory, or a byte-level BPE trained here on the training texts."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = parse_bpe_spec(spec)
    if vocab is None:  # validate has asked whether the Hub answers for a tokenizer that is no local directory
        try:
            tok = AutoTokenizer.from_pretrained(spec)
        except (OSError, ValueError) as e:
            raise UserError(
                f"--tokenizer {spec}: cannot be loaded with AutoTokenizer ({str(e).splitlines()[0]})"
            ) from None
        if tok.eos_token_id is None:
            raise UserError(f"--tokenizer {spec} has no EOS token; documents must be separated by one")
        return tok
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    bpe.train_from_iterator(train_texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=BPE_EOS,
        bos_token=BPE_EOS,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )


def bpe_sample(sources: list[corpora.Source], fraction: float) -> Iterator[str]:
    """The training documents of all sources, up to BPE_SAMPLE_CHARS characters."""
    seen = 0
    for source in sources:
        for text, target in corpora.routed_documents(source, fraction):
            if target != "train":
                continue
            # the trainer counts pre-tokens per text: pieces cut at PIECE_CUT give a byte-level BPE the same counts
            for piece in document_pieces(text, PIECE_CHARS, PIECE_CUT) if not isinstance(text, str) else [text]:
                yield piece
                seen += len(piece)
                if seen >= BPE_SAMPLE_CHARS:
                    return


def open_partial(out_dir: Path, fp: str, n_sources: int):
    """The work directory .DIR.partial, locked against a second run, and the checkpoint to resume from (None: fresh).
    A partial output of other inputs, or a damaged one (it is this script's own), is cleared for a fresh start."""
    tmp_dir = own_dirs(out_dir)[1]
    if tmp_dir.exists() and not tmp_dir.is_dir():
        raise UserError(
            f"{tmp_dir} is a file, not prepare_data.py's work directory; move it away or rename --output_dir"
        )
    tmp_dir.mkdir(parents=True, exist_ok=True)
    lock = open(tmp_dir / ".lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UserError(f"another prepare_data.py is writing {tmp_dir}; wait for it or stop it first") from None
    progress, damage = None, None
    try:
        progress = json.loads((tmp_dir / "progress.json").read_text())
        damage = progress_damage(progress, n_sources) if isinstance(progress, dict) else "not a JSON object"
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        damage = f"not valid JSON ({e})"
    if damage:
        print(f"note: {tmp_dir}/progress.json is damaged ({damage}); starting afresh")
    if damage or not progress or progress.get("fingerprint") != fp or not (tmp_dir / "tokenizer").is_dir():
        progress = None
        clear_partial(tmp_dir, fp)
    return tmp_dir, lock, progress


def progress_damage(progress: dict, n_sources: int) -> str | None:
    """What is wrong with a partial output's progress.json, None when it is whole."""
    position, splits, sources = progress.get("position"), progress.get("splits"), progress.get("sources")
    if not (isinstance(position, dict) and all(isinstance(position.get(k), int) for k in ("source", "documents"))):
        return "no checkpoint position"
    if not 0 <= position["source"] <= n_sources or position["documents"] < 0:
        return f"position {position} is outside the {n_sources} sources"
    keys = ("documents", "tokens", "bytes", "jsonl_bytes")
    if not (
        isinstance(splits, dict)
        and all(isinstance(c, dict) and all(isinstance(c.get(k), int) for k in keys) for c in splits.values())
    ):
        return "no per-split counts"
    if not (isinstance(sources, list) and len(sources) == n_sources):
        return "no per-source counts"
    return None


def clear_partial(tmp_dir: Path, fp: str) -> None:
    for p in tmp_dir.iterdir():
        if p.name != ".lock":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    (tmp_dir / "fingerprint").write_text(fp + "\n")


def resumed_tokenizer(tmp_dir: Path, progress: dict):
    """The partial output's own tokenizer, or None (with a note) when the partial output is damaged: a tokenizer that
    does not load, or a file shorter than its checkpoint says (cutting it back to that size would pad it with zeros)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tmp_dir / "tokenizer")
        itemsize = token_data.token_dtype(len(tokenizer)).itemsize
        for split, c in progress["splits"].items():
            for path, size in (
                (token_data.split_file(tmp_dir, split), c["tokens"] * itemsize),
                (tmp_dir / f"{split}.jsonl", c["jsonl_bytes"]),
            ):
                if size and (not path.is_file() or path.stat().st_size < size):
                    raise ValueError(f"{path.name} is shorter than its last checkpoint")
    except Exception as e:  # noqa: BLE001 - whatever is damaged, the remedy is the same: start afresh
        print(
            f"note: {tmp_dir} cannot be resumed ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
            "starting afresh"
        )
        return None
    return tokenizer


def prepare(cfg: Config, argv: list[str]) -> Path:
    out_dir = Path(cfg.output_dir).expanduser().resolve()
    validate(cfg)
    t0 = time.perf_counter()
    sources = [
        corpora.open_source(spec, cfg.text_field, cfg.doc_separator, exclude=own_dirs(out_dir)) for spec in cfg.dataset
    ]
    token_writer.check_small_sources(sources, cfg.validation_fraction)
    left_out = list(dict.fromkeys(str(d) for s in sources for d in s.skipped))
    if left_out:
        print(f"note: --dataset: left out {', '.join(left_out)} (prepare_data.py's own output or work directories)")
    tok_id = recorded_identity(tokenizer_identity(cfg.tokenizer), out_dir, own_dirs(out_dir)[1])
    fp = fingerprint(cfg, [s.identity for s in sources], tok_id)
    if check_output_dir(out_dir, fp, cfg.overwrite):
        return out_dir

    tmp_dir, lock, resume = open_partial(out_dir, fp, len(sources))
    try:
        tokenizer = resumed_tokenizer(tmp_dir, resume) if resume else None
        if tokenizer is not None:
            pos = resume["position"]
            print(
                f"resuming {tmp_dir} from its last checkpoint: source {pos['source'] + 1} of {len(sources)}, "
                f"{pos['documents']:,} documents in, {sum(c['tokens'] for c in resume['splits'].values()):,} tokens "
                "written"
            )
        else:
            resume = None
            clear_partial(tmp_dir, fp)
            tokenizer = load_tokenizer(cfg.tokenizer, bpe_sample(sources, cfg.validation_fraction))
            tokenizer.save_pretrained(tmp_dir / "tokenizer")
        dtype = token_data.token_dtype(len(tokenizer))
        t1 = time.perf_counter()
        stamp = {"fingerprint": fp, "tokenizer_identity": tok_id}
        job = token_writer.Job(
            tmp_dir, dtype, tokenizer.eos_token_id, stamp, cfg.num_proc, cfg.checkpoint_mb, cfg.validation_fraction
        )
        result = token_writer.tokenize_all(sources, job, resume)
        tok_s = time.perf_counter() - t1
        meta = output_meta(cfg, argv, tokenizer, dtype, stamp, result)
        for name in ("progress.json", "fingerprint"):
            (tmp_dir / name).unlink(missing_ok=True)
        write_json_atomic(tmp_dir / "meta.json", meta)
        (tmp_dir / ".lock").unlink()
        cli.replace_dir(tmp_dir, out_dir)
    except UserError:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # bad input: the partial work cannot be continued with other input
        raise
    except WorkerDied as e:
        raise WorkerDied(
            f"{e}; the partial output stays in {tmp_dir}: run the same command again to continue from its last "
            "checkpoint"
        ) from None
    except BaseException:
        if tmp_dir.exists():
            print(
                f"stopped: the partial output stays in {tmp_dir}; run the same command again to continue from its last "
                "checkpoint",
                file=sys.stderr,
            )
        raise
    finally:
        lock.close()

    report(out_dir, meta, result["tokens_this_run"] / tok_s, time.perf_counter() - t0, result["peak_worker_mib"])
    return out_dir


def output_meta(cfg: Config, argv: list[str], tokenizer, dtype: np.dtype, stamp: dict, result: dict) -> dict:
    split_meta = {s: {k: c[k] for k in ("documents", "tokens", "bytes")} for s, c in result["splits"].items()}
    return {
        "format_version": token_data.FORMAT_VERSION,
        "dtype": dtype.name,
        "vocab_size": len(tokenizer),
        "eos_id": tokenizer.eos_token_id,
        "tokenizer": cfg.tokenizer,
        "tokenizer_identity": stamp["tokenizer_identity"],
        "split_rule": SPLIT_RULE,
        "special_tokens_in_documents": SPECIAL_TOKENS_IN_DOCUMENTS,
        "splits": {s: split_meta[s] for s in corpora.SPLITS if s in split_meta},
        "sources": [{"name": n, **source} for n, source in zip(source_names(result["sources"]), result["sources"])],
        "fingerprint": stamp["fingerprint"],
        "command": ["prepare_data.py", *argv],
    }


def source_names(sources: list[dict]) -> list[str]:
    """Each source's name for train.py's --data_mix: a preset's, or a file's or directory's; a repeat gets -2, -3."""
    seen: collections.Counter = collections.Counter()
    names = []
    for source in sources:
        base = token_data.source_name(source["spec"])
        seen[base] += 1
        names.append(base if seen[base] == 1 else f"{base}-{seen[base]}")
    return names


def report(out_dir: Path, meta: dict, tokens_per_s: float, total_s: float, peak_worker_mib: float | None) -> None:
    for source in meta["sources"]:
        tolerated = [
            f"{source[k]:,} {k.replace('_', ' ')}"
            for k in ("replaced_bytes", "crlf_line_ends", "bom_files", "empty_documents")
            if source.get(k)
        ]
        if tolerated:
            print(
                f"note: {source['spec']}: {', '.join(tolerated)} (undecodable bytes became U+FFFD, CRLF became LF, "
                f"BOMs were dropped, empty documents skipped; counted in meta.json)",
                file=sys.stderr,
            )
    for name, s in meta["splits"].items():
        print(
            f"  {name:<10} {s['documents']:>9,} docs {s['tokens']:>13,} tokens {s['bytes']:>14,} bytes "
            f"({s['bytes'] / max(1, s['tokens'] - s['documents']):.2f} bytes/token)"
        )
    if len(meta["sources"]) > 1:
        for source in meta["sources"]:
            tokens = source.get("tokens", {})
            print(f"  source {source['name']}: " + ", ".join(f"{n:,} {split} tokens" for split, n in tokens.items()))
    docs = sum(s["documents"] for s in meta["splits"].values())
    tokens = sum(s["tokens"] for s in meta["splits"].values())
    text_bytes = sum(s["bytes"] for s in meta["splits"].values())
    own = peak_rss_mib()
    workers = f" + {peak_worker_mib:,.0f} MiB per tokenizer process" if peak_worker_mib else ""
    print(
        f"wrote {out_dir} ({meta['dtype']}, vocab {meta['vocab_size']}): {docs:,} documents, {tokens:,} tokens, "
        f"{text_bytes / max(1, tokens - docs):.2f} bytes/token, tokenized at {tokens_per_s:,.0f} tokens/s, "
        f"{total_s:.1f}s in all, peak RSS {own:,.0f} MiB{workers}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = cli.parse_config(Config, argv, __doc__.split("\n\n")[0])
    if cfg is None:
        return 2
    try:
        prepare(cfg, argv)
    except UserError as e:
        cli.print_error(str(e))
        return 2
    except WorkerDied as e:
        cli.print_error(str(e))
        return 3
    except OSError as e:  # a full or read-only disk, a file size limit (prepare has said where the partial output is)
        out_dir = Path(cfg.output_dir).expanduser().resolve()
        probe = nearest_existing(out_dir)
        where = e.filename or f"a file under {own_dirs(out_dir)[1]}"
        why = e.strerror or f"{e}, a short write: a full disk or a file size limit"
        if e.errno == errno.ENAMETOOLONG:  # not a full disk: freeing space would not help
            cli.print_error(f"writing {cli.shown(where)} failed: {why}; choose a shorter --output_dir")
            return 3
        cli.print_error(
            f"writing {cli.shown(where)} failed: {why} ({shutil.disk_usage(probe).free / 2**30:.1f} GiB free on "
            f"{probe}); free space, raise the limit or choose a writable --output_dir, then run the same command again"
        )
        return 3
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
