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

Read top to bottom: Config; what a forker edits first (LR schedule, optimizer, data order, loss); setup in four
phases (check, resume, plan, build); the loop and the step (`train`). The library it calls is the deepseek_zero3
package, a folder per concern (README, "Where to change what"): the planner is one call, plan.plan_run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from deepseek_zero3 import cli, distributed
from deepseek_zero3.cli import UserError, field
from deepseek_zero3.evaluation.generate import TrainingSamples
from deepseek_zero3.model import attention, models, moe, mtp
from deepseek_zero3.model.lmloss import DEFAULT_CHUNK_TOKENS, document_positions, loss_path, model_nll
from deepseek_zero3.model.lmloss import validation_losses
from deepseek_zero3.planning import breakdown, plan
from deepseek_zero3.recipe import optimizer as optimizer_lib
from deepseek_zero3.recipe.ema import EMA
from deepseek_zero3.recipe.schedule import Schedule, branch_settings, check_schedule_flags, fitted, parse_fractions
from deepseek_zero3.recipe.schedule import schedule_change_on_resume
from deepseek_zero3.run_dir import card, checkpoint, finish, metrics, reshard, resilience, trackers
from deepseek_zero3.training_data import token_data

# DeepSpeed calls collectives that torch renamed; the warning repeats every step and says nothing to a user.
warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)
cli.quiet_console()


