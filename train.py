"""Pretrain a DeepSeek-architecture (Llama) causal LM with Accelerate + DeepSpeed ZeRO-3.

    # 3 x RTX 4090, fp16 with dynamic loss scaling (add `--mixed_precision bf16` after the config for bf16)
    accelerate launch --config_file accelerate_configs/zero3_3gpu.yaml train.py \
        --data_dir data/wt103-owt --model_config deepseek-1.3b --output_dir runs/1.3b --seq_len 2048

    # laptop / CI: 3 CPU processes, gloo, fp32
    accelerate launch --config_file accelerate_configs/zero3_cpu.yaml train.py \
        --data_dir data/python-docs --model_config tiny --output_dir runs/tiny --max_steps 300

Precision and gradient accumulation come from the accelerate config alone; everything else is a flag below.
Outputs in OUT: metrics.jsonl, checkpoints/step_N/ (+ checkpoints/latest), final/ (a Hugging Face model
directory) and loss_curve.png. A restart with `--resume auto` continues exactly where the last checkpoint was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import resource
import shutil
import signal
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import lmdata
from lmdata import DataError

MODEL_CONFIG_DIR = Path(__file__).resolve().parent / "model_configs"
# Dense fp16/bf16 tensor-core peak with fp32 accumulate, FLOP/s, by substring of the CUDA device name; the longest
# matching name wins, so "H100 PCIe" is not read as the SXM card. fp32 runs are measured against a timed matmul.
GPU_PEAK_FLOPS = {"RTX 4090": 165.2e12, "H100": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H200": 989e12,
                  "A100": 312e12, "RTX 3090": 71e12, "L40S": 362e12}
# DeepSpeed calls collectives that torch renamed; the warning repeats every step and says nothing to a user.
warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)


@dataclasses.dataclass
class Config:
    data_dir: str = dataclasses.field(default="data/python-docs", metadata={"help": "directory written by prepare_data.py"})
    model_config: str = dataclasses.field(default="tiny", metadata={"help": "preset in model_configs/ (deepseek-7b, deepseek-1.3b, small, mini, tiny), a config.json, or a model directory"})
    init_from: str = dataclasses.field(default="", metadata={"help": "Hugging Face model directory to start from (its weights); default: random init"})
    output_dir: str = dataclasses.field(default="runs/tiny", metadata={"help": "metrics, checkpoints, final model and loss curve go here"})
    seq_len: int = dataclasses.field(default=256, metadata={"help": "tokens per training sequence"})
    micro_batch_size: int = dataclasses.field(default=8, metadata={"help": "sequences per process per forward/backward"})
    max_steps: int = dataclasses.field(default=0, metadata={"help": "optimizer steps to train (0: use --num_epochs)"})
    num_epochs: float = dataclasses.field(default=1.0, metadata={"help": "passes over the training split when --max_steps is 0"})
    lr: float = dataclasses.field(default=1e-3, metadata={"help": "peak learning rate"})
    min_lr_ratio: float = dataclasses.field(default=0.1, metadata={"help": "cosine decay floor as a fraction of --lr"})
    warmup_steps: int = dataclasses.field(default=30, metadata={"help": "linear warmup, in optimizer steps"})
    lr_decay_steps: int = dataclasses.field(default=0, metadata={"help": "length of warmup + cosine decay in steps (0: the run's total steps); set it to train a long schedule in shorter runs"})
    weight_decay: float = dataclasses.field(default=0.1, metadata={"help": "AdamW weight decay (2-D weights only)"})
    adam_beta1: float = dataclasses.field(default=0.9, metadata={"help": "AdamW beta1"})
    adam_beta2: float = dataclasses.field(default=0.95, metadata={"help": "AdamW beta2"})
    adam_eps: float = dataclasses.field(default=1e-8, metadata={"help": "AdamW epsilon"})
    max_grad_norm: float = dataclasses.field(default=1.0, metadata={"help": "clip the global gradient norm to this (0: no clipping)"})
    seed: int = dataclasses.field(default=0, metadata={"help": "seeds the weights and the data order"})
    log_every: int = dataclasses.field(default=10, metadata={"help": "optimizer steps between metric lines"})
    eval_every: int = dataclasses.field(default=100, metadata={"help": "optimizer steps between validation runs (0: only at start and end)"})
    eval_tokens: int = dataclasses.field(default=1 << 20, metadata={"help": "validation tokens per evaluation (0: the whole split)"})
    save_every: int = dataclasses.field(default=100, metadata={"help": "optimizer steps between checkpoints (0: only at the end)"})
    keep_last: int = dataclasses.field(default=2, metadata={"help": "complete checkpoints to keep"})
    resume: str = dataclasses.field(default="", metadata={"help": "'auto' (newest complete checkpoint in OUT, if any) or a checkpoint directory"})
    plan: bool = dataclasses.field(default=False, metadata={"help": "print the memory and time plan for this model, config and batch, then exit (no training, no GPU)"})
    accelerate_config: str = dataclasses.field(default="", metadata={"help": "with --plan: the accelerate config YAML to plan for (default: the CPU config)"})
    assumed_mfu: float = dataclasses.field(default=0.35, metadata={"help": "model FLOPs utilisation assumed for the planned step time"})
    interconnect_gb_s: float = dataclasses.field(default=10.0, metadata={"help": "GPU-to-GPU bandwidth assumed for the plan, GB/s (PCIe 4.0 x16 without P2P: ~10)"})
    gpu_memory_gib: float = dataclasses.field(default=24.0, metadata={"help": "with --plan: memory per GPU to plan for (RTX 4090: 24); a real run reads the device"})
    ignore_memory_plan: bool = dataclasses.field(default=False, metadata={"help": "start even when the plan says the model does not fit the GPUs"})
    eval_at_start: bool = dataclasses.field(default=True, metadata={"help": "validation loss of the initial weights at step 0 (--no_eval_at_start skips it: on CPU processes under ZeRO-3 no-grad forwards before the first step slow the whole run, see BENCHMARKS.md)"})
    log_with: str = dataclasses.field(default="", metadata={"help": "extra tracker for accelerate, e.g. tensorboard"})
    gradient_checkpointing: bool = dataclasses.field(default=False, metadata={"help": "recompute activations in backward (less memory, ~30%% more compute)"})
    attn_implementation: str = dataclasses.field(default="sdpa", metadata={"help": "attention kernel: sdpa or eager"})


# Settings that change what a run reports or where it reads and writes, not what it trains: free to change on resume.
RESUME_CHANGEABLE = {"data_dir", "log_every", "eval_every", "eval_at_start", "eval_tokens", "save_every", "keep_last", "accelerate_config",
                     "assumed_mfu", "interconnect_gb_s", "gpu_memory_gib", "ignore_memory_plan", "log_with",
                     "gradient_checkpointing", "attn_implementation"}
# The LR schedule's length; changing it on resume needs an explicit --lr_decay_steps (schedule_on_resume).
SCHEDULE_LENGTH = {"max_steps", "num_epochs", "lr_decay_steps"}


def injected_fault(kind: str, rank: int, step: int) -> bool:
    """Fault injection for the crash tests, set with TRAIN_TEST_FAULT=kind:rank:step (sigterm_launcher, nan_loss,
    sigkill_in_save). Real signals and real NaNs; nothing happens unless the variable names this exact point."""
    return os.environ.get("TRAIN_TEST_FAULT", "") == f"{kind}:{rank}:{step}"


class StartupError(Exception):
    """A user mistake found before any work; the message is one line naming the value, the constraint and the fix."""


# ---------------------------------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------------------------------


def lr_at(step: int, peak_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate for optimizer step `step` (0-based) of a `total_steps` schedule: linear warmup that reaches the
    peak on step warmup_steps - 1, then a cosine that reaches the floor on the last step, total_steps - 1."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    min_lr = peak_lr * min_lr_ratio
    top = max(warmup_steps - 1, 0)  # the step that holds the peak
    progress = min(1.0, (step - top) / max(1, total_steps - 1 - top))
    return min_lr + 0.5 * (peak_lr - min_lr) * (1 + math.cos(math.pi * progress))


def batch_plan(micro_batch_size: int, grad_accum_steps: int, world_size: int, seq_len: int) -> dict:
    sequences = micro_batch_size * grad_accum_steps * world_size
    return {"micro_batch_size": micro_batch_size, "grad_accum_steps": grad_accum_steps, "world_size": world_size,
            "sequences_per_step": sequences, "tokens_per_step": sequences * seq_len}


def total_steps_for(max_steps: int, num_epochs: float, n_windows: int, sequences_per_step: int) -> int:
    if max_steps > 0:
        return max_steps
    return max(1, math.ceil(num_epochs * n_windows / sequences_per_step))


def flops_per_token(n_params_non_embedding: int, n_layers: int, hidden_size: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 N + 12 L H T (PaLM appendix B; nanoGPT)."""
    return 6 * n_params_non_embedding + 12 * n_layers * hidden_size * seq_len


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops: float) -> float:
    return tokens_per_s * flops_per_tok / peak_flops


