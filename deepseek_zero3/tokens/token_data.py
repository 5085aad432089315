"""Tokens out: the on-disk token format and the training-sample order.

prepare_data.py writes, and train.py and eval.py read, one flat token file per split plus meta.json; this module
owns that format (its version, dtype and checked reader), the order train.py draws windows of seq_len + 1 tokens in,
a pure function of (seed, sample) so that a resumed run sees exactly the samples it would have, and how many of them
one optimizer step takes (the batch plan).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from deepseek_zero3.cli import UserError
from deepseek_zero3.tokens import mixture

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


@functools.lru_cache(maxsize=8)
def _epoch_permutation(seed: int, epoch: int, n: int, source: int = 0) -> np.ndarray:
    return np.random.default_rng([seed, epoch] if source == 0 else [seed, epoch, source]).permutation(n)


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


def document_positions(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Position ids that restart at 0 at each document's first token: the window's first token and every token after
    an EOS (prepare_data.py appends one to each document, so the EOS closes its document). Handed to a transformers
    model with no attention mask, they make its attention block-causal, each token seeing only its own document
    (transformers' packed-sequence path: masking_utils.find_packed_sequence_indices for SDPA and eager, varlen for
    flash attention)."""
    index = torch.arange(inputs.shape[-1], device=inputs.device).expand_as(inputs)
    starts = torch.ones_like(inputs, dtype=torch.bool)
    starts[..., 1:] = inputs[..., :-1] == eos_id
    return index - torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values


# ---------------------------------------------------------------------------------------------------------------------
# What train.py reads: the sources of one or several prepared directories
# ---------------------------------------------------------------------------------------------------------------------


def source_name(spec: str) -> str:
    """A source's name as the user gave it: a preset's name, or a file's or directory's name."""
    return Path(spec.rstrip("/")).name if ("/" in spec or Path(spec).exists()) else spec


def source_ranges(meta: dict) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """(name, {split: (first token, end)}) of each source in the token files, which hold the sources one after the
    other. A directory prepared before sources were counted apart is one source (its names joined by '+')."""
    sources = meta.get("sources") if isinstance(meta.get("sources"), list) else []
    names = [s.get("name") or source_name(str(s.get("spec", "data"))) for s in sources if isinstance(s, dict)]
    counted = sources and all(isinstance(s, dict) and isinstance(s.get("tokens"), dict) for s in sources)
    if not counted:
        whole = {split: (0, c["tokens"]) for split, c in meta["splits"].items()}
        return [("+".join(names) or "data", whole)]
    out, start = [], dict.fromkeys(meta["splits"], 0)
    for name, source in zip(names, sources):
        ranges = {}
        for split in meta["splits"]:
            n = source["tokens"].get(split, 0)
            ranges[split] = (start[split], start[split] + n)
            start[split] += n
        out.append((name, ranges))
    if start != {split: c["tokens"] for split, c in meta["splits"].items()}:
        raise UserError(
            f"meta.json's per-source token counts ({start}) do not add up to its splits'; rebuild it with "
            "prepare_data.py --overwrite"
        )
    return out


@dataclasses.dataclass
class Source:
    """One source's tokens (views of the memory-mapped files) and its training windows."""

    name: str
    train_tokens: np.ndarray
    val_tokens: np.ndarray  # the first eval_tokens + 1 of its validation tokens
    n_windows: int


@dataclasses.dataclass
class TrainingData:
    meta: dict  # the first directory's
    sources: list[Source]
    weights: tuple[Fraction, ...]  # each source's share of the samples (mixture.parse_mix), summing to 1
    fingerprint: str  # the data's: the directory's, or a hash of the directories' in order
    tokenizer_dir: Path

    @property
    def n_windows(self) -> int:
        return sum(s.n_windows for s in self.sources)


def training_data(data_dir: str, seq_len: int, eval_tokens: int, data_mix: str = "") -> TrainingData:
    """What train.py reads from one prepare_data.py directory or several (comma-separated, prepared with the same
    tokenizer), memory-mapped once: each directory's sources and their weights in the mixture, after checking every
    split holds at least one window of seq_len + 1 tokens, and so does every source the mixture draws from."""
    dirs = [d.strip() for d in data_dir.split(",") if d.strip()]
    if not dirs:
        raise UserError(f"--data_dir {data_dir!r} names no directory; create one with prepare_data.py")
    sources, metas = [], []
    for d in dirs:
        meta, splits = _checked_dir(d, seq_len)
        if metas and _tokenizer_of(meta) != _tokenizer_of(metas[0]):
            raise UserError(
                f"--data_dir: {d} was prepared with tokenizer {meta.get('tokenizer')!r} (vocab {meta['vocab_size']}, "
                f"EOS {meta['eos_id']}), {dirs[0]} with {metas[0].get('tokenizer')!r} (vocab "
                f"{metas[0]['vocab_size']}, EOS {metas[0]['eos_id']}); prepare both with the same --tokenizer"
            )
        metas.append(meta)
        for name, ranges in source_ranges(meta):
            train = splits["train"][slice(*ranges["train"])]
            val = splits["validation"][slice(*ranges["validation"])]
            val = val[: eval_tokens + 1] if eval_tokens else val
            taken = {s.name for s in sources}
            name = name if name not in taken else f"{Path(d).name}/{name}"
            sources.append(Source(name, train, val, num_windows(len(train), seq_len)))
    weights = mixture.parse_mix(data_mix, [s.name for s in sources], [s.n_windows for s in sources])
    for source, weight in zip(sources, weights):
        if weight > 0 and source.n_windows < 1:
            raise UserError(
                f"source {source.name} has {len(source.train_tokens)} training tokens, fewer than one window of "
                f"--seq_len {seq_len} + 1; give it weight 0 in --data_mix, lower --seq_len, or add data"
            )
    if len(dirs) == 1:
        fingerprint = metas[0]["fingerprint"]
    else:
        fingerprint = hashlib.sha256(json.dumps([m["fingerprint"] for m in metas]).encode()).hexdigest()
    return TrainingData(metas[0], sources, weights, fingerprint, Path(dirs[0]) / "tokenizer")


def sample_tokens(data: TrainingData, seed: int, sample: int, seq_len: int) -> np.ndarray:
    """The seq_len + 1 tokens of global sample `sample`: its source and that source's k-th sample (mixture.position),
    then the window sample_window gives within the source (source 0 as before mixtures; others a permutation seeded
    by their index too)."""
    s, k = mixture.position(sample, data.weights)
    source = data.sources[s]
    return window(source.train_tokens, sample_window(seed, k, source.n_windows, s)[1], seq_len)


def _tokenizer_of(meta: dict) -> tuple:
    return meta.get("tokenizer_identity"), meta["vocab_size"], meta["eos_id"], meta["dtype"]


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