# fmt: off
@dataclasses.dataclass
class Config:
    """Every flag: its default, its --help text, and `resume=`, what `--resume` does with it. A resumed run takes the
    checkpoint's value of every flag the command does not give; a flag the command gives is, by its policy:
        fixed   (the default) it must equal the checkpoint's, or the resume is refused naming both: it changes what
                the checkpoint's state means (the model, the batch, the optimizer's settings, the data order)
        free    it may change: it changes what the run reports, or where it reads and writes, not what it trains
        retune  it may change, and metrics.jsonl records the change (what the run's own advice after a divergence
                or a hang says to lower or raise)
        length  the LR schedule's length: a change needs --lr_decay_steps or --decay_branch
                (schedule.schedule_change_on_resume)
        own     this command's alone, never taken from the checkpoint
    A flag you add is `fixed` unless you say otherwise; a checkpoint from before it existed resumes with its default."""

    data_dir: str = field("data/python-docs", "directory written by prepare_data.py, or several (comma-separated, "
                                              "the same tokenizer)", resume="free")
    data_mix: str = field("", "each source's share of the samples, e.g. openwebtext=0.9,wikitext-103=0.1 (sources left "
                              "out: 0; default: in proportion to their sizes)", resume="free")
    document_masking: bool = field(True, "each packed document attends only to itself, positions restarting at 0 "
                                         "(--no_document_masking: across the whole window)")
    model_config: str = field("tiny", "preset in model_configs/ (deepseek-7b, deepseek-1.3b, small, mini, tiny, "
                                      "tiny-qk-norm, deepseek-v3-*), a config.json, or a model directory")
    init_from: str = field("", "Hugging Face model directory to start from (its weights); default: random init")
    output_dir: str = field("runs/tiny", "metrics, checkpoints, final model and loss curve go here", resume="own")
    seq_len: int = field(256, "tokens per training sequence")
    micro_batch_size: int = field(8, "sequences per process per forward/backward", resume="free")
    max_steps: int = field(0, "optimizer steps to train (0: use --num_epochs)", resume="length")
    num_epochs: float = field(1.0, "passes over the training split when --max_steps is 0", resume="length")
    lr: float = field(1e-3, "peak learning rate", resume="retune")
    lr_schedule: str = field("cosine", "cosine, multistep (DeepSeek LLM's steps) or wsd (warmup-stable-decay)")
    min_lr_ratio: float = field(0.1, "the floor of the cosine and WSD decays, as a fraction of --lr", resume="retune")
    warmup_steps: int = field(30, "linear warmup, in optimizer steps", resume="retune")
    lr_decay_steps: int = field(0, "length of the LR schedule in steps (0: the run's total steps); set it to "
                                   "train a long schedule in shorter runs", resume="length")
    multistep_at: str = field("0.8,0.9", "multistep: the LR is multiplied by --multistep_factor after these fractions "
                                         "of the schedule")
    multistep_factor: float = field(0.316, "multistep: the factor at each step down")
    decay_fraction: float = field(0.2, "wsd: the share of the schedule spent decaying to --min_lr_ratio")
    decay_shape: str = field("linear", "wsd and --decay_branch: linear, 1-sqrt or cosine")
    decay_branch: int = field(0, "decay the LR to its floor over this many steps from the checkpoint given to "
                                 "--resume, then export: a finished model in a new --output_dir, the run left to go on",
                              resume="free")
    decay_start_step: int = field(0, "the step a decay branch starts at (set by --decay_branch; 0: none)")
    optimizer: str = field("auto", "adamw, muon (Muon for the hidden matrices, AdamW for embedding, head and norms), "
                                   "or auto: muon for the presets it won on in bench/muon.py (mini, small), else adamw")
    muon_lr: float = field(0.02, "Muon's peak learning rate (the schedule scales it as it scales --lr)",
                           resume="retune")
    muon_momentum: float = field(0.95, "Muon's (Nesterov) momentum")
    muon_weight_decay: float = field(0.0, "Muon's decoupled weight decay")
    weight_decay: float = field(0.1, "AdamW weight decay (2-D weights only)")
    adam_beta1: float = field(0.9, "AdamW beta1")
    adam_beta2: float = field(0.95, "AdamW beta2")
    adam_eps: float = field(1e-8, "AdamW epsilon")
    max_grad_norm: float = field(1.0, "clip the global gradient norm to this (0: no clipping; Muon: off)",
                                 resume="retune")
    step_timeout_s: float = field(-1, "a step running longer than this is a hang: stacks to OUT/hang-*.txt, exit 3 "
                                      "(-1: 20x the warm step time, at least 5 min; 0: off)", resume="retune")
    max_skipped_steps: int = field(3, "steps in a row skipped for a non-finite loss or gradient norm before the run "
                                      "stops (bf16/fp32; fp16 stops at its minimum loss scale)", resume="retune")
    seed: int = field(0, "seeds the weights and the data order")
    log_every: int = field(10, "optimizer steps between metric lines", resume="free")
    eval_every: int = field(100, "optimizer steps between validation runs (0: only at start and end)", resume="free")
    eval_tokens: int = field(1 << 20, "validation tokens of each source per evaluation (0: all of them)", resume="free")
    sample_tokens: int = field(32, "at each validation, continue --sample_prompts by this many tokens, greedy (to the "
                                   "console, metrics.jsonl, the trackers and the model card; 0: no samples)",
                               resume="free")
    sample_prompts: str = field("", "the samples' prompts: one prompt, or @FILE with one per blank-line-separated block "
                                    "(default: the first 16 tokens of 3 held-out validation documents)", resume="free")
    save_every: int = field(100, "optimizer steps between checkpoints (0: only at the end)", resume="free")
    keep_last: int = field(2, "complete checkpoints to keep", resume="free")
    resume: str = field("", "'auto' (newest complete checkpoint in OUT, if any) or a checkpoint directory",
                        resume="own")
    plan: bool = field(False, "print the memory and time plan for this model, config and batch, then exit "
                              "(no training, no GPU)", resume="own")
    compare: bool = field(False, "with --plan: one row per strategy (DDP, ZeRO-2, ZeRO-3, offload, NVMe) and the "
                                 "recommended config, micro-batch and accumulation", resume="free")
    accelerate_config: str = field("", "with --plan: the accelerate config YAML to plan for (default: the CPU config; "
                                       "with --compare the 3-GPU ZeRO-3 config, for its processes and global batch)",
                                   resume="free")
    from_run: str = field("", "with --plan: a run's OUT: the plan it made beside what it measured, per component",
                          resume="own")
    assumed_mfu: float = field(0.35, "MFU the plan assumes on GPUs, as runs log it (CPU runs time their model)",
                               resume="free")
    interconnect_gb_s: float = field(10.0, "with --plan: GPU-to-GPU all-reduce bandwidth, GB/s (PCIe 4.0 x16 without "
                                           "P2P: ~10); a real run measures it", resume="free")
    pcie_gb_s: float = field(25.0, "with --plan: host-to-GPU bandwidth for offload, GB/s (PCIe 4.0 x16: ~25)",
                             resume="free")
    nvme_gb_s: float = field(3.0, "with --plan: NVMe read/write bandwidth for ZeRO-Infinity, GB/s", resume="free")
    gpu_memory_gib: float = field(24.0, "with --plan: memory per GPU to plan for (RTX 4090: 24); a real run reads "
                                        "the device", resume="free")
    host_memory_gib: float = field(0.0, "host RAM per machine to plan for (0: this machine's)", resume="free")
    gradient_accumulation_steps: int = field(0, "with --plan: accumulation to plan for (0: the accelerate config's); "
                                                "a run takes it from the config or `accelerate launch` only",
                                             resume="free")
    profile_steps: int = field(0, "profile steps 2..N+1 of each process: where the time goes, by the plan's "
                                  "components, in OUT/profile/ (train.py --plan --from_run OUT shows it)", resume="own")
    ignore_memory_plan: bool = field(False, "start even when the plan says the run does not fit the GPUs or RAM",
                                     resume="free")
    eval_at_start: bool = field(True, "validation loss of the initial weights at step 0 (--no_eval_at_start skips "
                                      "it)", resume="free")
    log_with: str = field("", "trackers, comma-separated: wandb, trackio, tensorboard, mlflow (one run across resumes)",
                          resume="free")
    push_to_hub: str = field("", "at the end, upload final/ (model, tokenizer, card) to this Hub repo, e.g. "
                                 "user/deepseek-1b (created private; needs `hf auth login` or HF_TOKEN)", resume="free")
    loss_chunk_tokens: int = field(DEFAULT_CHUNK_TOKENS, "tokens per chunk of output layer + loss (0: all logits)",
                                   resume="free")
    gradient_checkpointing: bool = field(False, "recompute activations in backward (less memory, ~30%% more compute)",
                                         resume="free")
    attn_implementation: str = field("auto", "attention kernel: auto (by device and dtype: flash_attention_2 or "
                                             "flex_attention on CUDA, varlen_sdpa elsewhere; the first lines name it), "
                                             "varlen_sdpa, flex_attention, flash_attention_2, or sdpa / eager (a dense "
                                             "document mask: the fallback); docs/architecture.md", resume="own")
    moe_bias_update_speed: float = field(0.001, "MoE models (deepseek-v3-*): how far each router's per-expert bias "
                                                "moves after every step toward balanced loads (DeepSeek-V3's gamma; "
                                                "0: off)")
    moe_aux_loss_alpha: float = field(0.0001, "MoE models: weight of the sequence-wise balance loss (DeepSeek-V3's "
                                              "alpha; 0: off)")
    mtp_depth: int = field(-1, "multi-token prediction modules, the k-th predicting the token k+1 ahead (DeepSeek-V3; "
                               "-1: 1 for deepseek-v3-* models, 0 for Llama ones; 0: off)")
    ema_decay: float = field(0.0, "keep an exponential moving average of the weights, ema = decay x ema + (1 - decay) "
                                  "x weights after every step (e.g. 0.999; 0: none), exported as OUT/final_ema",
                              resume="retune")
    mtp_loss_weight: float = field(0.3, "weight of the MTP loss, lambda (DeepSeek-V3: 0.3, then 0.1 for the last "
                                        "third of its tokens)", resume="retune")
