"""The planner: what a run is (the launch record, the batch plan, the model config) and what it costs (parameters,
FLOPs, memory, step time), on paper for `train.py --plan` and for real at the start of every run.

One record describes a launch: `launch_record` builds it from an accelerate config's settings, whether they come
from the YAML (`read_launch`, for --plan) or from the live Accelerator (`live_launch`), so both see the same values.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import time
from pathlib import Path

import torch

import cli
from cli import UserError

# Dense fp16/bf16 tensor-core peak with fp32 accumulate, FLOP/s, by substring of the CUDA device name; the longest
# matching name wins, so "H100 PCIe" is not read as the SXM card. fp32 runs are measured against a timed matmul.
GPU_PEAK_FLOPS = {
    "RTX 4090": 165.2e12,
    "H100": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200": 989e12,
    "A100": 312e12,
    "RTX 3090": 71e12,
    "L40S": 362e12,
}
GIB = 2**30
# The share of a GPU's memory a plan may fill: the CUDA context, allocator fragmentation and buffers take the rest.
FIT_FRACTION = 0.95


# ---------------------------------------------------------------------------------------------------------------------
# The launch and the batch
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Launch:
    """How a run is launched, as its accelerate config says."""

    world_size: int
    nodes: int
    precision: str  # fp32 | fp16 | bf16
    grad_accum_steps: int
    offload_optimizer: bool
    offload_params: bool
    gpu: bool


def launch_record(
    mixed_precision: str,
    ds_config: dict,
    yaml_deepspeed: dict,
    world_size: int,
    nodes: int,
    gpu: bool,
    default_accum: int = 1,
) -> Launch:
    """The one place a launch is read. ds_config: the DeepSpeed JSON (the live plugin's resolved config, or the file
    a YAML names); yaml_deepspeed: the YAML's deepspeed_config keys, which count where the JSON is silent."""
    zero = ds_config.get("zero_optimization", {})
    precision = mixed_precision
    if ds_config.get("fp16", {}).get("enabled") is True:
        precision = "fp16"
    elif ds_config.get("bf16", {}).get("enabled") is True:
        precision = "bf16"
    accum = ds_config.get("gradient_accumulation_steps", yaml_deepspeed.get("gradient_accumulation_steps", "auto"))

    def offloaded(key: str, yaml_key: str) -> bool:
        return (zero.get(key, {}).get("device") or yaml_deepspeed.get(yaml_key, "none")) not in ("none", None)

    return Launch(
        world_size=world_size,
        nodes=nodes,
        precision={"no": "fp32"}.get(precision, precision),
        grad_accum_steps=default_accum if accum == "auto" else int(accum),
        offload_optimizer=offloaded("offload_optimizer", "offload_optimizer_device"),
        offload_params=offloaded("offload_param", "offload_param_device"),
        gpu=gpu,
    )


def read_launch(path: str) -> Launch:
    """The launch an accelerate YAML (and the DeepSpeed JSON it may name) describes, without launching."""
    import yaml

    y = yaml.safe_load(Path(path).read_text())
    ds = y.get("deepspeed_config") or {}
    js = json.loads(Path(ds["deepspeed_config_file"]).read_text()) if ds.get("deepspeed_config_file") else {}
    return launch_record(
        y.get("mixed_precision", "no"),
        js,
        ds,
        int(y.get("num_processes", 1)),
        int(y.get("num_machines", 1)),
        not y.get("use_cpu", False),
    )


