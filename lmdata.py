"""The data format shared by prepare_data.py, train.py and eval.py.

Three things live here and nowhere else:
  * reading corpora as streams of documents (Hub presets, local files, the built-in `python-docs` corpus),
  * the on-disk format: one flat token file per split plus meta.json, and its checked reader,
  * the training-sample order: windows of seq_len + 1 tokens, shuffled as a pure function of (seed, sample).
"""

from __future__ import annotations

import ast
import codecs
import dataclasses
import functools
import glob
import hashlib
import itertools
import json
import os
import re
import sys
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path, PurePosixPath

import numpy as np

from cli import UserError

FORMAT_VERSION = 1
VALIDATION_FRACTION = 0.02  # prepare_data.py's default share of held-out documents
SPLITS = ("train", "validation", "test")
TEXT_SUFFIXES = (".txt", ".raw", ".tokens")
DATA_SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".parquet")
PYTHON_DOCS_VERSION = 1  # bump when the python-docs builder changes what it emits

BUILTIN_SOURCES = ("python-docs",)

# WikiText's top-level article title: " = Title = " (section titles are " = = Section = = ").
_WIKITEXT_TITLE = re.compile(r"^ = [^=].* = $")
_WIKITEXT_SPLIT_FILES = {"train": "wiki.train", "validation": "wiki.valid", "test": "wiki.test"}
_SPLIT_NAMES = {"train": "train", "validation": "validation", "valid": "validation", "test": "test"}
_READ_BLOCK = 1 << 22


# ---------------------------------------------------------------------------------------------------------------------
# Documents: streams of text -> streams of documents
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SourceStats:
    """What a source's reader tolerated on the way (reported and kept in meta.json), and how far it has read."""

    replaced_bytes: int = 0  # undecodable bytes, each replaced by U+FFFD
    crlf_line_ends: int = 0  # Windows "\r\n" line ends turned into "\n"
    bom_files: int = 0  # files whose UTF-8 byte-order mark was dropped
    empty_documents: int = 0  # whitespace-only documents skipped
    read_bytes: int = 0  # bytes read from files so far (progress)

    def counts(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "read_bytes"}

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, 0)


_counting = {"stats": None}


def _count_replaced(err: UnicodeDecodeError):
    if _counting["stats"] is not None:
        _counting["stats"].replaced_bytes += err.end - err.start
    return "\ufffd", err.end


codecs.register_error("lmdata-count-replace", _count_replaced)


def iter_text(path: Path, stats: SourceStats) -> Iterator[str]:
    """A file's text in blocks of about 4 MB: UTF-8, a leading BOM dropped, "\\r\\n" turned into "\\n", undecodable
    bytes replaced by U+FFFD, each counted in `stats`. UTF-16 and empty files are refused."""
    with open(path, "rb") as f:
        block = f.read(_READ_BLOCK)
        if not block.strip() and len(block) < _READ_BLOCK:
            raise UserError(f"{path} is empty{' (whitespace only)' if block else ''}; remove it or give it text")
        if block.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
            raise UserError(
                f"{path} is UTF-16 (byte-order mark), not UTF-8; convert it first, e.g. "
                f"iconv -f UTF-16 -t UTF-8 {path} > {path.with_suffix('.utf8' + path.suffix).name}"
            )
        head = block[:65536]
        undecodable = len(head) - len(head.decode("utf-8", "ignore").encode("utf-8"))
        if head[:4096].count(0) > len(head[:4096]) // 4 or undecodable > len(head) // 4:
            # a few bad bytes are tolerated (and counted), but a file that mostly does not decode would train on U+FFFD
            raise UserError(
                f"{path} is not UTF-8 text (a quarter of its first bytes are NUL or do not decode: binary, compressed, "
                "or another encoding); remove it from --dataset, or convert it, e.g. iconv -f LATIN1 -t UTF-8"
            )
        if block.startswith(codecs.BOM_UTF8):
            stats.bom_files += 1
            stats.read_bytes += 3
            block = block[3:]
        decoder = codecs.getincrementaldecoder("utf-8")(errors="lmdata-count-replace")
        held_cr = ""
        while True:
            stats.read_bytes += len(block)
            _counting["stats"] = stats
            try:
                text = held_cr + decoder.decode(block, final=not block)
            finally:
                _counting["stats"] = None
            held_cr = ""
            if text.endswith("\r") and block:  # a "\r\n" may straddle two blocks
                text, held_cr = text[:-1], "\r"
            stats.crlf_line_ends += text.count("\r\n")
            text = text.replace("\r\n", "\n")
            if text:
                yield text
            if not block:
                return
            block = f.read(_READ_BLOCK)


# A text file read as one document (--doc_separator file) above this size is never held in memory whole: it streams
# from disk, in pieces, to the tokenizer (a str costs 1-4 bytes a character, and Python joins blocks by copying).
LONG_DOCUMENT_BYTES = 1 << 23


