"""Tokenizer processes: each loads the saved tokenizer and encodes batches of documents into token ids (EOS after each
document, in the token files' dtype); a pool of them that hands back results in the order the batches went in and,
when a process dies (the out-of-memory killer, kill -9), says which one and how; and long documents cut into pieces
that the tokenizer cannot tell from the whole (PIECE_CUT, checked per tokenizer by cut_problem), so that memory stays
flat whatever a document's size. prepare_data.py's tokenizing pass (token_writer.py) is what drives them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import multiprocessing
import multiprocessing.connection
import os
import queue
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from deepseek_zero3.cli import UserError
from deepseek_zero3.prepare import documents

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


LOAD_FAILED = -1  # the batch number of a tokenizer process's message that it could not load the tokenizer


class WorkerDied(Exception):
    """A tokenizer process ended without being asked to (the out-of-memory killer, kill -9, a crash), or could not load
    the tokenizer the main process saved: exit 3."""


_worker: dict = {}


def init_tokenizer_worker(tokenizer_dir: str, dtype: str, eos_id: int, threads: bool) -> None:
    """Load the saved tokenizer in this process: the Rust tokenizer when there is a tokenizer.json, else
    AutoTokenizer. A document's text is text: a special token's text in it (`<|endoftext|>` in web text about language
    models) is tokenized as the characters it is, never as that token, which would put an EOS, and so a document
    boundary, inside the document (SPECIAL_TOKENS_IN_DOCUMENTS); the EOS after a document is appended by its id."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads else "false"
    if not threads:  # a tokenizer process: Ctrl-C is the main process's to handle (it stops them all)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    path = Path(tokenizer_dir) / "tokenizer.json"
    if path.is_file():
        tok = text_tokenizer(path)
        tok.no_truncation()
        tok.no_padding()
        encode = lambda texts: [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]  # noqa: E731
    else:
        from transformers import AutoTokenizer

        slow = AutoTokenizer.from_pretrained(tokenizer_dir)
        encode = lambda texts: slow(  # noqa: E731
            texts, add_special_tokens=False, split_special_tokens=True
        )["input_ids"]
    _worker.update(encode=encode, dtype=np.dtype(dtype), eos=eos_id)


# How meta.json and the fingerprint record that a special token's text inside a document was tokenized as text (data
# prepared without this key read it as the token itself: an EOS there cut the document for document masking).
SPECIAL_TOKENS_IN_DOCUMENTS = "text"