def live_launch(accelerator) -> Launch:
    """The launch this process is part of."""
    plugin = accelerator.state.deepspeed_plugin
    gpu = torch.cuda.is_available()
    world = accelerator.num_processes
    return launch_record(
        accelerator.mixed_precision,
        plugin.deepspeed_config if plugin else {},
        {},
        world,
        max(1, world // max(1, torch.cuda.device_count())) if gpu else 1,
        gpu,
        default_accum=accelerator.gradient_accumulation_steps,
    )


def join_restarted_process_group() -> None:
    """After a restart by `accelerate launch --max_restarts N` (torchrun's elastic agent), create the process group
    under a key prefix of this attempt, before Accelerate and DeepSpeed would (DeepSpeed adopts a group that exists).

    Why: the configs' rdzv_backend `static` keeps ONE key-value store on the launcher for every attempt, and the
    workers join it with no per-attempt prefix (torch's env:// rendezvous assumes a fresh store per attempt). The
    restarted workers then read the dead attempt's gloo/NCCL addresses and fail ("Connection refused") or hang. An
    upstream fix would give each static-rendezvous attempt a fresh store or an attempt prefix in the workers' store.
    The first attempt is left to Accelerate as before."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or torch.distributed.is_initialized():
        return
    import datetime

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(minutes=30)
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout)
    kwargs = {}
    if torch.cuda.is_available():  # bound to its GPU, as DeepSpeed binds it
        kwargs["device_id"] = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(kwargs["device_id"])
    torch.distributed.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo",
        store=torch.distributed.PrefixStore(f"train.py/attempt_{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
        **kwargs,
    )


def start_accelerator(log_with: str, project_dir: str):
    """The Accelerator of this process, refusing a launch whose processes would not synchronise."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    # Launched on CPUs, DeepSpeed needs gloo named explicitly or Accelerate and DeepSpeed disagree on the world size.
    # A plain `python train.py` has no process group to create; LOCAL_RANK is how Accelerate itself tells.
    launched = "LOCAL_RANK" in os.environ
    kwargs = [InitProcessGroupKwargs(backend="gloo")] if launched and not torch.cuda.is_available() else []
    join_restarted_process_group()
    with cli.without_noise():
        accelerator = Accelerator(log_with=log_with or None, project_dir=project_dir, kwargs_handlers=kwargs)
    if accelerator.mixed_precision == "fp16" and accelerator.state.deepspeed_plugin is None and not accelerator.scaler:
        raise UserError(
            f"fp16 without DeepSpeed needs a GPU: on {accelerator.device.type} Accelerate would run it as fp32 with "
            f"no loss scaling. Launch with accelerate_configs/zero3_cpu.yaml (DeepSpeed trains fp16 where oneDNN "
            f"has fp16), or use --mixed_precision bf16 or no"
        )
    started = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if started > 1 and accelerator.distributed_type == DistributedType.NO:  # torchrun on CPUs without the variable
        raise UserError(
            f"{started} processes were started but Accelerate runs them as "
            f"{accelerator.distributed_type.value}, with no gradient sync: each would train its own copy. "
            f"On CPUs launch with ACCELERATE_USE_CPU=1 torchrun --nproc_per_node {started} train.py ..., "
            f"or accelerate launch --config_file accelerate_configs/zero3_cpu.yaml train.py ..."
        )
    return accelerator


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
# Parameters, FLOPs and MFU
# ---------------------------------------------------------------------------------------------------------------------


def llama_param_counts(c) -> dict:
    """Parameter counts of a Llama/DeepSeek config without building it: total, non-embedding, largest tensor."""
    h, v, f, n_layers = c.hidden_size, c.vocab_size, c.intermediate_size, c.num_hidden_layers
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    embed = v * h
    head = 0 if c.tie_word_embeddings else v * h
    total = embed + head + n_layers * layer + h
    return {"total": total, "non_embedding": total - embed, "largest_tensor": max(embed, h * f), "per_layer": layer}


def flops_per_token(n_params_non_embedding: int, n_layers: int, hidden_size: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 N + 12 L H T (PaLM appendix B; nanoGPT)."""
    return 6 * n_params_non_embedding + 12 * n_layers * hidden_size * seq_len


def is_moe(c) -> bool:
    return getattr(c, "model_type", "") == "deepseek_v3"


def deepseek_v3_param_counts(c) -> dict:
    """Parameter counts of a DeepSeek-V3 config (MLA attention, DeepSeekMoE) without building it: total, activated
    per token (the top-k routed experts, the shared ones and the router of each MoE layer), non-embedding, largest
    tensor (the fused routed experts' gate and up projections, which ZeRO-3 gathers whole)."""
    h, v, n_layers, heads = c.hidden_size, c.vocab_size, c.num_hidden_layers, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    q = h * heads * qk if not c.q_lora_rank else h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * heads * qk
    kv = (
        h * (c.kv_lora_rank + c.qk_rope_head_dim)
        + c.kv_lora_rank
        + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
    )
    attention = q + kv + heads * c.v_head_dim * h + 2 * h  # with the layer's two norms
    expert = 3 * h * c.moe_intermediate_size
    router = c.n_routed_experts * h
    moe_total = c.n_routed_experts * expert + c.n_shared_experts * expert + router
    moe_active = c.num_experts_per_tok * expert + c.n_shared_experts * expert + router
    n_dense = min(c.first_k_dense_replace, n_layers)
    dense = 3 * h * c.intermediate_size
    embed, head = v * h, 0 if c.tie_word_embeddings else v * h
    body = n_layers * attention + n_dense * dense + h
    total = embed + head + body + (n_layers - n_dense) * moe_total
    activated = embed + head + body + (n_layers - n_dense) * moe_active
    largest = max(embed, h * c.intermediate_size, c.n_routed_experts * 2 * c.moe_intermediate_size * h)
    return {
        "total": total,
        "non_embedding": total - embed,
        "activated": activated,
        "activated_non_embedding": activated - embed,
        "largest_tensor": largest,
    }


def param_counts(c) -> dict:
    """total, non_embedding, activated (per token), activated_non_embedding and largest_tensor of a model config."""
    if is_moe(c):
        return deepseek_v3_param_counts(c)
    counts = llama_param_counts(c)
    return {**counts, "activated": counts["total"], "activated_non_embedding": counts["non_embedding"]}


def model_flops_per_token(c, seq_len: int) -> float:
    """Training FLOPs per token of a config: 6 x activated non-embedding parameters (a MoE layer counts only the
    experts a token goes to) + 6 L T x the attention's query-key and value widths (12 L H T for Llama; MLA's
    per-head query-key width is qk_nope + qk_rope, its value width v_head_dim)."""
    counts = param_counts(c)
    if is_moe(c):
        widths = c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    else:
        widths = 2 * c.hidden_size
    return 6 * counts["activated_non_embedding"] + 6 * c.num_hidden_layers * seq_len * widths


def activations_per_token(c, seq_len: int, attn: str) -> list[int]:
    """Values saved for backward per token, layer by layer (see memory_plan). DeepSeek-V3 layers: the two norm
    inputs, attention input, q and rotated q, the compressed kv, expanded k and v, attention output (MLA), then the
    MLP input and gate, up, SiLU and product of every expert the token goes to, and the router's scores."""
    h, a = c.hidden_size, c.num_attention_heads
    eager = 2 * a * seq_len if attn == "eager" else 0
    if not is_moe(c):
        kv = c.num_key_value_heads * (h // a)
        return [7 * h + 3 * kv + 4 * c.intermediate_size + eager] * c.num_hidden_layers
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    attention = 3 * h + 2 * a * qk + c.kv_lora_rank + c.qk_rope_head_dim + a * (qk + c.v_head_dim) + a * c.v_head_dim
    moe_ffn = (c.num_experts_per_tok + c.n_shared_experts) * c.moe_intermediate_size
    return [
        attention
        + eager
        + h
        + (4 * c.intermediate_size if i < c.first_k_dense_replace else 4 * moe_ffn + c.n_routed_experts)
        for i in range(c.num_hidden_layers)
    ]


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops: float) -> float:
    return tokens_per_s * flops_per_tok / peak_flops


def gpu_peak_flops(device_name: str, precision: str) -> float | None:
    """Datasheet 16-bit peak of a known GPU for fp16/bf16 runs; None (time a matmul instead) for fp32 or unknown."""
    if precision not in ("fp16", "bf16"):
        return None
    matches = [key for key in GPU_PEAK_FLOPS if key in device_name]
    return GPU_PEAK_FLOPS[max(matches, key=len)] if matches else None


def measure_peak_flops(accelerator, precision: str) -> tuple[float, str]:
    """Peak FLOP/s the MFU is measured against: the datasheet for known GPUs, else a large matmul timed now on every
    process at once (on a CPU the processes share cores, so the sum is what the machine gives them together)."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        flops = gpu_peak_flops(name, precision)
        if flops is not None:
            return flops * accelerator.num_processes, f"{name} datasheet, {precision}"
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)
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
    source = f"{n}x{n} {str(dtype).replace('torch.', '')} matmul timed on all processes"
    return float(accelerator.reduce(local, "sum")), source


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


# ---------------------------------------------------------------------------------------------------------------------
# Memory and time
# ---------------------------------------------------------------------------------------------------------------------


def memory_plan(
    c,
    world_size: int,
    micro_batch_size: int,
    seq_len: int,
    precision: str,
    offload_optimizer: bool,
    offload_params: bool,
    gradient_checkpointing: bool,
    attn: str,
    loss_chunk_tokens: int = 0,
) -> dict:
    """Bytes per GPU (and host) for one training process, by component.

    Model states (ZeRO-3, Adam, mixed precision): 16-bit parameters 2 B, 16-bit gradients 2 B, fp32 master weights
    + Adam m and v 12 B per parameter, each sharded over the world; in fp32 training parameters and gradients take
    4 B each and there is no separate master copy. The largest tensor is gathered whole in 16-bit for its forward,
    and the optimizer step needs one fp32 temporary the size of its shard (Adam's denominator).
    Activations saved for backward (activations_per_token), per token and layer of a Llama block (the count of
    Korthikanti et al. 2022 redone for RMSNorm, RoPE and SwiGLU, no dropout): two norm inputs (2h), attention input,
    q, k, v, rotated q and k, attention output (4h + 3 kv), MLP input, gate, up, SiLU and product (h + 4 ffn), plus
    2 a s for eager attention's score matrices; MLA and MoE layers as activations_per_token says. Checkpointing
    keeps each layer's input and recomputes one layer at a time. The loss: loss_bytes (the whole logits, or one chunk).
    """
    counts = param_counts(c)
    p, n = counts["total"], world_size
    half = precision in ("fp16", "bf16")
    param_b, grad_b, optim_b = (2, 2, 12) if half else (4, 4, 8)
    act_b = 2 if half else 4
    s, b, h, v = seq_len, micro_batch_size, c.hidden_size, c.vocab_size
    per_layer = [s * b * values * act_b for values in activations_per_token(c, s, attn)]
    acts_full = sum(per_layer)
    acts_ckpt = len(per_layer) * s * b * h * act_b + max(per_layer)
    loss = loss_bytes(s * b, v, h, act_b, loss_chunk_tokens)
    gpu = {
        "parameters": 0 if offload_params else param_b * p / n,
        "gradients": grad_b * p / n,
        "optimizer_states": 0 if offload_optimizer else optim_b * p / n,
        "gathered_largest_tensor": param_b * counts["largest_tensor"],
        "optimizer_step_temporaries": 0 if offload_optimizer else 4 * p / n,
        "activations": acts_ckpt if gradient_checkpointing else acts_full,
        "loss": loss,
    }
    # Offloaded optimizer: fp32 master weights, Adam states and fp32 gradients live in host RAM.
    host = ((optim_b + 4) * p / n if offload_optimizer else 0) + (param_b * p / n if offload_params else 0)
    return {
        "gpu": gpu,
        "gpu_total": sum(gpu.values()),
        "host_per_process": host,
        "activations_without_checkpointing": acts_full,
        "activations_with_checkpointing": acts_ckpt,
        "params": counts,
    }


def loss_bytes(tokens: int, vocab: int, hidden: int, act_b: int, chunk_tokens: int) -> int:
    """Peak bytes of the loss over the output layer in a micro-step of `tokens` tokens (lmloss.model_nll).

    Full logits (chunk_tokens 0): the logits in the activations' dtype, their fp32 log-softmax and its fp32 gradient.
    In chunks: one chunk's fp32 logits (beside its 16-bit matmul result in mixed precision), recomputed in backward,
    plus the fp32 accumulator of the output weight's gradient and one fp32 log-sum-exp per token."""
    if chunk_tokens == 0:
        return tokens * vocab * (act_b + 4 + 4)
    rows = min(chunk_tokens, tokens)
    return rows * vocab * (4 + (act_b if act_b < 4 else 0)) + vocab * hidden * 4 + tokens * 4


def deepspeed_estimate(
    total_params: int,
    largest_tensor: int,
    gpus_per_node: int,
    nodes: int,
    offload_optimizer: bool,
    offload_params: bool,
) -> tuple[int, int]:
    """DeepSpeed's own ZeRO-3 model-state estimate: (host bytes per node, GPU bytes per GPU), zero.Init on."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
        total_params,
        largest_tensor,
        gpus_per_node,
        nodes,
        cpu_offload=offload_optimizer,
        cpu_offload_params=offload_params,
        zero_init=True,
    )
    return cpu, gpu


def step_time_plan(
    flops_tok: float,
    tokens_per_step: int,
    world_size: int,
    peak_flops_per_device: float,
    mfu_assumed: float,
    total_params: int,
    grad_accum: int,
    param_bytes: int,
    bandwidth_b_s: float,
) -> dict:
    """Seconds per optimizer step: compute at the assumed MFU, plus ZeRO-3 traffic, which per micro-step is about 1.5x
    plain data parallel's all-reduce (parameters all-gathered for forward and backward, gradients reduce-scattered:
    3 x the 16-bit model over (n-1)/n of the ring), assumed not overlapped with compute (an upper bound)."""
    compute_s = flops_tok * tokens_per_step / (world_size * peak_flops_per_device * mfu_assumed)
    traffic_bytes = grad_accum * 3 * param_bytes * total_params * (world_size - 1) / world_size
    comm_s = 0.0 if world_size == 1 else traffic_bytes / bandwidth_b_s
    step_s = compute_s + comm_s
    return {"compute_s": compute_s, "comm_s": comm_s, "step_s": step_s, "tokens_per_s": tokens_per_step / step_s}


def run_memory(cfg, model_config, launch: Launch, micro_batch_size: int, loss_chunk_tokens: int) -> dict:
    """memory_plan for train.py's Config (cfg) on this launch at a micro-batch and loss path, with DeepSpeed's estimate
    of the model states (ds_gpu, ds_host) and `need`, the bytes per GPU a fit is judged on."""
    mem = memory_plan(
        model_config,
        launch.world_size,
        micro_batch_size,
        cfg.seq_len,
        launch.precision,
        launch.offload_optimizer,
        launch.offload_params,
        cfg.gradient_checkpointing,
        cfg.attn_implementation,
        loss_chunk_tokens,
    )
    counts = mem["params"]
    ds_host, ds_gpu = deepspeed_estimate(
        counts["total"],
        counts["largest_tensor"],
        launch.world_size // launch.nodes,
        launch.nodes,
        launch.offload_optimizer,
        launch.offload_params,
    )
    need = max(mem["gpu_total"], ds_gpu + mem["gpu"]["activations"] + mem["gpu"]["loss"])
    return {**mem, "ds_host": ds_host, "ds_gpu": ds_gpu, "need": need}


def largest_micro_batch(cfg, model_config, launch: Launch, gpu_memory_gib: float, loss_chunk_tokens: int) -> int:
    """The largest micro-batch (up to 1024) whose plan fits the GPU; 0 when none does."""
    for b in range(1, 1025):
        if run_memory(cfg, model_config, launch, b, loss_chunk_tokens)["need"] > gpu_memory_gib * GIB * FIT_FRACTION:
            return b - 1
    return 1024


def plan_report(cfg, model_config, launch: Launch, batch: BatchPlan, flops_tok: float, gpu_memory_gib: float,
                peak_flops_per_device: float, steps: int) -> tuple[list[str], bool]:  # fmt: skip
    """The memory and time plan as printable lines, and whether the model states + activations fit the devices.
    cfg is train.py's Config (micro batch, sequence length, checkpointing, attention, loss path, assumed MFU and
    bandwidth); flops_tok is model_flops_per_token of the model at that sequence length."""
    world, nodes = launch.world_size, launch.nodes
    mem = run_memory(cfg, model_config, launch, cfg.micro_batch_size, cfg.loss_chunk_tokens)
    counts, gpu, ds_gpu, ds_host = mem["params"], mem["gpu"], mem["ds_gpu"], mem["ds_host"]
    fits = mem["need"] <= gpu_memory_gib * GIB * FIT_FRACTION
    t = step_time_plan(
        flops_tok,
        batch.tokens_per_step,
        world,
        peak_flops_per_device,
        cfg.assumed_mfu,
        counts["total"],
        launch.grad_accum_steps,
        2 if launch.precision != "fp32" else 4,
        cfg.interconnect_gb_s * 1e9,
    )
    where = "device" if launch.gpu else "process"
    full_loss = run_memory(cfg, model_config, launch, cfg.micro_batch_size, 0)["gpu"]["loss"]
    loss_path = f"chunks of {cfg.loss_chunk_tokens} tokens; full logits: {full_loss / GIB:.2f}"
    checkpointing = "on" if cfg.gradient_checkpointing else "off"
    lines = [
        f"plan: {counts['total'] / 1e6:,.1f}M parameters ({counts['non_embedding'] / 1e6:,.1f}M non-embedding, "
        + (f"{counts['activated'] / 1e6:,.1f}M activated per token, " if is_moe(model_config) else "")
        + f"largest tensor {counts['largest_tensor'] / 1e6:.1f}M), {flops_tok / 1e9:.2f} GFLOP/token, "
        f"vocab {model_config.vocab_size}; {world} processes on {nodes} machine(s), {launch.precision}, "
        f"offload optimizer={launch.offload_optimizer} parameters={launch.offload_params}",
        f"  per {where}: parameters {gpu['parameters'] / GIB:.2f} GiB + gradients {gpu['gradients'] / GIB:.2f} "
        f"+ optimizer states {gpu['optimizer_states'] / GIB:.2f} + step temporaries "
        f"{gpu['optimizer_step_temporaries'] / GIB:.2f} + gathered largest tensor "
        f"{gpu['gathered_largest_tensor'] / GIB:.2f} + activations {gpu['activations'] / GIB:.2f} "
        f"(checkpointing {checkpointing}; on: {mem['activations_with_checkpointing'] / GIB:.2f}, "
        f"off: {mem['activations_without_checkpointing'] / GIB:.2f}) + loss {gpu['loss'] / GIB:.2f} "
        f"({loss_path if cfg.loss_chunk_tokens else 'full logits'}) "
        f"= {mem['gpu_total'] / GIB:.2f} GiB",
        f"  DeepSpeed's ZeRO-3 estimator: {ds_gpu / GIB:.2f} GiB model states per {where}, {ds_host / GIB:.1f} GiB "
        f"host RAM per machine (ours: {mem['host_per_process'] * world / nodes / GIB:.1f} GiB offloaded per machine)",
        f"  step: {batch.tokens_per_step:,} tokens, {t['step_s']:.2f} s ({t['compute_s']:.2f} s compute at "
        f"{cfg.assumed_mfu:.0%} MFU of {peak_flops_per_device / 1e12:.3g} TFLOP/s + {t['comm_s']:.2f} s ZeRO-3 traffic "
        f"at {cfg.interconnect_gb_s:g} GB/s) = {t['tokens_per_s']:,.0f} tokens/s"
        + (f"; {steps} steps = {steps * t['step_s'] / 3600:.1f} h" if steps else ""),
    ]
    if launch.gpu:
        lines.append(
            f"  {'fits' if fits else 'does NOT fit'}: needs {mem['need'] / GIB:.1f} GiB of {gpu_memory_gib:g} GiB "
            "per GPU"
        )
        if cfg.loss_chunk_tokens:
            largest = [
                largest_micro_batch(cfg, model_config, launch, gpu_memory_gib, c) for c in (cfg.loss_chunk_tokens, 0)
            ]
            lines.append(
                f"  largest --micro_batch_size that fits: {largest[0]} with the loss in chunks of "
                f"{cfg.loss_chunk_tokens} tokens, {largest[1]} with the full logits (--loss_chunk_tokens 0)"
            )
        if not fits:
            advice = (
                "use accelerate_configs/zero3_offload_3gpu.yaml (optimizer and parameters in CPU RAM)"
                if not launch.offload_optimizer
                else "lower --micro_batch_size or --seq_len"
            )
            lines.append(
                f"  advice: {advice}" + ("; add --gradient_checkpointing" if not cfg.gradient_checkpointing else "")
            )
    return lines, fits or not launch.gpu


def check_fits(run, accelerator, peak_flops: float) -> None:
    """Print the plan for this launch (run: train.py's Run); refuse to start when it says the model does not fit the
    GPU."""
    cfg, launch = run.cfg, run.launch
    device_gib = torch.cuda.get_device_properties(accelerator.device).total_memory / GIB if launch.gpu else 0.0
    lines, fits = plan_report(
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