def gpu_peak_flops(device_name: str, precision: str) -> float | None:
    """Datasheet 16-bit peak of a known GPU for fp16/bf16 runs; None (time a matmul instead) for fp32 or unknown cards."""
    if precision not in ("fp16", "bf16"):
        return None
    matches = [key for key in GPU_PEAK_FLOPS if key in device_name]
    return GPU_PEAK_FLOPS[max(matches, key=len)] if matches else None


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def sample_ids(step: int, micro_step: int, rank: int, plan: dict) -> range:
    """Global sample numbers of one micro-batch: an optimizer step takes the next `sequences_per_step` samples, laid out
    micro-step-major, so the set a step trains on depends only on the global batch, not on how it is split."""
    start = step * plan["sequences_per_step"] + (micro_step * plan["world_size"] + rank) * plan["micro_batch_size"]
    return range(start, start + plan["micro_batch_size"])


def config_hash(model_config) -> str:
    d = model_config.to_diff_dict() if hasattr(model_config, "to_diff_dict") else dict(model_config)
    d = {k: v for k, v in d.items() if k not in ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures")}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def llama_param_counts(c) -> dict:
    """Parameter counts of a Llama/DeepSeek config without building it: total, non-embedding, largest tensor."""
    h, v, f, n_layers = c.hidden_size, c.vocab_size, c.intermediate_size, c.num_hidden_layers
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    embed = v * h
    head = 0 if c.tie_word_embeddings else v * h
    total = embed + head + n_layers * layer + h
    return {"total": total, "non_embedding": total - embed, "largest_tensor": max(embed, h * f), "per_layer": layer}


def memory_plan(c, world_size: int, micro_batch_size: int, seq_len: int, precision: str, offload_optimizer: bool,
                offload_params: bool, gradient_checkpointing: bool, attn: str) -> dict:
    """Bytes per GPU (and host) for one training process, by component.

    Model states (ZeRO-3, Adam, mixed precision): 16-bit parameters 2 B, 16-bit gradients 2 B, fp32 master weights
    + Adam m and v 12 B per parameter, each sharded over the world; in fp32 training parameters and gradients take
    4 B each and there is no separate master copy. The largest tensor is gathered whole in 16-bit for its forward,
    and the optimizer step needs one fp32 temporary the size of its shard (Adam's denominator).
    Activations saved for backward, per token and layer of a Llama block (the count of Korthikanti et al. 2022
    redone for RMSNorm, RoPE and SwiGLU, no dropout): two norm inputs (2h), attention input, q, k, v, rotated q
    and k, attention output (4h + 3 kv), MLP input, gate, up, SiLU and product (h + 4 ffn), plus 2 a s for eager
    attention's score matrices. Checkpointing keeps each layer's input and recomputes one layer at a time. The
    loss keeps the logits, an fp32 copy and its gradient.
    """
    counts = llama_param_counts(c)
    p, n = counts["total"], world_size
    half = precision in ("fp16", "bf16")
    param_b, grad_b, optim_b = (2, 2, 12) if half else (4, 4, 8)
    act_b = 2 if half else 4
    s, b, h, a, L, v = seq_len, micro_batch_size, c.hidden_size, c.num_attention_heads, c.num_hidden_layers, c.vocab_size
    kv = c.num_key_value_heads * (h // a)
    per_token = 7 * h + 3 * kv + 4 * c.intermediate_size + (2 * a * s if attn == "eager" else 0)
    per_layer = s * b * per_token * act_b
    acts_full = L * per_layer
    acts_ckpt = L * s * b * h * act_b + per_layer
    logits = s * b * v * (act_b + 4 + 4)
    gpu = {
        "parameters": 0 if offload_params else param_b * p / n,
        "gradients": grad_b * p / n,
        "optimizer_states": 0 if offload_optimizer else optim_b * p / n,
        "gathered_largest_tensor": param_b * counts["largest_tensor"],
        "optimizer_step_temporaries": 0 if offload_optimizer else 4 * p / n,
        "activations": (acts_ckpt if gradient_checkpointing else acts_full) + logits,
    }
    # Offloaded optimizer: fp32 master weights, Adam states and fp32 gradients live in host RAM.
    host = ((optim_b + 4) * p / n if offload_optimizer else 0) + (param_b * p / n if offload_params else 0)
    return {"gpu": gpu, "gpu_total": sum(gpu.values()), "host_per_process": host,
            "activations_without_checkpointing": acts_full + logits, "activations_with_checkpointing": acts_ckpt + logits,
            "params": counts}


def deepspeed_estimate(total_params: int, largest_tensor: int, gpus_per_node: int, nodes: int, offload_optimizer: bool, offload_params: bool) -> tuple[int, int]:
    """DeepSpeed's own ZeRO-3 model-state estimate: (host bytes per node, GPU bytes per GPU), zero.Init on."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(total_params, largest_tensor, gpus_per_node, nodes,
                                                        cpu_offload=offload_optimizer, cpu_offload_params=offload_params, zero_init=True)
    return cpu, gpu


def step_time_plan(flops_tok: float, tokens_per_step: int, world_size: int, peak_flops_per_device: float, mfu_assumed: float,
                   total_params: int, grad_accum: int, param_bytes: int, bandwidth_b_s: float) -> dict:
    """Seconds per optimizer step: compute at the assumed MFU, plus ZeRO-3 traffic, which per micro-step is about 1.5x
    plain data parallel's all-reduce (parameters all-gathered for forward and backward, gradients reduce-scattered:
    3 x the 16-bit model over (n-1)/n of the ring), assumed not overlapped with compute (an upper bound)."""
    compute_s = flops_tok * tokens_per_step / (world_size * peak_flops_per_device * mfu_assumed)
    comm_s = 0.0 if world_size == 1 else grad_accum * 3 * param_bytes * total_params * (world_size - 1) / world_size / bandwidth_b_s
    step_s = compute_s + comm_s
    return {"compute_s": compute_s, "comm_s": comm_s, "step_s": step_s, "tokens_per_s": tokens_per_step / step_s}


# ---------------------------------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------------------------------


def resolve_model_config(name_or_path: str) -> Path:
    preset = MODEL_CONFIG_DIR / f"{name_or_path}.json"
    path = Path(name_or_path).expanduser()
    for candidate in (preset, path, path / "config.json"):
        if candidate.is_file():
            return candidate
    presets = sorted(p.stem for p in MODEL_CONFIG_DIR.glob("*.json"))
    raise StartupError(f"--model_config {name_or_path!r} is not a preset ({', '.join(presets)}), a config.json or a model directory")


def load_model_config(cfg: Config, meta: dict):
    """The model's transformers config, with the vocabulary taken from the data's tokenizer (padded to 64)."""
    from transformers import AutoConfig

    path = resolve_model_config(cfg.init_from or cfg.model_config)
    d = json.loads(path.read_text())
    model_config = AutoConfig.for_model(d.pop("model_type", "llama"), **d)
    if cfg.init_from:
        if meta is not None and model_config.vocab_size < meta["vocab_size"]:
            raise StartupError(f"--init_from {cfg.init_from} has vocab_size {model_config.vocab_size} < the data's {meta['vocab_size']}; "
                               f"prepare the data with that model's tokenizer")
    elif meta is not None:  # without data (planning) the preset keeps its own vocabulary
        model_config.vocab_size = round_up(meta["vocab_size"], 64)
        model_config.bos_token_id = model_config.eos_token_id = meta["eos_id"]
        model_config.pad_token_id = None
    if cfg.seq_len > model_config.max_position_embeddings:
        raise StartupError(f"--seq_len {cfg.seq_len} exceeds the model's context max_position_embeddings={model_config.max_position_embeddings}; "
                           f"lower --seq_len or use a config with a longer context")
    return model_config


def check_output_dir(cfg: Config) -> None:
    """--output_dir and --resume, checked before a checkpoint's settings are read from them."""
    out = Path(cfg.output_dir)
    if out.exists() and any(out.iterdir()):
        if not cfg.resume:
            raise StartupError(f"--output_dir {cfg.output_dir} is not empty; pass --resume auto to continue that run or choose an empty directory")
        if not written_by_train_py(out):
            raise StartupError(f"--output_dir {cfg.output_dir} holds files but no train.py run (no checkpoints/, no config.json of train.py); "
                               f"--resume continues only a train.py run: choose an empty or new directory")
    probe = out if out.exists() else next(p for p in out.absolute().parents if p.exists())
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        raise StartupError(f"--output_dir {cfg.output_dir}: {probe} is not a writable directory; choose a directory you can write to")
    if cfg.resume not in ("", "auto") and not (Path(cfg.resume) / "trainer_state.json").is_file():
        raise StartupError(f"--resume {cfg.resume} is not a complete checkpoint (no trainer_state.json); use --resume auto or a checkpoints/step_N directory")


def written_by_train_py(out: Path) -> bool:
    """Whether OUT is a train.py output directory, the only kind whose final/ and config.json train.py replaces."""
    try:
        return (out / "checkpoints").is_dir() or json.loads((out / "config.json").read_text()).get("written_by") == "train.py"
    except (OSError, ValueError, AttributeError):
        return False


def given_fields(argv: list[str]) -> set[str]:
    """The Config fields the command line sets (argparse abbreviations included), as opposed to leaves at default."""
    import argparse

    from transformers import HfArgumentParser

    parser = HfArgumentParser(Config)
    for action in parser._actions:  # set_defaults would not do: argparse type-converts string defaults
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_known_args(argv)[0]))


