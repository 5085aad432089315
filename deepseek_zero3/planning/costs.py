"""What a training strategy costs, on paper: memory per GPU and in host RAM, bytes over the links per optimizer step
and seconds per step; the plan a run prints at start and the comparison of strategies (`train.py --plan --compare`).

The strategies, one accelerate config each (accelerate_configs/<file>, see STRATEGIES):
  DDP         fp32 parameters, gradients and Adam on every GPU; one gradient all-reduce per optimizer step (Accelerate
              skips the sync during accumulation)
  ZeRO-2      16-bit parameters on every GPU, gradients and optimizer states partitioned; gradients all-reduced (as
              DeepSpeed does it) every micro-step (ZeRO cannot skip it during accumulation: DeepSpeed #6793),
              parameters all-gathered once per step
  ZeRO-3      everything partitioned; parameters all-gathered for the forward, for the backward (and for the recompute
              with checkpointing) and gradients reduce-scattered, every micro-step
  + offload   the fp32 master weights, Adam states and fp32 gradients in host RAM, Adam on the CPU; with parameter
              offload the 16-bit parameters too, copied to the GPU for every pass; with NVMe (ZeRO-Infinity) the
              optimizer states on an SSD, read and written every step

A step's time is compute + GPU-link traffic + PCIe offload traffic + NVMe + host Adam, none assumed to overlap (an upper
bound, and on PCIe without P2P the links are what overlaps least) but DDP's all-reduce, which PyTorch's DDP runs bucket
by bucket during the backward (ddp_hidden_s). DeepSpeed's overlap_comm (its default under ZeRO-3 on GPUs, off in the CPU
configs here) is not counted: the ZeRO rows are the pessimistic ones. Traffic is counted per process as a ring moves it:
an all-gather or reduce-scatter of S bytes puts (n-1)/n S on each link, an all-reduce twice that, and a bandwidth is the
all-reduce bus bandwidth (what nccl-tests calls busbw; measure.measure_links measures it on the real process group). The
strategies' own copies (buckets, flattening, gathers) and the optimizer step are counted as bytes through device memory
(traffic), at the two copy rates a run measures. The recommendation is the fastest plan that fits, parameter offload
only when nothing else does (see compare). Checked against measurement: bench/strategy_vs_plan.py.
"""

from __future__ import annotations

import dataclasses
import math

from deepseek_zero3.distributed import Launch
from deepseek_zero3.model import attention
from deepseek_zero3.planning import measure, model_math
from deepseek_zero3.planning.model_math import FIT_FRACTION, GIB, is_moe, model_flops_per_token, param_counts
from deepseek_zero3.recipe import optimizer

# The share of host RAM a plan may fill: the OS, the page cache the data is read through and the launcher need the rest.
HOST_FIT_FRACTION = 0.9
# The compute capability a GPU plan assumes where no GPU is at hand: the RTX 4090's (sm89), the card plans target.
GPU_CAPABILITY = (8, 9)
# Host RAM a GPU training process takes before the model (CUDA, cuBLAS, NCCL and PyTorch loaded): assumed, not
# measured here (no GPU); a real run measures its own processes instead (plan.process_rss).
GPU_PROCESS_HOST_GIB = 3.0
# DeepSpeed's CPU Adam reads fp32 master weights, gradients, m and v (16 B) and writes weights, m, v and the 16-bit copy
# (14 B) per parameter: memory-bound. Assumed host memory bandwidth it reaches, GB/s (dual-channel DDR5 gives ~60).
HOST_ADAM_BYTES_PER_PARAM = 30
HOST_ADAM_GB_S = 40.0
# The target card's memory bandwidth (datasheet), for plans made without it; a run measures its device's.
RTX_4090_MEMORY_GB_S = 1008.0
# DeepSpeed's default zero_optimization.sub_group_size: the optimizer states are swapped to NVMe in groups this large.
NVME_SUB_GROUP = 1e9


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to spread a run over the GPUs: its accelerate config and what it shards or offloads."""

    name: str
    config: str  # file in accelerate_configs/
    zero_stage: int  # 0: plain DDP
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_params: bool = False


STRATEGIES = (
    Strategy("DDP", "ddp_3gpu.yaml", 0),
    Strategy("ZeRO-2", "zero2_3gpu.yaml", 2),
    Strategy("ZeRO-3", "zero3_3gpu.yaml", 3),
    Strategy("ZeRO-3 + optimizer offload", "zero3_offload_opt_3gpu.yaml", 3, "cpu"),
    Strategy("ZeRO-3 + optimizer and parameter offload", "zero3_offload_3gpu.yaml", 3, "cpu", True),
    Strategy("ZeRO-3 + optimizer on NVMe", "zero3_nvme_3gpu.yaml", 3, "nvme"),
)


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the plan divides by: per-GPU memory, host RAM per machine, bandwidths in GB/s (each collective's bus
    bandwidth between the processes, host <-> one GPU, NVMe, the device's copy rate), the model FLOP/s a device
    reaches (as MFU counts them: --assumed_mfu x the peak, the recomputation's cost in it; or timed on a copy of the
    model without checkpointing, timed_without_checkpointing, which step_costs then adds), where the figures came
    from, and the peak for the plan's MFU (0: none)."""

    gpu_memory_gib: float
    host_memory_gib: float
    link_gb_s: float  # all-reduce
    gather_gb_s: float  # all-gather
    scatter_gb_s: float  # reduce-scatter
    pcie_gb_s: float
    nvme_gb_s: float
    memory_gb_s: float  # device memory, bytes read + written per second, into memory already held
    fresh_memory_gb_s: float  # the same into a freshly allocated buffer
    flops_per_device: float
    link_source: str = "assumed"
    compute_source: str = ""
    peak_flops_per_device: float = 0.0
    timed_without_checkpointing: bool = False


