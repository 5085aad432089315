"""Tokenizer processes: each loads the saved tokenizer and encodes batches of documents into token ids (EOS after each
document, in the token files' dtype); a pool of them that hands back results in the order the batches went in and,
when a process dies (the out-of-memory killer, kill -9), says which one and how; and long documents cut into pieces
that the tokenizer cannot tell from the whole (PIECE_CUT, checked per tokenizer by cut_problem), so that memory stays
flat whatever a document's size. prepare_data.py's tokenizing pass (token_writer.py) is what drives them.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import multiprocessing.context
import os
import re
import signal
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

import numpy as np

import documents
from cli import UserError

PIECE_CHARS = 1 << 16  # a longer document goes to the tokenizer in pieces of about this many characters

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


def rss_mib() -> float:
    """This process's resident memory now, MiB (ru_maxrss would count, in a spawned process, its parent's pages at
    the fork that started it)."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20


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


def document_pieces(doc: str | documents.FileText, size: int, cut: re.Pattern | None) -> Iterator[str]:
    """A document's text in pieces, each cut at the first match of `cut` once it has `size` characters (no match:
    longer); `cut` None: one piece, the whole text. A FileText is read block by block, never whole."""
    blocks = doc.blocks() if isinstance(doc, documents.FileText) else iter([doc])
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
