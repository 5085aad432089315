"""Writing the token files: prepare_data.py's tokenizing pass.

Every source's documents, in order, go in batches (a long document in pieces) through the tokenizer processes
(tokenizer_pool.py) into one token file per split of the work directory, the held-out documents' text beside them as
JSON lines; a checkpoint (progress.json) every --checkpoint_mb of text and at the end of each source makes the work
directory resumable. The same bytes come out for any number of processes. Where the work directory is, and what is
resumed, is prepare_data.py's.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from deepseek_zero3 import cli
from deepseek_zero3.cli import UserError, write_json_atomic
from deepseek_zero3.prepare import corpora, documents
from deepseek_zero3.prepare.tokenizer_pool import (
    PIECE_CHARS,
    PIECE_CUT,
    Task,
    TokenizerPool,
    cut_problem,
    document_pieces,
    in_order,
    init_tokenizer_worker,
)
from deepseek_zero3.training_data import token_data

BATCH_DOCS, BATCH_CHARS = 1000, 1 << 20  # one tokenizer task: up to 1000 documents or ~1 MB of text
WHOLE_NOTE_CHARS = 1 << 23  # a document this long tokenized whole (its tokenizer cannot be cut) gets a note


@dataclasses.dataclass(frozen=True)
class Job:
    """One tokenizing pass: the work directory it writes, the token format and the settings it follows."""

    tmp_dir: Path  # the work directory: the saved tokenizer in tokenizer/, the split files and progress.json beside it
    dtype: np.dtype  # of the token files
    eos_id: int  # appended after every document
    stamp: dict  # fingerprint and tokenizer identity, carried by every checkpoint's progress.json
    num_proc: int  # tokenizer processes; 0: auto_num_proc
    checkpoint_mb: int  # a checkpoint after every this many MB of text
    validation_fraction: float  # share of documents held out from sources without a validation split


class SplitWriter:
    """Appends one split's tokens to NAME.bin and, for held-out splits, its documents' text to NAME.jsonl.
    Opened from a checkpoint's counts, it first cuts both files back to what that checkpoint had written."""

    def __init__(self, directory: Path, name: str, dtype: np.dtype, counts: dict | None = None):
        self.counts = dict(counts or {"documents": 0, "tokens": 0, "bytes": 0, "jsonl_bytes": 0})
        self.bin = self._open(token_data.split_file(directory, name), self.counts["tokens"] * dtype.itemsize)
        self.jsonl = self._open(directory / f"{name}.jsonl", self.counts["jsonl_bytes"]) if name != "train" else None

    @staticmethod
    def _open(path: Path, size: int):
        f = open(path, "r+b" if path.exists() else "wb")
        f.truncate(size)
        f.seek(size)
        return f

    def write(self, task: Task, ids: np.ndarray, n_bytes: int) -> None:
        ids.tofile(self.bin)
        if self.jsonl is not None:
            if task.joined:  # a long document's line, written piece by piece (JSON escapes each character alone)
                text = "".join(json.dumps(t, ensure_ascii=False)[1:-1] for t in task.texts)
                lines = ('{"text": "' if task.starts else "") + text + ('"}\n' if task.ends else "")
            else:
                lines = "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in task.texts)
            data = lines.encode("utf-8", "surrogatepass")
            self.jsonl.write(data)
            self.counts["jsonl_bytes"] += len(data)
        self.counts["documents"] += int(task.ends) if task.joined else len(task.texts)
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


class Batches:
    """Documents gathered per output split into tokenizer tasks of up to BATCH_DOCS documents or BATCH_CHARS of text."""

    def __init__(self):
        self.texts: dict[str, list[str]] = collections.defaultdict(list)
        self.chars: collections.Counter = collections.Counter()

    def add(self, split: str, text: str) -> Iterator[Task]:
        self.texts[split].append(text)
        self.chars[split] += len(text)
        if len(self.texts[split]) >= BATCH_DOCS or self.chars[split] >= BATCH_CHARS:
            yield from self.flush(split)

    def flush(self, split: str | None = None) -> Iterator[Task]:
        for name in [split] if split else list(self.texts):
            if self.texts.get(name):
                self.chars[name] = 0
                yield Task(name, self.texts.pop(name))


def piece_tasks(split: str, doc: str | documents.FileText, cut: re.Pattern | None) -> Iterator[Task]:
    """One long document as tasks of its consecutive pieces, about BATCH_CHARS of text each."""
    pieces, chars, first = [], 0, True
    for piece in document_pieces(doc, PIECE_CHARS, cut):
        if chars >= BATCH_CHARS:
            yield Task(split, pieces, joined=True, starts=first, ends=False)
            pieces, chars, first = [], 0, False
        pieces.append(piece)
        chars += len(piece)
    yield Task(split, pieces, joined=True, starts=first, ends=True)