@dataclasses.dataclass(eq=False)
class FileText:
    """A text file read as one document, or a range [start, stop) of its characters, read again in blocks whenever it
    is needed instead of held in memory. Its first full read (`summary`) counts what the reader tolerated into
    `stats`, once; the others count into scratch statistics."""

    path: Path
    stats: SourceStats
    start: int = 0
    stop: int | None = None  # None: the end of the file

    def blocks(self) -> Iterator[str]:
        pos = 0
        for block in iter_text(self.path, SourceStats()):
            end = pos + len(block)
            if end > self.start:
                yield block[max(0, self.start - pos) : None if self.stop is None else self.stop - pos]
            pos = end
            if self.stop is not None and pos >= self.stop:
                return

    @functools.cached_property
    def summary(self) -> tuple[int, bytes, int]:
        """(characters, blake2b-64 of the UTF-8 text, index after its last non-whitespace character)."""
        digest, n, text_end = hashlib.blake2b(digest_size=8), 0, 0
        for block in iter_text(self.path, self.stats):
            digest.update(block.encode("utf-8", "surrogatepass"))
            kept = len(block.rstrip())
            text_end = n + kept if kept else text_end
            n += len(block)
        return n, digest.digest(), text_end

    def __len__(self) -> int:
        return (self.summary[0] if self.stop is None else self.stop) - self.start

    def split_by_position(self, fraction: float) -> tuple[FileText, FileText | None]:
        """split_by_position for a whole file, read twice instead of held."""
        n, _, text_end = self.summary
        limit, cut, pos = int(n * (1 - fraction)), -1, 0
        for block in self.blocks():
            if pos >= limit:
                break
            found = block.rfind("\n", 0, limit - pos)
            cut = pos + found if found >= 0 else cut
            pos += len(block)
        if cut <= 0 or text_end <= cut + 1:
            return self, None
        return FileText(self.path, self.stats, 0, cut + 1), FileText(self.path, self.stats, cut + 1, n)


def is_blank(doc: str | FileText) -> bool:
    return doc.summary[2] == 0 if isinstance(doc, FileText) else not doc.strip()


def iter_lines(chunks: Iterable[str]) -> Iterator[str]:
    """Lines (each with its "\\n", the last one maybe without) of a stream of text blocks."""
    rest = ""
    for chunk in chunks:
        lines = (rest + chunk).split("\n")
        rest = lines.pop()
        for line in lines:
            yield line + "\n"
    if rest:
        yield rest


def wikitext_articles(lines: Iterable[str]) -> Iterator[str]:
    """WikiText lines -> whole articles, each starting at its ` = Title = ` line.

    Every byte after the first title stays in exactly one article (blank lines before the next title belong to the
    previous article); a whitespace-only preamble before the first title is dropped.
    """
    current: list[str] = []
    first = True
    for line in lines:
        if _WIKITEXT_TITLE.match(line.rstrip("\r\n")) and current:
            article = "".join(current)
            if not (first and not article.strip()):
                yield article
            first, current = False, []
        current.append(line)
    if current and "".join(current).strip():
        yield "".join(current)


def split_wikitext_articles(text: str) -> list[str]:
    return list(wikitext_articles(iter_lines([text])))


def blank_line_blocks(lines: Iterable[str]) -> Iterator[str]:
    """One document per block of lines between blank (whitespace-only) lines, without its surrounding newlines."""
    current: list[str] = []
    for line in lines:
        if line.strip(" \t\n"):
            current.append(line)
        elif current:
            yield "".join(current).strip("\n")
            current = []
    if current:
        yield "".join(current).strip("\n")


def split_blank_line_blocks(text: str) -> list[str]:
    return list(blank_line_blocks(iter_lines([text])))


def separated_documents(chunks: Iterable[str], separator: str) -> Iterator[str]:
    """Documents between occurrences of a literal separator (e.g. "<|endoftext|>"), without surrounding newlines."""
    rest = ""
    for chunk in chunks:
        parts = (rest + chunk).split(separator)
        rest = parts.pop()
        yield from (p.strip("\n") for p in parts)
    yield rest.strip("\n")


def text_file_documents(path: Path, separator: str, stats: SourceStats) -> Iterator[str | FileText]:
    """Documents of one plain-text file. separator "file": WikiText articles when the file has WikiText titles, else the
    whole file (over LONG_DOCUMENT_BYTES as a FileText, read when needed); "blank_line": blocks between blank lines;
    anything else: a literal separator string."""
    chunks = iter_text(path, stats)
    if separator == "blank_line":
        yield from blank_line_blocks(iter_lines(chunks))
    elif separator != "file":
        yield from separated_documents(chunks, separator)
    elif path.stat().st_size > LONG_DOCUMENT_BYTES and not (is_wikitext_file(path) or is_wikitext(_head(path))):
        yield FileText(path, stats)
    else:
        first = next(chunks, "")
        rest = itertools.chain([first], chunks)
        if is_wikitext(first) or is_wikitext_file(path):
            yield from wikitext_articles(iter_lines(rest))
        else:
            yield "".join(rest)


