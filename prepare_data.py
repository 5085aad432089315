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
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import multiprocessing.context
import os
import re
import resource
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
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
PIECE_CHARS = 1 << 16  # a longer document goes to the tokenizer in pieces of about this many characters
WHOLE_NOTE_CHARS = 1 << 23  # a document this long tokenized whole (its tokenizer cannot be cut) gets a note

# Where a long document is cut: before a space that follows a non-space character and precedes an ASCII letter.
# Why no tokenizer this project uses can join the two sides (so the pieces' ids are the whole document's ids):
# - GPT-2's byte-level regex (ByteLevel with use_regex; bpe:VOCAB's), 's|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|
#   \s+(?!\S)|\s+, lets a space into a pre-token only as its first character or within a whitespace run. So no
#   pre-token holds both the non-space before the cut and the space after it; and the scan, which has no look-behind
#   and whose one look-ahead (?!\S) only ends whitespace runs, finds the same pre-tokens on each side as in the whole.
#   A cut after "\n" would not do: "\n\n" and a run of spaces are one pre-token, and (?!\S) sees the piece's end.
# - DeepSeek's sequences of Split regexes (LLM: [\r\n], \s?[A-Za-z...]+, \s?[punctuation]+, \s+$, CJK, \p{N}+; V3:
#   \p{N}{1,3}, CJK/kana, then a GPT-4-style regex) keep whitespace in a match only as its first character or in a
#   whitespace run as well, and their letter patterns start a match at " " + letter, so the cut is a boundary even
#   where the character before it belongs to no pattern; \s+$ cannot match at a piece end that is not whitespace.
# Other Split regexes are not proven: cut_problem accepts only these kinds of pre-tokenizer and then checks the rule
# on a probe text with a cut after every kind of character (probe_text). Anything else (Metaspace adds a prefix to every
# piece; slow tokenizers; added tokens that strip spaces) is tokenized whole, with a note (memory ~150x the document).
PIECE_CUT = re.compile(r"(?<=[^\s\u180e\u200b\ufeff]) (?=[A-Za-z])")
CUTTABLE_NORMALIZERS = {"Sequence", "NFC", "NFD", "NFKC", "NFKD", "Lowercase"}  # per character, never across a space
CUTTABLE_PRE_TOKENIZERS = {"Sequence", "ByteLevel", "Split", "Digits"}


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
    """What the tokenizer is: a local directory's file hash, or a Hub id with the commit it resolves to. Online that is
    the Hub's answer; offline (HF_HUB_OFFLINE=1, or the Hub out of reach) the commit the local cache holds for the main
    branch, which is what AutoTokenizer loads then; None when neither can tell (see recorded_identity)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file())
        return {"spec": spec, "sha256": lmdata.sha256_files(files)}
    if parse_bpe_spec(spec) is not None:
        return {"spec": spec}
    from huggingface_hub import constants

    if not constants.is_offline_mode() and lmdata.hub_unreachable_reason() is None:
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
    if not threads:  # a tokenizer process: Ctrl-C is the main process's to handle (it stops them all)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
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


def encode_documents(texts: list[str], joined: bool = False, ends: bool = True) -> tuple[np.ndarray, int, float]:
    """Token ids of each document followed by EOS, flat in the token dtype, the documents' UTF-8 byte count, and this
    process's resident memory in MiB. joined: the texts are consecutive pieces of one document, with one EOS after the
    last, and only if it `ends` the document."""
    ids = _worker["encode"](texts)
    eos_after = [not joined or i == len(ids) - 1 for i in range(len(ids))]
    eos_after[-1] = eos_after[-1] and ends
    flat = np.fromiter(
        (t for doc, eos in zip(ids, eos_after) for t in (*doc, *((_worker["eos"],) if eos else ()))),
        dtype=np.int64,
        count=sum(map(len, ids)) + sum(eos_after),
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
    written. joined: the texts are consecutive pieces of one long document, which the task `starts` and/or `ends`."""

    split: str
    texts: list[str] | None
    position: dict | None = None
    joined: bool = False
    starts: bool = True
    ends: bool = True


class WorkerDied(Exception):
    """A tokenizer process ended without being asked to (the out-of-memory killer, kill -9, a crash): exit 3."""


