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

Read top to bottom: Config, helpers (batch, loss, optimizer, logging), setup, the loop (`train`). The planner
(plan.py), checkpoints (checkpoint.py), token files (lmdata.py) and the validation loss (lmloss.py) live beside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import checkpoint
import cli
import lmdata
import moe
import plan
from cli import UserError, field
from lmloss import validation_loss

# DeepSpeed calls collectives that torch renamed; the warning repeats every step and says nothing to a user.
warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)
cli.quiet_console()


# fmt: off
@dataclasses.dataclass
class Config:
    data_dir: str = field("data/python-docs", "directory written by prepare_data.py")
    model_config: str = field("tiny", "preset in model_configs/ (deepseek-7b, deepseek-1.3b, small, mini, tiny), "
                                      "a config.json, or a model directory")
    init_from: str = field("", "Hugging Face model directory to start from (its weights); default: random init")
    output_dir: str = field("runs/tiny", "metrics, checkpoints, final model and loss curve go here")
    seq_len: int = field(256, "tokens per training sequence")
    micro_batch_size: int = field(8, "sequences per process per forward/backward")
    max_steps: int = field(0, "optimizer steps to train (0: use --num_epochs)")
    num_epochs: float = field(1.0, "passes over the training split when --max_steps is 0")
    lr: float = field(1e-3, "peak learning rate")
    min_lr_ratio: float = field(0.1, "cosine decay floor as a fraction of --lr")
    warmup_steps: int = field(30, "linear warmup, in optimizer steps")
    lr_decay_steps: int = field(0, "length of warmup + cosine decay in steps (0: the run's total steps); set it to "
                                   "train a long schedule in shorter runs")
    weight_decay: float = field(0.1, "AdamW weight decay (2-D weights only)")
    adam_beta1: float = field(0.9, "AdamW beta1")
    adam_beta2: float = field(0.95, "AdamW beta2")
    adam_eps: float = field(1e-8, "AdamW epsilon")
    max_grad_norm: float = field(1.0, "clip the global gradient norm to this (0: no clipping)")
    seed: int = field(0, "seeds the weights and the data order")
    log_every: int = field(10, "optimizer steps between metric lines")
    eval_every: int = field(100, "optimizer steps between validation runs (0: only at start and end)")
    eval_tokens: int = field(1 << 20, "validation tokens per evaluation (0: the whole split)")
    save_every: int = field(100, "optimizer steps between checkpoints (0: only at the end)")
    keep_last: int = field(2, "complete checkpoints to keep")
    resume: str = field("", "'auto' (newest complete checkpoint in OUT, if any) or a checkpoint directory")
    plan: bool = field(False, "print the memory and time plan for this model, config and batch, then exit "
                              "(no training, no GPU)")
    accelerate_config: str = field("", "with --plan: the accelerate config YAML to plan for (default: the CPU config)")
    assumed_mfu: float = field(0.35, "model FLOPs utilisation assumed for the planned step time")
    interconnect_gb_s: float = field(10.0, "GPU-to-GPU bandwidth assumed for the plan, GB/s (PCIe 4.0 x16 without "
                                           "P2P: ~10)")
    gpu_memory_gib: float = field(24.0, "with --plan: memory per GPU to plan for (RTX 4090: 24); a real run reads "
                                        "the device")
    ignore_memory_plan: bool = field(False, "start even when the plan says the model does not fit the GPUs")
    eval_at_start: bool = field(True, "validation loss of the initial weights at step 0 (--no_eval_at_start skips it: "
                                      "on CPU processes under ZeRO-3 no-grad forwards before the first step slow the "
                                      "whole run, see BENCHMARKS.md)")
    log_with: str = field("", "extra tracker for accelerate, e.g. tensorboard")
    gradient_checkpointing: bool = field(False, "recompute activations in backward (less memory, ~30%% more compute)")
    attn_implementation: str = field("sdpa", "attention kernel: sdpa or eager")
    moe_bias_update_speed: float = field(0.001, "MoE models (deepseek-v3-*): how far each router's per-expert bias "
                                                "moves after every step toward balanced loads (DeepSeek-V3's gamma; "
                                                "0: off)")
    moe_aux_loss_alpha: float = field(0.0001, "MoE models: weight of the sequence-wise balance loss (DeepSeek-V3's "
                                              "alpha; 0: off)")