def jsonl_documents(path: Path, text_field: str, stats: SourceStats) -> Iterator[str]:
    """The `text_field` string of every record; a record without it, or with a non-string there, is refused."""
    for line_no, line in enumerate(iter_lines(iter_text(path, stats)), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(
                f"{path}:{line_no} is not valid JSON ({e.msg}); each line of a .jsonl file must be one JSON object"
            ) from None
        if not isinstance(record, dict) or text_field not in record:
            raise UserError(f"{path}:{line_no} has no '{text_field}' field; name the text field with --text_field")
        if not isinstance(record[text_field], str):
            raise UserError(
                f"{path}:{line_no}: '{text_field}' holds a {type(record[text_field]).__name__}, not a string; "
                f"fix the record or name another field with --text_field"
            )
        yield record[text_field]


def parquet_documents(path: str | Path, text_field: str, stats: SourceStats, open_file=open) -> Iterator[str]:
    """The `text_field` column of a Parquet file (local, or a Hub file through `open_file`), row group by row group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open_file(path, "rb") as f:
        pf = _parquet_step(path, lambda: pq.ParquetFile(f))
        if text_field not in pf.schema_arrow.names:
            raise UserError(
                f"{path} has no '{text_field}' column (it has {pf.schema_arrow.names}); name the text column with "
                "--text_field"
            )
        column_type = pf.schema_arrow.field(text_field).type
        if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
            raise UserError(
                f"{path}: column '{text_field}' holds {column_type}, not strings; name the text column with "
                "--text_field"
            )
        row = 0
        for group in range(pf.num_row_groups):
            texts = _parquet_step(path, lambda g=group: pf.read_row_group(g, columns=[text_field]))
            texts = texts.column(text_field).to_pylist()
            meta = pf.metadata.row_group(group)
            stats.read_bytes += sum(meta.column(i).total_compressed_size for i in range(meta.num_columns))
            for text in texts:
                if text is None:
                    raise UserError(
                        f"{path}: row {row} has no '{text_field}' (null); drop the row or name another column"
                    )
                row += 1
                yield text


def _parquet_step(path, step):
    """step() on a Parquet file, its failure (a truncated download, a file that is not Parquet) one line."""
    import pyarrow as pa

    try:
        return step()
    except (pa.ArrowException, OSError) as e:
        raise UserError(
            f"{path} cannot be read as Parquet ({str(e).splitlines()[0] if str(e) else type(e).__name__}): it is "
            "truncated or not a Parquet file; download it again, or remove it from --dataset"
        ) from None


def wikitext_text_from_rows(rows) -> str:
    """The raw WikiText file from the Hub's rows (`Salesforce/wikitext`): one row a line, blank lines (a single space
    in the file) stored as empty strings. Gives back the raw file byte for byte, whether rows keep their newline or
    not."""
    return "".join(wikitext_lines_from_rows(rows))


def wikitext_lines_from_rows(rows: Iterable[str]) -> Iterator[str]:
    return ((r if r.endswith("\n") else r + "\n") if r.strip() else " \n" for r in rows)


def is_wikitext_file(path: Path) -> bool:
    """A file named like WikiText's own (wiki.train.raw, wiki.test.tokens, ...)."""
    return re.fullmatch(r"wiki\.(train|valid|test)\.(raw|tokens|txt)", path.name) is not None


def is_wikitext(text: str) -> bool:
    return any(_WIKITEXT_TITLE.match(line) for line in text[:200_000].splitlines())


def read_text(path: Path) -> tuple[str, int]:
    """A whole (small) file's text as iter_text reads it, and the number of undecodable bytes replaced."""
    stats = SourceStats()
    return "".join(iter_text(path, stats)), stats.replaced_bytes


def file_documents(path: Path, text_field: str, separator: str, stats: SourceStats) -> Iterator[str]:
    if path.suffix == ".jsonl":
        return jsonl_documents(path, text_field, stats)
    if path.suffix == ".parquet":
        return parquet_documents(path, text_field, stats)
    return text_file_documents(path, separator, stats)


def is_held_out(text: str | FileText, fraction: float) -> bool:
    """Whether a document belongs to the held-out split: a hash of its text against `fraction`. Needs no count, so it
    works on a stream; the same text always lands on the same side (duplicates cannot straddle the split)."""
    if isinstance(text, FileText):
        digest = text.summary[1]
    else:
        digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < fraction * 2**64


def routed_documents(source: Source, fraction: float) -> Iterator[tuple[str, str]]:
    """(text, output split) per document of one source, in a fixed order: its own
    splits in SPLITS order; without a validation split of its own, training documents whose hash falls below
    `fraction` go to validation (a single-document source: its last `fraction`, cut at a line end)."""
    for split in [s for s in SPLITS if s in source.splits]:
        for text in source.splits[split]():
            if is_blank(text):
                source.stats.empty_documents += 1
                continue
            if split != "train" or "validation" in source.splits:
                yield text, split
            elif source.single_document:
                train, held = split_by_position(text, fraction)
                yield train, "train"
                if held:
                    yield held, "validation"
            else:
                yield text, "validation" if is_held_out(text, fraction) else "train"


def split_by_position(text: str | FileText, fraction: float) -> tuple[str | FileText, str | FileText | None]:
    """(train, held-out) of a single-document source: its last `fraction` held out, cut at a line boundary."""
    if isinstance(text, FileText):
        return text.split_by_position(fraction)
    cut = text.rfind("\n", 0, int(len(text) * (1 - fraction)))
    if cut <= 0 or not text[cut + 1 :].strip():
        return text, ""
    return text[: cut + 1], text[cut + 1 :]