def make_tasks(
    sources: list[corpora.Source], job: Job, start: dict, per_source: list[dict], bar, uncut: str | None
) -> Iterator[Task]:
    """The tokenizer tasks of every source in order, with a checkpoint every --checkpoint_mb of text and at the end
    of each source. From a checkpoint (start), the documents it covers are read again (for the counts) but not sent.
    Documents over PIECE_CHARS go in pieces, unless `uncut` says why this tokenizer's cannot be cut."""
    every, cut, noted = job.checkpoint_mb * 1_000_000, None if uncut else PIECE_CUT, False
    by_bytes = all(s.total_bytes for s in sources)  # the bar counts bytes read, else documents
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
        batches = Batches()
        since_checkpoint, n, last_read = 0, 0, 0
        for n, (text, target) in enumerate(corpora.routed_documents(source, job.validation_fraction), 1):
            counts[target] += 1
            bar.update(source.stats.read_bytes - last_read if by_bytes else 1)
            last_read = source.stats.read_bytes
            if n <= skip:
                continue
            if uncut and len(text) >= WHOLE_NOTE_CHARS and not noted:
                print(f"note: documents of {len(text):,} characters are tokenized whole: {uncut}", file=sys.stderr)
                noted = True
            if isinstance(text, documents.FileText) or (cut and len(text) > PIECE_CHARS):
                yield from batches.flush(target)  # this split's earlier documents first
                yield from piece_tasks(target, text, cut)
            else:
                yield from batches.add(target, text)
            since_checkpoint += len(text)
            if since_checkpoint >= every:
                yield from batches.flush()
                since_checkpoint = 0
                yield Task("", None, {"source": si, "documents": n})
        yield from batches.flush()
        check_counts(source, counts, job.validation_fraction)
        per_source[si] = {**source.identity, **source.stats.counts(), "documents": dict(counts)}
        yield Task("", None, {"source": si + 1, "documents": 0})


PRECHECK_BYTES = 64 << 20  # sources this small are read once before anything is tokenized (a fraction of a second)


def check_small_sources(sources: list[corpora.Source], fraction: float) -> None:
    """check_counts for every source small enough to read in a moment, before the first is tokenized: found at that
    source's end, an empty source or one without held-out documents would be refused after every source before it
    was tokenized. (A larger source is checked at its end; one with no held-out document among 64 MB is unheard of.)"""
    for source in sources:
        if source.total_bytes is not None and source.total_bytes <= PRECHECK_BYTES:
            counts = collections.Counter(target for _, target in corpora.routed_documents(source, fraction))
            source.stats.reset()  # the tokenizing pass counts what the readers tolerate
            check_counts(source, counts, fraction)


def check_counts(source: corpora.Source, counts: collections.Counter, fraction: float) -> None:
    """A source read to its end has training documents, and held-out ones when it has no validation split."""
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
            f"--validation_fraction {fraction}; raise it or add documents{hint}"
        )


def auto_num_proc(sources: list[corpora.Source]) -> int:
    """One tokenizer process per core; but starting them costs about a second, so corpora of known size under 32 MB a
    core go through this process, where the tokenizer's own threads use the cores."""
    cores = os.cpu_count() or 1
    known = all(s.total_bytes is not None for s in sources)
    return 1 if known and sum(s.total_bytes for s in sources) < cores * (32 << 20) else cores


def source_counts(counts: dict, earlier: list[dict], key: str) -> dict:
    """The tokens (or text bytes) of each split the source just finished wrote: the split files hold the sources one
    after another."""
    return {split: c[key] - sum(e.get(key, {}).get(split, 0) for e in earlier) for split, c in counts.items()}


def tokenize_all(sources: list[corpora.Source], job: Job, resume: dict | None) -> dict:
    """Stream every source through the tokenizer into job.tmp_dir, from the checkpoint `resume` when given; every
    checkpoint's progress.json carries job.stamp (fingerprint, tokenizer identity). Returns the counts per split and
    per source, and the tokens this run wrote. A tokenizer process that dies raises WorkerDied."""
    counts = resume["splits"] if resume else {}
    writers: dict[str, SplitWriter] = {}
    per_source = resume["sources"] if resume else [{} for _ in sources]
    start = resume["position"] if resume else {"source": 0, "documents": 0}
    num_proc = job.num_proc or auto_num_proc(sources)
    args = (str(job.tmp_dir / "tokenizer"), job.dtype.str, job.eos_id, num_proc == 1)
    pool = TokenizerPool(num_proc, args) if num_proc > 1 else None
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
    tasks = make_tasks(sources, job, start, per_source, bar, cut_problem(job.tmp_dir / "tokenizer"))
    try:
        for task, result in in_order(tasks, pool, 2 * num_proc + 2):
            done = sum(c["tokens"] for c in counts.values()) - tokens0
            rate = f"{done / (time.perf_counter() - t0):,.0f} tokens/s"
            if task.texts is None:
                for w in writers.values():
                    w.sync()
                if task.position["documents"] == 0 and task.position["source"] > 0:  # a source's end: its tokens
                    ended = per_source[task.position["source"] - 1]
                    earlier = per_source[: task.position["source"] - 1]
                    ended["tokens"], ended["bytes"] = (source_counts(counts, earlier, k) for k in ("tokens", "bytes"))
                progress = {**job.stamp, "position": task.position, "splits": counts, "sources": per_source}
                write_json_atomic(job.tmp_dir / "progress.json", progress)
                if bar.disable:  # no terminal: a line per checkpoint instead of the bar
                    print(f"checkpoint: {done + tokens0:,} tokens written, {rate}", flush=True)
                continue
            if task.split not in writers:
                writers[task.split] = SplitWriter(job.tmp_dir, task.split, job.dtype, counts.get(task.split))
            ids, n_bytes, worker_rss = result
            writers[task.split].write(task, ids, n_bytes)
            peak_worker = max(peak_worker, worker_rss)
            counts[task.split] = writers[task.split].counts
            bar.set_postfix_str(rate, refresh=False)
    except BaseException:  # WorkerDied included: the pool has stopped its other processes
        if pool is not None:
            pool.stop()
        raise
    finally:
        bar.close()
        for w in writers.values():
            w.close()
    if pool is not None:
        pool.close()
    return {
        "splits": counts,
        "sources": per_source,
        "tokens_this_run": sum(c["tokens"] for c in counts.values()) - tokens0,
        "peak_worker_mib": peak_worker if pool is not None else None,
    }
