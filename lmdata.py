"""The data format shared by prepare_data.py, train.py and eval.py.

Three things live here and nowhere else:
  * reading corpora into whole documents (Hub presets, local files, the built-in `python-docs` corpus),
  * the on-disk format: one flat token file per split plus meta.json, and its checked reader,
  * the training-sample order: windows of seq_len + 1 tokens, shuffled as a pure function of (seed, sample).
"""

from __future__ import annotations

import ast
import functools
import glob
import hashlib
import json
import os
import re
import socket
import sys
import sysconfig
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

FORMAT_VERSION = 1
SPLITS = ("train", "validation", "test")
TEXT_SUFFIXES = (".txt", ".raw", ".tokens")
DATA_SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".parquet")
PYTHON_DOCS_VERSION = 1  # bump when the python-docs builder changes what it emits

# Hub presets: name -> (dataset id, config, whether its rows are WikiText lines to be joined into articles)
HUB_PRESETS = {
    "wikitext-103": ("Salesforce/wikitext", "wikitext-103-raw-v1", True),
    "wikitext-2": ("Salesforce/wikitext", "wikitext-2-raw-v1", True),
    "openwebtext": ("Skylion007/openwebtext", None, False),
}
BUILTIN_SOURCES = ("python-docs",)

# WikiText's top-level article title: " = Title = " (section titles are " = = Section = = ").
_WIKITEXT_TITLE = re.compile(r"^ = [^=].* = $")
_WIKITEXT_SPLIT_FILES = {"train": "wiki.train", "validation": "wiki.valid", "test": "wiki.test"}


class DataError(Exception):
    """A problem with the user's input data; the message is one line that says what to do."""


# ---------------------------------------------------------------------------------------------------------------------
# Documents
# ---------------------------------------------------------------------------------------------------------------------


def split_wikitext_articles(text: str) -> list[str]:
    """Split WikiText text into whole articles, each starting at its ` = Title = ` line.

    Every byte after the first title stays in exactly one article (blank lines before the next title belong to the
    previous article); a whitespace-only preamble before the first title is dropped.
    """
    docs: list[str] = []
    current: list[str] = []
    for line in text.splitlines(keepends=True):
        if _WIKITEXT_TITLE.match(line.rstrip("\r\n")) and current:
            docs.append("".join(current))
            current = []
        current.append(line)
    if current:
        docs.append("".join(current))
    if docs and not docs[0].strip():
        docs.pop(0)
    return docs


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
    (directory / f"{name}.yaml").write_text(HARNESS_TASK_YAML.format(name=name, pages=(directory / "pages.jsonl").resolve()))
    (directory / "harness_wikitext.py").write_text(
        "from lm_eval.tasks.wikitext.preprocess_wikitext import process_results, wikitext_detokenizer  # noqa: F401\n")
    return name


def harness_command(model_dir, task_dir: Path, name: str, batch_size: int, output_path: Path) -> list[str]:
    """`lm_eval` on the task write_harness_wikitext_task made, fp32 on the CPU, as a user runs it (offline: run it with
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1). read_harness_results reads what it writes."""
    return [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={model_dir},dtype=float32",
            "--tasks", name, "--include_path", str(task_dir), "--batch_size", str(batch_size), "--device", "cpu",
            "--output_path", str(output_path)]


def read_harness_results(output_path: Path, name: str) -> dict:
    """The task's metrics from the one results_*.json lm_eval wrote under output_path, e.g. {"word_perplexity": ...}."""
    (results,) = Path(output_path).rglob("results_*.json")
    return {k.split(",")[0]: v for k, v in json.loads(results.read_text())["results"][name].items()}


def wikitext_text_from_rows(rows) -> str:
    """The raw WikiText file from the Hub's rows (`Salesforce/wikitext`): one row a line, blank lines (a single space
    in the file) stored as empty strings. Gives back the raw file byte for byte, whether rows keep their newline or not."""
    return "".join((r if r.endswith("\n") else r + "\n") if r.strip() else " \n" for r in rows)


def is_wikitext_file(path: Path) -> bool:
    """A file named like WikiText's own (wiki.train.raw, wiki.test.tokens, ...)."""
    return re.fullmatch(r"wiki\.(train|valid|test)\.(raw|tokens|txt)", path.name) is not None


def is_wikitext(text: str) -> bool:
    return any(_WIKITEXT_TITLE.match(line) for line in text[:200_000].splitlines())


def split_blank_line_blocks(text: str) -> list[str]:
    """One document per block of text separated by blank lines (surrounding whitespace kept out)."""
    return [block.strip("\n") for block in re.split(r"\n[ \t]*\n", text) if block.strip()]