def harness_wikitext_pages(text: str) -> list[str]:
    """WikiText pages as lm-evaluation-harness scores them (the `EleutherAI/wikitext_document_level` dataset): the file
    split on "\n", a new page at every top-level title line, the lines of a page joined by "\n" (so only the last
    page keeps a final newline), whitespace-only pages dropped. A title line is one that, with " = = = " and " = = "
    section markers closed up and the ends stripped, starts with "= " and ends with " =".
    """
    pages, lines = [], []
    for line in text.split("\n"):
        marker = line.replace("= = =", "===").replace("= =", "==").strip()
        if marker.startswith("= ") and marker.endswith(" =") and lines:
            pages.append("\n".join(lines))
            lines = []
        lines.append(line)
    pages.append("\n".join(lines))
    return [p for p in pages if p.strip()]


HARNESS_TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {pages}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: !function harness_wikitext.wikitext_detokenizer
process_results: !function harness_wikitext.process_results
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def write_harness_wikitext_task(pages: list[str], directory: Path, name: str = "wikitext_local") -> str:
    """lm-evaluation-harness's `wikitext` task on local pages (its Hub dataset out of reach): the same output type,
    metrics, detokenizer and process_results, imported from the harness, with the pages from a JSONL. Run it with
    `lm_eval --tasks NAME --include_path DIRECTORY ...`. Returns NAME."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "pages.jsonl").write_text("".join(json.dumps({"page": p}) + "\n" for p in pages))
    (directory / f"{name}.yaml").write_text(
        HARNESS_TASK_YAML.format(name=name, pages=(directory / "pages.jsonl").resolve())
    )
    (directory / "harness_wikitext.py").write_text(
        "from lm_eval.tasks.wikitext.preprocess_wikitext import process_results, wikitext_detokenizer  # noqa: F401\n"
    )
    return name


def harness_command(model_dir, task_dir: Path, name: str, batch_size: int, output_path: Path) -> list[str]:
    """`lm_eval` on the task write_harness_wikitext_task made, fp32 on the CPU, as a user runs it (offline: run it with
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1). read_harness_results reads what it writes."""
    return [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={model_dir},dtype=float32",
        "--tasks",
        name,
        "--include_path",
        str(task_dir),
        "--batch_size",
        str(batch_size),
        "--device",
        "cpu",
        "--output_path",
        str(output_path),
    ]


def read_harness_results(output_path: Path, name: str) -> dict:
    """The task's metrics from the one results_*.json lm_eval wrote under output_path, e.g. {"word_perplexity": ...}."""
    (results,) = Path(output_path).rglob("results_*.json")
    return {k.split(",")[0]: v for k, v in json.loads(results.read_text())["results"][name].items()}


