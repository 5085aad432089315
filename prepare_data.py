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

Documents stream from the sources through --num_proc tokenizer processes into the token files in bounded batches:
memory stays flat whatever the corpus size, and the output is the same bytes for any --num_proc. Sources without a
validation split hold out the documents whose text hashes below --validation_fraction.

Output (DIR): train.bin / validation.bin / test.bin (flat token ids, EOS after every document), tokenizer/,
meta.json, and validation.jsonl / test.jsonl (the held-out documents' text, for eval.py). The work happens in
.DIR.partial, checkpointed every --checkpoint_mb of text: run a killed command again and it continues from the last
checkpoint. DIR appears only when complete; an identical second run returns at once.
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import hashlib
import json
import os
import resource
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

import cli
import lmdata
from cli import UserError, field, write_json_atomic

BPE_EOS = "<|endoftext|>"
BPE_SAMPLE_CHARS = 1 << 30  # bpe:VOCAB trains on at most the first ~1 GB of training text
BATCH_DOCS, BATCH_CHARS = 1000, 1 << 20  # one tokenizer task: up to 1000 documents or ~1 MB of text
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
    validation_fraction: float = field(lmdata.VALIDATION_FRACTION, "share of documents held out as the validation "
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
        "format_version": lmdata.FORMAT_VERSION,
        "split_rule": SPLIT_RULE,
        "sources": sources,
        "tokenizer": tokenizer_id,
        "text_field": cfg.text_field,
        "doc_separator": cfg.doc_separator,
        "validation_fraction": cfg.validation_fraction,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def tokenizer_identity(spec: str) -> dict:
    """What the tokenizer is: a local directory's file hash, or a Hub id with the commit it resolves to."""
    path = Path(spec).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file())
        return {"spec": spec, "sha256": lmdata.sha256_files(files)}
    if parse_bpe_spec(spec) is None and lmdata.hub_unreachable_reason() is None:
        try:
            from huggingface_hub import HfApi

            return {"spec": spec, "revision": HfApi().model_info(spec).sha}
        except Exception as e:  # noqa: BLE001 - offline cache, private repo: load_tokenizer gives the real error
            return {"spec": spec, "revision": f"unknown ({type(e).__name__})"}
    return {"spec": spec}


def peak_rss_mib() -> float:
    """This process's peak resident memory, MiB: VmHWM on Linux (ru_maxrss would carry over the peak of the process
    that started this one, through fork and exec), else ru_maxrss."""
    try:
        line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    """This process's resident memory now, MiB (ru_maxrss would count, in a spawned process, its parent's pages at
    the fork that started it)."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizing in worker processes, results in submission order
# ---------------------------------------------------------------------------------------------------------------------

_worker: dict = {}


def init_tokenizer_worker(tokenizer_dir: str, dtype: str, eos_id: int, threads: bool) -> None:
    """Load the saved tokenizer in this process: the Rust tokenizer when there is a tokenizer.json, else
    AutoTokenizer."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads else "false"
    path = Path(tokenizer_dir) / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        tok.no_truncation()
        tok.no_padding()
        encode = lambda texts: [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]  # noqa: E731
    else:
        from transformers import AutoTokenizer

        slow = AutoTokenizer.from_pretrained(tokenizer_dir)
        encode = lambda texts: slow(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    _worker.update(encode=encode, dtype=np.dtype(dtype), eos=eos_id)


def encode_documents(texts: list[str]) -> tuple[np.ndarray, int, float]:
    """Token ids of each document followed by EOS, flat in the token dtype, the documents' UTF-8 byte count, and this
    process's resident memory in MiB."""
    ids = _worker["encode"](texts)
    flat = np.fromiter(
        (t for doc in ids for t in (*doc, _worker["eos"])), dtype=np.int64, count=sum(map(len, ids)) + len(ids)
    )
    top = int(flat.max()) if flat.size else 0
    if top > np.iinfo(_worker["dtype"]).max:
        raise UserError(
            f"token id {top} does not fit {_worker['dtype'].name}; the tokenizer's vocabulary is larger than it says"
        )
    n_bytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    return flat.astype(_worker["dtype"]), n_bytes, rss_mib()


@dataclasses.dataclass
class Task:
    """A batch of documents for one output split, or (texts None) a checkpoint to take once all before it are
    written."""

    split: str
    texts: list[str] | None
    position: dict | None = None


def in_order(tasks: Iterator[Task], pool, max_in_flight: int) -> Iterator[tuple[Task, tuple | None]]:
    """(task, encode_documents result) for every task, in task order, with at most max_in_flight batches queued."""
    queue: collections.deque = collections.deque()
    for task in tasks:
        if task.texts is None:
            queue.append((task, None))
        elif pool is None:
            queue.append((task, encode_documents(task.texts)))
        else:
            queue.append((task, pool.apply_async(encode_documents, (task.texts,))))
        while queue and (
            len(queue) > max_in_flight
            or queue[0][1] is None
            or not hasattr(queue[0][1], "ready")
            or queue[0][1].ready()
        ):
            done, result = queue.popleft()
            yield done, result.get() if hasattr(result, "get") else result
    for done, result in queue:
        yield done, result.get() if hasattr(result, "get") else result


# ---------------------------------------------------------------------------------------------------------------------
# Output: one appender per split, and the checkpoint that makes the partial directory resumable
# ---------------------------------------------------------------------------------------------------------------------


class SplitWriter:
    """Appends one split's tokens to NAME.bin and, for held-out splits, its documents' text to NAME.jsonl.
    Opened from a checkpoint's counts, it first cuts both files back to what that checkpoint had written."""

    def __init__(self, directory: Path, name: str, dtype: np.dtype, counts: dict | None = None):
        self.counts = dict(counts or {"documents": 0, "tokens": 0, "bytes": 0, "jsonl_bytes": 0})
        self.bin = self._open(lmdata.split_file(directory, name), self.counts["tokens"] * dtype.itemsize)
        self.jsonl = self._open(directory / f"{name}.jsonl", self.counts["jsonl_bytes"]) if name != "train" else None

    @staticmethod
    def _open(path: Path, size: int):
        f = open(path, "r+b" if path.exists() else "wb")
        f.truncate(size)
        f.seek(size)
        return f

    def write(self, texts: list[str], ids: np.ndarray, n_bytes: int) -> None:
        ids.tofile(self.bin)
        if self.jsonl is not None:
            lines = "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts).encode(
                "utf-8", "surrogatepass"
            )
            self.jsonl.write(lines)
            self.counts["jsonl_bytes"] += len(lines)
        self.counts["documents"] += len(texts)
        self.counts["tokens"] += ids.size
        self.counts["bytes"] += n_bytes

    def sync(self) -> None:
        for f in (self.bin, self.jsonl):
            if f is not None:
                f.flush()
                os.fsync(f.fileno())

    def close(self) -> None:
        self.sync()
        for f in (self.bin, self.jsonl):
            if f is not None:
                f.close()


# ---------------------------------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------------------------------


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
    parse_bpe_spec(cfg.tokenizer)
    for spec in cfg.dataset:
        if spec not in lmdata.HUB_PRESETS and spec not in lmdata.BUILTIN_SOURCES:
            lmdata.resolve_local_files(spec)


def check_output_dir(out_dir: Path, fp: str, overwrite: bool) -> bool:
    """True when out_dir is already this exact preparation, intact. Refuses to replace anything prepare_data.py did not
    write: --overwrite deletes only a directory with its own meta.json and nothing but its own files."""
    if not out_dir.exists():
        return False
    if not out_dir.is_dir():
        raise UserError(f"--output_dir {out_dir} is a file; choose a directory path")
    entries = sorted(p.name for p in out_dir.iterdir())
    if not entries:
        return False
    foreign = [name for name in entries if name not in OWN_FILES]
    try:
        meta = json.loads((out_dir / "meta.json").read_text())
        ours = isinstance(meta, dict) and "fingerprint" in meta and meta.get("command", [""])[0] == "prepare_data.py"
    except (OSError, ValueError):
        meta, ours = None, False
    if foreign or not ours:
        held = (
            f"{len(foreign)} other entries: {', '.join(foreign[:4])}{', ...' if len(foreign) > 4 else ''}"
            if foreign
            else "no meta.json of prepare_data.py"
        )
        raise UserError(
            f"--output_dir {out_dir} exists and is not a directory prepare_data.py wrote ({held}); nothing was "
            f"deleted, even with --overwrite: choose a new or empty --output_dir"
        )
    try:
        lmdata.read_meta(out_dir)
        for split in meta["splits"]:
            lmdata.load_split(out_dir, split, meta)
        intact = True
    except UserError:
        intact = False
    if intact and meta["fingerprint"] == fp:
        print(f"{out_dir} is up to date (same sources, tokenizer and settings); nothing to do")
        return True
    if not overwrite:
        why = "holds data prepared from other inputs" if intact else "holds damaged prepared data"
        raise UserError(f"{out_dir} {why}; pass --overwrite to rebuild it or choose another --output_dir")
    return False


def load_tokenizer(spec: str, train_texts: Iterator[str]):
    """An AutoTokenizer from the Hub / a directory, or a byte-level BPE trained here on the training texts."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = parse_bpe_spec(spec)
    if vocab is None:
        if not Path(spec).expanduser().is_dir():
            reason = lmdata.hub_unreachable_reason()
            if reason:
                raise UserError(
                    f"--tokenizer {spec}: not a local directory and {reason}; pass a downloaded tokenizer directory or "
                    "bpe:VOCAB"
                )
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


def bpe_sample(sources: list[lmdata.Source], fraction: float) -> Iterator[str]:
    """The training documents of all sources, up to BPE_SAMPLE_CHARS characters."""
    seen = 0
    for source in sources:
        for text, target in lmdata.routed_documents(source, fraction):
            if target == "train":
                yield text
                seen += len(text)
                if seen >= BPE_SAMPLE_CHARS:
                    return


def make_tasks(
    sources: list[lmdata.Source], cfg: Config, start: dict, per_source: list[dict], bar, by_bytes: bool
) -> Iterator[Task]:
    """The tokenizer tasks of every source in order, with a checkpoint every --checkpoint_mb of text and at the end
    of each source. From a checkpoint (start), the documents it covers are read again (for the counts) but not sent."""
    every = cfg.checkpoint_mb * 1_000_000
    for si, source in enumerate(sources):
        if si < start["source"]:
            bar.update(source.total_bytes if by_bytes else 0)
            continue
        if "train" not in source.splits:
            raise UserError(
                f"--dataset {source.spec} has no training files (only {', '.join(source.splits)}); add train files or "
                "a train/ directory"
            )
        skip = start["documents"] if si == start["source"] else 0
        source.stats.reset()  # counted afresh, also over what a checkpoint covers
        counts: collections.Counter = collections.Counter()
        pending: dict[str, list[str]] = collections.defaultdict(list)
        pending_chars: collections.Counter = collections.Counter()
        since_checkpoint, n, last_read = 0, 0, 0
        for n, (text, target) in enumerate(lmdata.routed_documents(source, cfg.validation_fraction), 1):
            counts[target] += 1
            bar.update(source.stats.read_bytes - last_read if by_bytes else 1)
            last_read = source.stats.read_bytes
            if n <= skip:
                continue
            pending[target].append(text)
            pending_chars[target] += len(text)
            since_checkpoint += len(text)
            if len(pending[target]) >= BATCH_DOCS or pending_chars[target] >= BATCH_CHARS:
                yield Task(target, pending.pop(target))
                pending_chars[target] = 0
            if since_checkpoint >= every:
                yield from (Task(split, texts) for split, texts in pending.items())
                pending.clear()
                pending_chars.clear()
                since_checkpoint = 0
                yield Task("", None, {"source": si, "documents": n})
        yield from (Task(split, texts) for split, texts in pending.items())
        if not counts["train"]:
            raise UserError(f"--dataset {source.spec} has no training documents (empty corpus); point it at text")
        if "validation" not in source.splits and not counts["validation"]:
            hint = (
                ", or split the file into documents with --doc_separator (blank_line or a literal string)"
                if source.single_document
                else ""
            )
            raise UserError(
                f"--dataset {source.spec}: none of its {counts['train']} documents fell in the validation split at "
                f"--validation_fraction {cfg.validation_fraction}; raise it or add documents{hint}"
            )
        per_source[si] = {**source.identity, **source.stats.counts(), "documents": dict(counts)}
        yield Task("", None, {"source": si + 1, "documents": 0})


def auto_num_proc(sources: list[lmdata.Source]) -> int:
    """One tokenizer process per core; but starting them costs about a second, so corpora of known size under 32 MB a
    core go through this process, where the tokenizer's own threads use the cores."""
    cores = os.cpu_count() or 1
    known = all(s.total_bytes is not None for s in sources)
    return 1 if known and sum(s.total_bytes for s in sources) < cores * (32 << 20) else cores


def tokenize_all(
    cfg: Config, sources: list[lmdata.Source], tmp_dir: Path, tokenizer, dtype: np.dtype, fp: str, resume: dict | None
) -> dict:
    """Stream every source through the tokenizer into tmp_dir, from the checkpoint `resume` when given. Returns the
    counts per split and per source, and the tokens this run wrote."""
    from multiprocessing import get_context

    counts = resume["splits"] if resume else {}
    writers: dict[str, SplitWriter] = {}
    per_source = resume["sources"] if resume else [{} for _ in sources]
    start = resume["position"] if resume else {"source": 0, "documents": 0}
    num_proc = cfg.num_proc or auto_num_proc(sources)
    args = (str(tmp_dir / "tokenizer"), dtype.str, tokenizer.eos_token_id, num_proc == 1)
    pool = get_context("spawn").Pool(num_proc, init_tokenizer_worker, args) if num_proc > 1 else None
    if pool is None:
        init_tokenizer_worker(*args)
    by_bytes = all(s.total_bytes for s in sources)  # the bar counts bytes read, else documents
    bar = cli.progress_bar(
        total=sum(s.total_bytes for s in sources) if by_bytes else None,
        unit="B" if by_bytes else " docs",
        unit_scale=True,
        desc="tokenizing",
        mininterval=1.0,
        smoothing=0.1,
    )
    tokens0, t0, peak_worker = sum(c["tokens"] for c in counts.values()), time.perf_counter(), 0.0
    try:
        for task, result in in_order(
            make_tasks(sources, cfg, start, per_source, bar, by_bytes), pool, 2 * num_proc + 2
        ):
            if task.texts is not None:
                if task.split not in writers:
                    writers[task.split] = SplitWriter(tmp_dir, task.split, dtype, counts.get(task.split))
                ids, n_bytes, worker_rss = result
                writers[task.split].write(task.texts, ids, n_bytes)
                peak_worker = max(peak_worker, worker_rss)
                counts[task.split] = writers[task.split].counts
                done = sum(c["tokens"] for c in counts.values()) - tokens0
                bar.set_postfix_str(f"{done / (time.perf_counter() - t0):,.0f} tokens/s", refresh=False)
            else:
                for w in writers.values():
                    w.sync()
                write_json_atomic(
                    tmp_dir / "progress.json",
                    {"fingerprint": fp, "position": task.position, "splits": counts, "sources": per_source},
                )
                if bar.disable:  # no terminal: a line per checkpoint instead of the bar
                    done = sum(c["tokens"] for c in counts.values()) - tokens0
                    print(
                        f"checkpoint: {sum(c['tokens'] for c in counts.values()):,} tokens written, "
                        f"{done / (time.perf_counter() - t0):,.0f} tokens/s",
                        flush=True,
                    )
    except BaseException:
        if pool is not None:
            pool.terminate()
        raise
    finally:
        bar.close()
        for w in writers.values():
            w.close()
    if pool is not None:
        pool.close()
        pool.join()
    return {
        "splits": counts,
        "sources": per_source,
        "tokens_this_run": sum(c["tokens"] for c in counts.values()) - tokens0,
        "peak_worker_mib": peak_worker if pool is not None else None,
    }


def open_partial(out_dir: Path, fp: str):
    """The work directory .DIR.partial, locked against a second run, and the checkpoint to resume from (None: fresh)."""
    tmp_dir = out_dir.parent / f".{out_dir.name}.partial"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    lock = open(tmp_dir / ".lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UserError(f"another prepare_data.py is writing {tmp_dir}; wait for it or stop it first") from None
    progress = None
    try:
        progress = json.loads((tmp_dir / "progress.json").read_text())
        if progress.get("fingerprint") != fp or not (tmp_dir / "tokenizer").is_dir():
            progress = None
    except (OSError, ValueError):
        pass
    if progress is None:
        for p in tmp_dir.iterdir():
            if p.name != ".lock":
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        (tmp_dir / "fingerprint").write_text(fp + "\n")
    return tmp_dir, lock, progress


def prepare(cfg: Config, argv: list[str]) -> Path:
    out_dir = Path(cfg.output_dir).expanduser().resolve()
    validate(cfg)
    t0 = time.perf_counter()
    sources = [lmdata.open_source(spec, cfg.text_field, cfg.doc_separator) for spec in cfg.dataset]
    tok_id = tokenizer_identity(cfg.tokenizer)
    fp = fingerprint(cfg, [s.identity for s in sources], tok_id)
    if check_output_dir(out_dir, fp, cfg.overwrite):
        return out_dir

    tmp_dir, lock, resume = open_partial(out_dir, fp)
    try:
        if resume:
            pos = resume["position"]
            print(
                f"resuming {tmp_dir} from its last checkpoint: source {pos['source'] + 1} of {len(sources)}, "
                f"{pos['documents']:,} documents in, {sum(c['tokens'] for c in resume['splits'].values()):,} tokens "
                "written"
            )
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tmp_dir / "tokenizer")
        else:
            tokenizer = load_tokenizer(cfg.tokenizer, bpe_sample(sources, cfg.validation_fraction))
            tokenizer.save_pretrained(tmp_dir / "tokenizer")
        dtype = lmdata.token_dtype(len(tokenizer))
        t1 = time.perf_counter()
        result = tokenize_all(cfg, sources, tmp_dir, tokenizer, dtype, fp, resume)
        tok_s = time.perf_counter() - t1
        split_meta = {s: {k: c[k] for k in ("documents", "tokens", "bytes")} for s, c in result["splits"].items()}
        meta = {
            "format_version": lmdata.FORMAT_VERSION,
            "dtype": dtype.name,
            "vocab_size": len(tokenizer),
            "eos_id": tokenizer.eos_token_id,
            "tokenizer": cfg.tokenizer,
            "tokenizer_identity": tok_id,
            "split_rule": SPLIT_RULE,
            "splits": {s: split_meta[s] for s in lmdata.SPLITS if s in split_meta},
            "sources": result["sources"],
            "fingerprint": fp,
            "command": ["prepare_data.py", *argv],
        }
        for name in ("progress.json", "fingerprint"):
            (tmp_dir / name).unlink()
        write_json_atomic(tmp_dir / "meta.json", meta)
        (tmp_dir / ".lock").unlink()
        cli.replace_dir(tmp_dir, out_dir)
    except UserError:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # bad input: the partial work cannot be continued with other input
        raise
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
    from transformers import HfArgumentParser

    argv = sys.argv[1:] if argv is None else argv
    (cfg,) = HfArgumentParser(Config, description=__doc__.split("\n\n")[0]).parse_args_into_dataclasses(argv)
    try:
        prepare(cfg, argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