class _RecordingSpawn(multiprocessing.context.SpawnContext):
    """The spawn start method, keeping every process it starts: once the pool breaks they tell which one died, and
    how (concurrent.futures only says that one did)."""

    def __init__(self):
        super().__init__()
        self.started: list = []

    def Process(self, *args, **kwargs):  # the name ProcessPoolExecutor calls
        process = multiprocessing.context.SpawnProcess(*args, **kwargs)
        self.started.append(process)
        return process


class TokenizerPool:
    """num_proc tokenizer processes, spawned (forking a process that holds a Rust tokenizer's threads can deadlock).
    concurrent.futures, not multiprocessing.Pool: when a process dies, Pool starts another and waits forever for the
    batch the dead one held, while ProcessPoolExecutor fails every pending result at once (BrokenProcessPool) and
    stops the other processes."""

    def __init__(self, num_proc: int, init_args: tuple):
        self.context = _RecordingSpawn()
        self.executor = ProcessPoolExecutor(
            num_proc, mp_context=self.context, initializer=init_tokenizer_worker, initargs=init_args
        )

    def submit(self, task: Task) -> Future:
        return self.executor.submit(encode_documents, task.texts, task.joined, task.ends)

    def close(self) -> None:
        self.executor.shutdown(wait=True)

    def stop(self) -> None:
        for process in self.context.started:
            if process.exitcode is None:
                process.terminate()
        self.executor.shutdown(wait=True, cancel_futures=True)

    def death(self) -> str:
        """Which process died and how, once the pool has broken: the first one that did not end by the SIGTERM that
        the pool sends the others."""
        self.stop()
        ended = [p for p in self.context.started if p.exitcode is not None]
        dead = next((p for p in ended if p.exitcode != -signal.SIGTERM), ended[0] if ended else None)
        if dead is None:
            return "a tokenizer process died"
        if dead.exitcode == -signal.SIGKILL:
            how = "was killed by SIGKILL (the out-of-memory killer sends it too: see dmesg, and lower --num_proc)"
        elif dead.exitcode < 0:
            how = f"was killed by {signal.Signals(-dead.exitcode).name}"
        else:
            how = f"exited with status {dead.exitcode}"
        return f"tokenizer process {dead.pid} {how}"


def in_order(tasks: Iterator[Task], pool: TokenizerPool | None, max_in_flight: int) -> Iterator[tuple[Task, tuple]]:
    """(task, encode_documents result) for every task, in task order, with at most max_in_flight batches queued."""
    queue: collections.deque = collections.deque()
    for task in tasks:
        if task.texts is None:
            queue.append((task, None))
        elif pool is None:
            queue.append((task, encode_documents(task.texts, task.joined, task.ends)))
        else:
            queue.append((task, pool.submit(task)))
        while queue and (len(queue) > max_in_flight or not isinstance(queue[0][1], Future) or queue[0][1].done()):
            done, result = queue.popleft()
            yield done, result.result() if isinstance(result, Future) else result
    for done, result in queue:
        yield done, result.result() if isinstance(result, Future) else result


# ---------------------------------------------------------------------------------------------------------------------
# Long documents: pieces the tokenizer cannot tell from the whole
# ---------------------------------------------------------------------------------------------------------------------


def document_pieces(doc: str | lmdata.FileText, size: int, cut: re.Pattern | None) -> Iterator[str]:
    """A document's text in pieces, each cut at the first match of `cut` once it has `size` characters (no match:
    longer); `cut` None: one piece, the whole text. A FileText is read block by block, never whole."""
    blocks = doc.blocks() if isinstance(doc, lmdata.FileText) else iter([doc])
    if cut is None:
        yield doc if isinstance(doc, str) else "".join(blocks)
        return
    text, start, searched = "", 0, 0
    for block in blocks:
        text, searched, start = text[start:] + block, max(0, searched - start), 0  # "" + doc does not copy doc
        while len(text) - start > size:
            found = cut.search(text, max(start + size, searched))
            if found is None:
                searched = len(text) - 1  # a space at the very end is a cut once the next block shows a letter
                break
            yield text[start : found.start()]
            start = found.start()
    if start < len(text):
        yield text[start:]


def _component_types(node) -> set[str]:
    """The "type" of a tokenizer.json component and of every component nested in it."""
    if isinstance(node, list):
        return set().union(*map(_component_types, node))
    if not isinstance(node, dict):
        return set()
    return ({node["type"]} if "type" in node else set()) | _component_types(list(node.values()))