def python_docs_corpus() -> list[str]:
    """The built-in offline corpus: the running Python's own documentation, deterministic for a given Python.

    One document per language-reference topic (pydoc_data) and one per standard-library module (its module, class
    and function docstrings, read with `ast`, so nothing is imported or executed).
    """
    from pydoc_data.topics import topics

    docs = [topics[name].strip() for name in sorted(topics)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "idlelib", "lib2to3", "turtledemo", "ensurepip", "tkinter", "pydoc_data"}
    for path in sorted(stdlib.rglob("*.py")):
        parts = path.relative_to(stdlib).parts
        if any(p in skip or p.startswith("test") for p in parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = (
            n
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        )
        docstrings = [d.strip() for d in (ast.get_docstring(n) for n in nodes) if d and d.strip()]
        if docstrings:
            docs.append("\n\n".join(docstrings))
    return docs


# ---------------------------------------------------------------------------------------------------------------------
# Sources: a --dataset value -> its splits, each a stream of documents
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HubPreset:
    repo: str
    config: str | None  # the subset's directory in the repository, None when it has one subset
    wikitext_lines: bool  # rows are WikiText lines, to be joined back into articles


HUB_PRESETS = {
    "wikitext-103": HubPreset("Salesforce/wikitext", "wikitext-103-raw-v1", True),
    "wikitext-2": HubPreset("Salesforce/wikitext", "wikitext-2-raw-v1", True),
    "openwebtext": HubPreset("Skylion007/openwebtext", None, False),
}
# Where a Hub dataset's Parquet files are: its own branch, else the Hub's automatic conversion (for repositories that
# hold a loading script, which datasets >= 4 refuses to run: "Dataset scripts are no longer supported").
HUB_REVISIONS = ("main", "refs/convert/parquet")


@dataclasses.dataclass
class Source:
    """One --dataset value: each split as a function that starts a fresh stream of its documents, what the source
    is (recorded in meta.json and the fingerprint) and what its readers tolerated."""

    spec: str
    identity: dict
    splits: dict[str, Callable[[], Iterator[str]]]
    stats: SourceStats
    single_document: bool = False  # one text file read as one document: its held-out part is cut by position
    total_bytes: int | None = None  # bytes the readers will read, when known (progress bar)
    skipped: list[Path] = dataclasses.field(default_factory=list)  # prepare_data.py outputs its directory holds


class HubAccess:
    """The Hugging Face Hub, as the Hub presets use it: list a revision's files, open one file of a commit."""

    def list_files(self, repo: str, revision: str) -> tuple[str, list[str]] | None:
        """(commit sha, file paths) of a dataset revision, None when the revision does not exist."""
        from huggingface_hub import HfApi
        from huggingface_hub.errors import RevisionNotFoundError

        try:
            info = HfApi().dataset_info(repo, revision=revision)
        except RevisionNotFoundError:
            return None
        return info.sha, [s.rfilename for s in info.siblings or []]

    def open(self, repo: str, commit: str, path: str):
        from huggingface_hub import HfFileSystem

        return HfFileSystem().open(f"datasets/{repo}@{commit}/{path}", "rb")


def layout_splits(paths: list[str]) -> dict[str, list[str]]:
    """Files by split, as the Hub lays out Parquet (and as many local corpora are laid out): a `train/`, `validation/`
    (`valid/`), `test/` directory, or a file named `train-00000-of-00002.parquet`, `test.jsonl`, ... Other files
    (`test_notes.txt` too) go to train. Parts of a partial conversion (`partial-train/`) are refused."""
    by_split: dict[str, list[str]] = {}
    for p in sorted(paths):
        parts = PurePosixPath(p).parts
        partial = [d for d in parts[:-1] if d.startswith("partial-")]
        if partial:
            raise UserError(
                f"{p}: '{partial[0]}' is a partial conversion of that split, not all of it; download the full split"
            )
        names = [d for d in parts[:-1] if d in _SPLIT_NAMES]
        stem = re.fullmatch(r"(train|validation|valid|test)(-\d.*)?", PurePosixPath(p).stem)
        split = _SPLIT_NAMES[names[-1]] if names else _SPLIT_NAMES[stem.group(1)] if stem else "train"
        by_split.setdefault(split, []).append(p)
    return by_split


def hub_parquet_files(spec: str, hub: HubAccess) -> tuple[str, str, dict[str, list[str]]]:
    """(revision, commit, Parquet files by split) of a Hub preset: the first revision in HUB_REVISIONS with a complete
    set of Parquet files for the preset's subset."""
    preset = HUB_PRESETS[spec]
    tried = []
    for revision in HUB_REVISIONS:
        try:
            listing = hub.list_files(preset.repo, revision)
        except Exception as e:  # noqa: BLE001 - network, auth, HF_HUB_OFFLINE: all end in the same advice
            raise UserError(
                f"--dataset {spec}: cannot list {preset.repo}@{revision} on the Hub ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); download it and pass its directory, e.g. --dataset "
                f"path/to/{spec}"
            ) from None
        if listing is None:
            tried.append(f"{revision}: no such revision")
            continue
        commit, files = listing
        files = [
            f
            for f in files
            if f.endswith(".parquet") and (preset.config is None or preset.config in PurePosixPath(f).parts[:-1])
        ]
        if not files:
            has_script = any(f.endswith(".py") for f in listing[1])
            tried.append(f"{revision}: no Parquet files" + (" (a loading script)" if has_script else ""))
            continue
        try:
            return revision, commit, layout_splits(files)
        except UserError as e:
            tried.append(f"{revision}: {e}")
    raise UserError(
        f"--dataset {spec}: no complete Parquet copy of {preset.repo} on the Hub ({'; '.join(tried)}); download the "
        f"corpus as .parquet/.jsonl/.txt files and pass their directory, e.g. --dataset path/to/{spec}"
    )


def hub_source(spec: str, text_field: str, hub: HubAccess | None = None) -> Source:
    hub = hub or HubAccess()  # tests put a local stand-in in its place
    preset = HUB_PRESETS[spec]
    revision, commit, files = hub_parquet_files(spec, hub)
    stats = SourceStats()
    field = "text" if preset.wikitext_lines else text_field

    def stream(paths: list[str]) -> Iterator[str]:
        opener = lambda path, mode: hub.open(preset.repo, commit, path)  # noqa: E731
        rows = (t for p in paths for t in parquet_documents(p, field, stats, opener))
        if preset.wikitext_lines:
            yield from wikitext_articles(wikitext_lines_from_rows(rows))
        else:
            yield from rows

    identity = {
        "spec": spec,
        "kind": "hub",
        "dataset": preset.repo,
        "config": preset.config,
        "revision": revision,
        "commit": commit,
        "files": sum(len(v) for v in files.values()),
    }
    return Source(spec, identity, {s: functools.partial(stream, p) for s, p in files.items()}, stats)


def local_source(spec: str, text_field: str, separator: str, exclude: Iterable[Path] = ()) -> Source:
    files, layout, skipped = local_files(spec, exclude)
    stats = SourceStats()
    all_files = [f for split in files.values() for f in split]
    identity = {
        "spec": spec,
        "kind": "local",
        "layout": layout,
        "files": len(all_files),
        "sha256": sha256_files(all_files),
    }

    def stream(paths: list[Path]) -> Iterator[str]:
        for p in paths:
            yield from file_documents(p, text_field, separator, stats)

    single = (
        separator == "file"
        and layout == "files"
        and len(all_files) == 1
        and all_files[0].suffix in TEXT_SUFFIXES
        and not is_wikitext_file(all_files[0])
        and not is_wikitext(_head(all_files[0]))
    )
    return Source(
        spec,
        identity,
        {s: functools.partial(stream, p) for s, p in files.items()},
        stats,
        single,
        sum(f.stat().st_size for f in all_files),
        skipped,
    )


def builtin_source(spec: str) -> Source:
    docs = python_docs_corpus()
    identity = {
        "spec": spec,
        "kind": "builtin",
        "version": f"{PYTHON_DOCS_VERSION}/python-{sys.version.split()[0]}",
        "sha256": sha256_text(docs),
    }
    stats = SourceStats()

    def stream() -> Iterator[str]:
        for d in docs:
            stats.read_bytes += len(d.encode("utf-8"))
            yield d

    return Source(spec, identity, {"train": stream}, stats, total_bytes=sum(len(d.encode("utf-8")) for d in docs))


def open_source(
    spec: str, text_field: str = "text", separator: str = "file", hub: HubAccess | None = None, exclude=()
) -> Source:
    """The Source of one --dataset value. Nothing is read yet but what identifies it (local files are hashed). A local
    directory or glob leaves out prepare_data.py's outputs and the directories in `exclude`."""
    if spec in BUILTIN_SOURCES:
        return builtin_source(spec)
    if spec in HUB_PRESETS:
        reason = hub_unreachable_reason() if hub is None else None
        if reason:
            raise UserError(
                f"--dataset {spec}: {reason}. Offline, download the dataset elsewhere and pass its local copy as "
                "--dataset DIR (a directory with wiki.train.raw / wiki.valid.raw / wiki.test.raw, or "
                ".txt/.jsonl/.parquet files)"
            )
        return hub_source(spec, text_field, hub)
    return local_source(spec, text_field, separator, exclude)


def _head(path: Path, n: int = 200_000) -> str:
    with open(path, "rb") as f:
        return f.read(n).decode("utf-8", errors="replace")


def sha256_files(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def sha256_text(docs: list[str]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(d.encode("utf-8") + b"\0")
    return h.hexdigest()


def resolve_local_files(spec: str, exclude: Iterable[Path] = ()) -> tuple[dict[str, list[Path]], str]:
    """Map a local path spec (file, directory or glob) to files per split. Returns (files by split, layout):
    "wikitext" (wiki.train.* / wiki.valid.* / wiki.test.*), "splits" (train/ validation/ test/ directories or
    train-*.parquet-style names, as on the Hub) or "files" (everything is training text). A directory or glob leaves
    out prepare_data.py's outputs and the directories in `exclude` (see local_files)."""
    files, layout, _ = local_files(spec, exclude)
    return files, layout


def local_files(spec: str, exclude: Iterable[Path] = ()) -> tuple[dict[str, list[Path]], str, list[Path]]:
    """resolve_local_files, and the directories whose files it left out."""
    path = Path(spec).expanduser()
    if any(c in spec for c in "*?["):
        found = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True) if Path(p).is_file())
        files, skipped = without_prepared_outputs([f for f in found if f.suffix in DATA_SUFFIXES], exclude)
        if not files:
            only = f" outside prepare_data.py's outputs ({', '.join(map(str, skipped[:3]))})" if skipped else ""
            raise UserError(
                f"--dataset {spec!r}: the glob matches no {'/'.join(DATA_SUFFIXES)} file{only}; check the pattern"
            )
        return {"train": files}, "files", skipped
    if path.is_file():
        if path.suffix not in DATA_SUFFIXES:
            raise UserError(
                f"--dataset {spec!r}: unsupported file type {path.suffix!r}; use one of {', '.join(DATA_SUFFIXES)}"
            )
        return {"train": [path]}, "files", []
    if path.is_dir():
        inside = without_prepared_outputs([path / "-"], exclude)[1]
        if inside:
            raise UserError(
                f"--dataset {spec!r} lies in {inside[0]}, an output (or work directory) of prepare_data.py, not a "
                "corpus; pass the text it was prepared from"
            )
        by_split: dict[str, list[Path]] = {}
        for split, stem in _WIKITEXT_SPLIT_FILES.items():
            candidates = [path / f"{stem}{suffix}" for suffix in (".raw", ".tokens", ".txt")]
            found = [c for c in candidates if c.is_file()]
            if found:
                by_split[split] = found[:1]  # prefer the raw text over the tokenized variant
        if by_split:
            return by_split, "wikitext", []
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES)
        files, skipped = without_prepared_outputs(found, exclude)
        if not files:
            only = f" outside prepare_data.py's outputs ({', '.join(map(str, skipped[:3]))})" if skipped else ""
            raise UserError(f"--dataset {spec!r}: the directory holds no {'/'.join(DATA_SUFFIXES)} file{only}")
        named = layout_splits([p.relative_to(path).as_posix() for p in files])
        layout = "splits" if set(named) != {"train"} else "files"
        return {s: [path / p for p in v] for s, v in named.items()}, layout, skipped
    known = ", ".join(list(HUB_PRESETS) + list(BUILTIN_SOURCES))
    raise UserError(f"--dataset {spec!r} is neither an existing file, directory or glob nor a known preset ({known})")


