"""A training run's checkpoint as a model to evaluate, read without the training processes and without writing.

    OUT/checkpoints/step_N   that checkpoint: refused unless it is complete (trainer_state.json, the manifest's files)
    OUT                      its newest intact checkpoint (as `--resume auto` would pick it)

The weights are the ZeRO-3 shards consolidated by DeepSpeed's own zero_to_fp32 in memory (the fp32 master weights),
the architecture is the model_config.json saved beside them, and the tokenizer is the one of the data the run was
trained on (trainer_state.json's data_dir, checked against its fingerprint) or the run's final/ export.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import sys
from pathlib import Path

from deepseek_zero3.cli import UserError
from deepseek_zero3.model import mtp
from deepseek_zero3.run_dir import checkpoint
from deepseek_zero3.training_data import token_data


@dataclasses.dataclass(frozen=True)
class RunCheckpoint:
    """A checkpoint to score: where it is, its step, and the directory its tokenizer is read from."""

    path: Path
    step: int
    tokenizer_dir: Path


def is_checkpoint_dir(path: Path) -> bool:
    """Whether a directory is (or was meant to be) a train.py checkpoint rather than a Hugging Face model directory."""
    if any((path / m).is_file() for m in ("trainer_state.json", "model_config.json", "manifest.json")):
        return True
    named_like_one = checkpoint.step_of(path) is not None and path.parent.name == "checkpoints"
    return named_like_one and not (path / "config.json").is_file()  # another tool's model saved under that name


def find_checkpoint(name: str, tokenizer: str = "") -> RunCheckpoint | None:
    """The checkpoint `--model NAME` means: NAME itself (OUT/checkpoints/step_N) or, for a run directory OUT, its newest
    intact one. None when NAME is neither (a Hugging Face model directory or a Hub id). Refuses an incomplete one.
    `tokenizer` (--tokenizer), when given, is the tokenizer; else the run's own is looked for."""
    path = Path(name).expanduser()
    if not path.is_dir():
        return None
    if path.name == "checkpoints" and checkpoint.is_train_run(path.parent):
        path = path.parent
    if checkpoint.is_train_run(path) and not is_checkpoint_dir(path):
        return newest_checkpoint(name, path, tokenizer)
    if checkpoint.LEFTOVER.fullmatch(path.name):
        raise UserError(
            f"--model {name} is a checkpoint being written, or one a crash left half-written; pass a complete "
            f"checkpoint ({path.parent}/step_N) or the run directory {path.parent.parent} for its newest intact one"
        )
    if not is_checkpoint_dir(path):
        return None
    problem = checkpoint.checkpoint_problem(path)
    if problem is not None:
        intact = [
            p for p in checkpoint.step_dirs(path.parent) if p != path and checkpoint.checkpoint_problem(p) is None
        ]
        fix = f"pass an intact one, e.g. {intact[-1]}" if intact else "no other checkpoint of this run is intact"
        raise UserError(f"--model {name} is not a complete checkpoint: {problem}; {fix}")
    state = json.loads((path / "trainer_state.json").read_text())
    return RunCheckpoint(path, state["step"], Path(tokenizer) if tokenizer else tokenizer_dir(name, path, state))


def newest_checkpoint(name: str, out: Path, tokenizer: str = "") -> RunCheckpoint:
    def warn(line: str) -> None:
        print(line, file=sys.stderr)

    newest = checkpoint.newest_intact_checkpoint(out / "checkpoints", warn)
    if newest is None:
        final = out / "final"
        fix = f"score its exported model with --model {final}" if final.is_dir() else "train until it saves one"
        raise UserError(f"--model {name}: the run has no intact checkpoint in {out / 'checkpoints'}; {fix}")
    return find_checkpoint(str(newest), tokenizer)