# fmt: on


# ---------------------------------------------------------------------------------------------------------------------
# What a forker edits first: the LR schedule, the optimizer, the data order, the loss
# ---------------------------------------------------------------------------------------------------------------------


def schedule_for(cfg: Config, total_steps: int) -> Schedule:
    """The LR schedule (recipe/schedule.py: cosine, DeepSeek's multistep, WSD; a decay branch), a pure function of the
    optimizer step."""
    return Schedule(
        cfg.lr, cfg.warmup_steps, cfg.lr_decay_steps or total_steps, cfg.min_lr_ratio, cfg.lr_schedule,
        parse_fractions(cfg.multistep_at, "--multistep_at"), cfg.multistep_factor, cfg.decay_fraction,
        cfg.decay_shape, cfg.decay_start_step, cfg.decay_branch,
    )  # fmt: skip


make_optimizer = optimizer_lib.make  # AdamW, or Muon for the hidden matrices and AdamW for the rest (recipe/)


def sample_ids(step: int, micro_step: int, rank: int, batch: token_data.BatchPlan) -> range:
    """Global sample numbers of one micro-batch: an optimizer step takes the next `sequences_per_step` samples, laid
    out micro-step-major, so the set a step trains on depends only on the global batch, not on how it is split."""
    start = step * batch.sequences_per_step + (micro_step * batch.world_size + rank) * batch.micro_batch_size
    return range(start, start + batch.micro_batch_size)


def get_batch(data: token_data.TrainingData, ids: range, cfg: Config) -> tuple[torch.Tensor, ...]:
    """Inputs, next-token targets and position ids of the samples `ids`: windows of the sources' training tokens in
    the mixture's order (token_data.sample_tokens: a pure function of seed and sample number). With document masking
    the positions restart at each document (its attention stays inside it), else they run 0..seq_len-1."""
    batch = torch.from_numpy(np.stack([token_data.sample_tokens(data, cfg.seed, i, cfg.seq_len) for i in ids]))
    inputs = batch[:, :-1]
    positions = document_positions(inputs, data.meta["eos_id"]) if cfg.document_masking else None
    return inputs, batch[:, 1:], positions


def lm_loss(model, batch: tuple[torch.Tensor, ...], cfg: Config, mtp_scale=None, balancer=None):
    """The loss of one micro-batch, put together in this one place: (what the step backpropagates, {name: term} of
    what it logs). `loss` is the model's own mean next-token NLL: what the console, metrics.jsonl and the trackers call
    loss, and what validation measures. DeepSeek-V3's MTP depths add mtp_loss_weight / D x their losses (`mtp_loss_k`:
    the mean over its scored targets, or in training its summed NLL x mtp_scale, mtp.step_scale's share of the global
    batch's mean), a MoE model its balance loss (`moe_aux_loss`). A term you add here is backpropagated; put it in
    `logged` too and every log line has its mean over the log window under that name. A z-loss (PaLM's), for one:
        z_loss = (z[0] / n[0]).float()  # the mean squared log-normaliser of the scored tokens
        objective, logged["z_loss"] = objective + 1e-4 * z_loss, z_loss"""
    inputs, targets, positions = batch
    depths = mtp.depth_targets(inputs, targets, positions, cfg.mtp_depth) if cfg.mtp_depth else None
    nll, n, z = model_nll(model, inputs, targets, cfg.loss_chunk_tokens, positions, depths, z_loss=True)
    nll, n, z = nll.reshape(-1), n.reshape(-1), z.reshape(-1)  # the model's, then each MTP depth's
    loss = (nll[0] / n[0]).float()
    objective, logged = loss, {"loss": loss}
    if depths:
        per_depth = (nll[1:] / n[1:] if mtp_scale is None else nll[1:] * mtp_scale).float()
        objective = mtp.objective(torch.cat([loss[None], per_depth]), cfg.mtp_loss_weight)
        logged.update({f"mtp_loss_{k}": depth for k, depth in enumerate(per_depth, 1)})
    aux = balancer.aux_loss() if balancer is not None else None
    if aux is not None:
        objective, logged["moe_aux_loss"] = objective + aux, aux
    return objective, {name: term.detach() for name, term in logged.items()}


def backward(training, loss: torch.Tensor, step: int) -> None:
    """The gradients of one micro-batch's loss, summed over the step's micro-batches (and, at the last, over the
    processes). Under every strategy the weights stay as they are: DeepSpeed's engine is told whether this is the
    step's last micro-batch and runs its backward only (its step is update's); without DeepSpeed Accelerate divides by
    the accumulation and, in fp16, scales by the GradScaler."""
    resilience.backward(training.accelerator, training.engine, loss, step)