def is_prepared_output(directory: Path) -> bool:
    """Whether a directory is prepare_data.py's output (a meta.json of its format, or any meta.json beside a train.bin:
    a torn one) or its work directory (.NAME.partial, also a killed run's)."""
    name = directory.name
    work_files = ("progress.json", "fingerprint", "tokenizer", ".lock", "meta.json")
    if name.startswith(".") and name.endswith(".partial") and any((directory / f).exists() for f in work_files):
        return True
    if not (directory / "meta.json").is_file():
        return False
    if (directory / "train.bin").is_file():
        return True
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and {"format_version", "splits", "fingerprint"} <= meta.keys()


def without_prepared_outputs(files: list[Path], exclude: Iterable[Path] = ()) -> tuple[list[Path], list[Path]]:
    """The files that lie in no prepare_data.py output and under no directory of `exclude`, and the directories of
    those left out. Corpus files found by a directory or a glob must never include them: a rerun would read its own
    validation.jsonl / test.jsonl as training text, and the held-out documents would land in both splits."""
    excluded = {Path(e).resolve() for e in exclude}
    owners: dict[Path, Path | None] = {}

    def owner(d: Path) -> Path | None:  # the output directory that d lies in, if any
        if d not in owners:
            if d in excluded or is_prepared_output(d):
                owners[d] = d
            else:
                owners[d] = None if d.parent == d else owner(d.parent)
        return owners[d]

    kept, skipped = [], []
    for f in files:
        found = owner(f.resolve().parent)
        if found is None:
            kept.append(f)
        elif found not in skipped:
            skipped.append(found)
    return kept, skipped