def probe_text() -> str:
    """A cut candidate after every kind of character, before every kind of word, amid every kind of whitespace."""
    before = list("aZ9.,'\")-_$`@éßΩж中한ا😀") + ["\u0301", "\u200d", "e\u0301", "1,000", "ab'", "x\t"]
    after = ["a", "ab", "s", "t", "re", "ll", "A9", "b'c", "x.", "y\n\n", "z  ", "w\r\n", "q😀", "k\u0301", "Dr. X"]
    around = ["", " ", "  ", "\n", "\n\n", "\t", "\r\n", "\u00a0", "\u3000", "\n \n", "   \n"]
    parts = [
        around[(i + j) % len(around)] + b + " " + a + around[(i * j) % len(around)]
        for i, b in enumerate(before)
        for j, a in enumerate(after)
    ]
    return "".join(parts)


def cut_problem(tokenizer_dir: Path) -> str | None:
    """None when documents cut at PIECE_CUT tokenize with this tokenizer exactly as whole, else why not (see
    PIECE_CUT): its kind of normalizer, pre-tokenizer and added tokens, then every cut of a probe text."""
    path = tokenizer_dir / "tokenizer.json"
    if not path.is_file():
        return "no tokenizer.json (a slow, Python tokenizer)"
    from tokenizers import Tokenizer

    spec = json.loads(path.read_text())
    odd = _component_types(spec.get("normalizer")) - CUTTABLE_NORMALIZERS
    if odd:
        return f"its normalizer ({', '.join(sorted(odd))}) is not one that keeps to each character"
    kinds = _component_types(spec.get("pre_tokenizer"))
    if not kinds or kinds - CUTTABLE_PRE_TOKENIZERS:
        return f"its pre-tokenizer ({', '.join(sorted(kinds - CUTTABLE_PRE_TOKENIZERS)) or 'none'}) is not one known"
    for added in spec.get("added_tokens", []):
        content = added.get("content", "")
        # rstrip takes in the space after a cut; lstrip the space before a word that is an added token
        lstrip_word = added.get("lstrip") and content[:1].isascii() and content[:1].isalpha()
        if added.get("rstrip") or lstrip_word or any(c.isspace() for c in content):
            return f"its added token {content!r} takes in the whitespace around it"
    tok = Tokenizer.from_file(str(path))
    tok.no_truncation()
    text = probe_text()
    cuts = [m.start() for m in PIECE_CUT.finditer(text)]
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    whole = tok.encode(text, add_special_tokens=False).ids
    if [t for e in tok.encode_batch(pieces, add_special_tokens=False) for t in e.ids] != whole:
        return "a probe text cut at those places gave other token ids than whole"
    return None


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
            lmdata.resolve_local_files(spec, own_dirs(Path(cfg.output_dir).expanduser().resolve()))


def own_dirs(out_dir: Path) -> tuple[Path, Path]:
    """The output directory and its work directory: never read as a source, wherever a --dataset directory is."""
    return out_dir, out_dir.parent / f".{out_dir.name}.partial"


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
            if target != "train":
                continue
            # the trainer counts pre-tokens per text: pieces cut at PIECE_CUT give a byte-level BPE the same counts
            for piece in document_pieces(text, PIECE_CHARS, PIECE_CUT) if not isinstance(text, str) else [text]:
                yield piece
                seen += len(piece)
                if seen >= BPE_SAMPLE_CHARS:
                    return


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


def piece_tasks(split: str, doc: str | lmdata.FileText, cut: re.Pattern | None) -> Iterator[Task]:
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
    sources: list[lmdata.Source],
    cfg: Config,
    start: dict,
    per_source: list[dict],
    bar,
    by_bytes: bool,
    uncut: str | None,
) -> Iterator[Task]:
    """The tokenizer tasks of every source in order, with a checkpoint every --checkpoint_mb of text and at the end
    of each source. From a checkpoint (start), the documents it covers are read again (for the counts) but not sent.
    Documents over PIECE_CHARS go in pieces, unless `uncut` says why this tokenizer's cannot be cut."""
    every, cut, noted = cfg.checkpoint_mb * 1_000_000, None if uncut else PIECE_CUT, False
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
        for n, (text, target) in enumerate(lmdata.routed_documents(source, cfg.validation_fraction), 1):
            counts[target] += 1
            bar.update(source.stats.read_bytes - last_read if by_bytes else 1)
            last_read = source.stats.read_bytes
            if n <= skip:
                continue
            if uncut and len(text) >= WHOLE_NOTE_CHARS and not noted:
                print(f"note: documents of {len(text):,} characters are tokenized whole: {uncut}", file=sys.stderr)
                noted = True
            if isinstance(text, lmdata.FileText) or (cut and len(text) > PIECE_CHARS):
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
        check_counts(source, counts, cfg.validation_fraction)
        per_source[si] = {**source.identity, **source.stats.counts(), "documents": dict(counts)}
        yield Task("", None, {"source": si + 1, "documents": 0})