def read_text(path: Path) -> tuple[str, int]:
    """Decode a file as UTF-8; undecodable bytes become U+FFFD. Returns (text, number of bytes replaced)."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        return text, text.count("\ufffd") - raw.decode("utf-8", errors="ignore").count("\ufffd")


def text_file_documents(path: Path, text_blocks: bool) -> tuple[list[str], int]:
    """Documents of one plain-text file: WikiText articles when it has WikiText titles, otherwise the whole file
    (text_blocks=False, for training) or one document per blank-line-separated block (text_blocks=True)."""
    text, replaced = read_text(path)
    if is_wikitext(text):
        return split_wikitext_articles(text), replaced
    if text_blocks:
        return split_blank_line_blocks(text), replaced
    return ([text] if text.strip() else []), replaced


def jsonl_documents(path: Path, text_field: str) -> tuple[list[str], int]:
    text, replaced = read_text(path)
    docs = []
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{line_no} is not valid JSON ({e.msg}); each line of a .jsonl file must be one JSON object") from None
        if not isinstance(record, dict) or text_field not in record:
            raise DataError(f"{path}:{line_no} has no '{text_field}' field; name the text field with --text_field")
        docs.append(str(record[text_field]))
    return docs, replaced


def parquet_documents(path: Path, text_field: str) -> list[str]:
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    if text_field not in schema.names:
        raise DataError(f"{path} has no '{text_field}' column (it has {schema.names}); name the text column with --text_field")
    return [str(t) for t in pq.read_table(path, columns=[text_field]).column(text_field).to_pylist() if t is not None]


def file_documents(path: Path, text_field: str, text_blocks: bool) -> tuple[list[str], int]:
    if path.suffix == ".jsonl":
        return jsonl_documents(path, text_field)
    if path.suffix == ".parquet":
        return parquet_documents(path, text_field), 0
    return text_file_documents(path, text_blocks)


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
        nodes = (n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))
        docstrings = [d.strip() for d in (ast.get_docstring(n) for n in nodes) if d and d.strip()]
        if docstrings:
            docs.append("\n\n".join(docstrings))
    return docs


# ---------------------------------------------------------------------------------------------------------------------
# Sources: a --dataset value -> documents per split
# ---------------------------------------------------------------------------------------------------------------------


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


def resolve_local_files(spec: str) -> tuple[dict[str, list[Path]], str]:
    """Map a local path spec (file, directory or glob) to files per split. Returns (files by split, layout)."""
    path = Path(spec).expanduser()
    if any(c in spec for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True) if Path(p).is_file())
        files = [f for f in files if f.suffix in DATA_SUFFIXES]
        if not files:
            raise DataError(f"--dataset {spec!r}: the glob matches no {'/'.join(DATA_SUFFIXES)} file; check the pattern")
        return {"train": files}, "files"
    if path.is_file():
        if path.suffix not in DATA_SUFFIXES:
            raise DataError(f"--dataset {spec!r}: unsupported file type {path.suffix!r}; use one of {', '.join(DATA_SUFFIXES)}")
        return {"train": [path]}, "files"
    if path.is_dir():
        by_split: dict[str, list[Path]] = {}
        for split, stem in _WIKITEXT_SPLIT_FILES.items():
            candidates = [path / f"{stem}{suffix}" for suffix in (".raw", ".tokens", ".txt")]
            found = [c for c in candidates if c.is_file()]
            if found:
                by_split[split] = found[:1]  # prefer the raw text over the tokenized variant
        if by_split:
            return by_split, "wikitext"
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES)
        if not files:
            raise DataError(f"--dataset {spec!r}: the directory holds no {'/'.join(DATA_SUFFIXES)} file")
        return {"train": files}, "files"
    known = ", ".join(list(HUB_PRESETS) + list(BUILTIN_SOURCES))
    raise DataError(f"--dataset {spec!r} is neither an existing file, directory or glob nor a known preset ({known})")


def source_identity(spec: str) -> dict:
    """What a source is, cheaply (no tokenizing): used to decide whether prepared data is up to date."""
    if spec in BUILTIN_SOURCES:
        return {"spec": spec, "kind": "builtin", "version": f"{PYTHON_DOCS_VERSION}/python-{sys.version.split()[0]}"}
    if spec in HUB_PRESETS:
        name, config, _ = HUB_PRESETS[spec]
        return {"spec": spec, "kind": "hub", "dataset": name, "config": config}
    files, layout = resolve_local_files(spec)
    all_files = [f for split in files.values() for f in split]
    return {"spec": spec, "kind": "local", "layout": layout, "files": len(all_files), "sha256": sha256_files(all_files)}


def hub_unreachable_reason() -> str | None:
    """None when the Hugging Face Hub answers (or HF_HUB_OFFLINE asks for the local cache), else why not."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return None
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=5).close()
        return None
    except OSError as e:
        return f"cannot reach {endpoint.hostname} ({e.strerror or e})"