def hub_unreachable_reason() -> str | None:
    """None when the Hugging Face Hub answers (or offline mode, HF_HUB_OFFLINE=1, asks for the local cache), else why
    not. Asked through huggingface_hub's own HTTP client, so that HF_ENDPOINT and HTTPS_PROXY / HTTP_PROXY / NO_PROXY
    count as they do for every download: a raw socket would call a cluster that reaches the Hub through a proxy
    unreachable."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.is_offline_mode():
        return None
    try:
        get_session().head(constants.ENDPOINT, timeout=5)  # any HTTP answer, an error status too, means it answers
        return None
    except Exception as e:  # noqa: BLE001 - DNS, refused, proxy, TLS, timeout: all mean "not reachable from here"
        return f"cannot reach {constants.ENDPOINT} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


def synthetic_web_documents(n_bytes: int, seed: int = 0) -> Iterator[str]:
    """Web-like documents for benchmarks and tests, about n_bytes of UTF-8 in all, deterministic for a seed: a long
    tail of lengths, paragraphs, 30,000 made-up words drawn with Zipf frequencies, numbers, URLs and some non-ASCII
    text (accents, CJK, Cyrillic, Arabic, emoji)."""
    rng = np.random.default_rng(seed)
    syllables = [
        c + v
        for c in ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "tr", "ch"]
        for v in ["a", "e", "i", "o", "u", "ai", "ou", "er", "an", "in"]
    ]
    lengths = rng.integers(1, 5, 30_000)
    vocab = np.array(["".join(syllables[j] for j in rng.integers(0, len(syllables), n)) for n in lengths])
    cdf = np.cumsum(1 / np.arange(1, len(vocab) + 1))
    cdf /= cdf[-1]
    extra = ["café", "naïve", "Zürich", "São Paulo", "東京", "数据", "モデル", "Привет", "مرحبا", "🙂", "→", "€12.50"]
    done = 0
    while done < n_bytes:
        paragraphs = []
        for _ in range(int(rng.integers(1, 12))):
            n = int(rng.lognormal(3.8, 0.8)) + 3
            words = vocab[np.minimum(np.searchsorted(cdf, rng.random(n)), len(vocab) - 1)].tolist()
            for j in np.nonzero(rng.random(n) < 0.03)[0]:
                words[j] = extra[int(rng.integers(0, len(extra)))]
            for j in np.nonzero(rng.random(n) < 0.02)[0]:
                words[j] = (
                    str(int(rng.integers(0, 10**6)))
                    if rng.random() < 0.7
                    else f"https://example.org/{int(rng.integers(0, 10**5))}"
                )
            for j in np.nonzero(rng.random(n) < 0.06)[0]:
                words[j] += ","
            paragraphs.append(" ".join(words).capitalize() + ".")
        doc = "\n\n".join(paragraphs)
        done += len(doc.encode("utf-8"))
        yield doc


# ---------------------------------------------------------------------------------------------------------------------
# On-disk format
# ---------------------------------------------------------------------------------------------------------------------


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every token id fits, else uint32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def split_file(data_dir: Path, split: str) -> Path:
    return Path(data_dir) / f"{split}.bin"


def read_meta(data_dir: str | Path) -> dict:
    """meta.json of a prepared data directory, checked for what every reader relies on."""
    data_dir = Path(data_dir)
    meta_path = data_dir / "meta.json"
    if not meta_path.is_file():
        raise UserError(f"{data_dir} is not a prepared data directory (no meta.json); create it with prepare_data.py")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(
            f"{meta_path} is not valid JSON ({e.msg}); rebuild it with prepare_data.py --overwrite"
        ) from None
    if not isinstance(meta, dict):
        raise UserError(
            f"{meta_path} holds a JSON {type(meta).__name__}, not an object; rebuild it with prepare_data.py"
        )
    if meta.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"{data_dir} has data format version {meta.get('format_version')!r}, this code reads version "
            f"{FORMAT_VERSION}; "
            f"rebuild it with prepare_data.py --overwrite"
        )
    splits = meta.get("splits")
    if not (
        isinstance(meta.get("vocab_size"), int)
        and meta["vocab_size"] > 0
        and isinstance(meta.get("eos_id"), int)
        and isinstance(splits, dict)
        and all(isinstance(c, dict) and isinstance(c.get("tokens"), int) and c["tokens"] >= 0 for c in splits.values())
    ):
        raise UserError(
            f"{meta_path} is damaged (vocab_size, eos_id or per-split token counts missing or not numbers); rebuild "
            "it with prepare_data.py --overwrite"
        )
    expected = token_dtype(meta["vocab_size"]).name
    if meta.get("dtype") != expected:
        raise UserError(
            f"{meta_path} says dtype {meta.get('dtype')!r} but vocab_size {meta['vocab_size']} needs {expected}; "
            "rebuild it"
        )
    return meta


def load_split(data_dir: str | Path, split: str, meta: dict | None = None) -> np.memmap:
    """Memory-map one split's token file after checking it against meta.json."""
    meta = meta or read_meta(data_dir)
    if split not in meta["splits"]:
        raise UserError(f"{data_dir} has no '{split}' split (it has {sorted(meta['splits'])})")
    path = split_file(Path(data_dir), split)
    dtype = np.dtype(meta["dtype"])
    n_tokens = meta["splits"][split]["tokens"]
    if not path.is_file():
        raise UserError(f"{path} is missing; rebuild the data directory with prepare_data.py --overwrite")
    size = path.stat().st_size
    if size != n_tokens * dtype.itemsize:
        raise UserError(
            f"{path} has {size} bytes but meta.json promises {n_tokens} {dtype.name} tokens "
            f"({n_tokens * dtype.itemsize} bytes); "
            f"the file is truncated or foreign: rebuild with prepare_data.py --overwrite"
        )
    return np.memmap(path, dtype=dtype, mode="r", shape=(n_tokens,))