def check_counts(source: lmdata.Source, counts: collections.Counter, fraction: float) -> None:
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


def auto_num_proc(sources: list[lmdata.Source]) -> int:
    """One tokenizer process per core; but starting them costs about a second, so corpora of known size under 32 MB a
    core go through this process, where the tokenizer's own threads use the cores."""
    cores = os.cpu_count() or 1
    known = all(s.total_bytes is not None for s in sources)
    return 1 if known and sum(s.total_bytes for s in sources) < cores * (32 << 20) else cores


def tokenize_all(
    cfg: Config,
    sources: list[lmdata.Source],
    tmp_dir: Path,
    tokenizer,
    dtype: np.dtype,
    stamp: dict,
    resume: dict | None,
) -> dict:
    """Stream every source through the tokenizer into tmp_dir, from the checkpoint `resume` when given; every
    checkpoint's progress.json carries `stamp` (fingerprint, tokenizer identity). Returns the counts per split and per
    source, and the tokens this run wrote. A tokenizer process that dies raises WorkerDied."""
    counts = resume["splits"] if resume else {}
    writers: dict[str, SplitWriter] = {}
    per_source = resume["sources"] if resume else [{} for _ in sources]
    start = resume["position"] if resume else {"source": 0, "documents": 0}
    num_proc = cfg.num_proc or auto_num_proc(sources)
    args = (str(tmp_dir / "tokenizer"), dtype.str, tokenizer.eos_token_id, num_proc == 1)
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
    tasks = make_tasks(sources, cfg, start, per_source, bar, by_bytes, cut_problem(tmp_dir / "tokenizer"))
    try:
        for task, result in in_order(tasks, pool, 2 * num_proc + 2):
            done = sum(c["tokens"] for c in counts.values()) - tokens0
            rate = f"{done / (time.perf_counter() - t0):,.0f} tokens/s"
            if task.texts is None:
                for w in writers.values():
                    w.sync()
                progress = {**stamp, "position": task.position, "splits": counts, "sources": per_source}
                write_json_atomic(tmp_dir / "progress.json", progress)
                if bar.disable:  # no terminal: a line per checkpoint instead of the bar
                    print(f"checkpoint: {done + tokens0:,} tokens written, {rate}", flush=True)
                continue
            if task.split not in writers:
                writers[task.split] = SplitWriter(tmp_dir, task.split, dtype, counts.get(task.split))
            ids, n_bytes, worker_rss = result
            writers[task.split].write(task, ids, n_bytes)
            peak_worker = max(peak_worker, worker_rss)
            counts[task.split] = writers[task.split].counts
            bar.set_postfix_str(rate, refresh=False)
    except BrokenProcessPool:
        raise WorkerDied(pool.death()) from None
    except BaseException:
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
        itemsize = lmdata.token_dtype(len(tokenizer)).itemsize
        for split, c in progress["splits"].items():
            for path, size in (
                (lmdata.split_file(tmp_dir, split), c["tokens"] * itemsize),
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
        lmdata.open_source(spec, cfg.text_field, cfg.doc_separator, exclude=own_dirs(out_dir)) for spec in cfg.dataset
    ]
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
        dtype = lmdata.token_dtype(len(tokenizer))
        t1 = time.perf_counter()
        stamp = {"fingerprint": fp, "tokenizer_identity": tok_id}
        result = tokenize_all(cfg, sources, tmp_dir, tokenizer, dtype, stamp, resume)
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
        "format_version": lmdata.FORMAT_VERSION,
        "dtype": dtype.name,
        "vocab_size": len(tokenizer),
        "eos_id": tokenizer.eos_token_id,
        "tokenizer": cfg.tokenizer,
        "tokenizer_identity": stamp["tokenizer_identity"],
        "split_rule": SPLIT_RULE,
        "splits": {s: split_meta[s] for s in lmdata.SPLITS if s in split_meta},
        "sources": result["sources"],
        "fingerprint": stamp["fingerprint"],
        "command": ["prepare_data.py", *argv],
    }


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
    except WorkerDied as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