def load_hub_preset(spec: str) -> dict[str, list[str] | object]:
    reason = hub_unreachable_reason()
    if reason:
        raise DataError(
            f"--dataset {spec}: {reason}. Offline, download the dataset elsewhere and pass its local copy "
            f"(e.g. a directory with wiki.train.raw / wiki.valid.raw / wiki.test.raw, or .txt/.jsonl/.parquet files), "
            f"or set HF_HUB_OFFLINE=1 to use the Hugging Face cache"
        )
    from datasets import load_dataset

    name, config, _ = HUB_PRESETS[spec]
    return hub_documents(spec, load_dataset(name, config))


def hub_documents(spec: str, dsd) -> dict[str, list[str] | object]:
    """Documents per split of a Hub preset's DatasetDict: WikiText rows (lines) rejoined into the raw file and split
    into articles exactly as a local copy of the file is; other corpora keep their Arrow-backed `text` column."""
    wikitext_lines = HUB_PRESETS[spec][2]
    out: dict[str, object] = {}
    for split, ds in dsd.items():
        split = {"valid": "validation"}.get(split, split)
        out[split] = split_wikitext_articles(wikitext_text_from_rows(ds["text"])) if wikitext_lines else ds.select_columns(["text"])
    return out


def load_source(spec: str, text_field: str = "text", text_blocks: bool = False, identity: dict | None = None) -> tuple[dict, dict]:
    """Documents per split of one --dataset value, and a record of the source for meta.json (starting from
    `identity`, the source_identity of the spec, when the caller has already computed it).

    Splits are lists of strings, or (large Hub corpora) `datasets.Dataset`s with a `text` column.
    """
    record = dict(identity) if identity is not None else source_identity(spec)
    replaced = 0
    if spec == "python-docs":
        by_split: dict = {"train": python_docs_corpus()}
    elif spec in HUB_PRESETS:
        by_split = load_hub_preset(spec)
    else:
        files, _ = resolve_local_files(spec)
        by_split = {}
        for split, paths in files.items():
            docs: list[str] = []
            for p in paths:
                file_docs, n = file_documents(p, text_field, text_blocks)
                docs.extend(file_docs)
                replaced += n
            by_split[split] = docs
    if spec in BUILTIN_SOURCES:
        record["sha256"] = sha256_text(by_split["train"])
    record["replaced_bytes"] = replaced
    return by_split, record


def held_out_indices(n_docs: int, fraction: float) -> list[int]:
    """A deterministic, evenly spread held-out slice: round(n * fraction) documents (at least 1, at most n - 1)."""
    if n_docs < 2 or fraction <= 0:
        return []
    k = min(n_docs - 1, max(1, round(n_docs * fraction)))
    return sorted({int(i * n_docs / k + n_docs / (2 * k)) for i in range(k)})


def split_held_out(docs, fraction: float):
    """(train, held_out) from one list or Dataset of documents."""
    held = held_out_indices(len(docs), fraction)
    held_set = set(held)
    keep = [i for i in range(len(docs)) if i not in held_set]
    if isinstance(docs, list):
        return [docs[i] for i in keep], [docs[i] for i in held]
    return docs.select(keep), docs.select(held)


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
        raise DataError(f"{data_dir} is not a prepared data directory (no meta.json); create it with prepare_data.py")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{meta_path} is not valid JSON ({e.msg}); rebuild it with prepare_data.py --overwrite") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"{data_dir} has data format version {meta.get('format_version')!r}, this code reads version {FORMAT_VERSION}; "
            f"rebuild it with prepare_data.py --overwrite"
        )
    expected = token_dtype(meta["vocab_size"]).name
    if meta.get("dtype") != expected:
        raise DataError(f"{meta_path} says dtype {meta.get('dtype')!r} but vocab_size {meta['vocab_size']} needs {expected}; rebuild it")
    return meta


def load_split(data_dir: str | Path, split: str, meta: dict | None = None) -> np.memmap:
    """Memory-map one split's token file after checking it against meta.json."""
    meta = meta or read_meta(data_dir)
    if split not in meta["splits"]:
        raise DataError(f"{data_dir} has no '{split}' split (it has {sorted(meta['splits'])})")
    path = split_file(Path(data_dir), split)
    dtype = np.dtype(meta["dtype"])
    n_tokens = meta["splits"][split]["tokens"]
    if not path.is_file():
        raise DataError(f"{path} is missing; rebuild the data directory with prepare_data.py --overwrite")
    size = path.stat().st_size
    if size != n_tokens * dtype.itemsize:
        raise DataError(
            f"{path} has {size} bytes but meta.json promises {n_tokens} {dtype.name} tokens ({n_tokens * dtype.itemsize} bytes); "
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