# ---------------------------------------------------------------------------------------------------------------------
# Training-sample order
# ---------------------------------------------------------------------------------------------------------------------


def num_windows(n_tokens: int, seq_len: int) -> int:
    """Non-overlapping windows of seq_len + 1 tokens (inputs and next-token targets) over a token stream."""
    return max(0, (n_tokens - 1) // seq_len)


def window(tokens: np.ndarray, index: int, seq_len: int) -> np.ndarray:
    start = index * seq_len
    return np.asarray(tokens[start : start + seq_len + 1], dtype=np.int64)


@functools.lru_cache(maxsize=2)
def _epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def sample_window(seed: int, sample: int, n_windows: int) -> tuple[int, int]:
    """(epoch, window index) of the global sample number `sample`: each epoch is a fresh permutation of all windows,
    a pure function of (seed, epoch), so any sample can be found again after a restart."""
    epoch, offset = divmod(sample, n_windows)
    return epoch, int(_epoch_permutation(seed, epoch, n_windows)[offset])


@dataclasses.dataclass
class TrainingData:
    meta: dict
    train_tokens: np.ndarray  # memory-mapped
    val_tokens: np.ndarray  # the first eval_tokens + 1 of the validation split
    n_windows: int  # training windows of seq_len + 1 tokens


def training_data(data_dir: str, seq_len: int, eval_tokens: int) -> TrainingData:
    """What train.py reads from a prepare_data.py directory, memory-mapped once, after checking it holds at least one
    window of seq_len + 1 tokens per split and its tokenizer."""
    if not Path(data_dir).is_dir():
        raise UserError(f"--data_dir {data_dir} does not exist; create it with prepare_data.py")
    meta = read_meta(data_dir)
    splits = {split: load_split(data_dir, split, meta) for split in ("train", "validation")}
    for split, tokens in splits.items():
        if num_windows(len(tokens), seq_len) < 1:
            raise UserError(
                f"the {split} split of {data_dir} has {len(tokens)} tokens, fewer than --seq_len "
                f"{seq_len} + 1; lower --seq_len or add data"
            )
    if not (Path(data_dir) / "tokenizer").is_dir():
        raise UserError(f"{data_dir} has no tokenizer/ directory; rebuild it with prepare_data.py --overwrite")
    val = splits["validation"][: eval_tokens + 1] if eval_tokens else splits["validation"]
    return TrainingData(meta, splits["train"], val, num_windows(len(splits["train"]), seq_len))
