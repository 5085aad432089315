"""Which attention kernel and which MoE expert path a run takes, by device and dtype, and the document-masked kernel
that runs everywhere (varlen_sdpa).

Document masking (train.py's default) hands the model position ids that restart at each document
(lmloss.document_positions). What each kernel makes of them:
    flash_attention_2  transformers' packed-sequence path: flash-attn's varlen kernel over the documents (cu_seqlens
                       from the position ids); CUDA, fp16/bf16, the `flash_attn` package installed
    flex_attention     transformers' packed-sequence path: FlexAttention with a block mask built from the position ids,
                       which skips every 128 x 128 block outside the documents' causal triangles; CUDA (torch 2.13
                       refuses its backward on a CPU: "FlexAttention does not support backward on CPU")
    varlen_sdpa        this module: SDPA with is_causal run on each document alone, no mask at all (the kernels of
                       torch's causal fast path, no pair across documents computed); any device
    sdpa, eager        the dense fallback: transformers builds a (batch, 1, T, T) mask from the position ids, which
                       SDPA turns into a bias over all T^2 pairs (off its causal fast path, never flash)
Without document masking there is no mask to build: `auto` takes sdpa's causal path.
"""

from __future__ import annotations

import weakref

import torch

KERNELS = ("auto", "varlen_sdpa", "flex_attention", "flash_attention_2", "sdpa", "eager")
VARLEN = "varlen_sdpa"
# FlexAttention's block (torch.nn.attention.flex_attention._DEFAULT_SPARSE_BLOCK_SIZE): its block index is per block.
FLEX_BLOCK = 128


def choose(requested: str, device_type: str, precision: str, document_masking: bool, flash_installed: bool) -> str:
    """The kernel a run takes: `requested` unless it is auto, else the fastest that keeps documents apart without a
    dense mask on this device and dtype (see the module's docstring). Pure: the environment comes as arguments."""
    if requested != "auto":
        return requested
    if not document_masking:
        return "sdpa"
    if device_type == "cuda":
        return "flash_attention_2" if flash_installed and precision in ("fp16", "bf16") else "flex_attention"
    return VARLEN


def refusal(kernel: str, device_type: str, precision: str, flash_installed: bool) -> str | None:
    """Why `kernel` cannot train here (one `error:` line's text), or None."""
    if kernel not in KERNELS:
        return f"--attn_implementation {kernel!r} must be one of {', '.join(KERNELS)}"
    if kernel == "flex_attention" and device_type == "cpu":
        return ("--attn_implementation flex_attention cannot train on a CPU (torch refuses FlexAttention's backward "
                "there): use varlen_sdpa, or auto")  # fmt: skip
    if kernel == "flash_attention_2" and (device_type != "cuda" or not flash_installed or precision == "fp32"):
        return (f"--attn_implementation flash_attention_2 needs a CUDA GPU, fp16 or bf16 and the flash_attn package "
                f"(here: {device_type}, {precision}, flash_attn {'installed' if flash_installed else 'missing'}): use "
                "auto")  # fmt: skip
    return None


def describe(kernel: str, document_masking: bool) -> str:
    """The startup line: the kernel and what it does with the documents of a packed window."""
    if not document_masking:
        return f"attention: {kernel}, causal over the whole window (--no_document_masking: no mask)"
    what = {
        "flash_attention_2": "flash-attn's varlen kernel over each document (no mask)",
        "flex_attention": f"FlexAttention, a block mask from the position ids ({FLEX_BLOCK}-token blocks outside "
        "the documents skipped)",
        VARLEN: "SDPA's causal kernel on each document alone (no mask, nothing across documents computed)",
        "sdpa": "a dense (batch, 1, T, T) document mask: the fallback, every pair computed and masked",
        "eager": "a dense (batch, 1, T, T) document mask and T x T scores per head: the fallback",
    }[kernel]
    return f"attention: {kernel}, {what}"