def with_strategy(launch: Launch, s: Strategy, grad_accum_steps: int) -> Launch:
    return dataclasses.replace(
        launch,
        zero_stage=s.zero_stage,
        offload_optimizer=s.offload_optimizer,
        offload_params=s.offload_params,
        grad_accum_steps=grad_accum_steps,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------------------------


def memory_plan(c, launch: Launch, micro_batch_size: int, seq_len: int, gradient_checkpointing: bool, attn: str,
                loss_chunk_tokens: int = 0, mtp_depth: int = 0, muon: int = 0, ema: bool = False,
                document_masking: bool = False) -> dict:  # fmt: skip
    """Bytes per GPU (and per process in host RAM and on NVMe) of one training process, by component.

    Model states, mixed precision with Adam (fp32 in brackets), P parameters over n processes:
      DDP     fp32 parameters 4P (+ autocast's 16-bit copy of the weights during the forward, 2P), fp32 gradients 4P
              + the reducer's buckets that copy them 4P, Adam m and v 8P, AdamW's denominator 4P
      ZeRO-2  16-bit parameters 2P; 16-bit and fp32 gradient partitions 6P/n (4P/n); master weights and Adam 12P/n
              (8P/n); the step's denominator 4P/n (DeepSpeed's estimate: 2P + 18P/n)
      ZeRO-3  16-bit parameters 2P/n, gradients 2P/n, master weights and Adam 12P/n (fp32: 4, 4, 8), the largest tensor
              gathered whole, the step's denominator 4P/n
    Gradients summed in fp32 over the micro-steps (launch.grad_accum_dtype: bf16 under ZeRO-2/3, train.py sets it):
    ZeRO-3's partition is 4P/n, in host RAM when the optimizer is offloaded (DeepSpeed keeps it where the optimizer
    is); ZeRO-2 sums into one fp32 partition, 4P/n, which the step takes as it is (in 16 bits it copies the partition
    into fp32 for the step: 6P/n). Counted on a CPU engine of the `small` preset, 1 process, accumulation 2: ZeRO-3's
    partition 2 -> 4 bytes/parameter, ZeRO-2's held partition 2 -> 4 (the 4 of the step's copy gone).
    Offloaded optimizer: master weights, Adam states and fp32 gradients ((12 + 4)P/n) in host RAM; on NVMe the states
    (12P/n) on the SSD, the fp32 gradients and 4 pinned swap buffers of a sub-group in RAM. Offloaded parameters: their
    2P/n in host RAM.
    Activations saved for backward (activations_per_token), per token and layer of a Llama block (the count of
    Korthikanti et al. 2022 redone for RMSNorm, RoPE and SwiGLU, no dropout): two norm inputs (2h), attention input,
    q, k, v, rotated q and k, attention output (2h + 3q + 3 kv; q = h unless a head_dim of the config's own sets it
    apart), MLP input, gate, up, SiLU and product (h + 4 ffn), with QK-norm the normalised q and k (q + kv), plus 2 a s
    for eager attention's score matrices; MLA and MoE layers as activations_per_token says. Checkpointing
    keeps each layer's input and recomputes one layer at a time. The loss: loss_bytes (the whole logits, or one chunk).
    MTP modules (mtp_depth): their parameters, each block's activations as one more layer, each depth's loss.
    Muon (muon: the parameters it updates, recipe/optimizer.py): one fp32 momentum for those, not Adam's two moments.
    EMA (--ema_decay, recipe/ema.py): an fp32 average of every parameter where the weights are: 4P per process, 4P/n
    under ZeRO-3, in host RAM with the parameters offloaded.
    Document masking (attn: the kernel, `auto` as a run on this launch's device resolves it): what the kernel keeps to
    mask documents, attention.mask_bytes (the dense fallback's b x T^2 mask and per-layer bias; a block index or the
    position ids otherwise).
    """
    counts = param_counts(c, mtp_depth)
    p, n, stage = counts["total"], launch.world_size, launch.zero_stage
    half = launch.precision in ("fp16", "bf16")
    param_b, grad_b, optim_b = (2, 2, 12) if half else (4, 4, 8)
    act_b = 2 if half else 4
    s, b = seq_len, micro_batch_size
    kernel = attention.choose(attn, "cuda" if launch.gpu else "cpu", launch.precision, document_masking, False)
    per_layer = [s * b * values * act_b for values in model_math.activations_per_token(c, s, kernel, mtp_depth)]
    acts_full = sum(per_layer)
    acts_ckpt = len(per_layer) * s * b * c.hidden_size * act_b + max(per_layer)
    offload_opt = launch.offload_optimizer != "none"
    if stage == 0:
        states = {
            "parameters": 4 * p + (2 * p if half else 0),
            "gradients": 8 * p,
            "optimizer_states": 8 * p - 4 * muon,
            "optimizer_step_temporaries": 4 * p,
            "gathered_largest_tensor": 0,
        }
    else:
        shard = 1 if stage == 3 else n  # ZeRO-2 keeps every parameter whole on every GPU
        sum_b = 4 if launch.grad_accum_dtype == "fp32" else grad_b
        if stage == 3:
            grads = (grad_b if offload_opt else sum_b) * p / n  # offloaded: the partition is in host RAM (below)
        else:
            grads = (sum_b if sum_b == 4 else grad_b + 4) * p / n
        states = {
            "parameters": 0 if launch.offload_params else param_b * p * shard / n,
            "gradients": grads,
            "optimizer_states": 0 if offload_opt else (optim_b * p - 4 * muon) / n,
            "optimizer_step_temporaries": 0 if offload_opt else 4 * p / n,
            "gathered_largest_tensor": param_b * counts["largest_tensor"] if stage == 3 else 0,
        }
    ema_b = 4 * p / (n if stage == 3 else 1) if ema else 0
    states["ema"] = 0 if launch.offload_params else ema_b
    gpu = {
        **states,
        "activations": acts_ckpt if gradient_checkpointing else acts_full,
        "loss": loss_bytes(s * b, c.vocab_size, c.hidden_size, act_b, loss_chunk_tokens, mtp_depth),
        "attention_mask": attention.mask_bytes(
            kernel, b, s, document_masking, act_b, len(per_layer), gradient_checkpointing
        ),
    }
    # ZeRO-Infinity pins buffer_count (4) fp32 buffers of its largest sub-group (sub_group_size, 1e9, or the shard).
    swap_buffers = 4 * min(NVME_SUB_GROUP, p / n) * 4
    summed_on_host = stage == 3 and offload_opt and launch.grad_accum_dtype == "fp32" and half
    host = (
        2 * p / n * summed_on_host  # ZeRO-3's partition in fp32, not 16 bits, where DeepSpeed keeps it
        + (optim_b + 4) * p / n * (launch.offload_optimizer == "cpu")
        + (4 * p / n + swap_buffers) * (launch.offload_optimizer == "nvme")
        + param_b * p / n * launch.offload_params
        + ema_b * launch.offload_params
    )
    return {
        "gpu": gpu,
        "gpu_total": sum(gpu.values()),
        "host_per_process": host,
        "nvme_per_process": optim_b * p / n if launch.offload_optimizer == "nvme" else 0,
        "activations_without_checkpointing": acts_full,
        "activations_with_checkpointing": acts_ckpt,
        "params": counts,
    }


def loss_bytes(tokens: int, vocab: int, hidden: int, act_b: int, chunk_tokens: int, mtp_depth: int = 0) -> int:
    """Peak bytes of the loss over the output layer in a micro-step of `tokens` tokens (lmloss.model_nll).

    Full logits (chunk_tokens 0): the logits in the activations' dtype, their fp32 log-softmax and its fp32 gradient.
    In chunks: one chunk's fp32 logits (beside its 16-bit matmul result in mixed precision), the last one kept for
    backward and the others recomputed there (the same peak: backward starts with the loss), plus the fp32
    accumulator of the output weight's gradient and one fp32 log-sum-exp per token. Each MTP depth's loss keeps its
    own last chunk (all its logits without chunks) and log-sum-exps until backward."""
    rows = min(chunk_tokens, tokens) if chunk_tokens else tokens
    depths = mtp_depth * (rows * vocab * 4 + tokens * 4)
    if chunk_tokens == 0:
        return tokens * vocab * (act_b + 4 + 4) + depths
    return rows * vocab * (4 + (act_b if act_b < 4 else 0)) + vocab * hidden * 4 + tokens * 4 + depths


def deepspeed_estimate(counts: dict, launch: Launch) -> tuple[int, int]:
    """DeepSpeed's own model-state estimate for ZeRO-2/3: (host bytes per machine, GPU bytes per GPU); (0, 0) for
    DDP, which it does not estimate."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    per_node = launch.world_size // launch.nodes
    offload = launch.offload_optimizer != "none"
    if launch.zero_stage == 3:
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            counts["total"], counts["largest_tensor"], per_node, launch.nodes, offload, launch.offload_params, True
        )
        return cpu, gpu
    if launch.zero_stage in (1, 2):
        return estimate_zero2_model_states_mem_needs(counts["total"], per_node, launch.nodes, offload)
    return 0, 0


def host_bytes(mem: dict, launch: Launch, base_per_process: float) -> float:
    """Peak host RAM of one machine: each process's base, then the larger of loading and training.

    Loading: without zero.Init (DDP, ZeRO-2) every process builds the whole fp32 model in host RAM before it moves
    to the GPU. Training: what is offloaded, and at the end the 16-bit model gathered on rank 0 for OUT/final. On CPU
    processes the device is the host, so everything the plan puts on the GPU counts here too."""
    local = launch.world_size // launch.nodes
    p = mem["params"]["total"]
    on_device = 0 if launch.gpu else mem["gpu_total"]
    load = 4 * p * local if launch.zero_stage < 3 and launch.gpu else 0
    export = (2 if launch.precision in ("fp16", "bf16") else 4) * p
    return local * base_per_process + max(load, local * (mem["host_per_process"] + on_device) + export)


# ---------------------------------------------------------------------------------------------------------------------
# Traffic and time
# ---------------------------------------------------------------------------------------------------------------------


def traffic(counts: dict, launch: Launch, gradient_checkpointing: bool, muon: int = 0) -> dict:
    """Bytes one process moves per optimizer step: over the GPU link by collective (ring counts; "link" is their sum),
    over its PCIe link to host RAM for offload, through its own device memory for the optimizer step and the
    strategy's gradient and parameter copies ("memory", read + written), and, per machine, to and from NVMe.

    The copies, as DDP's reducer and DeepSpeed 0.19's ZeRO code make them: DDP copies the fp32 gradients into its
    buckets and back once per step; ZeRO-2 copies each micro-step's gradients into its bucket (a fresh buffer every
    micro-step), divides it in place, flattens it for the all-reduce and copies its partition out, and writes the
    gathered parameters once per step; ZeRO-3 writes
    the gathered parameters of every gather, flattens the gradients for the reduce-scatter and copies its partition
    out. Adam reads weights, gradients, m and v and writes weights, m and v (28 B per fp32 parameter it updates).
    Muon under ZeRO-3 (muon: its parameters) all-gathers, once per step, the fp32 gradients and momentum of its
    matrices, then each process's orthogonalised share and its momentum (16 B per Muon parameter); under ZeRO-2 each
    process holds the whole gradients already (the all-reduce) and orthogonalises the matrices of its partition."""
    p, n, accum, stage = counts["total"], launch.world_size, launch.grad_accum_steps, launch.zero_stage
    param_b = 2 if launch.precision in ("fp16", "bf16") else 4
    ring = (n - 1) / n if n > 1 else 0.0
    gathers = 3 if gradient_checkpointing else 2  # forward, backward, and the recompute of each checkpointed layer
    moved = {"all_reduce": 0.0, "all_gather": 0.0, "reduce_scatter": 0.0}
    if stage == 0:
        moved["all_reduce"] = 2 * ring * 4 * p  # the fp32 gradients' all-reduce, once per step
        held, fresh = 4 * 4 * p, 0.0
    elif stage in (1, 2):
        # DeepSpeed's ZeRO-2 all-reduces each gradient bucket and keeps its partition (its default
        # use_multi_rank_bucket_allreduce), every micro-step; the updated parameters are all-gathered once. Its
        # gradient bucket is a fresh buffer every micro-step (setup_buckets allocates it, the step releases it):
        # copying the gradients in pays fresh pages, as flattening does (a profile of a rank: those copies ran at the
        # fresh rate, and the plan that counted them as held missed ZeRO-2's step by 1.3x). The bucket is divided
        # in place by the processes before the all-reduce.
        moved["all_reduce"] = accum * 2 * ring * param_b * p
        moved["all_gather"] = ring * param_b * p
        held = accum * (2 * param_b * p + 2 * param_b * p / n)  # the divide; the partition copied out
        fresh = accum * 2 * 2 * param_b * p + 2 * param_b * p  # the bucket; its flattened copy; the parameters gathered
    else:
        moved["all_gather"] = accum * gathers * ring * param_b * p
        moved["reduce_scatter"] = accum * ring * param_b * p
        moved["all_gather"] += 16 * ring * muon
        held = accum * 2 * param_b * p / n
        fresh = accum * (gathers * param_b * p + 2 * param_b * p)
    optimizer = 28 * (p if stage == 0 else p / n) if launch.offload_optimizer == "none" else 0.0
    held += optimizer
    pcie = 0.0
    if launch.offload_optimizer != "none":  # 16-bit gradients down every micro-step, updated parameters up once
        pcie += (accum + 1) * param_b * p / n
    if launch.offload_params:  # each gather starts from the partition in host RAM
        pcie += accum * gathers * param_b * p / n
    optim_b = 12 if param_b == 2 else 8
    nvme = 2 * optim_b * p / launch.nodes if launch.offload_optimizer == "nvme" else 0.0  # read and write every step
    return {**moved, "link": sum(moved.values()), "pcie": pcie, "nvme": nvme, "memory": held, "memory_fresh": fresh,
            "memory_optimizer": optimizer}  # fmt: skip


def step_costs(c, cfg, launch: Launch, micro_batch_size: int, machine: Machine, base_per_process: float) -> dict:
    """Memory, traffic and seconds per optimizer step of train.py's Config (cfg: sequence length, checkpointing,
    attention, loss path) under `launch` at a micro-batch; `fits` and, when it does not, `why`."""
    depth = model_math.mtp_depth(cfg, c)
    muon = getattr(cfg, "optimizer", "adamw") == "muon"
    muon_params = model_math.muon_params(c, depth) if muon else 0
    mem = memory_plan(c, launch, micro_batch_size, cfg.seq_len, cfg.gradient_checkpointing, cfg.attn_implementation,
                      cfg.loss_chunk_tokens, depth, muon_params, bool(getattr(cfg, "ema_decay", 0)),
                      getattr(cfg, "document_masking", False))  # fmt: skip
    counts = mem["params"]
    ds_host, ds_gpu = deepspeed_estimate(counts, launch)
    need = max(mem["gpu_total"], ds_gpu + mem["gpu"]["activations"] + mem["gpu"]["loss"])
    host = host_bytes(mem, launch, base_per_process)
    moved = traffic(counts, launch, cfg.gradient_checkpointing, muon_params)
    tokens = micro_batch_size * launch.grad_accum_steps * launch.world_size * cfg.seq_len
    flops = model_flops_per_token(c, cfg.seq_len, depth)
    hardware = model_math.run_hardware_flops(cfg, c, depth, micro_batch_size)
    timed = flops  # model FLOP/s: the recomputation's cost is in the rate, unless the rate was timed without it
    if cfg.gradient_checkpointing and machine.timed_without_checkpointing:
        timed += model_math.checkpointed_flops_per_token(c, cfg.seq_len, depth)
    compute_s = timed * tokens / (launch.world_size * machine.flops_per_device)
    adam_s = 0.0
    if launch.offload_optimizer != "none":
        adam_s = HOST_ADAM_BYTES_PER_PARAM * counts["total"] / launch.nodes / (HOST_ADAM_GB_S * 1e9)
    all_reduce_s = moved["all_reduce"] / machine.link_gb_s / 1e9
    hidden_s = ddp_hidden_s(counts["total"], c.vocab_size * c.hidden_size, launch, all_reduce_s, compute_s)
    comm_s = all_reduce_s - hidden_s + (moved["all_gather"] / machine.gather_gb_s
                                        + moved["reduce_scatter"] / machine.scatter_gb_s) / 1e9  # fmt: skip
    seconds = {
        "compute_s": compute_s,
        "comm_s": comm_s,
        "copies_s": (moved["memory"] / machine.memory_gb_s + moved["memory_fresh"] / machine.fresh_memory_gb_s) / 1e9,
        "offload_s": moved["pcie"] / (machine.pcie_gb_s * 1e9) + moved["nvme"] / (machine.nvme_gb_s * 1e9),
        "host_adam_s": adam_s,
        # Muon's Newton-Schulz: under ZeRO each process orthogonalises a round-robin share of the matrices, under DDP
        # every process all of them (DeepSpeed's single-device class)
        "newton_schulz_s": (
            model_math.newton_schulz_flops(c, depth)
            / (launch.world_size if launch.zero_stage else 1)
            / machine.flops_per_device
            if muon
            else 0.0
        ),
    }
    step_s = sum(seconds.values())
    # What a run that takes step_s logs (metrics.utilisation): Newton-Schulz and the rest are time, not model FLOPs.
    peak = launch.world_size * machine.peak_flops_per_device
    mfu = model_math.mfu(tokens / step_s, flops, peak) if peak else None
    why = []
    if muon and launch.offload_optimizer != "none":
        why.append("Muon does not run with the optimizer offloaded")
    if launch.gpu and need > machine.gpu_memory_gib * GIB * FIT_FRACTION:
        why.append(f"GPU needs {need / GIB:.1f} of {machine.gpu_memory_gib:.1f} GiB")
    if host > machine.host_memory_gib * GIB * HOST_FIT_FRACTION:
        why.append(f"host needs {host / GIB:.1f} of {machine.host_memory_gib:.1f} GiB")
    return {
        **seconds,
        "mem": mem,
        "need": need,
        "ds_gpu": ds_gpu,
        "ds_host": ds_host,
        "host": host,
        "traffic": moved,
        "tokens": tokens,
        "all_reduce_hidden_s": hidden_s,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "model_flops_per_token": flops,
        "hardware_flops_per_token": hardware,
        "mfu": mfu,
        "hfu": mfu * hardware / flops if mfu is not None and hardware > flops else None,
        "fits": not why,
        "why": "; ".join(why),
    }


# PyTorch DDP's bucket_cap_mb (train.py keeps the default): the gradients are all-reduced in buckets of this size; a
# tensor larger than that in a bucket of its own.
DDP_BUCKET_BYTES = 25 * 2**20


def ddp_hidden_s(params: float, embedding: float, launch: Launch, all_reduce_s: float, compute_s: float) -> float:
    """Seconds of DDP's gradient all-reduce the backward hides: DDP all-reduces each bucket of fp32 gradients as the
    backward fills it and waits for them all at the backward's end (Li et al., PyTorch Distributed, VLDB 2020), in the
    micro-step that syncs (Accelerate skips the sync in the others). Hidden: what fits in that micro-step's backward
    (2/3 of its compute), less the last bucket, which starts only as the backward ends: the input embedding's
    (`embedding` parameters, the last gradient the backward makes; DDP orders its buckets so after the first step) or
    a full bucket, whichever is larger. 0 for ZeRO and one process. On 2 CPU processes (bench/strategy_vs_plan.py
    --breakdown) the run hid less than this: 0.02 s planned exposed, 0.06 s waited, of 0.11 s."""
    if launch.zero_stage or launch.world_size == 1 or all_reduce_s <= 0:
        return 0.0
    last_bucket_s = all_reduce_s * min(1.0, max(DDP_BUCKET_BYTES, 4 * embedding) / (4 * params))
    backward_s = 2 / 3 * compute_s / launch.grad_accum_steps
    return max(0.0, min(all_reduce_s - last_bucket_s, backward_s))


def largest_fitting(c, cfg, launch: Launch, machine: Machine, base: float, sequences_per_process: int):
    """The largest micro-batch that divides the sequences a process takes per step and fits, with the accumulation that
    keeps that batch: (micro, its costs); (1, the costs of micro-batch 1) when none fits."""
    cfg = optimizer.pick(cfg, launch)  # --optimizer auto as a run under this launch takes it (AdamW where offloaded)
    divisors = [d for d in range(sequences_per_process, 0, -1) if sequences_per_process % d == 0]
    for micro in divisors:
        run = dataclasses.replace(launch, grad_accum_steps=sequences_per_process // micro)
        costs = step_costs(c, cfg, run, micro, machine, base)
        if costs["fits"] or micro == 1:
            return micro, costs
    raise AssertionError("1 divides every batch")


# ---------------------------------------------------------------------------------------------------------------------
# Reports: the plan of one launch, the comparison of strategies, the check at the start of a run
# ---------------------------------------------------------------------------------------------------------------------


def strategy_name(launch: Launch) -> str:
    if launch.world_size == 1 and launch.zero_stage == 0:
        return "one process"
    for s in STRATEGIES:
        if (s.zero_stage, s.offload_optimizer, s.offload_params) == (
            launch.zero_stage, launch.offload_optimizer, launch.offload_params
        ):  # fmt: skip
            return s.name
    return f"ZeRO-{launch.zero_stage}"


def machine_for(
    cfg,
    launch: Launch,
    peak_flops_per_device: float,
    links: dict | None = None,
    gpu_memory_gib: float = 0.0,
    model_rate: float | None = None,
    paper: bool = False,
) -> Machine:
    """The Machine a plan of train.py's Config divides by: measured figures where given (links: measure.measure_links of
    the run; gpu_memory_gib > 0: the device's; model_rate: measure.measure_model_rate's FLOP/s, `paper` or live), else
    the flags (compute: --assumed_mfu of the peak) and, for the device's copy rate, the RTX 4090's datasheet (or an
    assumed 10 GB/s for a CPU core)."""
    links = links or {}
    assumed = cfg.interconnect_gb_s
    # On paper a CPU's peak is a nominal core's, not one timed: no MFU is planned against it.
    peak = 0.0 if paper and not launch.gpu else peak_flops_per_device
    if model_rate:
        flops, source = model_rate, f"measured on this model: {measure.measured_rate_source(launch, paper)}"
    else:
        flops = peak_flops_per_device * cfg.assumed_mfu
        source = f"{cfg.assumed_mfu:.0%} MFU of {peak_flops_per_device / 1e12:.3g} TFLOP/s"
    return Machine(
        gpu_memory_gib=gpu_memory_gib or cfg.gpu_memory_gib,
        host_memory_gib=cfg.host_memory_gib or measure.host_memory_gib(),
        link_gb_s=links.get("all_reduce", assumed),
        gather_gb_s=links.get("all_gather", assumed),
        scatter_gb_s=links.get("reduce_scatter", assumed),
        pcie_gb_s=cfg.pcie_gb_s,
        nvme_gb_s=cfg.nvme_gb_s,
        memory_gb_s=links.get("memory", RTX_4090_MEMORY_GB_S if launch.gpu else 10.0),
        fresh_memory_gb_s=links.get("memory_fresh", RTX_4090_MEMORY_GB_S if launch.gpu else 4.0),
        flops_per_device=flops,
        link_source="measured" if "all_reduce" in links else "assumed, --interconnect_gb_s",
        compute_source=source,
        peak_flops_per_device=peak,
        timed_without_checkpointing=bool(model_rate),
    )


def kernel_of(cfg, launch: Launch) -> str:
    """The attention kernel a run of cfg takes on this launch's kind of device (`auto` resolved as on that device,
    flash-attn taken as not installed)."""
    device = "cuda" if launch.gpu else "cpu"
    return attention.choose(cfg.attn_implementation, device, launch.precision, cfg.document_masking, False)


def plan_report(cfg, c, launch: Launch, machine: Machine, base: float, steps: int) -> tuple[list[str], bool]:
    """The memory and time plan of one launch as printable lines, and whether it fits the GPUs and the host RAM.
    cfg is train.py's Config; base the host bytes of one process before the model."""
    world, nodes = launch.world_size, launch.nodes
    costs = step_costs(c, cfg, launch, cfg.micro_batch_size, machine, base)
    mem, moved = costs["mem"], costs["traffic"]
    counts, gpu = mem["params"], mem["gpu"]
    depth = model_math.mtp_depth(cfg, c)
    flops_tok = model_flops_per_token(c, cfg.seq_len, depth)
    checkpointed = model_math.checkpointed_flops_per_token(c, cfg.seq_len, depth)
    again = model_math.recomputed(cfg, c, depth, cfg.micro_batch_size)
    where = "device" if launch.gpu else "process"
    full_loss = memory_plan(c, launch, cfg.micro_batch_size, cfg.seq_len, cfg.gradient_checkpointing,
                            cfg.attn_implementation, 0, depth)["gpu"]["loss"]  # fmt: skip
    loss_path = f"chunks of {cfg.loss_chunk_tokens} tokens; full logits: {full_loss / GIB:.2f}"
    checkpointing = "on" if cfg.gradient_checkpointing else "off"
    lines = [
        (
            f"plan: {counts['total'] / 1e6:,.1f}M parameters ({counts['non_embedding'] / 1e6:,.1f}M non-embedding, "
            + (f"{counts['activated'] / 1e6:,.1f}M activated per token, " if is_moe(c) else "")
            + (f"{counts['mtp'] / 1e6:,.1f}M in MTP modules (--mtp_depth {depth}), " if counts["mtp"] else "")
            + f"largest tensor {counts['largest_tensor'] / 1e6:.1f}M), {flops_tok / 1e9:.2f} GFLOP/token, "
            f"vocab {c.vocab_size}; {world} processes on {nodes} machine(s), {launch.precision}, "
            f"{strategy_name(launch)}"
        ),
        (
            f"  per {where}: parameters {gpu['parameters'] / GIB:.2f} GiB + gradients {gpu['gradients'] / GIB:.2f} "
            f"+ optimizer states {gpu['optimizer_states'] / GIB:.2f} + step temporaries "
            f"{gpu['optimizer_step_temporaries'] / GIB:.2f} + gathered largest tensor "
            f"{gpu['gathered_largest_tensor'] / GIB:.2f} + activations {gpu['activations'] / GIB:.2f} "
            f"(checkpointing {checkpointing}; on: {mem['activations_with_checkpointing'] / GIB:.2f}, "
            f"off: {mem['activations_without_checkpointing'] / GIB:.2f}) + loss {gpu['loss'] / GIB:.2f} "
            f"({loss_path if cfg.loss_chunk_tokens else 'full logits'})"
            + (f" + EMA {gpu['ema'] / GIB:.2f}" if gpu["ema"] else "")
            + (f" + document mask {gpu['attention_mask'] / GIB:.2f}" if gpu["attention_mask"] else "")
            + f" = {mem['gpu_total'] / GIB:.2f} GiB"
        ),
        "  " + attention.describe(kernel_of(cfg, launch), getattr(cfg, "document_masking", False)),
    ]
    if is_moe(c) and launch.gpu:
        capability = attention.cuda_capability() or GPU_CAPABILITY
        name, cost = attention.expert_path("cuda", capability, launch.precision, True)
        lines.append(f"  MoE experts (sm{capability[0]}{capability[1]}, {launch.precision}): {name}, {cost}")
    if launch.zero_stage:
        lines.append(
            f"  DeepSpeed's ZeRO-{launch.zero_stage} estimator: {costs['ds_gpu'] / GIB:.2f} GiB model states per "
            f"{where}, {costs['ds_host'] / GIB:.1f} GiB host RAM per machine (with its 1.5x buffer factor)"
        )
    lines.append(
        f"  host RAM: {costs['host'] / GIB:.1f} GiB per machine of {machine.host_memory_gib:.1f} GiB "
        f"({world // nodes} x {base / GIB:.1f} GiB per process before the model"
        + (f", offloaded {mem['host_per_process'] * world / nodes / GIB:.1f} GiB" if mem["host_per_process"] else "")
        + (", the device's share too: CPU processes" if not launch.gpu else "")
        + (f"; NVMe {mem['nvme_per_process'] * world / nodes / GIB:.0f} GiB" if mem["nvme_per_process"] else "")
        + ")"
    )
    lines.append(
        f"  step: {costs['tokens']:,} tokens, {costs['step_s']:.2f} s = {costs['compute_s']:.2f} s compute at "
        f"{machine.flops_per_device / 1e12:.3g} TFLOP/s per {where} ({machine.compute_source})"
        + (
            f" with the checkpointed layers' forward again (+{checkpointed / flops_tok:.0%} FLOPs)"
            if cfg.gradient_checkpointing and machine.timed_without_checkpointing
            else ""
        )  # fmt: skip
        + f" + {costs['comm_s']:.2f} s for {moved['link'] / 1e9:.2f} GB per process over the link "
        + (f"and {costs['all_reduce_hidden_s']:.3g} s behind the backward " if costs["all_reduce_hidden_s"] else "")
        + f"(all-reduce {machine.link_gb_s:.3g}, all-gather {machine.gather_gb_s:.3g}, reduce-scatter "
        f"{machine.scatter_gb_s:.3g} GB/s, {machine.link_source}) + {costs['copies_s']:.2f} s copying in device "
        f"memory ({moved['memory'] / 1e9:.2f} GB "
        f"in place at {machine.memory_gb_s:.3g} GB/s, {moved['memory_fresh'] / 1e9:.2f} GB into fresh buffers at "
        f"{machine.fresh_memory_gb_s:.3g} GB/s)"
        + (f" + {costs['offload_s']:.2f} s offload" if costs["offload_s"] else "")
        + (f" + {costs['host_adam_s']:.2f} s host Adam" if costs["host_adam_s"] else "")
        + (f" + {costs['newton_schulz_s']:.2f} s Muon's Newton-Schulz" if costs["newton_schulz_s"] else "")
        + f" = {costs['tokens_per_s']:,.0f} tokens/s"
        + (f", MFU {model_math.percent(costs['mfu'])}" if costs["mfu"] is not None else "")
        + (f" (HFU {model_math.percent(costs['hfu'])}: {again} run again)" if costs["hfu"] is not None else "")
        + (f"; {steps} steps = {steps * costs['step_s'] / 3600:.1f} h" if steps else "")
    )
    if launch.gpu:
        lines.append(
            f"  {'fits' if costs['fits'] else 'does NOT fit'}: needs {costs['need'] / GIB:.1f} GiB of "
            f"{machine.gpu_memory_gib:g} GiB per GPU and {costs['host'] / GIB:.1f} GiB of "
            f"{machine.host_memory_gib:.1f} GiB host RAM"
        )
        sizes = [largest_micro_batch(c, cfg, launch, machine, base, chunk) for chunk in (cfg.loss_chunk_tokens, 0)]
        if cfg.loss_chunk_tokens:
            lines.append(
                f"  largest --micro_batch_size that fits: {sizes[0]} with the loss in chunks of "
                f"{cfg.loss_chunk_tokens} tokens, {sizes[1]} with the full logits (--loss_chunk_tokens 0)"
            )
        if not costs["fits"]:
            lines.append(f"  advice (train.py --plan --compare): {compare(c, cfg, launch, machine, base)[1]}")
    elif not costs["fits"]:
        lines.append(f"  does NOT fit: {costs['why']}")
    return lines, costs["fits"]