def tokenizer_dir(name: str, ckpt: Path, state: dict) -> Path:
    """The tokenizer the run was trained with: its data directory's, when that still holds the data the run read
    (same fingerprint), else the run's final/ export (saved from the same tokenizer)."""
    data_dir = str(state.get("data_dir") or state.get("config", {}).get("data_dir", ""))
    dirs = [Path(d) for d in token_data.data_dirs(data_dir)]  # a mixture of several: the first one's tokenizer
    found = None
    if dirs and (dirs[0] / "tokenizer").is_dir():
        try:
            metas = [json.loads((d / "meta.json").read_text()) for d in dirs]
            fingerprint = token_data.fingerprint([m["fingerprint"] for m in metas])
        except (OSError, ValueError, TypeError, KeyError):
            fingerprint = None
        if fingerprint is not None and fingerprint == state.get("data_fingerprint"):
            return dirs[0] / "tokenizer"
        found = f"{data_dir} no longer holds the data the run read (its meta.json fingerprint is not the checkpoint's)"
    final = ckpt.parent.parent / "final"
    if (final / "tokenizer_config.json").is_file() or (final / "tokenizer.json").is_file():
        return final
    found = found or f"neither the run's data directory ({data_dir or 'unknown'}) nor its final/ holds one"
    raise UserError(
        f"--model {name}: the tokenizer the run was trained with cannot be found: {found}; pass it with --tokenizer "
        f"(the tokenizer/ of the data directory the run was trained on)"
    )


def rotated_away(path: Path) -> UserError:
    """A checkpoint found complete that is gone when read: a running train.py deleted it (--keep_last)."""
    return UserError(
        f"--model {path} was removed while it was read: the run rotated it away (--keep_last); run again on a newer "
        f"checkpoint, or on the run's directory for its newest"
    )


def consolidated_model(ckpt: RunCheckpoint, dtype):
    """The model of a checkpoint: its model_config.json and its weights (the fp32 weights DeepSpeed consolidates from
    the ZeRO shards in memory, or a run's without DeepSpeed), loaded by transformers as from_pretrained loads an export
    (its weight-name conversions included).
    Returns (model, transformers' loading info: missing, unexpected and mismatched tensors)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        config = checkpoint.read_model_config(ckpt.path)
    except UserError:
        if not ckpt.path.is_dir():
            raise rotated_away(ckpt.path) from None
        raise
    tag = ckpt.path / "latest"
    tag = tag.read_text().strip() if tag.is_file() else "pytorch_model"
    if (ckpt.path / tag).is_dir():
        state_dict = zero_state_dict(ckpt, tag)
    elif (ckpt.path / "model.safetensors").is_file():  # a run without DeepSpeed (one process, DDP): Accelerate's file
        state_dict = plain_state_dict(ckpt)
    elif not ckpt.path.is_dir():
        raise rotated_away(ckpt.path)
    else:
        raise UserError(
            f"--model {ckpt.path} has neither ZeRO shards ({tag}/) nor model.safetensors: it was not written by "
            f"train.py, or lost its weights; pass another checkpoints/step_N directory of the run"
        )
    state_dict = mtp.split_state_dict(state_dict)[0]  # the main network: eval.py scores it alone
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    return model_class.from_pretrained(
        None, config=config, state_dict=state_dict, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True
    )


def plain_state_dict(ckpt: RunCheckpoint) -> dict:
    """The weights of a checkpoint saved without DeepSpeed: Accelerate's model.safetensors, whole in one file."""
    from safetensors.torch import load_file

    try:
        return load_file(str(ckpt.path / "model.safetensors"))
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: safetensors raises several kinds
        if not ckpt.path.is_dir():
            raise rotated_away(ckpt.path) from None
        raise UserError(
            f"--model {ckpt.path}: its model.safetensors cannot be read ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''}); pass another checkpoint of the run"
        ) from None


def zero_state_dict(ckpt: RunCheckpoint, tag: str) -> dict:
    """The fp32 weights DeepSpeed consolidates from a checkpoint's ZeRO shards (its `tag`/ directory), in memory."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        # Its progress lines ("Processing zero checkpoint ...") and bars say nothing a user acts on; errors are raised.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            state_dict = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.path), tag=tag)
    except Exception as e:  # noqa: BLE001 - torch.load and DeepSpeed raise many kinds for one damaged shard
        if not (ckpt.path / tag).is_dir():
            raise rotated_away(ckpt.path) from None
        raise UserError(
            f"--model {ckpt.path}: its ZeRO shards cannot be consolidated ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''}); pass another checkpoint of the run"
        ) from None
    return state_dict
