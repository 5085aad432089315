"""The optimizer: AdamW, or Muon for the hidden matrices with AdamW for the rest (train.py --optimizer).

    adamw  torch's AdamW (fused), weight decay on 2-D weights (matrices and the embedding), not on norms
    muon   MomentUm Orthogonalized by Newton-Schulz (Jordan et al. 2024, kellerjordan.github.io/posts/muon): SGD with
           Nesterov momentum whose update, for each weight matrix, is replaced by the nearest semi-orthogonal matrix
           (5 Newton-Schulz iterations on the momentum), scaled by sqrt(max(1, rows / cols)). It gets every matrix of
           the blocks: attention (MLA's q_a/q_b/kv_a/kv_b/o projections, each as one matrix), the MLPs, each routed
           expert of a MoE layer on its own (the fused [experts, rows, cols] tensors are orthogonalised per expert),
           the routers, and the MTP modules' projection. The embedding and the output layer (by DeepSpeed's rule,
           parameters named *embed* or *lm_head*) and the norms get AdamW, with --adam_beta1/2, --adam_eps and
           --weight_decay (2-D only) as the adamw optimizer has them.

Both are kept implementations, not ours: under DeepSpeed (ZeRO-1/2/3) its own Muon (optimizer type "Muon", the update
computed on whole gradients, each rank a round-robin share of the matrices, the momentum partitioned like Adam's
state; its AdamW half torch's AdamW, so nothing is built on first use); without DeepSpeed (DDP, one plain process)
DeepSpeed's single-device class of the same update, which takes the 3-D expert tensors that torch.optim.Muon (2-D
only) refuses. Muon with the optimizer offloaded is refused.

Muon runs without gradient clipping (resolve), as the speedrun's records do. Under DeepSpeed the grad_norm a
run logs is the norm DeepSpeed takes: of Muon's orthogonalised updates and AdamW's gradients; without it, of the
gradients.

The LR schedule multiplies both: at a step where the schedule gives lr, the AdamW groups get lr and the Muon groups
lr x --muon_lr / --lr.
"""

from __future__ import annotations

import dataclasses
import os
import re

import torch

from deepseek_zero3.cli import UserError

OPTIMIZERS = ("auto", "adamw", "muon")
# --optimizer auto: Muon for the presets where bench/muon.py found it reaching AdamW's final loss in at most 0.8x the
# tokens (BENCHMARKS.md, muon_<preset>); AdamW for every other model, --init_from's included.
MUON_PRESETS = ("mini", "small")
WORKING_WITH_MUON = "zero3_3gpu.yaml, zero2_3gpu.yaml, ddp_3gpu.yaml, zero3_multinode.yaml or the CPU configs"


def shape_of(p) -> tuple:
    return tuple(getattr(p, "ds_shape", p.shape))  # under zero.Init parameters are flat shards; ds_shape: the real


def takes_muon(name: str, p) -> bool:
    """DeepSpeed's rule (deepspeed.set_optimizer_flags), which its engine applies to the model it is given: Muon for
    every tensor of 2 or more dimensions whose name holds neither 'embed' nor 'lm_head'."""
    return len(shape_of(p)) >= 2 and not any(word in name.lower() for word in ("embed", "lm_head"))


def check(cfg, launch) -> None:
    """The flags, and Muon's strategies: one line naming what works."""
    if cfg.optimizer not in OPTIMIZERS:
        raise UserError(f"--optimizer {cfg.optimizer!r} must be one of {', '.join(OPTIMIZERS)}")
    for name in ("muon_lr", "muon_weight_decay"):
        if not getattr(cfg, name) >= 0 or getattr(cfg, name) == float("inf"):
            raise UserError(f"--{name} {getattr(cfg, name)} must be a finite number, not negative")
    if not 0 <= cfg.muon_momentum < 1:
        raise UserError(f"--muon_momentum {cfg.muon_momentum} must be within [0, 1)")
    if cfg.optimizer == "muon" and launch is not None and launch.offload_optimizer != "none":
        raise UserError(
            f"--optimizer muon does not run with the optimizer offloaded (this config offloads it to "
            f"{launch.offload_optimizer}; DeepSpeed's Muon is not supported there): use {WORKING_WITH_MUON}, or "
            f"--optimizer adamw"
        )


