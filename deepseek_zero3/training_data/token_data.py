"""Tokens out: the on-disk token format and the training-sample order.

prepare_data.py writes, and train.py and eval.py read, one flat token file per split plus meta.json; this module
owns that format (its version, dtype and checked reader), the order train.py draws windows of seq_len + 1 tokens in,
a pure function of (seed, sample) so that a resumed run sees exactly the samples it would have, and how many of them
one optimizer step takes (the batch plan).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from fractions import Fraction
from pathlib import Path

import numpy as np

from deepseek_zero3.cli import UserError
from deepseek_zero3.training_data import mixture

FORMAT_VERSION = 1


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


_PERMUTATIONS: dict[tuple[int, int, int], dict[int, np.ndarray]] = {}  # (seed, n, source): {epoch: window order}


def _epoch_permutation(seed: int, epoch: int, n: int, source: int = 0) -> np.ndarray:
    """The window order of one epoch of a source. Each source keeps its last two (a mixture visits the sources in
    turn; a batch can straddle an epoch's end)."""
    kept = _PERMUTATIONS.setdefault((seed, n, source), {})
    if epoch not in kept:
        rng = np.random.default_rng([seed, epoch] if source == 0 else [seed, epoch, source])
        kept[epoch] = rng.permutation(n)
        for old in sorted(kept)[:-2]:
            del kept[old]
    return kept[epoch]


def sample_window(seed: int, sample: int, n_windows: int, source: int = 0) -> tuple[int, int]:
    """(epoch, window index) of a source's sample number `sample`: each epoch is a fresh permutation of all its windows,
    a pure function of (seed, epoch, source), so any sample can be found again after a restart."""
    epoch, offset = divmod(sample, n_windows)
    return epoch, int(_epoch_permutation(seed, epoch, n_windows, source)[offset])


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """One optimizer step's batch: micro-batch x accumulation x processes sequences of seq_len tokens."""

    micro_batch_size: int
    grad_accum_steps: int
    world_size: int
    seq_len: int

    @property
    def sequences_per_step(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.world_size

    @property
    def tokens_per_step(self) -> int:
        return self.sequences_per_step * self.seq_len


def total_steps_for(max_steps: int, num_epochs: float, n_windows: int, sequences_per_step: int) -> int:
    if max_steps > 0:
        return max_steps
    return max(1, math.ceil(num_epochs * n_windows / sequences_per_step))


# ---------------------------------------------------------------------------------------------------------------------
# What train.py reads: the sources of one or several prepared directories
# ---------------------------------------------------------------------------------------------------------------------


def source_name(spec: str) -> str:
    """A source's name as the user gave it: a preset's name, or a file's or directory's name (',' and '=', which
    --data_mix uses, become '_')."""
    name = Path(spec.rstrip("/")).name if ("/" in spec or Path(spec).exists()) else spec
    return name.replace(",", "_").replace("=", "_")


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def source_ranges(meta: dict) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """(name, {split: (first token, end)}) of each source in the token files, which hold the sources one after the
    other. A directory prepared before sources were counted apart is one source (its names joined by '+')."""
    sources = meta.get("sources") if isinstance(meta.get("sources"), list) else []
    sources = [s for s in sources if isinstance(s, dict)]
    names = [source_name(str(s.get("spec", "data"))) for s in sources]
    counted = sources and all("tokens" in s for s in sources)
    if not counted:
        whole = {split: (0, c["tokens"]) for split, c in meta["splits"].items()}
        return [("+".join(names) or "data", whole)]
    damaged = "meta.json's per-source token counts are damaged ({}); rebuild it with prepare_data.py --overwrite"
    out, start = [], dict.fromkeys(meta["splits"], 0)
    for source in sources:
        tokens, name = source["tokens"], source.get("name")
        if not (isinstance(tokens, dict) and all(_count(tokens.get(split, 0)) for split in meta["splits"])):
            raise UserError(damaged.format(f"{source.get('spec')!r}: {tokens!r}"))
        if not (isinstance(name, str) and name and name == source_name(name)):
            raise UserError(damaged.format(f"a source named {name!r}"))
        ranges = {}
        for split in meta["splits"]:
            ranges[split] = (start[split], start[split] + tokens.get(split, 0))
            start[split] += tokens.get(split, 0)
        out.append((name, ranges))
    if start != {split: c["tokens"] for split, c in meta["splits"].items()}:
        raise UserError(damaged.format(f"they add up to {start}, not to the splits' tokens"))
    return out


def bytes_per_token(meta: dict, source: int | None, split: str) -> float | None:
    """UTF-8 bytes of the text per token (EOS included) of a split, of the whole directory (source None) or of its
    source number `source`, as prepare_data.py counted them; None where it did not (directories prepared before)."""
    if source is None:
        counts = meta["splits"].get(split, {})
        n_bytes, tokens = counts.get("bytes"), counts.get("tokens")
    else:
        entry = meta["sources"][source]
        n_bytes, tokens = entry.get("bytes", {}).get(split), entry["tokens"].get(split)
    ok = _count(n_bytes) and _count(tokens) and n_bytes > 0 and tokens > 0
    return n_bytes / tokens if ok else None


@dataclasses.dataclass
class Source:
    """One source's tokens (views of the memory-mapped files) and its training windows."""

    name: str
    train_tokens: np.ndarray
    val_tokens: np.ndarray  # the first eval_tokens + 1 of its validation tokens
    n_windows: int
    val_bytes_per_token: float | None = None  # UTF-8 bytes of its validation text per token (None: not recorded)


@dataclasses.dataclass
class TrainingData:
    meta: dict  # the first directory's
    sources: list[Source]
    weights: tuple[Fraction, ...]  # each source's share of the samples (mixture.parse_mix), summing to 1
    fingerprint: str  # the data's: the directory's, or a hash of the directories' in order
    tokenizer_dir: Path
    notes: tuple[str, ...] = ()  # what a reader of this data should know (stale_note), one line each
    renamed: dict[str, str] = dataclasses.field(default_factory=dict)  # a checkpoint's source names -> today's

    @property
    def n_windows(self) -> int:
        return sum(s.n_windows for s in self.sources)


def data_dirs(data_dir: str) -> list[str]:
    """--data_dir as directories: one, or several comma-separated (a directory whose own name has a comma is one)."""
    if os.path.isdir(data_dir):  # not Path.is_dir: Python 3.11's raises on a name past the filesystem's limit
        return [data_dir]
    return [d.strip() for d in data_dir.split(",") if d.strip()]


def training_data(data_dir: str, seq_len: int, eval_tokens: int, data_mix: str = "", one_source: bool = False,
                  known_as: dict | None = None):  # fmt: skip
    """What train.py reads from one prepare_data.py directory or several (comma-separated, prepared with the same
    tokenizer), memory-mapped once: each directory's sources and their weights in the mixture, after checking every
    split holds at least one window of seq_len + 1 tokens, and so does every source the mixture draws from.
    one_source: each directory read as one source, as runs before mixtures read it (a checkpoint of such a run).
    A source whose name an earlier one has is name-2, name-3 (as prepare_data.py names a source given twice): never
    a directory's name, so a moved or renamed directory keeps its sources' names and a --data_mix its keys.
    known_as: {"names": [...], "fingerprint": ...} of a checkpoint, whose train.py may have named the sources
    otherwise (DIRECTORY/name): when it read this very data (the fingerprint), its names are taken as today's by
    position, in data_mix too; `renamed` of the result says which."""
    dirs = data_dirs(data_dir)
    if not dirs:
        raise UserError(f"--data_dir {data_dir!r} names no directory; create one with prepare_data.py")
    if len({Path(d).resolve() for d in dirs}) < len(dirs):
        raise UserError(f"--data_dir {data_dir} names a directory twice; weight its sources with --data_mix instead")
    sources, metas = [], []
    for d in dirs:
        meta, splits = _checked_dir(d, seq_len)
        if metas and _tokenizer_of(d, meta) != _tokenizer_of(dirs[0], metas[0]):
            raise UserError(
                f"--data_dir: {d} and {dirs[0]} were prepared with different tokenizers ({meta.get('tokenizer')!r} "
                f"and {metas[0].get('tokenizer')!r}; their tokenizer/ files differ); prepare the second with "
                f"--tokenizer {Path(dirs[0]) / 'tokenizer'}"
            )
        metas.append(meta)
        ranges = source_ranges(meta)
        if one_source:
            ranges = [("+".join(name for name, _ in ranges), {s: (0, c["tokens"]) for s, c in meta["splits"].items()})]
        for index, (name, r) in enumerate(ranges):
            train = splits["train"][slice(*r["train"])]
            val = splits["validation"][slice(*r["validation"])]
            val = val[: eval_tokens + 1] if eval_tokens else val
            taken = {s.name for s in sources}
            unique, i = name, 2
            while unique in taken:
                unique, i = f"{name}-{i}", i + 1
            bpt = bytes_per_token(meta, None if len(ranges) == 1 else index, "validation")
            sources.append(Source(unique, train, val, num_windows(len(train), seq_len), bpt))
    data_print = fingerprint([m["fingerprint"] for m in metas])
    renamed = {}
    if known_as and known_as.get("fingerprint") == data_print and len(known_as.get("names", [])) == len(sources):
        renamed = {old: s.name for old, s in zip(known_as["names"], sources) if old != s.name}
        data_mix = mixture.renamed(data_mix, renamed)
    weights = mixture.parse_mix(data_mix, [s.name for s in sources], [s.n_windows for s in sources])
    for source, weight in zip(sources, weights):
        if weight > 0 and source.n_windows < 1:
            raise UserError(
                f"source {source.name} has {len(source.train_tokens)} training tokens, fewer than one window of "
                f"--seq_len {seq_len} + 1; give it weight 0 in --data_mix, lower --seq_len, or add data"
            )
    notes = tuple(note for d, m in zip(dirs, metas) if (note := stale_note(d, m)))
    return TrainingData(metas[0], sources, weights, data_print, Path(dirs[0]) / "tokenizer", notes, renamed)


def stale_note(data_dir: str, meta: dict) -> str | None:
    """The note on a directory prepared before a special token's text inside a document was tokenized as text
    (meta.json without special_tokens_in_documents): its documents whose text held one (`<|endoftext|>` in web text
    about language models) hold that token there, an EOS cutting the document for document masking. Still readable:
    only such documents differ."""
    if "special_tokens_in_documents" in meta:
        return None
    return (f"note: {data_dir} was prepared before special tokens' text in documents was tokenized as text: a "
            "document holding e.g. <|endoftext|> as text holds that token there, an end of document; the same "
            "prepare_data.py command with --overwrite rebuilds it")  # fmt: skip


def fingerprint(fingerprints: list[str]) -> str:
    """The data's fingerprint: one directory's, or a hash of several directories' in their order."""
    return fingerprints[0] if len(fingerprints) == 1 else hashlib.sha256(json.dumps(fingerprints).encode()).hexdigest()


def sample_tokens(data: TrainingData, seed: int, sample: int, seq_len: int) -> np.ndarray:
    """The seq_len + 1 tokens of global sample `sample`: its source and that source's k-th sample (mixture.position),
    then the window sample_window gives within the source (source 0 as before mixtures; others a permutation seeded
    by their index too)."""
    s, k = mixture.position(sample, data.weights)
    source = data.sources[s]
    return window(source.train_tokens, sample_window(seed, k, source.n_windows, s)[1], seq_len)


def _tokenizer_of(data_dir: str, meta: dict) -> tuple:
    """What must agree for two directories' token ids to mean the same: the tokenizer's vocabulary files (a BPE trained
    on each directory's own text differs under the same spec; tokenizer_config.json also records where it was loaded
    from) and the format."""
    files = sorted(p for p in (Path(data_dir) / "tokenizer").iterdir() if p.is_file())
    files = [p for p in files if p.name != "tokenizer_config.json"]
    files = [p for p in files if p.name == "tokenizer.json"] or files  # a fast tokenizer is all in its tokenizer.json
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest(), meta["vocab_size"], meta["eos_id"], meta["dtype"]


def _checked_dir(data_dir: str, seq_len: int) -> tuple[dict, dict]:
    """A prepared directory's meta.json and memory-mapped splits, each holding one window and its tokenizer."""
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
    return meta, splits
