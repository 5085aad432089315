"""Tokens out: the on-disk token format and the training-sample order.

prepare_data.py writes, and train.py and eval.py read, one flat token file per split plus meta.json; this module
owns that format (its version, dtype and checked reader), the order train.py draws windows of seq_len + 1 tokens in,
a pure function of (seed, sample) so that a resumed run sees exactly the samples it would have, and how many of them
one optimizer step takes (the batch plan).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import numpy as np

from deepseek_zero3.cli import UserError

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


@functools.lru_cache(maxsize=2)
def _epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def sample_window(seed: int, sample: int, n_windows: int) -> tuple[int, int]:
    """(epoch, window index) of the global sample number `sample`: each epoch is a fresh permutation of all windows,
    a pure function of (seed, epoch), so any sample can be found again after a restart."""
    epoch, offset = divmod(sample, n_windows)
    return epoch, int(_epoch_permutation(seed, epoch, n_windows)[offset])


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
