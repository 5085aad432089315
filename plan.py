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
    offload_optimizer: str  # none | cpu | nvme
    offload_params: bool
    gpu: bool
    zero_stage: int  # 0: no DeepSpeed (plain DDP, or one process)


def launch_record(
    mixed_precision: str,
    ds_config: dict,
    yaml_deepspeed: dict,
    world_size: int,
    nodes: int,
    gpu: bool,
    deepspeed: bool,
    default_accum: int = 1,
) -> Launch:
    """The one place a launch is read. ds_config: the DeepSpeed JSON (the live plugin's resolved config, or the file
    a YAML names); yaml_deepspeed: the YAML's deepspeed_config keys, which count where the JSON is silent; deepspeed:
    whether DeepSpeed runs at all (else plain DDP or one process)."""
    zero = ds_config.get("zero_optimization", {})
    precision = mixed_precision
    if ds_config.get("fp16", {}).get("enabled") is True:
        precision = "fp16"
    elif ds_config.get("bf16", {}).get("enabled") is True:
        precision = "bf16"
    accum = ds_config.get("gradient_accumulation_steps", yaml_deepspeed.get("gradient_accumulation_steps", "auto"))

    def offloaded(key: str, yaml_key: str) -> str:
        return zero.get(key, {}).get("device") or yaml_deepspeed.get(yaml_key) or "none"

    return Launch(
        world_size=world_size,
        nodes=nodes,
        precision={"no": "fp32"}.get(precision, precision),
        grad_accum_steps=default_accum if accum == "auto" else int(accum),
        offload_optimizer=offloaded("offload_optimizer", "offload_optimizer_device"),
        offload_params=offloaded("offload_param", "offload_param_device") != "none",
        gpu=gpu,
        zero_stage=int(zero.get("stage", yaml_deepspeed.get("zero_stage", 3))) if deepspeed else 0,
    )


