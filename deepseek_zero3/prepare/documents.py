"""Documents in: text files, JSON lines and Parquet columns read as streams of documents.

This module owns how text is read (UTF-8, a byte-order mark dropped, CRLF turned into LF, undecodable bytes replaced
and counted in SourceStats, a file too long to hold streamed as a FileText), how a file splits into documents
(WikiText articles, blocks between blank lines, a literal separator), the held-out rule (a document's hash against
the validation fraction, or a single document's last part), and WikiText pages as lm-evaluation-harness scores them
(eval.py). Which files and Hub datasets make up a --dataset, and which split each document goes to, is corpora.py's.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import hashlib
import itertools
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from deepseek_zero3.cli import UserError

TEXT_SUFFIXES = (".txt", ".raw", ".tokens")
DATA_SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".parquet")

# WikiText's top-level article title: " = Title = " (section titles are " = = Section = = ").
_WIKITEXT_TITLE = re.compile(r"^ = [^=].* = $")
_READ_BLOCK = 1 << 22


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


codecs.register_error("documents-count-replace", _count_replaced)


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
        decoder = codecs.getincrementaldecoder("utf-8")(errors="documents-count-replace")
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
    elif path.stat().st_size > LONG_DOCUMENT_BYTES and not (is_wikitext_file(path) or is_wikitext(file_head(path))):
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


def file_head(path: Path, n: int = 200_000) -> str:
    with open(path, "rb") as f:
        return f.read(n).decode("utf-8", errors="replace")