def text_tokenizer(tokenizer_json: Path):
    """The Rust tokenizer of a tokenizer.json, reading special tokens' text as text (encode_special_tokens)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.encode_special_tokens = True
    return tok


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


def worker_loop(tasks, results, init_args: tuple) -> None:
    """A tokenizer process: take (number, batch) from the shared `tasks` queue, encode it and send (number, "ok",
    result) or (number, "error", the exception) on this process's own pipe, until None or until the main process is
    gone (killed: nothing would read the results, and the process would wait on the queue for ever)."""
    try:
        init_tokenizer_worker(*init_args)
    except Exception as e:  # said once by the main process, not as a traceback from each process
        with contextlib.suppress(OSError):
            results.send((LOAD_FAILED, "error", f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"))  # one line
        return
    if os.environ.get("TOKENIZER_TEST_FAULT") == "die_sending":  # tests: killed halfway through sending a result
        os.write(results.fileno(), (1 << 20).to_bytes(4, "big") + b"half a message")
        os.kill(os.getpid(), signal.SIGKILL)
    parent = os.getppid()
    while True:
        try:
            item = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if item is None:
            return
        number, args = item
        try:
            reply = (number, "ok", encode_documents(*args))
        except Exception as e:  # a UserError (an id too large) reaches the user as it would in one process
            reply = (number, "error", e)
        try:
            results.send(reply)
        except OSError:  # the main process is gone
            return


class TokenizerPool:
    """num_proc tokenizer processes, spawned (forking a process that holds a Rust tokenizer's threads can deadlock):
    batches go into one queue that any free process takes from, and each process sends its results back on its own
    pipe, numbered; result(n) hands back batch n's.

    Not concurrent.futures: its processes share one result pipe and its lock, so one killed while sending a result
    leaves half a message there, and the executor's thread waits forever for the rest (prepare_data.py hung so after a
    kill -9, seen here). Here a death shows as end of file on that process's own pipe. multiprocessing.Pool would start
    another process and wait forever for the dead one's batch."""

    def __init__(self, num_proc: int, init_args: tuple):
        ctx = multiprocessing.get_context("spawn")
        self.tasks = ctx.Queue()
        self.processes, self.pipes = [], []
        for _ in range(num_proc):
            ours, theirs = ctx.Pipe(duplex=False)
            process = ctx.Process(target=worker_loop, args=(self.tasks, theirs, init_args), daemon=True)
            process.start()
            theirs.close()  # the process's end only: its death is then end of file here
            self.processes.append(process)
            self.pipes.append(ours)
        self.submitted = 0
        self.received: dict[int, tuple] = {}
        self.tokenizer_dir = init_args[0]

    def submit(self, task: Task) -> int:
        """Queue a batch; returns its number."""
        self.tasks.put((self.submitted, (task.texts, task.joined, task.ends)))
        self.submitted += 1
        return self.submitted - 1

    def receive(self, block: bool) -> None:
        """Take in what the processes have sent (block: wait for at least one); WorkerDied when a pipe has ended."""
        for pipe in multiprocessing.connection.wait(self.pipes, timeout=None if block else 0):
            process = self.processes[self.pipes.index(pipe)]
            try:
                number, status, value = pipe.recv()
            except (EOFError, OSError):
                raise WorkerDied(self.death(process)) from None
            if number == LOAD_FAILED:
                self.stop()
                raise WorkerDied(
                    f"tokenizer process {process.pid} could not load the tokenizer saved in {self.tokenizer_dir} "
                    f"({value}); with --num_proc 1 the main process loads and runs it instead"
                )
            self.received[number] = (status, value)

    def ready(self, number: int) -> bool:
        self.receive(block=False)
        return number in self.received

    def result(self, number: int) -> tuple:
        """Batch `number`'s encode_documents result (its exception raised here)."""
        while number not in self.received:
            self.receive(block=True)
        status, value = self.received.pop(number)
        if status == "error":
            raise value
        return value

    def close(self) -> None:
        for _ in self.processes:
            self.tasks.put(None)
        for process in self.processes:
            process.join()
        self.tasks.close()
        for pipe in self.pipes:
            pipe.close()

    def stop(self) -> None:
        """End every process now (a death, an error, Ctrl-C): nothing they hold is needed."""
        self.tasks.cancel_join_thread()  # batches still queued are dropped, not waited on at exit
        for process in self.processes:
            if process.exitcode is None:
                process.kill()
        for process in self.processes:
            process.join()

    def death(self, process) -> str:
        """Which process died and how: `process`, whose pipe ended, by its exit status."""
        process.join()
        self.stop()
        if process.exitcode == -signal.SIGKILL:
            how = "was killed by SIGKILL (the out-of-memory killer sends it too: see dmesg, and lower --num_proc)"
        elif process.exitcode < 0:
            how = f"was killed by {signal.Signals(-process.exitcode).name}"
        else:
            how = f"exited with status {process.exitcode}"
        return f"tokenizer process {process.pid} {how}"


def in_order(tasks: Iterator[Task], pool: TokenizerPool | None, max_in_flight: int) -> Iterator[tuple[Task, tuple]]:
    """(task, encode_documents result) for every task, in task order, with at most max_in_flight batches queued."""
    pending: collections.deque = collections.deque()  # (task, its batch number | its result | None)
    for task in tasks:
        if task.texts is None:
            pending.append((task, None))
        elif pool is None:
            pending.append((task, encode_documents(task.texts, task.joined, task.ends)))
        else:
            pending.append((task, pool.submit(task)))
        while pending and (
            len(pending) > max_in_flight or not isinstance(pending[0][1], int) or pool.ready(pending[0][1])
        ):
            done, result = pending.popleft()
            yield done, pool.result(result) if isinstance(result, int) else result
    for done, result in pending:
        yield done, pool.result(result) if isinstance(result, int) else result


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
    tok = text_tokenizer(path)
    tok.no_truncation()
    text = probe_text()
    cuts = [m.start() for m in PIECE_CUT.finditer(text)]
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    whole = tok.encode(text, add_special_tokens=False).ids
    if [t for e in tok.encode_batch(pieces, add_special_tokens=False) for t in e.ids] != whole:
        return "a probe text cut at those places gave other token ids than whole"
    return None