def read_launch(path: str) -> Launch:
    """The launch an accelerate YAML (and the DeepSpeed JSON it may name) describes, without launching."""
    import yaml

    y = yaml.safe_load(Path(path).read_text())
    if not isinstance(y, dict) or "distributed_type" not in y:
        raise UserError(f"{path} is not an accelerate config (a YAML with distributed_type): see accelerate_configs/")
    deepspeed = y["distributed_type"] == "DEEPSPEED"
    ds = (y.get("deepspeed_config") or {}) if deepspeed else {}
    js = json.loads(Path(ds["deepspeed_config_file"]).read_text()) if ds.get("deepspeed_config_file") else {}
    stage = js.get("zero_optimization", {}).get("stage", ds.get("zero_stage", 3))
    if deepspeed and not isinstance(stage, int):
        raise UserError(f"{path}: zero_stage {stage!r} must be 0-3 for --plan to count it")
    return launch_record(
        y.get("mixed_precision", "no"),
        js,
        ds,
        int(y.get("num_processes", 1)),
        int(y.get("num_machines", 1)),
        not y.get("use_cpu", False),
        deepspeed,
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
        plugin is not None,
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
        trackers = [name.strip() for name in log_with.split(",") if name.strip()] or None  # check_trackers: known ones
        accelerator = Accelerator(log_with=trackers, project_dir=project_dir, kwargs_handlers=kwargs)
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


# A CPU run times its own model for the plan (measure_model_rate) up to this many parameters in the 2-layer copy;
# beyond it the copy would cost gigabytes and seconds, and the plan keeps --assumed_mfu of the timed matmul.
MEASURED_COPY_MAX_PARAMS = 100e6
MEASURED_RATE = "forward, loss and backward of 1 and 2 of its layers at this sequence and dtype"
# ... over at most this many tokens (whole sequences, at least one): the rate, not the run's memory, is measured.
MEASURED_TOKENS = 1024


def in_lock_step(launch: Launch) -> bool:
    """Whether the launch's processes go through the layers together (ZeRO-3 gathers each layer's parameters on all of
    them): live_cpu_rate times them so, paper_cpu_rate gives them turns of the cores."""
    return launch.zero_stage == 3 and launch.world_size > 1


def measured_rate_source(launch: Launch, paper: bool) -> str:
    """How the plan's compute rate was measured (live_cpu_rate, or paper_cpu_rate when `paper`), for the plan line."""
    lock_step = in_lock_step(launch)
    if paper:
        turns = "; under ZeRO-3 processes beyond the cores take turns" if lock_step else ""
        return f"{MEASURED_RATE}, one process on paper, its share of the cores{turns}"
    return f"{MEASURED_RATE}, all processes at once{', in step at each layer' if lock_step else ''}"


def measure_model_rate(c, micro: int, seq_len: int, precision: str, attn: str, chunk: int, sync=None) -> float | None:
    """FLOP/s this process reaches on the model itself, for the plan's compute time on CPUs (where small models reach
    a fraction of a big matmul's rate, and no fixed MFU fits them all): copies of the model with 1 and 2 decoder
    layers, in the run's dtype, each timed over forward, the run's loss (lmloss.model_nll, `chunk` tokens at a time)
    and backward at the run's sequence and micro-batch, capped at MEASURED_TOKENS (best of 2 after a warm-up), the
    whole model's pass read as the 1-layer time + (layers - 1) x the second layer's. sync: called at each layer's start
    and backward's end (lock_step), on every process at once. It leaves out what ZeRO moves (the plan's link and copy
    terms) and the optimizer. Call it on every process at once: on a CPU they share the cores. None for a copy over
    MEASURED_COPY_MAX_PARAMS."""
    import copy

    from transformers import AutoModelForCausalLM

    import lmloss

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)
    copies = [copy.deepcopy(c) for _ in (1, 2)]
    for layers, small in enumerate(copies, 1):
        small.num_hidden_layers = layers
    if param_counts(copies[1])["total"] > MEASURED_COPY_MAX_PARAMS:
        return None
    seconds = []
    with torch.random.fork_rng():  # the run's random state stays as it was
        torch.manual_seed(0)
        micro = max(1, min(micro, MEASURED_TOKENS // seq_len))
        ids = torch.randint(0, c.vocab_size, (micro, seq_len))
        for small in copies:
            try:
                model = AutoModelForCausalLM.from_config(small, attn_implementation=attn, dtype=dtype)
            except (ValueError, TypeError, IndexError):  # a config whose per-layer lists do not shrink: not timed
                return None
            if sync is not None:
                lock_step(model, sync, small.num_hidden_layers)  # the same on every process: same config
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                nll, n = lmloss.model_nll(model, ids, ids, chunk)
                (nll / n).backward()
                times.append(time.perf_counter() - t0)
            seconds.append(min(times[1:]))
            del model, nll
    whole = seconds[0] + (c.num_hidden_layers - 1) * max(seconds[1] - seconds[0], 0.0)
    return model_flops_per_token(c, seq_len) * micro * seq_len / whole


def lock_step(model, sync, layers: int) -> None:
    """Calls sync() as each decoder layer starts its forward and as its backward ends: where ZeRO-3 gathers and
    reduces that layer's parameters, and so where its processes wait for the slowest. Processes that outnumber the
    cores finish a layer in turns there (3 on 2 cores: a layer takes two turns, not 1.5), which timing them apart
    misses. The decoder layers: the one ModuleList of `layers` modules (by its name when several are that long; none
    hooked when that is not one, the same on every process: a list of experts, which ranks call differently, must
    never be taken)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == layers]
    if len(lists) > 1:
        lists = [(name, m) for name, m in lists if name.rsplit(".", 1)[-1] in ("layers", "h", "blocks")]
    if len(lists) != 1:
        return

    def before(module, args, kwargs):
        sync()
        hidden = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)), None)
        if hidden is not None and hidden.requires_grad:
            hidden.register_hook(lambda grad: (sync(), grad)[1])

    for layer in lists[0][1]:
        layer.register_forward_pre_hook(before, with_kwargs=True)


def check_plan_flags(cfg) -> None:
    """The planner's own flags, in --plan and in a real run."""
    for name in ("assumed_mfu", "interconnect_gb_s", "pcie_gb_s", "nvme_gb_s", "gpu_memory_gib"):
        if not getattr(cfg, name) > 0:
            raise UserError(f"--{name} {getattr(cfg, name)} must be positive")
    for name in ("host_memory_gib", "gradient_accumulation_steps"):
        if getattr(cfg, name) < 0:
            raise UserError(f"--{name} {getattr(cfg, name)} must not be negative (0: the default)")
    if cfg.compare and not cfg.plan:
        raise UserError("--compare is a --plan option: python train.py --plan --compare ...")


def live_cpu_rate(accelerator, cfg, c, launch: Launch) -> float | None:
    """measure_model_rate on every process of a CPU run at once; the mean over processes. Under ZeRO-3 the processes
    run the copies in lock step (a one-element all-reduce at each layer's start and backward's end), as the gathers
    keep the run: on 3 processes sharing 2 cores, timing them apart planned ~2x the tokens/s the run reached. The
    copies are plain models: transformers builds every model partitioned while Accelerate's DeepSpeed config is
    registered with it (Accelerate's zero3_init_context_manager(enable=False) re-registers it, so it does not stop
    that)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    plugin = accelerator.state.deepspeed_plugin
    hf_deepspeed.unset_hf_deepspeed_config()
    one = torch.zeros(1)
    sync = (lambda: torch.distributed.all_reduce(one)) if in_lock_step(launch) else None
    try:
        rate = measure_model_rate(c, cfg.micro_batch_size, cfg.seq_len, launch.precision, cfg.attn_implementation,
                                  cfg.loss_chunk_tokens, sync)  # fmt: skip
    finally:
        if plugin is not None and plugin.dschf is not None:
            hf_deepspeed.set_hf_deepspeed_config(plugin.dschf)
    found = accelerator.gather(torch.tensor([rate or 0.0], device=accelerator.device))
    return float(found.mean()) if bool((found > 0).all()) else None


def paper_cpu_rate(cfg, c, launch: Launch) -> float | None:
    """measure_model_rate for a CPU launch planned on paper, in this one process: as the launcher runs it, one thread
    per process when there are several (torchrun's default), and the processes' share of this machine's cores. Under
    ZeRO-3, where the processes go through the layers in lock step (see live_cpu_rate), processes that outnumber the
    cores get one core in ceil(processes / cores) turns, not cores / processes of one."""
    threads = torch.get_num_threads()
    if launch.world_size > 1:
        torch.set_num_threads(1)
    try:
        rate = measure_model_rate(c, cfg.micro_batch_size, cfg.seq_len, launch.precision, cfg.attn_implementation,
                                  cfg.loss_chunk_tokens)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    per_machine, cores = launch.world_size // launch.nodes, len(os.sched_getaffinity(0))
    if not rate or per_machine <= cores:
        return rate
    return rate / math.ceil(per_machine / cores) if in_lock_step(launch) else rate * cores / per_machine


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def host_memory_gib() -> float:
    """This machine's RAM."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def process_rss_gib() -> float:
    """This process's resident memory now (the base a plan adds the model to)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GIB


def measure_links(accelerator) -> dict:
    """What moving bytes costs this run, measured in a second or two on the real process group and device: the bus
    bandwidth (GB/s) of each collective ZeRO and DDP use (all-reduce, all-gather, reduce-scatter; none for one
    process) and the device's copy rate (GB/s read + written), after checking that what every process sends arrives
    unchanged.

    The check: an all-gather of rank-stamped integers, compared on every rank. On some RTX 40-series drivers NCCL's
    P2P copies between cards return wrong data without an error; training would then go on with corrupted gradients.
    Bus bandwidth as nccl-tests defines it: bytes x 2 (n-1)/n (all-reduce) or (n-1)/n (the others) / seconds, the best
    of 2 after a warm-up; the backends differ in each (gloo's reduce-scatter runs at a fraction of its all-reduce)."""
    n, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    numel = (64 if device.type == "cuda" else 16) * 2**20 // 4  # the collectives' buffer; the copy's is 4x that

    def best_s(op) -> float:
        times = []
        for _ in range(3):
            accelerator.wait_for_everyone()
            t0 = time.perf_counter()
            op()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return min(times[1:])

    # Two copy rates: into memory the process already holds (the optimizer step, persistent buckets), and as the
    # frameworks flatten many tensors into a fresh buffer (a bucket to reduce, a gather); on a CPU the fresh pages cost
    # more than the bytes (3.9 GB/s here against 13.5).
    pieces = list(torch.ones(numel * 4, device=device).chunk(16))
    held, into = torch.ones(numel * 4, device=device), torch.zeros(numel * 4, device=device)
    links = {
        "memory": 2 * numel * 4 * 4 / best_s(lambda: into.copy_(held)) / 1e9,
        "memory_fresh": 2 * numel * 4 * 4 / best_s(lambda: torch.cat(pieces)) / 1e9,
    }
    buf, out = torch.ones(numel, device=device), torch.empty(numel, device=device)
    if n == 1:
        return links
    check_link_content(accelerator, numel)
    shard = torch.ones(numel // n, device=device)
    ring = (n - 1) / n * numel * 4 / 1e9
    links["all_reduce"] = 2 * ring / best_s(lambda: torch.distributed.all_reduce(buf))
    links["all_gather"] = ring / best_s(
        lambda: torch.distributed.all_gather_into_tensor(out[: shard.numel() * n], shard)
    )
    links["reduce_scatter"] = ring / best_s(
        lambda: torch.distributed.reduce_scatter_tensor(shard, buf[: shard.numel() * n])
    )
    return links


def check_link_content(accelerator, numel: int) -> None:
    """Stop the run when an all-gather of rank-stamped integers arrives changed anywhere (see measure_links)."""
    n, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    stamp = torch.arange(numel, dtype=torch.int32, device=device)
    got = [torch.empty_like(stamp) for _ in range(n)]
    torch.distributed.all_gather(got, stamp * (rank + 1))
    if cli.fault("corrupt_link", rank, 0):
        got[(rank + 1) % n][numel // 2] += 1
    wrong = torch.zeros(n, n, device=device)  # [receiver, sender]
    wrong[rank] = torch.tensor([float(not torch.equal(g, stamp * (r + 1))) for r, g in enumerate(got)])
    pairs = accelerator.reduce(wrong, "sum").nonzero().tolist()
    if pairs:
        raise UserError(
            f"data sent between the processes arrived changed (an all-gather of {numel * 4 // 2**20} MiB per process; "
            + ", ".join(f"rank {sender}'s on rank {receiver}" for receiver, sender in pairs)
            + "): some RTX 40-series drivers' P2P copies return wrong data; launch with NCCL_P2P_DISABLE=1 in the "
            "environment, or update the driver"
        )
