"""Corpora: a --dataset value as its splits, each a stream of documents, and the split each document goes to.

A value is a Hub preset (its Parquet files, found on the dataset's branch or the Hub's conversion), a local file,
directory or glob (laid out as WikiText files, split directories or plain training text), or the built-in
python-docs corpus. This module owns finding and opening them, what identifies each (a content hash or the Hub
commit, recorded in meta.json and the fingerprint), leaving prepare_data.py's own outputs out of a directory or
glob, whether the Hub answers, and routed_documents: every document with its output split. Reading the files
themselves is documents.py's.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import glob
import hashlib
import json
import os
import re
import sys
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path, PurePosixPath

from deepseek_zero3.cli import UserError, shown
from deepseek_zero3.prepare import documents
from deepseek_zero3.prepare.documents import DATA_SUFFIXES, TEXT_SUFFIXES, SourceStats

VALIDATION_FRACTION = 0.02  # prepare_data.py's default share of held-out documents
SPLITS = ("train", "validation", "test")
PYTHON_DOCS_VERSION = 1  # bump when the python-docs builder changes what it emits

BUILTIN_SOURCES = ("python-docs",)
_WIKITEXT_SPLIT_FILES = {"train": "wiki.train", "validation": "wiki.valid", "test": "wiki.test"}
_SPLIT_NAMES = {"train": "train", "validation": "validation", "valid": "validation", "test": "test"}


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
        rows = (t for p in paths for t in documents.parquet_documents(p, field, stats, opener))
        if preset.wikitext_lines:
            yield from documents.wikitext_articles(documents.wikitext_lines_from_rows(rows))
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
            yield from documents.file_documents(p, text_field, separator, stats)

    single = (
        separator == "file"
        and layout == "files"
        and len(all_files) == 1
        and all_files[0].suffix in TEXT_SUFFIXES
        and not documents.is_wikitext_file(all_files[0])
        and not documents.is_wikitext(documents.file_head(all_files[0]))
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


def routed_documents(source: Source, fraction: float) -> Iterator[tuple[str, str]]:
    """(text, output split) per document of one source, in a fixed order: its own
    splits in SPLITS order; without a validation split of its own, training documents whose hash falls below
    `fraction` go to validation (a single-document source: its last `fraction`, cut at a line end)."""
    for split in [s for s in SPLITS if s in source.splits]:
        for text in source.splits[split]():
            if documents.is_blank(text):
                source.stats.empty_documents += 1
                continue
            if split != "train" or "validation" in source.splits:
                yield text, split
            elif source.single_document:
                train, held = documents.split_by_position(text, fraction)
                yield train, "train"
                if held:
                    yield held, "validation"
            else:
                yield text, "validation" if documents.is_held_out(text, fraction) else "train"


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
    """resolve_local_files, and the directories whose files it left out. A file whose name is not UTF-8 is refused:
    a source is named after its file, and meta.json, the tokenizer and the console take UTF-8 only."""
    files, layout, skipped = _local_files(spec, exclude)
    for path in (path for split in files.values() for path in split):
        try:
            str(path).encode("utf-8")
        except UnicodeEncodeError:
            raise UserError(f"--dataset {shown(spec)}: the name of {shown(path)} is not valid UTF-8 (a source is named "
                            "after its file, and meta.json and the tokenizer take UTF-8 only); rename it in "
                            "UTF-8") from None  # fmt: skip
    return files, layout, skipped


def _local_files(spec: str, exclude: Iterable[Path]) -> tuple[dict[str, list[Path]], str, list[Path]]:
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


def offline_variable() -> str | None:
    """The variable that puts Hugging Face's libraries in offline mode (local cache only), if one does, read as they
    read it: huggingface_hub (and transformers) by the first of HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE that is set,
    even to 0; datasets by HF_DATASETS_OFFLINE too."""
    hub = next((v for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if os.environ.get(v)), None)
    for variable in (hub, "HF_DATASETS_OFFLINE"):
        if variable and os.environ.get(variable, "").upper() in ("1", "ON", "YES", "TRUE"):
            return variable
    return None


def from_hub(what: str, load, fix: str):
    """load(): something the Hub serves (a dataset, a model, a tokenizer). Out of the Hub's reach, or in offline mode
    with a local cache that does not hold it, one UserError saying `what`, why and `fix` instead of the library's
    traceback (datasets' ConnectionError, transformers' OSError, huggingface_hub's OfflineModeIsEnabled)."""
    reason = hub_unreachable_reason()
    if reason is not None and offline_variable() is None:
        raise UserError(f"{what}: {reason}; {fix}")
    try:
        return load()
    except Exception as e:  # noqa: BLE001 - only in offline mode, where every library says "not cached" its own way
        variable = offline_variable()
        if variable is None:
            raise
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise UserError(
            f"{what}: {variable}={os.environ[variable]} (offline mode) and the local Hugging Face cache does not hold "
            f"it ({type(e).__name__}: {first}); {fix}, or run once without {variable} where the Hub is reachable"
        ) from None


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