def mask_bytes(kernel: str, micro_batch_size: int, seq_len: int, document_masking: bool, act_bytes: int,
               layers: int, gradient_checkpointing: bool) -> int:  # fmt: skip
    """Memory of what a kernel keeps to mask documents, per process: the dense fallback's boolean (b, 1, T, T) mask
    built once per forward, plus the float bias SDPA derives from it and keeps for backward in every layer (one layer
    at a time with checkpointing); FlexAttention's block index (4 int32 tensors of b x (T / 128)^2, full and partial
    blocks, forward and transposed); the varlen kernels' position ids (b x T int64). Nothing without masking."""
    b, t = micro_batch_size, seq_len
    if not document_masking:
        return 0
    if kernel in ("sdpa", "eager"):
        return b * t * t + b * t * t * act_bytes * (1 if gradient_checkpointing else layers)
    if kernel == "flex_attention":
        blocks = -(-t // FLEX_BLOCK)
        return 4 * b * blocks * blocks * 4
    return b * t * 8


# --- varlen_sdpa: SDPA on each document alone ------------------------------------------------------------------------

_segments: dict = {"of": None, "rows": None}  # the last position ids' documents: computed once per forward


def _documents(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) of each document: a new one wherever a position is not its predecessor's + 1
    (transformers' rule for packed sequences, masking_utils.find_packed_sequence_indices)."""
    cached = _segments["of"]
    if cached is not None and cached() is position_ids:
        return _segments["rows"]
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    length = position_ids.shape[1]
    rows = []
    for row in starts.tolist():  # one host read per forward
        first = [i for i, s in enumerate(row) if s]
        rows.append(list(zip(first, first[1:] + [length])))
    _segments["of"], _segments["rows"] = weakref.ref(position_ids), rows
    return rows


def varlen_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                        **kwargs):  # fmt: skip
    """transformers' attention interface: (batch, heads, T, d) in, (batch, T, heads, d_v) out. A window's documents
    (from kwargs' position_ids) each attend causally to themselves through SDPA's is_causal path; anything else a
    caller asks (a mask, a cache, one query token) goes to transformers' own sdpa."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    plain = attention_mask is not None or query.shape[2] != key.shape[2] or query.shape[2] == 1
    if plain or position_ids is None or not getattr(module, "is_causal", True):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    # One output in the layout transformers wants, each document's result written into its slice: no copy of the
    # whole beyond what SDPA's own causal path makes (its output, then that output made contiguous).
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
    rows = _documents(position_ids)  # keyed on the model's own tensor (an expanded view is new each call)
    rows = rows * query.shape[0] if len(rows) == 1 else rows  # one row of positions broadcast over the batch
    for b, documents in enumerate(rows):
        for s, e in documents:
            # 4-D slices: on a CPU, 3-D ones leave SDPA's flash kernel for its math path (a T x T matrix per head)
            q, k, v = query[b : b + 1, :, s:e], key[b : b + 1, :, s:e], value[b : b + 1, :, s:e]
            part = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True, scale=scaling
            )
            out[b : b + 1, s:e] = part.transpose(1, 2)
    return out, None


def _no_mask(*args, **kwargs):
    """varlen_sdpa's mask interface for the packed training forward (no padding, no cache): none, the documents come
    from the position ids; any other call gets sdpa's mask."""
    from transformers.masking_utils import sdpa_mask

    padded = kwargs.get("attention_mask") is not None
    offset = kwargs.get("q_offset", 0) or kwargs.get("kv_offset", 0)
    if padded or offset or kwargs.get("q_length") != kwargs.get("kv_length"):
        return sdpa_mask(*args, **kwargs)
    return None


def register() -> None:
    """Make `varlen_sdpa` a name transformers' from_config / from_pretrained accept (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_sdpa_forward)
    AttentionMaskInterface.register(VARLEN, _no_mask)


def flash_installed() -> bool:
    """Whether flash-attn's kernels can be imported here."""
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


# --- MoE experts -------------------------------------------------------------------------------------------------------


def expert_path(device_type: str, capability: tuple[int, int] | None, precision: str, has_grouped_mm: bool) -> tuple:
    """(name, what it costs) of the matmuls of a MoE layer's routed experts under transformers' grouped_mm experts
    (integrations/moe.py, its default): torch's grouped_mm from compute capability 8.0, whose fast CUTLASS kernel takes
    bf16 on sm90/sm100 (H100, B200) only; elsewhere torch loops over the experts, and below 8.0 transformers does.
    Pure: the device's capability comes as an argument (None on a CPU)."""
    if not has_grouped_mm:
        return "loop", "one matmul per expert (transformers' loop; this torch has no grouped_mm)"
    if device_type == "cpu":
        return "grouped_mm (CPU)", "torch's CPU grouped_mm: one matmul per expert, no host sync"
    if device_type != "cuda" or capability is None:
        return "grouped_mm", f"torch's grouped_mm on {device_type}"
    if capability < (8, 0):
        return "loop", (f"sm{capability[0]}{capability[1]} is below 8.0: transformers loops over the experts, one "
                        "matmul each and a device-to-host read of the offsets per grouped matmul (3 per MoE layer "
                        "and pass)")  # fmt: skip
    if capability[0] in (9, 10) and precision == "bf16":
        return "grouped_mm (fast)", "one CUTLASS grouped GEMM per projection (bf16 on sm90/sm100)"
    why = "fp16/fp32 weights" if precision != "bf16" else f"sm{capability[0]}{capability[1]}"
    return "grouped_mm (loop)", (f"torch's grouped_mm without its fast kernel ({why}; it needs bf16 on sm90/sm100): "
                                 "one matmul per expert and a device-to-host read of the offsets per call; bf16 on an "
                                 "H100/B200 takes the fast one")  # fmt: skip


def cuda_capability() -> tuple[int, int] | None:
    """This machine's first GPU's compute capability, None without one."""
    return torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None


def describe_experts(model_config, device: torch.device, precision: str) -> str | None:
    """The startup line of a MoE model's expert path on this device and precision; None for a dense model."""
    if not getattr(model_config, "n_routed_experts", 0):
        return None
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    has = hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")
    name, cost = expert_path(device.type, capability, precision, has)
    return f"MoE experts: {name}, {cost}"