def pick(cfg, launch=None):
    """--optimizer auto made concrete: muon for MUON_PRESETS where the launch does not offload the optimizer (which
    Muon cannot run with), adamw otherwise."""
    if cfg.optimizer != "auto":
        return cfg
    offloaded = launch is not None and launch.offload_optimizer != "none"
    muon = cfg.model_config in MUON_PRESETS and not cfg.init_from and not offloaded
    return dataclasses.replace(cfg, optimizer="muon" if muon else "adamw")


def resolve(cfg, flags_given: set[str], launch=None):
    """pick, then: Muon runs unclipped. DeepSpeed's Muon takes the global norm after orthogonalising, over Muon's
    updates (each a matrix of singular values ~1, its norm ~ sqrt(min(rows, cols)): 33 on the tiny preset) and AdamW's
    gradients, and clips that: --max_grad_norm 1 would shrink every step ~30x. So --max_grad_norm defaults to 0 with
    Muon, and a value given is refused."""
    auto = cfg.optimizer == "auto"
    cfg = pick(cfg, launch)
    if cfg.optimizer != "muon" or cfg.max_grad_norm == 0:
        return cfg
    if "max_grad_norm" in flags_given:
        which = f" (--optimizer auto's choice for --model_config {cfg.model_config})" if auto else ""
        raise UserError(
            f"--max_grad_norm {cfg.max_grad_norm} with --optimizer muon{which}: Muon runs unclipped (DeepSpeed's Muon "
            f"would "
            f"clip its orthogonalised update, whose norm is set by the matrices' shapes, not by the gradient); drop "
            f"--max_grad_norm, or train with --optimizer adamw"
        )
    return dataclasses.replace(cfg, max_grad_norm=0.0)


def check_names(model) -> None:
    """The embedding and the output layer must fall to AdamW under DeepSpeed's name rule, or its engine would give them
    Muon (a model whose embedding is named otherwise, GPT-2's `wte`, say)."""
    names = {id(p): n for n, p in model.named_parameters()}
    for layer in (model.get_input_embeddings(), model.get_output_embeddings()):
        p = getattr(layer, "weight", None)
        if p is not None and id(p) in names and takes_muon(names[id(p)], p):
            raise UserError(
                f"--optimizer muon: this model's {names[id(p)]} would get Muon, as DeepSpeed picks AdamW's parameters "
                f"by name (*embed*, *lm_head*); train it with --optimizer adamw"
            )