def config_for_resume(cfg: Config, given: set[str], saved: dict) -> tuple[Config, dict]:
    """The settings of a resumed run: the checkpoint's for every field the command does not give. A command that
    changes a training setting is refused; the schedule's length is checked by schedule_on_resume once known.
    Returns (the run's Config, the settings taken from the checkpoint that differ from this command's)."""
    taken = {}
    for f in dataclasses.fields(Config):
        if f.name not in saved or f.name in ("output_dir", "resume", "plan"):
            continue
        if f.name not in given:
            if saved[f.name] != getattr(cfg, f.name):
                taken[f.name] = saved[f.name]
        elif getattr(cfg, f.name) != saved[f.name] and f.name not in RESUME_CHANGEABLE | SCHEDULE_LENGTH:
            raise StartupError(f"cannot resume: the run was trained with --{f.name} {saved[f.name]}, this command gives "
                               f"--{f.name} {getattr(cfg, f.name)}; drop --{f.name} to keep the run's setting, or start a new "
                               f"--output_dir with --init_from OUT/final (weights only, fresh optimizer and schedule)")
    return dataclasses.replace(cfg, **taken), taken


def schedule_on_resume(cfg: Config, given: set[str], total_steps: int, state: dict) -> str | None:
    """A resumed run keeps its LR schedule unless the command re-plans it with --lr_decay_steps. Returns a line saying
    how the LR at the resume step changes when it does; raises when --max_steps or --num_epochs alone would stretch it."""
    saved = state.get("config", {})
    old_len = saved.get("lr_decay_steps") or state["total_steps"]
    new_len = cfg.lr_decay_steps or total_steps
    if new_len == old_len:
        return None
    step = state["step"]
    old_lr = lr_at(step, cfg.lr, cfg.warmup_steps, old_len, cfg.min_lr_ratio)
    new_lr = lr_at(step, cfg.lr, cfg.warmup_steps, new_len, cfg.min_lr_ratio)
    if "lr_decay_steps" not in given:
        raise StartupError(f"cannot resume: this command makes the LR schedule {new_len} steps long, the run's is {old_len} "
                           f"(the LR at step {step} would jump from {old_lr:.3g} to {new_lr:.3g}); give --lr_decay_steps {new_len} "
                           f"to re-plan the schedule, or --lr_decay_steps {old_len} to keep it and train on at its floor")
    return f"re-planned LR schedule: {old_len} -> {new_len} steps; the LR at step {step} goes from {old_lr:.3g} to {new_lr:.3g}"