def update(training, cfg: Config, step: int) -> tuple[torch.Tensor | float | None, bool]:
    """The step's weight update, the one place it happens under every strategy: clip the gradients to --max_grad_norm,
    step the optimizer, zero the gradients. A step whose gradients are not finite is skipped (weights and optimizer
    state unchanged). Returns (gradient norm, skipped). Under DeepSpeed (ZeRO-1/2/3, offload) its engine does all of it
    and decides the skip (`gradient_clipping` in its config is --max_grad_norm: build_model); fp16's GradScaler skips an
    overflowing step by itself."""
    accelerator = training.accelerator
    if training.engine is not None:
        resilience.engine_step(training.engine, step)
        return training.engine.get_global_grad_norm(), training.skips.after_step(step, False)
    grad_norm = accelerator.clip_grad_norm_(training.model.parameters(), cfg.max_grad_norm or float("inf"))
    skip = accelerator.scaler is None and not torch.isfinite(grad_norm)
    if not skip:
        training.optimizer.step()
    training.optimizer.zero_grad()
    return grad_norm, training.skips.after_step(step, skip)


def mtp_scale(run, step: int) -> torch.Tensor:
    """mtp.step_scale of the step's global batch: every process's samples, as sample_ids lays them out."""
    n = run.batch.sequences_per_step
    batch = get_batch(run.data, range(n * step, n * (step + 1)), run.cfg)
    return mtp.step_scale(batch, run.cfg.mtp_depth, n // run.batch.micro_batch_size)


# ---------------------------------------------------------------------------------------------------------------------
# Setup, phase 1: check. Flags, output directory, the settings of the checkpoint to resume, data, model config,
# launch, batch plan and schedule; a mistake raises UserError before anything is written.
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """What the checks decided: the run's settings (a resumed run's come from its checkpoint) and its shape."""

    cfg: Config
    data: token_data.TrainingData
    tokenizer: object  # the data's; saved with the final model
    model_config: object
    launch: distributed.Launch
    batch: token_data.BatchPlan
    total_steps: int
    schedule: Schedule
    resume: checkpoint.Resume | None
    samples: TrainingSamples | None = None  # --sample_tokens: what the model writes at each validation

    def identity(self) -> dict:
        """What a checkpoint must match to be resumed by this run (and the global batch: reshard.py)."""
        return {
            "seq_len": self.cfg.seq_len,
            "seed": self.cfg.seed,
            "data_fingerprint": self.data.fingerprint,
            "data_mix": {s.name: str(w) for s, w in zip(self.data.sources, self.data.weights)},
            "model_config_hash": checkpoint.config_hash(self.model_config),
            "precision": self.launch.precision,
            "zero_stage": self.launch.zero_stage,
        }

    def state_at(self, step: int, skipped_steps: int = 0) -> dict:
        """trainer_state.json of the checkpoint at `step`."""
        data_dir = ",".join(str(Path(d).resolve()) for d in token_data.data_dirs(self.cfg.data_dir))
        return {
            **self.identity(),
            "world_size": self.launch.world_size,
            "micro_batch_size": self.cfg.micro_batch_size,
            "grad_accum_steps": self.launch.grad_accum_steps,
            "step": step,
            "skipped_steps": skipped_steps,
            "tokens_seen": step * self.batch.tokens_per_step,
            "samples_seen": step * self.batch.sequences_per_step,
            "epoch": step * self.batch.sequences_per_step / self.data.n_windows,
            "data_dir": data_dir,
            "total_steps": self.total_steps,
            "config": {**dataclasses.asdict(self.cfg), "data_dir": data_dir},
            **({"branch": self.resume.branch} if self.resume and self.resume.branch else {}),  # explicit_resume's
        }


def check_flags(cfg: Config) -> None:
    for name in ("seq_len", "micro_batch_size", "log_every", "keep_last"):
        if getattr(cfg, name) < 1:
            raise UserError(f"--{name} {getattr(cfg, name)} must be at least 1")
    never_negative = ("max_steps", "warmup_steps", "lr_decay_steps", "eval_every", "save_every", "eval_tokens",
                      "moe_bias_update_speed", "moe_aux_loss_alpha", "loss_chunk_tokens", "max_grad_norm",
                      "max_skipped_steps", "decay_branch", "decay_start_step", "mtp_loss_weight",
                      "profile_steps", "sample_tokens")  # fmt: skip
    for name in never_negative:
        value = getattr(cfg, name)
        if value < 0:
            raise UserError(f"--{name} {value} must not be negative")
        if math.isnan(value) or (math.isinf(value) and name in ("moe_aux_loss_alpha", "mtp_loss_weight")):
            raise UserError(f"--{name} {value} must be a finite number")  # a weight of the loss, or nan anywhere
    if not -1 <= cfg.mtp_depth < cfg.seq_len:
        raise UserError(f"--mtp_depth {cfg.mtp_depth} must be -1 (the model's default), 0 (off) or a number of modules "
                        f"below --seq_len {cfg.seq_len}")  # fmt: skip
    if not (cfg.step_timeout_s >= 0 or cfg.step_timeout_s == -1):
        raise UserError(f"--step_timeout_s {cfg.step_timeout_s} must be -1 (automatic), 0 (off) or a number of seconds")
    if cfg.max_steps == 0 and cfg.num_epochs <= 0:
        raise UserError(f"--num_epochs {cfg.num_epochs} must be positive when --max_steps is 0")
    if not 0 <= cfg.ema_decay < 1:  # nan fails too; 1 would never move, above 1 or below 0 grows without bound
        raise UserError(f"--ema_decay {cfg.ema_decay} must be within [0, 1) (0: no EMA; e.g. 0.999)")
    if not cfg.lr > 0 or not 0 <= cfg.min_lr_ratio <= 1:
        raise UserError(f"--lr {cfg.lr} must be positive and --min_lr_ratio {cfg.min_lr_ratio} within [0, 1]")
    check_schedule_flags(cfg)
    optimizer_lib.check(cfg, None)
    if cfg.attn_implementation not in attention.KERNELS:
        raise UserError(attention.refusal(cfg.attn_implementation, "cpu", "fp32", False))
    if 0 < cfg.eval_tokens < cfg.seq_len:
        raise UserError(f"--eval_tokens {cfg.eval_tokens} is less than one validation window of --seq_len "
                        f"{cfg.seq_len} tokens; raise it, or 0 for the whole validation split")  # fmt: skip
    if not cfg.plan:  # again for a resumed run's own (setup checks the command's before the process group)
        trackers.check(cfg.log_with)


def check(cfg: Config, flags_given: set[str], accelerator) -> RunSettings:
    """Every start-up check, in the order a user would fix them; nothing is written. A resumed run's settings are
    its checkpoint's (those the command gives must agree), and its weights and model config come from there too, so
    --init_from is not read again."""
    check_flags(cfg)
    if "decay_start_step" in flags_given:
        raise UserError("--decay_start_step is set by --decay_branch (the checkpoint's step), not by hand: drop it")
    if cfg.push_to_hub:
        card.check_push(cfg.push_to_hub)
    checkpoint.check_paths(cfg, token_data.data_dirs(cfg.data_dir))  # OUT's deepest file included, before any is read
    resilience.lock_run_dir(accelerator, Path(cfg.output_dir))  # before anything in OUT is read (a new OUT: in setup)
    checkpoint.check_output_dir(cfg.output_dir, cfg.resume)
    # A decay branch's first launch refuses an OUT with checkpoints itself (schedule.branch_settings).
    resume = checkpoint.find_resume_checkpoint(cfg.resume, Path(cfg.output_dir) / "checkpoints", accelerator,
                                               own_work=not cfg.decay_branch)  # fmt: skip
    if resume is not None:
        cfg, resume = checkpoint.resume_settings(cfg, flags_given, resume, accelerator.print)
        check_flags(cfg)
    if cfg.decay_branch:
        cfg = branch_settings(cfg, flags_given, resume)
    one_source = resume is not None and "data_mix" not in resume.state  # a run from before mixtures: as it read it
    known_as = checkpoint.sources_known_as(resume)
    data = token_data.training_data(cfg.data_dir, cfg.seq_len, cfg.eval_tokens, cfg.data_mix, one_source, known_as)
    cfg, resume = checkpoint.adopt_source_names(cfg, resume, data.renamed, accelerator.print)
    for note in data.notes:
        accelerator.print(note)
    tokenizer = models.load_tokenizer(data.tokenizer_dir, "rebuild the data with prepare_data.py --overwrite")
    if resume is not None and (resume.path / "model_config.json").is_file():
        model_config = checkpoint.read_model_config(resume.path)
        models.check_model_unchanged(cfg, flags_given, model_config, data.meta, accelerator.print)
    else:
        model_config = models.load_model_config(cfg.model_config, cfg.init_from, cfg.seq_len, data.meta)
        if cfg.init_from and resume is None:  # its config's fields and vocabulary first: they need no weights read
            with distributed.without_zero3_init(accelerator):
                models.check_init_from(cfg.init_from, tokenizer, data.meta["eos_id"])
    cfg = dataclasses.replace(cfg, mtp_depth=mtp.depth_of(cfg.mtp_depth, model_config))  # -1: the model's own
    launch = distributed.live_launch(accelerator)
    cfg = choose_attention(cfg, model_config, launch, accelerator)
    cfg = optimizer_lib.resolve(cfg, flags_given, launch)  # auto: by preset and launch; Muon: unclipped
    check_flags(cfg)  # the depth resolved is below --seq_len too
    optimizer_lib.check(cfg, launch)
    batch = token_data.BatchPlan(cfg.micro_batch_size, launch.grad_accum_steps, launch.world_size, cfg.seq_len)
    total_steps = token_data.total_steps_for(cfg.max_steps, cfg.num_epochs, data.n_windows, batch.sequences_per_step)
    schedule, note = fitted(schedule_for(cfg, total_steps), "warmup_steps" in flags_given)
    if note:
        accelerator.print(note)
    samples = TrainingSamples.of_run(cfg, data, tokenizer, model_config.max_position_embeddings)
    return RunSettings(cfg, data, tokenizer, model_config, launch, batch, total_steps, schedule, resume, samples)


def choose_attention(cfg: Config, model_config, launch, accelerator) -> Config:
    """The attention kernel for this device and precision (--attn_implementation auto: model/attention.py), said in
    the run's first lines with a MoE model's expert path; a kernel that cannot train here is refused."""
    device, flash = accelerator.device.type, attention.flash_installed()
    kernel = attention.choose(cfg.attn_implementation, device, launch.precision, cfg.document_masking, flash)
    why = attention.refusal(kernel, device, launch.precision, flash)
    if why:
        raise UserError(why)
    accelerator.print(attention.describe(kernel, cfg.document_masking))
    experts = attention.describe_experts(model_config, accelerator.device, launch.precision)
    if experts:
        accelerator.print(experts)
    return dataclasses.replace(cfg, attn_implementation=kernel)


# ---------------------------------------------------------------------------------------------------------------------
# Setup, phase 2: resume. The checkpoint must continue this very run: same identity, a schedule that does not jump,
# a step within the run.
# ---------------------------------------------------------------------------------------------------------------------


def check_resume(run: RunSettings, flags_given: set[str]) -> str | None:
    """Refuse a checkpoint this run cannot continue; returns a line to print when the schedule changes (a new --lr,
    --lr_decay_steps, a decay branch)."""
    state, path = run.resume.state, run.resume.path
    checkpoint.check_resume_compatible(state, run.identity(), path)
    reshard.check_launch(state, run.launch, run.batch, path)
    if state["step"] > run.total_steps:
        raise UserError(
            f"cannot resume {path}: it is at step {state['step']}, beyond this run's {run.total_steps} steps; raise "
            f"--max_steps (or --num_epochs)"
        )
    # A branch's first launch resumes the original run's checkpoint (no decay_start_step in it); later ones its own.
    branching = run.cfg.decay_branch and not state.get("config", {}).get("decay_start_step")
    if branching and state["world_size"] != run.launch.world_size:
        raise UserError(  # resharding would write a universal copy beside the original run's checkpoint
            f"--decay_branch resumes on the {state['world_size']} processes that wrote {path}, not "
            f"{run.launch.world_size}: launch it with --num_processes {state['world_size']}"
        )
    return schedule_change_on_resume(run.schedule, state, flags_given)


# ---------------------------------------------------------------------------------------------------------------------
# Setup, phase 3: build. The memory plan, OUT (its marker first), the model under ZeRO-3, its optimizer, the
# checkpoint's state, the tracker.
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TrainingObjects:
    """What the loop works with besides the RunSettings."""

    accelerator: object
    model: object  # prepared: the DeepSpeed engine under DeepSpeed
    optimizer: object
    balancer: moe.LoadBalancer | None  # None for a dense model
    planned: plan.RunPlan  # what MFU is measured against, among others
    finalises_checkpoints: bool  # this process finalises checkpoints on its filesystem
    watchdog: resilience.Watchdog
    ema: EMA | None = None  # --ema_decay
    skips: resilience.Skips | None = None
    trackers: trackers.Trackers | None = None  # started by metrics.start_outputs; they log on the main process

    @property
    def engine(self):
        """The DeepSpeed engine (it counts skipped steps), or None without DeepSpeed."""
        return self.model if self.accelerator.state.deepspeed_plugin is not None else None


def build_model(run: RunSettings, accelerator):
    """The model under ZeRO-3 (each parameter partitioned as it is created), its optimizer and, for a MoE model, the
    load balancer. Returns (model, optimizer, balancer, parameter count)."""
    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM

    cfg = run.cfg
    set_seed(cfg.seed)
    attention.register()  # varlen_sdpa: a name transformers knows from here on
    model_kwargs = {"attn_implementation": cfg.attn_implementation, "dtype": torch.float32}
    if cfg.init_from and run.resume is None:  # a resumed fine-tune's weights come from its checkpoint
        model = AutoModelForCausalLM.from_pretrained(cfg.init_from, **model_kwargs)
    else:
        model = models.scale_residual_init(AutoModelForCausalLM.from_config(run.model_config, **model_kwargs))
    if cfg.mtp_depth:  # DeepSeek-V3's MTP modules, fresh also on --init_from (its final/mtp.safetensors is not read)
        mtp.attach(model, cfg.mtp_depth, cfg.seed)
        if cfg.init_from and (Path(cfg.init_from) / mtp.EXPORT_FILE).is_file() and run.resume is None:
            accelerator.print(f"note: {Path(cfg.init_from) / mtp.EXPORT_FILE} is not read: the MTP modules start fresh")
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters())
    held = accelerator.gather(torch.tensor([local / n_params], device=accelerator.device)).tolist()
    accelerator.print(f"parameters held per process: {' '.join(f'{h:.1%}' for h in held)}")
    accelerator.print(optimizer_lib.describe(model, cfg))
    optimizer = make_optimizer(model, cfg, accelerator)
    deepspeed = accelerator.state.deepspeed_plugin is not None
    if deepspeed:
        ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
        ds_config["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
        ds_config["gradient_clipping"] = cfg.max_grad_norm
        # bf16 under ZeRO-2/3: gradients summed over the micro-steps in fp32, not in bf16 (distributed.Launch)
        ds_config.setdefault("data_types", {})["grad_accum_dtype"] = run.launch.grad_accum_dtype
    model, optimizer = accelerator.prepare(model, optimizer)
    if deepspeed:
        accelerator.print(distributed.describe_engine(model, run.launch.grad_accum_steps))
    balancer = None
    if moe.routers(accelerator.unwrap_model(model)):
        balancer = moe.LoadBalancer(accelerator.unwrap_model(model), cfg.moe_bias_update_speed, cfg.moe_aux_loss_alpha)
    return model, optimizer, balancer, n_params


def checkpoint_state(training: TrainingObjects) -> dict:
    """What a checkpoint holds besides the model, the optimizer, the random states and the data position (DeepSpeed's
    and Accelerate's files, trainer_state.json): name -> an object with state_dict() and load_state_dict(). Add a piece
    of state here and every checkpoint saves it and every resume restores it. One that each process holds its own share
    of says `sharded = True` (saved per process; on another number of processes its reshard() cuts it again, or the
    resume is refused naming it); any other must be the same on every process (checked when saved). See
    run_dir/state.py. None: not in this run."""
    return {"moe_balancer": training.balancer, "ema": training.ema}


def setup(cfg: Config, flags_given: set[str]) -> tuple[RunSettings, TrainingObjects]:
    """Check, resume, plan, build: nothing is written to OUT before the first three phases have passed on every
    process."""
    watchdog = resilience.Watchdog(cfg.output_dir, cfg.step_timeout_s)  # a hang while starting ends the attempt too
    trackers.check(cfg.log_with)
    accelerator = distributed.start_accelerator(cfg.output_dir)
    run = check(cfg, flags_given, accelerator)
    if run.cfg.step_timeout_s != cfg.step_timeout_s:  # a resumed run's own limit, or the one this resume changed
        watchdog.set_timeout(run.cfg.step_timeout_s)
    schedule_change = check_resume(run, flags_given) if run.resume is not None else None
    if schedule_change:
        accelerator.print(schedule_change)
    cfg = run.cfg
    accelerator.gradient_accumulation_steps = run.launch.grad_accum_steps  # a DeepSpeed JSON may be what sets it
    planned = plan.plan_run(run, accelerator)

    # Past every check: from here on the run writes to OUT, starting with the marker that makes it ours.
    out, ckpt_root = Path(cfg.output_dir), Path(cfg.output_dir) / "checkpoints"
    if accelerator.is_local_main_process:
        checkpoint.mark_train_run(out)
    resilience.lock_run_dir(accelerator, out)
    finalises_checkpoints = checkpoint.first_process_on_disk(accelerator, ckpt_root)
    if finalises_checkpoints:
        if removed := checkpoint.remove_leftovers(ckpt_root):
            print(f"removed what earlier runs left unfinished in {ckpt_root}: {', '.join(removed)}")
    accelerator.wait_for_everyone()
    mem_before_model_gib = metrics.peak_memory_gib(accelerator.device)  # the baseline the plan's estimate adds to
    universal = reshard.prepare(run, accelerator, watchdog)  # a checkpoint of another number of processes
    model, optimizer, balancer, n_params = build_model(run, accelerator)
    counts = planned.counts
    activated = f", {counts['activated'] / 1e6:.2f}M activated per token" if balancer else ""
    accelerator.print(
        f"model: {n_params / 1e6:.2f}M parameters ({counts['non_embedding'] / 1e6:.2f}M non-embedding{activated}), "
        f"{planned.flops_per_token / 1e6:.1f} MFLOP/token; peak {planned.peak_flops / 1e12:.2f} TFLOP/s "
        f"({planned.peak_source}); loss: {loss_path(cfg.loss_chunk_tokens)}"
    )
    training = TrainingObjects(accelerator, model, optimizer, balancer, planned, finalises_checkpoints, watchdog)
    if cfg.ema_decay:
        training.ema = EMA(model, cfg.ema_decay)  # from the weights as built; a resume loads the checkpoint's
    if run.resume is not None:
        checkpoint.load_checkpoint(run, training, checkpoint_state(training), universal)
        reshard.after_load(model, universal, run.launch.zero_stage)
        optimizer_lib.after_load(training.engine)  # a Muon checkpoint of DeepSpeed's FusedAdam: torch's AdamW's steps
    resumed = run.resume.state if run.resume else None
    training.skips = resilience.Skips(training, resumed, cfg.max_skipped_steps, run.launch.precision)
    training.trackers = metrics.start_outputs(run, accelerator, mem_before_model_gib, n_params)
    return run, training


# ---------------------------------------------------------------------------------------------------------------------
# Training: the loop and the step
# ---------------------------------------------------------------------------------------------------------------------


def train(cfg: Config, flags_given: set[str]) -> int:
    run, training = setup(cfg, flags_given)
    cfg, accelerator, model, optimizer = run.cfg, training.accelerator, training.model, training.optimizer
    balancer, out, rank = training.balancer, Path(cfg.output_dir), accelerator.process_index
    accum, chunk, ckpt_root = run.launch.grad_accum_steps, cfg.loss_chunk_tokens, out / "checkpoints"

    def log(record: dict, console: str) -> None:
        if accelerator.is_main_process:
            metrics.append(out / "metrics.jsonl", record)
            bar.write(console)
            training.trackers.log(record)

    def validate_at(step: int) -> None:
        eos = run.data.meta["eos_id"] if cfg.document_masking else None
        losses = {  # each source's main loss, then its MTP depths'
            s.name: validation_losses(
                model, accelerator, s.val_tokens, cfg.seq_len, cfg.micro_batch_size, chunk, eos, cfg.mtp_depth
            )
            for s in run.data.sources
            if token_data.num_windows(len(s.val_tokens), cfg.seq_len)
        }
        samples = run.samples.take(model, accelerator) if run.samples else None  # greedy, on every process
        record, console = metrics.validation_record(run, step, losses, samples)
        log(record, console)
        resilience.check_validation(record, step)  # the same on every process: the losses are reduced over all

    stop_signals = resilience.StopSignals(out, rank)  # preemption, Ctrl-C, a closed terminal: finish the step, save
    step = run.resume.state["step"] if run.resume is not None else 0
    bar = cli.progress_bar(total=run.total_steps, initial=step, desc="train", dynamic_ncols=True,
                           disable=not accelerator.is_main_process)  # fmt: skip
    watchdog = training.watchdog
    if step == 0 and cfg.eval_at_start:
        watchdog.beat(0, "validation")
        validate_at(0)
    log_window, skips = metrics.LogWindow(), training.skips
    # What --plan --from_run OUT compares; written once the run has started (a failed resume: none).
    if training.finalises_checkpoints:
        cli.write_json_atomic(out / "plan.json", training.planned.record)
    profiler = breakdown.Profiler(cfg.profile_steps, out, rank, step)
    watchdog.beat(step)
    while step < run.total_steps:
        # One optimizer step: the gradients of `accum` micro-batches, then the update. A skipped step (a non-finite loss
        # or gradient norm, an fp16 overflow) leaves weights, optimizer state and the LR schedule where they were.
        lr = run.schedule.lr(step - skips.total)
        optimizer_lib.set_lr(optimizer, lr, cfg)
        scale = mtp_scale(run, step).to(accelerator.device) if cfg.mtp_depth else None
        logged = {}
        for micro_step in range(accum):
            batch = get_batch(run.data, sample_ids(step, micro_step, rank, run.batch), cfg)
            batch = tuple(t.to(accelerator.device) if t is not None else None for t in batch)
            with accelerator.accumulate(model):  # the last micro-step syncs the gradients
                with balancer.collecting() if balancer else contextlib.nullcontext():
                    loss, terms = lm_loss(model, batch, cfg, scale, balancer)
                backward(training, loss, step + 1)  # gradients only: no strategy changes the weights here
            logged = {name: logged.get(name, 0) + term / accum for name, term in terms.items()}
        grad_norm, skipped = update(training, cfg, step + 1)  # <- the weights change here, under every strategy
        # From here on the weights are the updated ones, whole or ZeRO-3 partitions (model/weights.py reads either).
        if balancer:
            balancer.update(accelerator)
        if training.ema is not None and not skipped:
            training.ema.update()
        step += 1
        stop_requested = resilience.stop_vote(accelerator, stop_signals, step)  # every process stops after this step
        profiler.step(last=stop_requested or step == run.total_steps)
        log_window.add(logged, skipped)  # the loss logged is the mean over the steps taken
        bar.update(1)

        if step % cfg.log_every == 0 or step == run.total_steps or stop_requested:
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
            record = metrics.metrics_record(run, training, step, log_window, {"lr": lr, "grad_norm": grad_norm})
            bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{lr:.2e}")
            log(record, metrics.console_line(record, run.total_steps))
            log_window = metrics.LogWindow()
        pause_t0 = time.perf_counter()
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == run.total_steps:
            watchdog.beat(step, "validation")
            validate_at(step)
        if (cfg.save_every and step % cfg.save_every == 0) or step == run.total_steps or stop_requested:
            watchdog.beat(step, "checkpoint")
            saved = checkpoint.save_checkpoint(
                accelerator,
                checkpoint.Save(
                    ckpt_root,
                    step,
                    run.state_at(step, skips.total),
                    run.model_config,
                    cfg.keep_last,
                    checkpoint_state(training),
                ),
                run.resume.kept if run.resume else (),
                training.finalises_checkpoints,
            )
            accelerator.print(f"saved {saved}")
            # A signal that came while the checkpoint was written stops the run now, not one step and checkpoint later.
            stop_requested = resilience.any_process(accelerator, stop_requested or bool(stop_signals.received))
        log_window.t0 += time.perf_counter() - pause_t0  # throughput counts training time only
        watchdog.beat(step)
        if stop_requested and step < run.total_steps:
            bar.close()
            why = stop_signals.name(accelerator)
            if accelerator.is_main_process:  # the run's history says why it ended here
                metrics.append(out / "metrics.jsonl", {"step": step, "event": "stop", "signal": why})
            accelerator.print(
                f"stopped by signal after step {step} ({why}); the same command with --resume auto "
                f"continues from {ckpt_root / f'step_{step}'}"
            )
            watchdog.stop()
            training.trackers.end_training()
            return 0
    bar.close()
    watchdog.beat(step, "final export")
    code = finish.export_run(run, training)
    watchdog.stop()
    return code


def run_plan(cfg: Config, flags_given: set[str] = frozenset()) -> int:
    """`train.py --plan [--compare]`: the plan for a config on paper, no process group and no GPU needed."""
    return plan.plan_on_paper(cfg, check_flags, flags_given)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = cli.parse_config(Config, argv, __doc__.split("\n\n")[0])
    if cfg is None:
        return 2
    if cfg.plan:
        return run_plan(cfg, cli.flags_given_in(Config, argv))
    try:
        return train(cfg, cli.flags_given_in(Config, argv))
    except UserError as e:  # raised by setup, before anything is written; the same on every process
        cli.print_error(str(e))
        return 2
    except (resilience.Diverged, checkpoint.CheckpointWriteError) as e:  # the last complete checkpoint is intact
        cli.print_error(str(e), wait=getattr(e, "follows_another", False))
        return 3
    except OSError as e:  # a full disk, a file size limit, a vanished mount while writing metrics or final/
        cli.print_error(f"{cli.shown(e.filename)}: {e.strerror or e}; complete checkpoints are intact: "
                        f"{checkpoint.fix_for(e)}, then --resume auto")  # fmt: skip
        return 3


if __name__ == "__main__":
    cli.exit_process(main())