def groups(model, cfg) -> list[dict]:
    """The param groups: with Muon its matrices, then AdamW's decayed 2-D weights, then the rest undecayed."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = [p for n, p in named if cfg.optimizer == "muon" and takes_muon(n, p)]
    taken = {id(p) for p in muon}
    decay = [p for n, p in named if id(p) not in taken and len(shape_of(p)) >= 2]
    no_decay = [p for n, p in named if id(p) not in taken and len(shape_of(p)) < 2]
    adam = [{"params": decay, "weight_decay": cfg.weight_decay, "name": "adamw_decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "adamw_no_decay"}]  # fmt: skip
    if cfg.optimizer == "adamw":
        return [{k: v for k, v in g.items() if k != "name"} for g in adam]
    return [{"params": muon, "weight_decay": cfg.muon_weight_decay, "name": "muon"}, *adam]


def make(model, cfg, accelerator=None):
    """The optimizer to hand accelerator.prepare. With the optimizer offloaded, Accelerate swaps torch's AdamW for
    DeepSpeed's CPU AdamW; any other optimizer, CPU Adam itself included, it rebuilds as Adam with L2 decay
    (accelerate's map_pytorch_optim_to_deepspeed)."""
    cfg = pick(cfg)
    if cfg.optimizer == "muon":
        check_names(model)
    param_groups = groups(model, cfg)
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    if cfg.optimizer == "adamw":
        # fused: one kernel per tensor (CPU and CUDA), not a dozen elementwise passes; on a ZeRO-3 partition 7x faster.
        # Loading a checkpoint's groups (one saved before fused was set) must not turn it off.
        optimizer = torch.optim.AdamW(param_groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, fused=True)
        optimizer.register_load_state_dict_post_hook(lambda opt: [g.update(fused=True) for g in opt.param_groups])
        return optimizer
    device = accelerator.device if accelerator is not None else next(model.parameters()).device
    (accelerator.print if accelerator is not None else print)(compile_newton_schulz(device, accelerator))
    plugin = accelerator.state.deepspeed_plugin if accelerator is not None else None
    if plugin is not None:  # DeepSpeed builds its Muon from the config; Accelerate hands it these groups
        from accelerate.utils import DummyOptim

        # torch_adam: the AdamW half is torch's AdamW. DeepSpeed's default, its FusedAdam, is built on first use
        # (nvcc and ninja on a GPU, a C++ compiler on a CPU), and of the ways that build fails (no CUDA_HOME: OSError,
        # no nvcc, no ninja, a failed compile: CalledProcessError, ImportError) DeepSpeed falls back on RuntimeError
        # only: the rest ended the run in a traceback. On ZeRO's flat partitions torch's AdamW is a few kernels.
        plugin.deepspeed_config["optimizer"] = {
            "type": "Muon",
            "params": {"muon_lr": cfg.muon_lr, "adam_lr": cfg.lr, "momentum": cfg.muon_momentum, "betas": list(betas),
                       "eps": cfg.adam_eps, "weight_decay": cfg.weight_decay, "torch_adam": True},
        }  # fmt: skip
        zero = plugin.deepspeed_config.setdefault("zero_optimization", {})
        if zero.get("stage") == 3:  # its ZeRO-3 Muon refuses per-parameter reduce-scatter: one bucket-wide scatter
            zero["reduce_scatter"] = False
        return DummyOptim(param_groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    from deepspeed.runtime.zero.muon.original_muon import SingleDeviceMuonWithAuxAdam

    muon, *adam = param_groups
    muon.update(use_muon=True, lr=cfg.muon_lr, momentum=cfg.muon_momentum)
    for group in adam:
        group.update(use_muon=False, lr=cfg.lr, betas=betas, eps=cfg.adam_eps)
    return SingleDeviceMuonWithAuxAdam([g for g in param_groups if g["params"]])


def compile_newton_schulz(device: torch.device, accelerator=None) -> str:
    """How Muon's Newton-Schulz runs, set for this process and said in one startup line.

    DeepSpeed wraps Muon's update in torch.compile. On a CPU inductor compiles C++ for it at the first steps of every
    process (a C++ compiler must be installed) and gains nothing: 3 ZeRO-3 processes of `mini`, 20 steps, took 135 s
    compiled and 54 s eager (TORCHDYNAMO_DISABLE=1) on 2 AMD EPYC cores, at the same tokens/s after the compile
    (4,185-4,347 against 4,275-4,355) and the same losses. A CPU run takes it eagerly, unless it asked Accelerate to
    compile (`accelerate launch --dynamo_backend X` sets ACCELERATE_DYNAMO_BACKEND).

    Where it compiles (GPUs: Triton), one small update is compiled here first, on this device, so that a compiler that
    cannot work on this machine (Triton's launcher without a C compiler, inductor's C++ without one, Triton missing
    or broken: InductorError, BackendCompilerFailed, ImportError, OSError, CalledProcessError) is found before the
    first step rather than ending the run there in a traceback. Then every process runs eagerly (the stance is the
    process's: a model compile asked of Accelerate too), the line says why. A compile that fails later, for a shape
    this one did not cover, falls back to eager for that call with torch's warning (suppress_errors)."""
    if device.type == "cpu" and os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower() == "no":
        torch.compiler.set_stance("force_eager")
        return "Muon's Newton-Schulz: eager (on a CPU compiling it gains nothing)"
    import torch._dynamo as dynamo
    from deepspeed.runtime.zero.muon.original_muon import muon_update

    why = ""
    try:
        update = torch.randn(8, 16, device=device)
        muon_update(update, torch.zeros_like(update))
    except Exception as e:  # noqa: BLE001 - a compiler stack fails in many kinds, all of them to be named
        first_line = (str(e).strip().splitlines() or [""])[0][:300]
        why = f"{type(e).__name__}: {first_line}"
    failed = torch.tensor([float(bool(why))], device=device)
    if accelerator is not None and accelerator.num_processes > 1:  # every process the same way
        failed = accelerator.reduce(failed, "sum")
    if not failed.item():
        dynamo.config.suppress_errors = True
        return "Muon's Newton-Schulz: compiled (torch.compile); a later compile that fails runs that call eagerly"
    torch.compiler.set_stance("force_eager")
    return (
        f"note: torch.compile does not work on this machine ({why or 'on another process'}): Muon's Newton-Schulz, "
        f"and anything else this process would compile, runs eagerly (the same update, slower). To compile it, fix "
        f"the compiler: a C compiler for Triton (CC), a C++ compiler for inductor on a CPU (CXX), triton installed"
    )


def after_load(engine) -> None:
    """A checkpoint of DeepSpeed's Muon from before its AdamW half was torch's (DeepSpeed's FusedAdam, or its inline
    update where FusedAdam failed to build) holds each AdamW parameter's step count as an int, where torch's AdamW
    takes a tensor ("API has changed, `state_steps` argument must contain a list of singleton tensors" at the first
    step): the same count, as a tensor. A no-op for any other optimizer, or without DeepSpeed (engine None)."""
    base = getattr(getattr(engine, "optimizer", None), "optimizer", None)  # inside DeepSpeed's ZeRO wrapper
    if not isinstance(getattr(base, "aux_optimizer", None), torch.optim.AdamW):
        return
    for group in base.param_groups:
        for p in [] if group.get("use_muon") else group["params"]:
            state = base.state.get(p, {})
            if "step" in state and not torch.is_tensor(state["step"]):
                state["step"] = torch.tensor(float(state["step"]))


def set_lr(optimizer, lr: float, cfg) -> None:
    """The schedule's LR into every group: AdamW's as it is, Muon's scaled by --muon_lr / --lr."""
    for group in optimizer.param_groups:
        group["lr"] = lr * cfg.muon_lr / cfg.lr if group.get("use_muon") else lr


def describe(model, cfg) -> str:
    """Which parameters each optimizer updates, printed once at start: counts, and names with layer numbers as *."""
    if cfg.optimizer == "adamw":
        n = sum(p.numel() if not hasattr(p, "ds_numel") else p.ds_numel for p in model.parameters())
        return f"optimizer: AdamW for all {n / 1e6:.2f}M parameters (weight decay on 2-D weights only)"
    lines = []
    for label, picked in (("Muon", True), ("AdamW", False)):
        chosen = [(n, p) for n, p in model.named_parameters() if p.requires_grad and takes_muon(n, p) is picked]
        kinds: dict[str, list] = {}
        for n, p in chosen:
            kinds.setdefault(re.sub(r"\.\d+\.", ".*.", n), []).append(shape_of(p))
        total = sum(int(torch.Size(s).numel()) for shapes in kinds.values() for s in shapes)
        parts = [f"{k} x{len(v)} {list(v[0])}" for k, v in kinds.items()]
        lines.append(f"  {label}: {len(chosen)} tensors, {total / 1e6:.2f}M parameters: {'; '.join(parts)}")
    lr = f"Muon lr {cfg.muon_lr:g} (momentum {cfg.muon_momentum:g}, weight decay {cfg.muon_weight_decay:g})"
    head = f"optimizer: Muon + AdamW; {lr}, AdamW lr {cfg.lr:g}; 3-D expert tensors orthogonalised per expert"
    return "\n".join([head, *lines])