def validate(cfg: Config) -> dict:
    """Check everything a user can get wrong before anything is built or written. Returns the data's meta.json."""
    for name in ("seq_len", "micro_batch_size", "log_every", "keep_last"):
        if getattr(cfg, name) < 1:
            raise StartupError(f"--{name} {getattr(cfg, name)} must be at least 1")
    for name in ("max_steps", "warmup_steps", "lr_decay_steps", "eval_every", "save_every", "eval_tokens"):
        if getattr(cfg, name) < 0:
            raise StartupError(f"--{name} {getattr(cfg, name)} must not be negative")
    if cfg.max_steps == 0 and cfg.num_epochs <= 0:
        raise StartupError(f"--num_epochs {cfg.num_epochs} must be positive when --max_steps is 0")
    if not cfg.lr > 0 or not 0 <= cfg.min_lr_ratio <= 1:
        raise StartupError(f"--lr {cfg.lr} must be positive and --min_lr_ratio {cfg.min_lr_ratio} within [0, 1]")
    if cfg.attn_implementation not in ("sdpa", "eager"):
        raise StartupError(f"--attn_implementation {cfg.attn_implementation!r} must be sdpa or eager")
    if cfg.init_from and not (Path(cfg.init_from) / "config.json").is_file():
        raise StartupError(f"--init_from {cfg.init_from} is not a Hugging Face model directory (no config.json)")
    data_dir = Path(cfg.data_dir)
    if not data_dir.is_dir():
        raise StartupError(f"--data_dir {cfg.data_dir} does not exist; create it with prepare_data.py")
    try:
        meta = lmdata.read_meta(data_dir)
        for split in ("train", "validation"):
            tokens = lmdata.load_split(data_dir, split, meta)
            if lmdata.num_windows(len(tokens), cfg.seq_len) < 1:
                raise StartupError(f"the {split} split of {cfg.data_dir} has {len(tokens)} tokens, fewer than --seq_len {cfg.seq_len} + 1; "
                                   f"lower --seq_len or add data")
    except DataError as e:
        raise StartupError(str(e)) from None
    if not (data_dir / "tokenizer").is_dir():
        raise StartupError(f"{cfg.data_dir} has no tokenizer/ directory; rebuild it with prepare_data.py --overwrite")
    if 0 < cfg.eval_tokens < cfg.seq_len:
        raise StartupError(f"--eval_tokens {cfg.eval_tokens} is less than one validation window of --seq_len {cfg.seq_len} tokens; "
                           f"raise it, or 0 for the whole validation split")
    return meta


def read_accelerate_config(path: str) -> dict:
    """What the planner needs from an accelerate YAML (and the DeepSpeed JSON it may name)."""
    import yaml

    y = yaml.safe_load(Path(path).read_text())
    ds = y.get("deepspeed_config") or {}
    js = json.loads(Path(ds["deepspeed_config_file"]).read_text()) if ds.get("deepspeed_config_file") else {}
    zero = js.get("zero_optimization", {})
    precision = y.get("mixed_precision", "no")
    if js.get("fp16", {}).get("enabled") is True:
        precision = "fp16"
    elif js.get("bf16", {}).get("enabled") is True:
        precision = "bf16"
    return {
        "world_size": int(y.get("num_processes", 1)), "nodes": int(y.get("num_machines", 1)),
        "precision": {"no": "fp32"}.get(precision, precision),
        "grad_accum": int(str(js.get("gradient_accumulation_steps", ds.get("gradient_accumulation_steps", 1))).replace("auto", "1")),
        "offload_optimizer": (zero.get("offload_optimizer", {}).get("device") or ds.get("offload_optimizer_device", "none")) not in ("none", None),
        "offload_params": (zero.get("offload_param", {}).get("device") or ds.get("offload_param_device", "none")) not in ("none", None),
        "gpu": not y.get("use_cpu", False),
    }


def plan_report(cfg: Config, model_config, setup: dict, gpu_memory_gib: float, peak_flops_per_device: float, steps: int) -> tuple[list[str], bool]:
    """The memory and time plan as printable lines, and whether the model states + activations fit the devices."""
    gib = 2**30
    world, nodes = setup["world_size"], setup["nodes"]
    mem = memory_plan(model_config, world, cfg.micro_batch_size, cfg.seq_len, setup["precision"], setup["offload_optimizer"],
                      setup["offload_params"], cfg.gradient_checkpointing, cfg.attn_implementation)
    counts = mem["params"]
    ds_host, ds_gpu = deepspeed_estimate(counts["total"], counts["largest_tensor"], world // nodes, nodes,
                                         setup["offload_optimizer"], setup["offload_params"])
    act = mem["gpu"]["activations"]
    need = max(mem["gpu_total"], ds_gpu + act)
    fits = need <= gpu_memory_gib * gib * 0.95  # the CUDA context, allocator fragmentation and buffers take the rest
    flops_tok = flops_per_token(counts["non_embedding"], model_config.num_hidden_layers, model_config.hidden_size, cfg.seq_len)
    plan = batch_plan(cfg.micro_batch_size, setup["grad_accum"], world, cfg.seq_len)
    t = step_time_plan(flops_tok, plan["tokens_per_step"], world, peak_flops_per_device, cfg.assumed_mfu, counts["total"],
                       setup["grad_accum"], 2 if setup["precision"] != "fp32" else 4, cfg.interconnect_gb_s * 1e9)
    where = "device" if setup["gpu"] else "process"
    lines = [
        f"plan: {counts['total'] / 1e6:,.1f}M parameters ({counts['non_embedding'] / 1e6:,.1f}M non-embedding, largest tensor {counts['largest_tensor'] / 1e6:.1f}M), "
        f"{flops_tok / 1e9:.2f} GFLOP/token, vocab {model_config.vocab_size}; {world} processes on {nodes} machine(s), {setup['precision']}, "
        f"offload optimizer={setup['offload_optimizer']} parameters={setup['offload_params']}",
        f"  per {where}: parameters {mem['gpu']['parameters'] / gib:.2f} GiB + gradients {mem['gpu']['gradients'] / gib:.2f} + optimizer states "
        f"{mem['gpu']['optimizer_states'] / gib:.2f} + step temporaries {mem['gpu']['optimizer_step_temporaries'] / gib:.2f} + gathered largest tensor {mem['gpu']['gathered_largest_tensor'] / gib:.2f} + activations "
        f"{act / gib:.2f} (checkpointing {'on' if cfg.gradient_checkpointing else 'off'}; on: {mem['activations_with_checkpointing'] / gib:.2f}, "
        f"off: {mem['activations_without_checkpointing'] / gib:.2f}) = {mem['gpu_total'] / gib:.2f} GiB",
        f"  DeepSpeed's ZeRO-3 estimator: {ds_gpu / gib:.2f} GiB model states per {where}, {ds_host / gib:.1f} GiB host RAM per machine "
        f"(ours: {mem['host_per_process'] * world / nodes / gib:.1f} GiB offloaded per machine)",
        f"  step: {plan['tokens_per_step']:,} tokens, {t['step_s']:.2f} s ({t['compute_s']:.2f} s compute at {cfg.assumed_mfu:.0%} MFU of "
        f"{peak_flops_per_device / 1e12:.3g} TFLOP/s + {t['comm_s']:.2f} s ZeRO-3 traffic at {cfg.interconnect_gb_s:g} GB/s) = "
        f"{t['tokens_per_s']:,.0f} tokens/s" + (f"; {steps} steps = {steps * t['step_s'] / 3600:.1f} h" if steps else ""),
    ]
    if setup["gpu"]:
        verdict = "fits" if fits else "does NOT fit"
        lines.append(f"  {verdict}: needs {need / gib:.1f} GiB of {gpu_memory_gib:g} GiB per GPU")
        if not fits:
            advice = ("use accelerate_configs/zero3_offload_3gpu.yaml (optimizer and parameters in CPU RAM)"
                      if not setup["offload_optimizer"] else "lower --micro_batch_size or --seq_len")
            lines.append(f"  advice: {advice}" + ("; add --gradient_checkpointing" if not cfg.gradient_checkpointing else ""))
    return lines, fits or not setup["gpu"]