# fmt: on


class Diverged(Exception):
    """Training cannot go on (exit 3); the message says why and how to continue from the last checkpoint."""


# ---------------------------------------------------------------------------------------------------------------------
# Helpers: data order, loss, optimizer, logging
# ---------------------------------------------------------------------------------------------------------------------


def sample_ids(step: int, micro_step: int, rank: int, batch: dict) -> range:
    """Global sample numbers of one micro-batch: an optimizer step takes the next `sequences_per_step` samples, laid
    out micro-step-major, so the set a step trains on depends only on the global batch, not on how it is split."""
    start = step * batch["sequences_per_step"] + (micro_step * batch["world_size"] + rank) * batch["micro_batch_size"]
    return range(start, start + batch["micro_batch_size"])


def get_batch(
    tokens: np.ndarray, ids: range, seq_len: int, seed: int, n_windows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([lmdata.window(tokens, lmdata.sample_window(seed, i, n_windows)[1], seq_len) for i in ids])
    batch = torch.from_numpy(rows)
    return batch[:, :-1], batch[:, 1:]


def lm_loss(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


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


def fp16_loss_scale(engine, scaler) -> float | None:
    """The current fp16 loss scale: DeepSpeed's dynamic scaler, or Accelerate's GradScaler without DeepSpeed."""
    if engine is not None and hasattr(engine.optimizer, "loss_scale"):
        return float(engine.optimizer.loss_scale)
    if scaler is not None:
        return float(scaler.get_scale())
    return None


def any_process(accelerator, flag: bool) -> bool:
    return bool(accelerator.reduce(torch.tensor([float(flag)], device=accelerator.device), "sum") > 0)


def plot_losses(metrics_path: Path, png_path: Path) -> None:
    """The loss curve; for a MoE model, a second panel with the expert-load imbalance (MaxVio) and the balance loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records, _ = checkpoint.read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    balance = [r for r in records if "moe_maxvio_max" in r]
    fig, axes = plt.subplots(2 if balance else 1, 1, figsize=(7, 7 if balance else 4.2), sharex=True, squeeze=False)
    ax = axes[0, 0]
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", ms=4)
    ax.set(ylabel="cross-entropy (nats/token)", title=metrics_path.parent.name)
    if balance:
        steps = [r["step"] for r in balance]
        bottom = axes[1, 0]
        bottom.plot(steps, [r["moe_maxvio_max"] for r in balance], label="MaxVio, worst layer", lw=1)
        bottom.plot(steps, [r["moe_maxvio_mean"] for r in balance], label="MaxVio, mean of layers", lw=1)
        bottom.set(ylabel="max load / mean load - 1")
        if any("moe_aux_loss" in r for r in balance):
            aux = bottom.twinx()
            aux.plot(steps, [r.get("moe_aux_loss", float("nan")) for r in balance], "k:", label="balance loss", lw=1)
            aux.set(ylabel="balance loss")
            aux.legend(loc="upper center")
    for ax in axes[:, 0]:
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
    axes[-1, 0].set(xlabel="optimizer step")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------------
# Setup: check everything, then build. A mistake raises UserError before anything is written.
# ---------------------------------------------------------------------------------------------------------------------


def validate(cfg: Config, resuming: bool):
    """Check the flags and the data directory; returns the data, memory-mapped once for the whole run, and its
    tokenizer. A resumed run needs nothing from --init_from: its weights are in the checkpoint."""
    for name in ("seq_len", "micro_batch_size", "log_every", "keep_last"):
        if getattr(cfg, name) < 1:
            raise UserError(f"--{name} {getattr(cfg, name)} must be at least 1")
    never_negative = ("max_steps", "warmup_steps", "lr_decay_steps", "eval_every", "save_every", "eval_tokens",
                      "moe_bias_update_speed", "moe_aux_loss_alpha")  # fmt: skip
    for name in never_negative:
        if getattr(cfg, name) < 0:
            raise UserError(f"--{name} {getattr(cfg, name)} must not be negative")
    if cfg.max_steps == 0 and cfg.num_epochs <= 0:
        raise UserError(f"--num_epochs {cfg.num_epochs} must be positive when --max_steps is 0")
    if not cfg.lr > 0 or not 0 <= cfg.min_lr_ratio <= 1:
        raise UserError(f"--lr {cfg.lr} must be positive and --min_lr_ratio {cfg.min_lr_ratio} within [0, 1]")
    if cfg.attn_implementation not in ("sdpa", "eager"):
        raise UserError(f"--attn_implementation {cfg.attn_implementation!r} must be sdpa or eager")
    if cfg.init_from and not resuming and not (Path(cfg.init_from) / "config.json").is_file():
        raise UserError(f"--init_from {cfg.init_from} is not a Hugging Face model directory (no config.json)")
    if 0 < cfg.eval_tokens < cfg.seq_len:
        raise UserError(
            f"--eval_tokens {cfg.eval_tokens} is less than one validation window of --seq_len "
            f"{cfg.seq_len} tokens; raise it, or 0 for the whole validation split"
        )
    data = lmdata.training_data(cfg.data_dir, cfg.seq_len, cfg.eval_tokens)
    tokenizer = load_tokenizer(Path(cfg.data_dir) / "tokenizer", "rebuild the data with prepare_data.py --overwrite")
    if cfg.init_from and not resuming:
        plan.check_weight_files(Path(cfg.init_from), f"--init_from {cfg.init_from}")
        check_same_tokenizer(cfg.init_from, tokenizer, data.meta["eos_id"])
    return data, tokenizer


def load_tokenizer(directory: Path, fix: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # noqa: BLE001 - a missing, torn or foreign tokenizer file: many exception types
        raise UserError(f"{directory} holds no readable tokenizer ({type(e).__name__}); {fix}") from None


def check_same_tokenizer(model_dir: str, ours, data_eos_id: int) -> None:
    """--init_from must have been trained on the ids the data holds: the same vocabulary (token -> id), the same
    encoding of a probe text and the same EOS id. A vocabulary size alone says nothing (two 512-token BPEs agree)."""
    theirs = load_tokenizer(
        Path(model_dir), "nothing shows --init_from was trained on the data's ids: copy its tokenizer into it"
    )
    probe = "The tokenizer probe: naïve café, 1234 + x**2\n\n\tdef f(): return 'ok'"
    if theirs.get_vocab() != ours.get_vocab() or theirs.encode(probe) != ours.encode(probe):
        raise UserError(
            f"--init_from {model_dir} was trained with another tokenizer than the data's (vocabularies "
            f"or encodings differ); prepare the data with prepare_data.py --tokenizer {model_dir}"
        )
    if theirs.eos_token_id != data_eos_id:
        raise UserError(
            f"--init_from {model_dir} has EOS id {theirs.eos_token_id}, the data {data_eos_id}; prepare the data "
            f"with prepare_data.py --tokenizer {model_dir}"
        )


@dataclasses.dataclass
class Run:
    """What setup decided: the run's settings (a resumed run's come from its checkpoint) and its shape."""

    cfg: Config
    data: lmdata.TrainingData
    model_config: object
    launch: plan.Launch
    batch: dict
    total_steps: int
    flops_per_token: float
    identity: dict  # what a checkpoint must match to be resumed by this run
    resume_from: Path | None
    resume_state: dict | None
    tokenizer: object  # the data's, saved with the final model

    def state_at(self, step: int) -> dict:
        """trainer_state.json of the checkpoint at `step`."""
        data_dir = str(Path(self.cfg.data_dir).resolve())
        return {
            **self.identity,
            "step": step,
            "tokens_seen": step * self.batch["tokens_per_step"],
            "samples_seen": step * self.batch["sequences_per_step"],
            "epoch": step * self.batch["sequences_per_step"] / self.data.n_windows,
            "data_dir": data_dir,
            "total_steps": self.total_steps,
            "config": {**dataclasses.asdict(self.cfg), "data_dir": data_dir},
        }


def start_accelerator(cfg: Config):
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    # Launched on CPUs, DeepSpeed needs gloo named explicitly or Accelerate and DeepSpeed disagree on the world size.
    # A plain `python train.py` has no process group to create; LOCAL_RANK is how Accelerate itself tells.
    launched = "LOCAL_RANK" in os.environ
    kwargs = [InitProcessGroupKwargs(backend="gloo")] if launched and not torch.cuda.is_available() else []
    with cli.without_noise():
        accelerator = Accelerator(log_with=cfg.log_with or None, project_dir=cfg.output_dir, kwargs_handlers=kwargs)
    started = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if started > 1 and accelerator.distributed_type == DistributedType.NO:  # torchrun on CPUs without the variable
        raise UserError(
            f"{started} processes were started but Accelerate runs them as "
            f"{accelerator.distributed_type.value}, with no gradient sync: each would train its own copy. "
            f"On CPUs launch with ACCELERATE_USE_CPU=1 torchrun --nproc_per_node {started} train.py ..., "
            f"or accelerate launch --config_file accelerate_configs/zero3_cpu.yaml train.py ..."
        )
    return accelerator


def plan_run(cfg: Config, given: set[str], accelerator) -> Run:
    """Every start-up check, in the order a user would fix them; nothing is written yet."""
    checkpoint.check_output_dir(cfg.output_dir, cfg.resume)
    resume_from = checkpoint.find_resume_checkpoint(cfg.resume, Path(cfg.output_dir) / "checkpoints", accelerator)
    resume_state = checkpoint.read_trainer_state(resume_from) if resume_from else None
    if resume_state is not None:
        cfg, taken = checkpoint.config_for_resume(cfg, given, resume_state.get("config", {}))
        if taken:
            accelerator.print(f"settings from {resume_from.name}: " + " ".join(f"--{k} {v}" for k, v in taken.items()))
    data, tokenizer = validate(cfg, resuming=resume_state is not None)
    if resume_state is not None and (resume_from / "model_config.json").is_file():
        model_config = checkpoint.read_model_config(resume_from)  # not --init_from's, which may have moved
    else:
        model_config = plan.load_model_config(cfg.model_config, cfg.init_from, cfg.seq_len, data.meta)
    launch = plan.live_launch(accelerator)
    batch = plan.batch_plan(cfg.micro_batch_size, launch.grad_accum_steps, launch.world_size, cfg.seq_len)
    total_steps = plan.total_steps_for(cfg.max_steps, cfg.num_epochs, data.n_windows, batch["sequences_per_step"])
    identity = {
        "world_size": launch.world_size,
        "micro_batch_size": cfg.micro_batch_size,
        "grad_accum_steps": launch.grad_accum_steps,
        "seq_len": cfg.seq_len,
        "seed": cfg.seed,
        "data_fingerprint": data.meta["fingerprint"],
        "model_config_hash": checkpoint.config_hash(model_config),
        "precision": launch.precision,
    }
    if resume_state is not None:
        checkpoint.check_resume_compatible(resume_state, identity, resume_from)
        replanned = checkpoint.schedule_on_resume(cfg, given, total_steps, resume_state)
        if replanned:
            accelerator.print(replanned)
        if resume_state["step"] > total_steps:
            raise UserError(
                f"cannot resume {resume_from}: it is at step {resume_state['step']}, beyond this run's "
                f"{total_steps} steps; raise --max_steps (or --num_epochs)"
            )
    return Run(
        cfg,
        data,
        model_config,
        launch,
        batch,
        total_steps,
        plan.model_flops_per_token(model_config, cfg.seq_len),
        identity,
        resume_from,
        resume_state,
        tokenizer,
    )


def check_memory_plan(run: Run, accelerator, peak_flops: float) -> None:
    """Print the plan for this launch; refuse to start when it says the model does not fit the GPU."""
    cfg, launch = run.cfg, run.launch
    device_gib = torch.cuda.get_device_properties(accelerator.device).total_memory / plan.GIB if launch.gpu else 0.0
    lines, fits = plan.plan_report(
        cfg,
        run.model_config,
        launch,
        run.batch,
        run.flops_per_token,
        device_gib,
        peak_flops / launch.world_size,
        run.total_steps,
    )
    accelerator.print("\n".join(lines))
    if not fits and not cfg.ignore_memory_plan:
        raise UserError(
            "the plan above does not fit this GPU's memory; follow its advice, or pass "
            "--ignore_memory_plan to try anyway"
        )


def build_model(run: Run, accelerator):
    """The model under ZeRO-3 (each parameter partitioned as it is created), its optimizer and the tokenizer."""
    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM

    cfg = run.cfg
    set_seed(cfg.seed)
    model_kwargs = {"attn_implementation": cfg.attn_implementation, "dtype": torch.float32}
    if cfg.init_from and run.resume_state is None:  # a resumed fine-tune's weights come from its checkpoint
        model = AutoModelForCausalLM.from_pretrained(cfg.init_from, **model_kwargs)
    else:
        model = AutoModelForCausalLM.from_config(run.model_config, **model_kwargs)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters())
    held = accelerator.gather(torch.tensor([local / n_params], device=accelerator.device)).tolist()
    accelerator.print(f"parameters held per process: {' '.join(f'{h:.1%}' for h in held)}")
    optimizer = make_optimizer(model, cfg, run.launch.offload_optimizer)
    if accelerator.state.deepspeed_plugin is not None:
        ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
        ds_config["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
        ds_config["gradient_clipping"] = cfg.max_grad_norm
    model, optimizer = accelerator.prepare(model, optimizer)
    balancer = None
    if moe.routers(accelerator.unwrap_model(model)):
        balancer = moe.LoadBalancer(accelerator.unwrap_model(model), cfg.moe_bias_update_speed, cfg.moe_aux_loss_alpha)
        accelerator.register_for_checkpointing(balancer)  # the routers' biases resume exactly
    return model, optimizer, balancer, run.tokenizer, n_params


def load_checkpoint(accelerator, run: Run, finaliser: bool) -> None:
    """Load the checkpoint to resume from; only once it has loaded does an explicit --resume from an older checkpoint
    move the newer ones aside, so a failed load leaves the run's checkpoints as they were."""
    try:
        accelerator.load_state(str(run.resume_from))
    except Exception as e:  # noqa: BLE001 - DeepSpeed and torch raise many kinds for one damaged file
        raise UserError(
            f"cannot load checkpoint {run.resume_from}: {type(e).__name__}: {str(e).splitlines()[0][:300]}; "
            f"resume from an older checkpoint with --resume {run.resume_from.parent}/step_N"
        ) from None
    ckpt_root = Path(run.cfg.output_dir) / "checkpoints"
    if run.cfg.resume != "auto" and finaliser:
        moved = checkpoint.set_aside_newer(ckpt_root, run.resume_from)
        if moved is not None:
            print(moved)
    accelerator.print(
        f"resumed from {run.resume_from} at step {run.resume_state['step']} "
        f"({run.resume_state['tokens_seen']:,} tokens seen)"
    )


def setup(cfg: Config, given: set[str]):
    """Accelerator, checks, plan, then (past every check) the output directory and the model."""
    accelerator = start_accelerator(cfg)
    run = plan_run(cfg, given, accelerator)
    cfg, batch, launch = run.cfg, run.batch, run.launch
    accelerator.gradient_accumulation_steps = launch.grad_accum_steps  # a DeepSpeed JSON may be what sets it
    accelerator.print(
        f"batch plan: {batch['micro_batch_size']} micro x {launch.grad_accum_steps} accumulation x "
        f"{launch.world_size} processes = {batch['sequences_per_step']} sequences = {batch['tokens_per_step']:,} "
        f"tokens per step; {run.total_steps} steps "
        f"({run.total_steps * batch['sequences_per_step'] / run.data.n_windows:.2f} "
        f"epochs of {run.data.n_windows:,} windows); {accelerator.distributed_type.value}, {launch.precision}, "
        f"on {accelerator.device.type}"
    )
    peak_flops, peak_source = plan.measure_peak_flops(accelerator, launch.precision)
    check_memory_plan(run, accelerator, peak_flops)

    # Past every start-up check: from here on the run writes to OUT, starting with the marker that makes it ours.
    out, ckpt_root = Path(cfg.output_dir), Path(cfg.output_dir) / "checkpoints"
    if accelerator.is_local_main_process:
        checkpoint.mark_train_run(out)
    finaliser = checkpoint.first_process_on_disk(accelerator, ckpt_root)
    if finaliser:
        removed = checkpoint.remove_leftovers(ckpt_root, finished=False)
        if removed:
            print(f"removed what earlier runs left unfinished in {ckpt_root}: {', '.join(removed)}")
    accelerator.wait_for_everyone()
    mem_before_model_gib = plan.peak_memory_gib(accelerator.device)  # the baseline the plan's estimate adds to
    model, optimizer, balancer, tokenizer, n_params = build_model(run, accelerator)
    counts = plan.param_counts(run.model_config)
    activated = f", {counts['activated'] / 1e6:.2f}M activated per token" if plan.is_moe(run.model_config) else ""
    accelerator.print(
        f"model: {n_params / 1e6:.2f}M parameters ({counts['non_embedding'] / 1e6:.2f}M non-embedding{activated}), "
        f"{run.flops_per_token / 1e6:.1f} MFLOP/token; "
        f"peak {peak_flops / 1e12:.2f} TFLOP/s ({peak_source})"
    )
    if run.resume_state is not None:
        load_checkpoint(accelerator, run, finaliser)
    if accelerator.is_main_process:
        if run.resume_state is not None and (out / "metrics.jsonl").exists():
            torn = checkpoint.truncate_metrics(out / "metrics.jsonl", run.resume_state["step"])
            if torn:
                print(f"warning: dropped {torn} torn line(s) of {out / 'metrics.jsonl'} (a write cut short)")
        else:
            cli.write_atomic(out / "metrics.jsonl", "")
        cli.write_json_atomic(
            out / "config.json",
            {
                "written_by": "train.py",
                **dataclasses.asdict(cfg),
                "batch_plan": batch,
                "total_steps": run.total_steps,
                "precision": launch.precision,
                "peak_mem_before_model_gib": mem_before_model_gib,
            },
        )
    if cfg.log_with:
        config = {k: v for k, v in dataclasses.asdict(cfg).items() if isinstance(v, (int, float, str, bool))}
        accelerator.init_trackers("train", config=config)
    return accelerator, run, model, optimizer, balancer, tokenizer, peak_flops, finaliser


# ---------------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------------


def optimizer_step(model, optimizer, balancer, accelerator, run: Run, step: int, lr: float, stop: bool):
    """Optimizer step `step + 1` over `grad_accum_steps` micro-batches. Returns (the loss averaged over all processes,
    the gradient norm, whether any process was asked to stop); raises Diverged on a loss or norm that is not finite.
    A MoE model's balance loss is added to what is backpropagated (not to the loss returned), and its routers' biases
    move once the step is taken."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    cfg, accum, rank = run.cfg, run.launch.grad_accum_steps, accelerator.process_index
    loss_sum = torch.zeros((), device=accelerator.device)
    grad_norm = None
    for micro_step in range(accum):
        inputs, targets = get_batch(
            run.data.train_tokens,
            sample_ids(step, micro_step, rank, run.batch),
            cfg.seq_len,
            cfg.seed,
            run.data.n_windows,
        )
        with accelerator.accumulate(model):
            with balancer.collecting() if balancer else contextlib.nullcontext():
                loss = lm_loss(model, inputs.to(accelerator.device), targets.to(accelerator.device))
            if cli.injected_fault("nan_loss", rank, step + 1):
                loss = loss * float("nan")
            aux_loss = balancer.aux_loss() if balancer else None
            try:
                accelerator.backward(loss if aux_loss is None else loss + aux_loss)
            except Exception as e:  # DeepSpeed's fp16 scaler raises on every rank at once when it cannot go lower
                if "loss scale already at minimum" not in str(e):
                    raise
                raise Diverged(
                    f"step {step + 1}: the fp16 loss scale is at its minimum and gradients still overflow; "
                    f"train in bf16 (--mixed_precision bf16 at launch), lower --lr, or --resume auto from "
                    f"the last checkpoint"
                ) from None
            if accelerator.sync_gradients:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
            optimizer.step()
            optimizer.zero_grad()
        loss_sum += loss.detach()
    if balancer:
        balancer.update(accelerator)
    if cli.injected_fault("sigterm_launcher", rank, step + 1):
        os.kill(os.getppid(), signal.SIGTERM)
    # One collective per step carries the loss and whether any process was asked to stop.
    reduced = accelerator.reduce(torch.stack([loss_sum / accum, torch.tensor(float(stop), device=loss_sum.device)]))
    step_loss, stop_requested = float(reduced[0]) / accelerator.num_processes, bool(reduced[1] > 0)
    grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
    if run.launch.precision != "fp16" and not (math.isfinite(step_loss) and math.isfinite(grad_norm)):
        raise Diverged(
            f"step {step + 1}: loss {step_loss} / grad norm {grad_norm} is not finite; stopping without "
            f"saving. The last checkpoint is intact: lower --lr, raise --warmup_steps or check the data, "
            f"then --resume auto"
        )
    return step_loss, grad_norm, stop_requested


def log_step(
    accelerator,
    run: Run,
    step: int,
    interval: dict,
    lr: float,
    grad_norm: float,
    peak_flops: float,
    scale: float | None,
    skipped: int,
    extra: dict,
) -> tuple[dict, str]:
    """The metrics record of a log step and its console line; interval: steps, loss_sum and seconds since the last."""
    tokens_per_s = interval["steps"] * run.batch["tokens_per_step"] / interval["seconds"]
    mem = float(
        accelerator.gather(torch.tensor([plan.peak_memory_gib(accelerator.device)], device=accelerator.device)).max()
    )
    loss = interval["loss_sum"] / interval["steps"]
    record = {
        "step": step,
        "tokens": step * run.batch["tokens_per_step"],
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": tokens_per_s,
        "mfu": plan.mfu(tokens_per_s, run.flops_per_token, peak_flops),
        "peak_mem_gib": mem,
        "epoch": step * run.batch["sequences_per_step"] / run.data.n_windows,
        "samples_seen": step * run.batch["sequences_per_step"],
    }
    if scale is not None:
        record.update(loss_scale=scale, skipped_steps=skipped)
    record.update(extra)
    line = (
        f"step {step}/{run.total_steps} | loss {loss:.4f} | lr {lr:.2e} | grad {grad_norm:.3f} | "
        f"{tokens_per_s:,.0f} tok/s | MFU {record['mfu']:.1%} | peak mem {mem:.2f} GiB"
        + (f" | scale {scale:.0f} skipped {skipped}" if scale is not None else "")
        + (f" | MaxVio {extra['moe_maxvio_max']:.3f} worst, {extra['moe_maxvio_mean']:.3f} mean" if extra else "")
        + (f" | aux {extra['moe_aux_loss']:.2e}" if "moe_aux_loss" in extra else "")
    )
    return record, line


def train(cfg: Config, given: set[str]) -> int:
    accelerator, run, model, optimizer, balancer, tokenizer, peak_flops, finaliser = setup(cfg, given)
    cfg, out = run.cfg, Path(run.cfg.output_dir)
    ckpt_root = out / "checkpoints"

    def log(record: dict, console: str) -> None:
        if accelerator.is_main_process:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            bar.write(console)
        if cfg.log_with:
            accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def validate_at(step: int) -> None:
        val = validation_loss(model, accelerator, run.data.val_tokens, cfg.seq_len, cfg.micro_batch_size)
        log(
            {"step": step, "tokens": step * run.batch["tokens_per_step"], "val_loss": val, "val_ppl": math.exp(val)},
            f"step {step} | val loss {val:.4f} | val ppl {math.exp(val):.2f}",
        )

    stop_signal = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop_signal.append(signum))
    step = run.resume_state["step"] if run.resume_state is not None else 0
    bar = cli.progress_bar(
        total=run.total_steps, initial=step, desc="train", dynamic_ncols=True, disable=not accelerator.is_main_process
    )
    if step == 0 and cfg.eval_at_start:
        validate_at(0)
    engine = model if accelerator.state.deepspeed_plugin is not None else None  # DeepSpeed counts skipped steps
    skipped_at_start, skipped_here = (engine.skipped_steps if engine else 0), 0
    interval = {"steps": 0, "loss_sum": 0.0, "t0": time.perf_counter()}
    while step < run.total_steps:
        lr = plan.lr_at(step, cfg.lr, cfg.warmup_steps, cfg.lr_decay_steps or run.total_steps, cfg.min_lr_ratio)
        loss, grad_norm, stop_requested = optimizer_step(
            model, optimizer, balancer, accelerator, run, step, lr, bool(stop_signal)
        )
        skipped_here += int(engine is None and accelerator.optimizer_step_was_skipped)
        step += 1
        interval["steps"] += 1
        interval["loss_sum"] += loss
        bar.update(1)
        if step % cfg.log_every == 0 or step == run.total_steps or stop_requested:
            interval["seconds"] = time.perf_counter() - interval["t0"]
            skipped = (engine.skipped_steps - skipped_at_start) if engine else skipped_here
            scale = fp16_loss_scale(engine, accelerator.scaler) if run.launch.precision == "fp16" else None
            extra = balancer.metrics(accelerator) if balancer else {}
            record, line = log_step(accelerator, run, step, interval, lr, grad_norm, peak_flops, scale, skipped, extra)
            bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{lr:.2e}")
            log(record, line)
            interval = {"steps": 0, "loss_sum": 0.0, "t0": time.perf_counter()}
        pause_t0 = time.perf_counter()
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == run.total_steps:
            validate_at(step)
        if (cfg.save_every and step % cfg.save_every == 0) or step == run.total_steps or stop_requested:
            saved = checkpoint.save_checkpoint(
                accelerator, ckpt_root, step, run.state_at(step), cfg.keep_last, run.resume_from, finaliser,
                run.model_config,
            )  # fmt: skip
            accelerator.print(f"saved {saved}")
            # A signal that came while the checkpoint was written stops the run now, not one step and checkpoint later.
            stop_requested = stop_requested or any_process(accelerator, bool(stop_signal))
        interval["t0"] += time.perf_counter() - pause_t0  # throughput counts training time only
        if stop_requested and step < run.total_steps:
            bar.close()
            accelerator.print(
                f"stopped by signal after step {step}; the same command with --resume auto continues "
                f"from {ckpt_root / f'step_{step}'}"
            )
            accelerator.end_training()
            return 0
    bar.close()
    finish(accelerator, model, tokenizer, out, finaliser)
    return 0


def finish(accelerator, model, tokenizer, out: Path, finaliser: bool) -> None:
    """After the last step's checkpoint: OUT/final and the loss curve."""
    final = checkpoint.export_final(accelerator, model, tokenizer, out)
    if finaliser:
        removed = checkpoint.remove_leftovers(out / "checkpoints", finished=True)
        if removed:
            print(f"removed from {out / 'checkpoints'}, no longer needed by the finished run: {', '.join(removed)}")
    if accelerator.is_main_process:
        plot_losses(out / "metrics.jsonl", out / "loss_curve.png")
        accelerator.print(
            f"done: model in {final}, loss curve in {out / 'loss_curve.png'}, metrics in {out / 'metrics.jsonl'}"
        )
    accelerator.end_training()


def run_plan(cfg: Config) -> int:
    """`train.py --plan`: the plan for a config on paper, no process group and no GPU needed."""
    try:
        launch = plan.read_launch(cfg.accelerate_config or "accelerate_configs/zero3_cpu.yaml")
        meta = lmdata.read_meta(cfg.data_dir) if (Path(cfg.data_dir) / "meta.json").is_file() else None
        model_config = plan.load_model_config(cfg.model_config, cfg.init_from, cfg.seq_len, meta)
    except (OSError, KeyError, UserError) as e:
        cli.print_error(str(e))
        return 2
    peak = plan.GPU_PEAK_FLOPS["RTX 4090"] if launch.gpu else 0.1e12  # the target card; a CPU core at ~100 GFLOP/s
    batch = plan.batch_plan(cfg.micro_batch_size, launch.grad_accum_steps, launch.world_size, cfg.seq_len)
    flops_tok = plan.model_flops_per_token(model_config, cfg.seq_len)
    lines, _ = plan.plan_report(cfg, model_config, launch, batch, flops_tok, cfg.gpu_memory_gib, peak, cfg.max_steps)
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    from transformers import HfArgumentParser

    argv = sys.argv[1:] if argv is None else argv
    (cfg,) = HfArgumentParser(Config, description=__doc__.split("\n\n")[0]).parse_args_into_dataclasses(argv)
    if cfg.plan:
        return run_plan(cfg)
    try:
        return train(cfg, cli.given_fields(Config, argv))
    except UserError as e:  # raised by setup, before anything is written; the same on every process
        cli.print_error(str(e))
        return 2
    except (Diverged, checkpoint.CheckpointWriteError) as e:  # the last complete checkpoint is intact
        cli.print_error(str(e))
        return 3


if __name__ == "__main__":
    cli.exit_process(main())