def largest_micro_batch(c, cfg, launch: Launch, machine: Machine, base: float, chunk: int) -> int:
    """The largest micro-batch (up to 1024) that fits the GPU with the loss in chunks of `chunk` tokens; 0: none."""
    run_cfg = dataclasses.replace(cfg, loss_chunk_tokens=chunk)
    for b in range(1, 1025):
        need = step_costs(c, run_cfg, launch, b, machine, base)["need"]
        if need > machine.gpu_memory_gib * GIB * FIT_FRACTION:
            return b - 1
    return 1024


def compare(c, cfg, launch: Launch, machine: Machine, base: float) -> tuple[list[str], str]:
    """One row per strategy (STRATEGIES) for this model, sequence and global batch on this launch's processes, each at
    the largest micro-batch that fits; and the recommendation: the fastest that fits, or what would make one fit."""
    per_process = cfg.micro_batch_size * launch.grad_accum_steps
    rows = [(s, *largest_fitting(c, cfg, with_strategy(launch, s, 1), machine, base, per_process)) for s in STRATEGIES]
    taken = {optimizer.pick(cfg, with_strategy(launch, s, 1)).optimizer for s in STRATEGIES}  # as largest_fitting
    header = (
        f"{'strategy (accelerate_configs/)':<31} {'micro x acc':>11} {'GPU GiB':>8} {'host GiB':>8} {'link GB':>8} "
        f"{'PCIe GB':>8} {'comp s':>7} {'link s':>7} {'copy s':>7} {'offl s':>7} {'optim s':>7} {'tokens/s':>9}  fits"
    )
    lines = [
        (
            f"compare: {c.model_type}, seq {cfg.seq_len}, {per_process * launch.world_size} sequences per step on "
            f"{launch.world_size} x {machine.gpu_memory_gib:g} GiB GPUs, {launch.precision}, checkpointing "
            f"{'on' if cfg.gradient_checkpointing else 'off'}, optimizer "
            f"{'auto: muon, adamw where offloaded' if len(taken) > 1 else min(taken)}; host "
            f"{machine.host_memory_gib:g} GiB; GPU link {machine.link_gb_s:g} GB/s ({machine.link_source}), PCIe "
            f"{machine.pcie_gb_s:g} GB/s, GPU memory {machine.memory_gb_s:g} GB/s, NVMe {machine.nvme_gb_s:g} GB/s; "
            f"compute at {machine.flops_per_device / 1e12:.3g} TFLOP/s per GPU "
            f"({machine.compute_source}); host Adam at {HOST_ADAM_GB_S:g} GB/s (assumed); traffic per process and "
            "optimizer step; DDP's link s: what its backward does not hide"
        ),
        header,
    ]
    for s, micro, k in rows:
        lines.append(
            f"{s.config:<31} {f'{micro} x {per_process // micro}':>11} {k['need'] / GIB:>8.1f} {k['host'] / GIB:>8.0f} "
            f"{k['traffic']['link'] / 1e9:>8.1f} {k['traffic']['pcie'] / 1e9:>8.1f} {k['compute_s']:>7.2f} "
            f"{k['comm_s']:>7.2f} {k['copies_s']:>7.2f} {k['offload_s']:>7.2f} "
            f"{k['host_adam_s'] + k['newton_schulz_s']:>7.2f} "
            f"{k['tokens_per_s']:>9,.0f}  " + ("yes" if k["fits"] else f"no: {k['why']}")
        )
    fitting = [(k["tokens_per_s"], s, micro, per_process // micro) for s, micro, k in rows if k["fits"]]
    if not fitting:
        advice = "nothing fits; " + what_would_fit(c, cfg, launch, machine, base, rows)
        return [*lines, f"recommended: {advice}"], advice
    # Parameter offload only where nothing else fits: its copies are synchronous per sub-module, which a bandwidth
    # count cannot see (DeepSpeed #3901 measured it 4.8x slower than ZeRO-3 on Falcon-7B); its row is optimistic.
    _, s, micro, accum = max(fitting, key=lambda row: (not row[1].offload_params, row[0]))
    advice = f"accelerate_configs/{s.config} --micro_batch_size {micro} --gradient_accumulation_steps {accum}"
    # accelerate launch passes --gradient_accumulation_steps on to DeepSpeed only, and drops
    # --offload_optimizer_nvme_path (Accelerate 1.15): the variables it would have set say both.
    accum_flag = f"--gradient_accumulation_steps {accum} " if s.zero_stage else ""
    env = "" if s.zero_stage else f"ACCELERATE_GRADIENT_ACCUMULATION_STEPS={accum} "
    if s.offload_optimizer == "nvme":
        env += "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH=/your/nvme/dir "
    return [
        *lines,
        f"recommended: {advice}",
        f"  {env}accelerate launch --config_file accelerate_configs/{s.config} {accum_flag}train.py "
        f"--model_config {cfg.model_config} --seq_len {cfg.seq_len} --micro_batch_size {micro}"
        + (" --gradient_checkpointing" if cfg.gradient_checkpointing else "")
        + " ...",
    ], advice


def what_would_fit(c, cfg, launch: Launch, machine: Machine, base: float, rows: list) -> str:
    """When no strategy fits: more host RAM, checkpointing or a shorter sequence, whichever would, with a strategy."""
    options = []
    gpu_only = [(k["host"], s) for s, _, k in rows if "GPU" not in k["why"]]
    if gpu_only:
        host, s = min(gpu_only, key=lambda row: row[0])
        options.append(f"{math.ceil(host / GIB / HOST_FIT_FRACTION)} GiB of host RAM ({s.config})")
    changes = [] if cfg.gradient_checkpointing else [("--gradient_checkpointing", {"gradient_checkpointing": True})]
    seq = cfg.seq_len // 2
    while seq >= 128:
        changes.append((f"--seq_len {seq}", {"seq_len": seq}))
        seq //= 2
    per_process = cfg.micro_batch_size * launch.grad_accum_steps
    for flag, change in changes:
        changed = dataclasses.replace(cfg, **change)
        fits = (
            (s, micro)
            for s in STRATEGIES
            for micro, k in [largest_fitting(c, changed, with_strategy(launch, s, 1), machine, base, per_process)]
            if k["fits"]
        )
        first = next(fits, None)
        if first:
            options.append(f"{flag} ({first[0].config} --micro_batch_size {first[1]})")
            break
    if not options:
        return "not even with full offload at micro-batch 1: more GPUs, or a smaller model"
    return "would fit with " + ", or ".join(options)