def run_plan(cfg: Config) -> int:
    """`train.py --plan`: the plan for a config on paper, no process group and no GPU needed."""
    try:
        setup = read_accelerate_config(cfg.accelerate_config or "accelerate_configs/zero3_cpu.yaml")
        meta = lmdata.read_meta(cfg.data_dir) if (Path(cfg.data_dir) / "meta.json").is_file() else None
        model_config = load_model_config(cfg, meta)
    except (OSError, KeyError, StartupError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    peak = GPU_PEAK_FLOPS["RTX 4090"] if setup["gpu"] else 0.1e12  # the target card; a CPU core at ~100 GFLOP/s
    lines, _ = plan_report(cfg, model_config, setup, cfg.gpu_memory_gib, peak, cfg.max_steps)
    print("\n".join(lines))
    return 0


def grad_accum_steps(accelerator) -> int:
    """Gradient accumulation as the accelerate config sets it (a DeepSpeed JSON may hold it instead of the YAML)."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        value = plugin.deepspeed_config.get("gradient_accumulation_steps", "auto")
        if value != "auto":
            accelerator.gradient_accumulation_steps = int(value)
    return accelerator.gradient_accumulation_steps


def make_optimizer(model, cfg: Config, offload_optimizer: bool):
    """AdamW with weight decay on 2-D weights only (matrices and embeddings, not norms)."""
    # Under zero.Init parameters are flat shards; ds_shape is the real shape.
    decay = [p for p in model.parameters() if len(getattr(p, "ds_shape", p.shape)) >= 2]
    no_decay = [p for p in model.parameters() if len(getattr(p, "ds_shape", p.shape)) < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    if offload_optimizer:  # ZeRO-Offload refuses torch optimizers: its CPU Adam is the one that is fast on the host
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps)


def count_params(model) -> tuple[int, int]:
    """(all parameters, non-embedding parameters), real sizes even when ZeRO-3 has partitioned them."""
    numel = {name: getattr(p, "ds_numel", p.numel()) for name, p in model.named_parameters()}
    embed = model.get_input_embeddings().weight
    embed_numel = getattr(embed, "ds_numel", embed.numel())
    return sum(numel.values()), sum(numel.values()) - embed_numel


def measure_peak_flops(accelerator, dtype: torch.dtype) -> tuple[float, str]:
    """Peak FLOP/s the MFU is measured against: the datasheet for known GPUs, else a large matmul timed now on every
    process at once (on a CPU the processes share cores, so the sum is what the machine gives them together)."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        precision = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "fp32")
        flops = gpu_peak_flops(name, precision)
        if flops is not None:
            return flops * accelerator.num_processes, f"{name} datasheet, {precision}"
    n = 1024 if accelerator.device.type == "cpu" else 8192
    a = torch.randn(n, n, device=accelerator.device, dtype=dtype)
    b = torch.randn(n, n, device=accelerator.device, dtype=dtype)
    a @ b
    accelerator.wait_for_everyone()
    reps = 5
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if accelerator.device.type == "cuda":
        torch.cuda.synchronize()
    local = torch.tensor([2 * n**3 * reps / (time.perf_counter() - t0)], device=accelerator.device)
    return float(accelerator.reduce(local, "sum")), f"{n}x{n} {str(dtype).replace('torch.', '')} matmul timed on all processes"


def fp16_loss_scale(engine, scaler) -> float | None:
    """The current fp16 loss scale: DeepSpeed's dynamic scaler, or Accelerate's GradScaler without DeepSpeed."""
    if engine is not None and hasattr(engine.optimizer, "loss_scale"):
        return float(engine.optimizer.loss_scale)
    if scaler is not None:
        return float(scaler.get_scale())
    return None


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


# ---------------------------------------------------------------------------------------------------------------------
# Data, loss and validation
# ---------------------------------------------------------------------------------------------------------------------


def get_batch(tokens: np.ndarray, ids: range, seq_len: int, seed: int, n_windows: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([lmdata.window(tokens, lmdata.sample_window(seed, i, n_windows)[1], seq_len) for i in ids])
    batch = torch.from_numpy(rows)
    return batch[:, :-1], batch[:, 1:]


def lm_loss(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@torch.no_grad()
def validation_loss(model, accelerator, tokens: np.ndarray, seq_len: int, micro_batch_size: int) -> float:
    """Mean next-token loss over non-overlapping windows of the validation tokens, split over all processes.

    Every process runs the same number of forward passes (ZeRO-3 gathers parameters collectively); a process with
    fewer windows pads with a repeat whose tokens carry no weight.
    """
    from eval import nll_sum

    model.eval()
    n = lmdata.num_windows(len(tokens), seq_len)
    mine = list(range(accelerator.process_index, n, accelerator.num_processes))
    per_rank = -(-n // accelerator.num_processes)
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for start in range(0, per_rank, micro_batch_size):
        chunk = [mine[i] if i < len(mine) else None for i in range(start, min(start + micro_batch_size, per_rank))]
        rows = torch.from_numpy(np.stack([lmdata.window(tokens, w if w is not None else 0, seq_len) for w in chunk]))
        targets = rows[:, 1:].clone()
        targets[[i for i, w in enumerate(chunk) if w is None]] = -100
        logits = model(input_ids=rows[:, :-1].to(accelerator.device), use_cache=False).logits
        total += torch.stack(nll_sum(logits, targets.to(accelerator.device)))
    total = accelerator.reduce(total, "sum")
    model.train()
    return float(total[0] / total[1])


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints: checkpoints/.tmp-step_N is written by every rank, then renamed to step_N; `latest` moves last.
# ---------------------------------------------------------------------------------------------------------------------


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    found = [p for p in ckpt_root.glob("step_*") if p.is_dir() and (p / "trainer_state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def newest_checkpoint(ckpt_root: Path) -> Path | None:
    """What `--resume auto` continues: the checkpoint `latest` names, else the newest complete one."""
    latest = ckpt_root / "latest"
    if latest.is_file():
        named = ckpt_root / latest.read_text().strip()
        if (named / "trainer_state.json").is_file():
            return named
    done = complete_checkpoints(ckpt_root)
    return done[-1] if done else None


def find_resume_checkpoint(cfg: Config, ckpt_root: Path, accelerator) -> Path | None:
    """The checkpoint to resume from, the same on every rank. With node-local disks each machine sees only its own
    copies, and a kill between two machines' renames leaves them at different steps: all take the oldest."""
    for partial in sorted(ckpt_root.glob(".tmp-step_*")) + [p for p in ckpt_root.glob("step_*") if not (p / "trainer_state.json").is_file()]:
        accelerator.print(f"warning: ignoring incomplete checkpoint {partial} (a run died while writing it)")
    if cfg.resume not in ("", "auto"):
        return Path(cfg.resume)
    if cfg.resume != "auto":
        return None
    mine = newest_checkpoint(ckpt_root)
    step = int(mine.name.split("_")[1]) if mine is not None else -1
    lowest, highest = step, step
    if accelerator.num_processes > 1:
        steps = torch.tensor([step, -step], device=accelerator.device)
        torch.distributed.all_reduce(steps, op=torch.distributed.ReduceOp.MIN)
        lowest, highest = int(steps[0]), -int(steps[1])
    if highest < 0:
        return None
    if lowest < 0:
        raise StartupError(f"--resume auto: some machines have no complete checkpoint in {ckpt_root} while others reach step {highest}; "
                           f"copy the checkpoints to every machine or start a new --output_dir")
    if lowest != highest:
        accelerator.print(f"warning: machines disagree on the newest checkpoint (steps {lowest} to {highest}); all resume from step {lowest}")
    chosen = ckpt_root / f"step_{lowest}"
    missing = torch.tensor([float(not (chosen / "trainer_state.json").is_file())], device=accelerator.device)
    if float(accelerator.reduce(missing, "sum")) > 0:
        raise StartupError(f"--resume auto: {chosen} is not complete on every machine; copy it there or resume from an older checkpoint")
    return chosen


def set_aside_newer(ckpt_root: Path, resume_from: Path) -> Path | None:
    """An explicit --resume from an older checkpoint starts a new branch: the checkpoints after it move to
    checkpoints/abandoned-<time>/ (kept, but out of pruning's and --resume auto's way) and `latest` names resume_from."""
    if not ckpt_root.is_dir() or resume_from.parent.resolve() != ckpt_root.resolve():
        return None
    step = int(resume_from.name.split("_")[1])
    newer = [p for p in ckpt_root.glob("step_*") if p.is_dir() and int(p.name.split("_")[1]) > step]
    if not newer:
        return None
    aside = ckpt_root / time.strftime("abandoned-%Y%m%d-%H%M%S")
    aside.mkdir(exist_ok=True)
    for p in newer:
        os.replace(p, aside / p.name)
    point_latest_at(ckpt_root, resume_from)
    return aside


def point_latest_at(ckpt_root: Path, checkpoint: Path) -> None:
    tmp = ckpt_root / f".latest.{os.getpid()}"
    tmp.write_text(checkpoint.name + "\n")
    os.replace(tmp, ckpt_root / "latest")


def first_process_on_disk(accelerator, directory: Path) -> bool:
    """True on exactly one process per filesystem holding `directory`: global rank 0, and on node-local disks (where
    rank 0's marker file is invisible) the first process of each other machine. These processes finalise checkpoints."""
    from accelerate.utils import broadcast_object_list

    nonce = broadcast_object_list([os.urandom(8).hex()])[0]
    marker = directory / f".rank0-{nonce}"
    if accelerator.is_local_main_process:
        directory.mkdir(parents=True, exist_ok=True)
    if accelerator.is_main_process:
        marker.touch()
    accelerator.wait_for_everyone()
    sees_rank0 = marker.exists()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        marker.unlink()
    return accelerator.is_main_process or (accelerator.is_local_main_process and not sees_rank0)


def check_resume_compatible(state: dict, current: dict, ckpt: Path) -> None:
    """A checkpoint only continues the same run: ZeRO-3 shards are per rank, and the data order and schedule depend on
    the global batch, sequence length, data and seed."""
    for key, value in current.items():
        if state.get(key) != value:
            raise StartupError(
                f"cannot resume {ckpt}: it was made with {key}={state.get(key)!r}, this run has {key}={value!r}; "
                f"relaunch with the original setting, or start a new --output_dir with --init_from OUT/final "
                f"(weights only, fresh optimizer and schedule)"
            )


def save_checkpoint(accelerator, ckpt_root: Path, step: int, state: dict, keep_last: int, resumed_from: Path | None,
                    finaliser: bool) -> Path:
    """Every rank writes its shards into .tmp-step_N; once all have, the finaliser of each filesystem (see
    first_process_on_disk) adds trainer_state.json, renames it to step_N, moves `latest` and prunes."""
    final = ckpt_root / f"step_{step}"
    tmp = ckpt_root / f".tmp-step_{step}"
    if finaliser:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died while writing this step
        tmp.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if injected_fault("sigkill_in_save", accelerator.process_index, step):
        os.kill(os.getpid(), signal.SIGKILL)
    accelerator.wait_for_everyone()
    if finaliser:
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")
        stale = ckpt_root / f".stale-step_{step}"
        if final.exists():  # written by an earlier attempt at this step
            os.replace(final, stale)
        os.replace(tmp, final)
        shutil.rmtree(stale, ignore_errors=True)
        point_latest_at(ckpt_root, final)
        for old in complete_checkpoints(ckpt_root)[:-keep_last]:
            if old != final and (resumed_from is None or old.resolve() != resumed_from.resolve()):
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def export_final(accelerator, model, tokenizer, out_dir: Path) -> Path:
    """OUT/final: a plain Hugging Face model directory, weights gathered from the ZeRO-3 shards."""
    state_dict = accelerator.get_state_dict(model)  # collective: every rank takes part
    final, tmp = out_dir / "final", out_dir / ".tmp-final"
    if accelerator.is_main_process:
        if tmp.exists():
            shutil.rmtree(tmp)
        accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()
    return final


def plot_losses(metrics_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", ms=4)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(metrics_path.parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------------


def train(cfg: Config, given: set[str]) -> int:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs, set_seed
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Launched on CPUs, DeepSpeed needs gloo named explicitly or Accelerate and DeepSpeed disagree on the world size.
    # A plain `python train.py` has no process group to create; LOCAL_RANK is how Accelerate itself tells.
    launched = "LOCAL_RANK" in os.environ
    kwargs = [InitProcessGroupKwargs(backend="gloo")] if launched and not torch.cuda.is_available() else []
    accelerator = Accelerator(log_with=cfg.log_with or None, project_dir=cfg.output_dir, kwargs_handlers=kwargs)
    started = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if started > 1 and accelerator.distributed_type == DistributedType.NO:  # torchrun on CPUs without ACCELERATE_USE_CPU=1
        if torch.distributed.get_rank() == 0:
            print(f"error: {started} processes were started but Accelerate runs them as {accelerator.distributed_type.value}, with "
                  f"no gradient sync: each would train its own copy. On CPUs launch with "
                  f"ACCELERATE_USE_CPU=1 torchrun --nproc_per_node {started} train.py ..., or accelerate launch --config_file "
                  f"accelerate_configs/zero3_cpu.yaml train.py ...")
        return 2
    try:
        check_output_dir(cfg)
        out = Path(cfg.output_dir)
        ckpt_root = out / "checkpoints"
        resume_from = find_resume_checkpoint(cfg, ckpt_root, accelerator)
        resume_state = json.loads((resume_from / "trainer_state.json").read_text()) if resume_from is not None else None
        if resume_state is not None:
            cfg, taken = config_for_resume(cfg, given, resume_state.get("config", {}))
            if taken:
                accelerator.print(f"settings from {resume_from.name}: " + " ".join(f"--{k} {v}" for k, v in taken.items()))
        meta = validate(cfg)
        model_config = load_model_config(cfg, meta)
        accum = grad_accum_steps(accelerator)
        plan = batch_plan(cfg.micro_batch_size, accum, accelerator.num_processes, cfg.seq_len)
        train_tokens = lmdata.load_split(cfg.data_dir, "train", meta)
        val_tokens = lmdata.load_split(cfg.data_dir, "validation", meta)
        if cfg.eval_tokens:
            val_tokens = val_tokens[: cfg.eval_tokens + 1]
        n_windows = lmdata.num_windows(len(train_tokens), cfg.seq_len)
        total_steps = total_steps_for(cfg.max_steps, cfg.num_epochs, n_windows, plan["sequences_per_step"])
        run_identity = {"world_size": plan["world_size"], "micro_batch_size": cfg.micro_batch_size, "grad_accum_steps": accum,
                        "seq_len": cfg.seq_len, "seed": cfg.seed, "data_fingerprint": meta["fingerprint"],
                        "model_config_hash": config_hash(model_config)}
        if resume_state is not None:
            check_resume_compatible(resume_state, run_identity, resume_from)
            replanned = schedule_on_resume(cfg, given, total_steps, resume_state)
            if replanned:
                accelerator.print(replanned)
            if resume_state["step"] > total_steps:
                raise StartupError(f"cannot resume {resume_from}: it is at step {resume_state['step']}, beyond this run's {total_steps} steps; "
                                   f"raise --max_steps (or --num_epochs)")
    except StartupError as e:
        accelerator.print(f"error: {e}")
        return 2

    is_deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config if is_deepspeed else {}
    precision = "fp16" if ds_config.get("fp16", {}).get("enabled") is True else "bf16" if ds_config.get("bf16", {}).get("enabled") is True else accelerator.mixed_precision
    precision = {"no": "fp32"}.get(precision, precision)
    accelerator.print(
        f"batch plan: {plan['micro_batch_size']} micro x {accum} accumulation x {plan['world_size']} processes = "
        f"{plan['sequences_per_step']} sequences = {plan['tokens_per_step']:,} tokens per step; {total_steps} steps "
        f"({total_steps * plan['sequences_per_step'] / n_windows:.2f} epochs of {n_windows:,} windows); "
        f"{accelerator.distributed_type.value}, {precision}"
    )

    offload = ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") not in ("none", None)
    offload_params = ds_config.get("zero_optimization", {}).get("offload_param", {}).get("device", "none") not in ("none", None)
    on_gpu = torch.cuda.is_available()
    peak_flops, peak_source = measure_peak_flops(accelerator, torch.float32 if precision == "fp32" else torch.bfloat16 if precision == "bf16" else torch.float16)
    setup = {"world_size": plan["world_size"], "nodes": max(1, plan["world_size"] // max(1, torch.cuda.device_count())) if on_gpu else 1,
             "precision": precision, "grad_accum": accum, "offload_optimizer": offload, "offload_params": offload_params, "gpu": on_gpu}
    device_gib = torch.cuda.get_device_properties(accelerator.device).total_memory / 2**30 if on_gpu else 0.0
    lines, fits = plan_report(cfg, model_config, setup, device_gib, peak_flops / plan["world_size"], total_steps)
    accelerator.print("\n".join(lines))
    if not fits and not cfg.ignore_memory_plan:
        accelerator.print("error: the plan above does not fit this GPU's memory; follow its advice, or pass --ignore_memory_plan to try anyway")
        return 2

    # Past every start-up check: from here on the run writes to OUT.
    finaliser = first_process_on_disk(accelerator, ckpt_root)
    if resume_from is not None and cfg.resume != "auto" and finaliser:
        aside = set_aside_newer(ckpt_root, resume_from)
        if aside is not None:
            print(f"moved the checkpoints after {resume_from.name} to {aside}: this run continues from {resume_from.name}")
    accelerator.wait_for_everyone()

    mem_before_model_gib = peak_memory_gib(accelerator.device)  # the baseline the plan's estimate adds to
    set_seed(cfg.seed)
    # The Accelerator exists, so under ZeRO-3 each parameter is partitioned as soon as it is created.
    model_kwargs = {"attn_implementation": cfg.attn_implementation, "dtype": torch.float32}
    if cfg.init_from:
        model = AutoModelForCausalLM.from_pretrained(cfg.init_from, **model_kwargs)
    else:
        model = AutoModelForCausalLM.from_config(model_config, **model_kwargs)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_params, n_non_embedding = count_params(model)
    local_numel = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters())
    held = accelerator.gather(torch.tensor([local_numel / n_params], device=accelerator.device)).tolist()
    accelerator.print(f"parameters held per process: {' '.join(f'{h:.1%}' for h in held)}")
    flops_tok = flops_per_token(n_non_embedding, model_config.num_hidden_layers, model_config.hidden_size, cfg.seq_len)
    optimizer = make_optimizer(model, cfg, offload)
    if is_deepspeed:
        ds_config["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
        ds_config["gradient_clipping"] = cfg.max_grad_norm
    model, optimizer = accelerator.prepare(model, optimizer)
    tokenizer = AutoTokenizer.from_pretrained(Path(cfg.data_dir) / "tokenizer")
    accelerator.print(f"model: {n_params / 1e6:.2f}M parameters ({n_non_embedding / 1e6:.2f}M non-embedding), "
                      f"{flops_tok / 1e6:.1f} MFLOP/token; peak {peak_flops / 1e12:.2f} TFLOP/s ({peak_source})")

    start_step = 0
    if resume_state is not None:
        accelerator.load_state(str(resume_from))
        start_step = resume_state["step"]
        accelerator.print(f"resumed from {resume_from} at step {start_step} ({resume_state['tokens_seen']:,} tokens seen)")
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        metrics_path = out / "metrics.jsonl"
        # Lines logged after the checkpoint by the run that died would be logged again: drop them.
        kept = ([l for l in metrics_path.read_text().splitlines() if json.loads(l)["step"] <= start_step]
                if resume_state is not None and metrics_path.exists() else [])
        metrics_path.write_text("".join(l + "\n" for l in kept))
        (out / "config.json").write_text(json.dumps({"written_by": "train.py", **dataclasses.asdict(cfg), "batch_plan": plan, "total_steps": total_steps, "precision": precision,
                                                    "peak_mem_before_model_gib": mem_before_model_gib}, indent=2) + "\n")
    if cfg.log_with:
        accelerator.init_trackers("train", config={k: v for k, v in dataclasses.asdict(cfg).items() if isinstance(v, (int, float, str, bool))})

    def log(record: dict, console: str | None = None) -> None:
        if accelerator.is_main_process:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            if console:
                bar.write(console)
        if cfg.log_with:
            accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    stop_signal = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop_signal.append(signum))

    from tqdm.auto import tqdm

    bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True, disable=not accelerator.is_main_process)
    if start_step == 0 and cfg.eval_at_start:
        val = validation_loss(model, accelerator, val_tokens, cfg.seq_len, cfg.micro_batch_size)
        log({"step": 0, "tokens": 0, "val_loss": val, "val_ppl": math.exp(val)}, f"step 0 | val loss {val:.4f} | val ppl {math.exp(val):.2f}")

    def state_at(step: int) -> dict:
        return {**run_identity, "step": step, "tokens_seen": step * plan["tokens_per_step"], "samples_seen": step * plan["sequences_per_step"],
                "epoch": step * plan["sequences_per_step"] / n_windows, "data_dir": str(Path(cfg.data_dir).resolve()), "total_steps": total_steps,
                "config": {**dataclasses.asdict(cfg), "data_dir": str(Path(cfg.data_dir).resolve())}}

    engine = model if is_deepspeed else None
    interval_t0, interval_steps, interval_loss = time.perf_counter(), 0, 0.0
    skipped_at_start, skipped_here = (engine.skipped_steps if engine else 0), 0
    last_saved = start_step if resume_state is not None else None
    step = start_step
    while step < total_steps:
        lr = lr_at(step, cfg.lr, cfg.warmup_steps, cfg.lr_decay_steps or total_steps, cfg.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=accelerator.device)
        grad_norm = None
        for micro_step in range(accum):
            inputs, targets = get_batch(train_tokens, sample_ids(step, micro_step, accelerator.process_index, plan), cfg.seq_len, cfg.seed, n_windows)
            with accelerator.accumulate(model):
                loss = lm_loss(model, inputs.to(accelerator.device), targets.to(accelerator.device))
                if injected_fault("nan_loss", accelerator.process_index, step + 1):
                    loss = loss * float("nan")
                try:
                    accelerator.backward(loss)
                except Exception as e:  # DeepSpeed's fp16 scaler raises on every rank at once when it cannot go lower
                    if "loss scale already at minimum" not in str(e):
                        raise
                    accelerator.print(f"error: step {step + 1}: the fp16 loss scale is at its minimum and gradients still overflow; "
                                      f"train in bf16 (--mixed_precision bf16 at launch), lower --lr, or --resume auto from the last checkpoint")
                    return 3
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
                optimizer.step()
                optimizer.zero_grad()
                skipped_here += int(accelerator.sync_gradients and engine is None and accelerator.optimizer_step_was_skipped)
            loss_sum += loss.detach()
        step += 1
        interval_steps += 1
        if injected_fault("sigterm_launcher", accelerator.process_index, step):
            os.kill(os.getppid(), signal.SIGTERM)
        # One collective per step carries the loss and whether any process was asked to stop.
        reduced = accelerator.reduce(torch.stack([loss_sum / accum, torch.tensor(float(bool(stop_signal)), device=accelerator.device)]), "sum")
        step_loss, stop_requested = float(reduced[0]) / accelerator.num_processes, bool(reduced[1] > 0)
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        skipped = (engine.skipped_steps - skipped_at_start) if engine else skipped_here
        interval_loss += step_loss
        if precision != "fp16" and not (math.isfinite(step_loss) and math.isfinite(grad_norm)):
            accelerator.print(f"error: step {step}: loss {step_loss} / grad norm {grad_norm} is not finite; stopping without saving. "
                              f"The last checkpoint is intact: lower --lr, raise --warmup_steps or check the data, then --resume auto")
            return 3
        bar.update(1)
        if step % cfg.log_every == 0 or step == total_steps or stop_requested:
            elapsed = time.perf_counter() - interval_t0
            tokens_per_s = interval_steps * plan["tokens_per_step"] / elapsed
            mem = float(accelerator.gather(torch.tensor([peak_memory_gib(accelerator.device)], device=accelerator.device)).max())
            mean_loss = interval_loss / interval_steps
            record = {"step": step, "tokens": step * plan["tokens_per_step"], "loss": mean_loss, "lr": lr, "grad_norm": grad_norm,
                      "tokens_per_s": tokens_per_s, "mfu": mfu(tokens_per_s, flops_tok, peak_flops), "peak_mem_gib": mem,
                      "epoch": step * plan["sequences_per_step"] / n_windows, "samples_seen": step * plan["sequences_per_step"]}
            scale = fp16_loss_scale(engine, accelerator.scaler) if precision == "fp16" else None
            if scale is not None:
                record.update(loss_scale=scale, skipped_steps=skipped)
            bar.set_postfix(loss=f"{mean_loss:.3f}", lr=f"{lr:.2e}")
            log(record, f"step {step}/{total_steps} | loss {mean_loss:.4f} | lr {lr:.2e} | grad {grad_norm:.3f} | "
                        f"{tokens_per_s:,.0f} tok/s | MFU {record['mfu']:.1%} | peak mem {mem:.2f} GiB"
                        + (f" | scale {scale:.0f} skipped {skipped}" if scale is not None else ""))
            interval_t0, interval_steps, interval_loss = time.perf_counter(), 0, 0.0
        pause_t0 = time.perf_counter()
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == total_steps:
            val = validation_loss(model, accelerator, val_tokens, cfg.seq_len, cfg.micro_batch_size)
            log({"step": step, "tokens": step * plan["tokens_per_step"], "val_loss": val, "val_ppl": math.exp(val)},
                f"step {step} | val loss {val:.4f} | val ppl {math.exp(val):.2f}")
        if (cfg.save_every and step % cfg.save_every == 0) or step == total_steps or stop_requested:
            saved = save_checkpoint(accelerator, ckpt_root, step, state_at(step), cfg.keep_last, resume_from, finaliser)
            last_saved = step
            accelerator.print(f"saved {saved}")
        interval_t0 += time.perf_counter() - pause_t0  # throughput counts training time only
        if stop_requested:
            bar.close()
            accelerator.print(f"stopped by signal after step {step}; the same command with --resume auto continues from {ckpt_root / f'step_{step}'}")
            accelerator.end_training()
            return 0
    bar.close()
    assert last_saved == total_steps
    final = export_final(accelerator, model, tokenizer, out)
    if accelerator.is_main_process:
        plot_losses(out / "metrics.jsonl", out / "loss_curve.png")
        accelerator.print(f"done: model in {final}, loss curve in {out / 'loss_curve.png'}, metrics in {out / 'metrics.jsonl'}")
    accelerator.end_training()
    return 0


def main(argv: list[str] | None = None) -> int:
    from transformers import HfArgumentParser

    argv = sys.argv[1:] if argv is None else argv
    (cfg,) = HfArgumentParser(Config, description=__doc__.split("\n\n")[0]).parse_args_into_dataclasses(argv)
    if cfg.plan:
        return run_plan(cfg)
    return train(cfg, given_fields(argv))


if __name__ == "__main__":
    from teardown import exit_process

    exit_process(main())
