"""Model arithmetic without building the model: parameter counts (dense and MoE), training FLOPs per token (the model's,
what MFU counts, and the hardware's with recomputation, what HFU counts), activations per token, and the GPUs'
datasheet peaks."""

from __future__ import annotations

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


def head_dim(c) -> int:
    """A dense (Llama, Qwen3) config's per-head width: its head_dim, hidden_size / num_attention_heads where it has
    none."""
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def dense_widths(c) -> tuple[int, int]:
    """A dense attention's query width (heads x head_dim; o_proj's input) and key/value width (its key/value heads x
    head_dim), which a head_dim of the config's own sets apart from hidden_size."""
    return c.num_attention_heads * head_dim(c), c.num_key_value_heads * head_dim(c)


def has_qk_norm(c) -> bool:
    """Whether a dense config has QK-norm: transformers' Qwen3, what a llama config's "qk_norm": true builds."""
    return getattr(c, "model_type", "") == "qwen3"


def llama_param_counts(c) -> dict:
    """Parameter counts of a dense (Llama/DeepSeek LLM, or Qwen3: Llama with QK-norm) config without building it:
    total, non-embedding, largest tensor. A layer: q, k, v and o projections, the MLP's gate, up and down, two norms;
    with its switches, the attention's biases (attention_bias: q, k, v and o), the MLP's (mlp_bias: gate, up, down) and
    QK-norm's two head_dim weights; the output layer unless tied (tie_word_embeddings)."""
    h, v, f, n_layers = c.hidden_size, c.vocab_size, c.intermediate_size, c.num_hidden_layers
    q, kv = dense_widths(c)
    layer = 2 * h * q + 2 * h * kv + 3 * h * f + 2 * h
    layer += (q + 2 * kv + h) * bool(getattr(c, "attention_bias", False))
    layer += (2 * f + h) * bool(getattr(c, "mlp_bias", False))
    layer += 2 * head_dim(c) * has_qk_norm(c)
    embed = v * h
    head = 0 if c.tie_word_embeddings else v * h
    total = embed + head + n_layers * layer + h
    return {"total": total, "non_embedding": total - embed, "largest_tensor": max(embed, h * f, h * q),
            "per_layer": layer, "mtp_layer": layer, "mtp_layer_activated": layer}  # fmt: skip


def flops_per_token(n_params_non_embedding: int, n_layers: int, hidden_size: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 N + 12 L H T (PaLM appendix B; nanoGPT)."""
    return 6 * n_params_non_embedding + 12 * n_layers * hidden_size * seq_len


def is_moe(c) -> bool:
    return getattr(c, "model_type", "") == "deepseek_v3"


def mtp_depth(cfg, c) -> int:
    """The MTP modules a run of train.py's Config (cfg) trains on config c (mtp.depth_of)."""
    from deepseek_zero3.model.mtp import depth_of

    return depth_of(getattr(cfg, "mtp_depth", -1), c)


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
        "mtp_layer": attention + moe_total,  # an MTP module's block: a MoE layer (its index is past the dense ones)
        "mtp_layer_activated": attention + moe_active,
    }


def param_counts(c, mtp_depth: int = 0) -> dict:
    """total, non_embedding, activated (per token), activated_non_embedding and largest_tensor of a model config, with
    `mtp_depth` MTP modules (mtp.py: each its block, eh_proj and three norms; the embedding and head are the main
    model's), whose parameters are also counted alone as `mtp`."""
    counts = deepseek_v3_param_counts(c) if is_moe(c) else llama_param_counts(c)
    counts.setdefault("activated", counts["total"])
    counts.setdefault("activated_non_embedding", counts["non_embedding"])
    h = c.hidden_size
    own = 2 * h * h + 3 * h
    counts["mtp"] = mtp_depth * (counts.pop("mtp_layer") + own)
    activated = mtp_depth * (counts.pop("mtp_layer_activated") + own)
    for key in ("total", "non_embedding"):
        counts[key] += counts["mtp"]
    for key in ("activated", "activated_non_embedding"):
        counts[key] += activated
    return counts


def muon_matrices(c, mtp_depth: int = 0) -> list[tuple[int, int, int]]:
    """The matrices Muon updates (recipe/optimizer.py: every 2-D or 3-D weight but the embedding and the output layer),
    as (how many, rows, cols): a MoE layer's fused expert tensors count one matrix per expert."""
    h = c.hidden_size

    def mlp(width: int) -> list:
        return [(2, width, h), (1, h, width)]  # gate and up, down

    if not is_moe(c):
        q, kv = dense_widths(c)
        layer = [(1, q, h), (2, kv, h), (1, h, q), *mlp(c.intermediate_size)]
        return [(n * (c.num_hidden_layers + mtp_depth), r, k) for n, r, k in layer] + [(mtp_depth, h, 2 * h)]
    heads, qk = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    q = [(1, c.q_lora_rank, h), (1, heads * qk, c.q_lora_rank)] if c.q_lora_rank else [(1, heads * qk, h)]
    attention = [*q, (1, c.kv_lora_rank + c.qk_rope_head_dim, h),
                 (1, heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), (1, h, heads * c.v_head_dim)]
    i, experts = c.moe_intermediate_size, c.n_routed_experts
    moe = [(experts, 2 * i, h), (experts, h, i), *mlp(i * c.n_shared_experts), (1, experts, h)]  # fmt: skip
    n_dense = min(c.first_k_dense_replace, c.num_hidden_layers)
    n_moe = c.num_hidden_layers - n_dense + mtp_depth
    return ([(n * c.num_hidden_layers, r, k) for n, r, k in attention] + [(n * n_dense, r, k) for n, r, k in
            mlp(c.intermediate_size)] + [(n * n_moe, r, k) for n, r, k in moe]
            + [(n * mtp_depth, r, k) for n, r, k in attention] + [(mtp_depth, h, 2 * h)])  # fmt: skip


def muon_params(c, mtp_depth: int = 0) -> int:
    return sum(n * r * k for n, r, k in muon_matrices(c, mtp_depth))


def newton_schulz_flops(c, mtp_depth: int = 0, steps: int = 5) -> float:
    """FLOPs of Muon's orthogonalisation per optimizer step: `steps` quintic Newton-Schulz iterations on each matrix
    (m <= n its sides): X X^T (2 m^2 n), b A + c A^2 (2 m^3), B X (2 m^2 n). DeepSpeed's Gram variant, on matrices
    far from square, does fewer; this is the standard iteration's count."""
    total = 0.0
    for n_mat, r, k in muon_matrices(c, mtp_depth):
        m, n = min(r, k), max(r, k)
        total += n_mat * steps * (4 * m * m * n + 2 * m**3)
    return total


def model_flops_per_token(c, seq_len: int, mtp_depth: int = 0) -> float:
    """Training FLOPs per token of a config, what MFU counts (PaLM's model FLOPs, Chowdhery et al. 2022, appendix B):
    6 x activated non-embedding parameters (a MoE layer counts only the experts a token goes to) + 6 L T x the
    attention's query-key and value widths (12 L H T for Llama, whose widths are heads x head_dim = H; MLA's per-head
    query-key width is qk_nope + qk_rope, its value width v_head_dim). The attention term is PaLM's and nanoGPT's:
    every one of the T x T query-key pairs, not the causal half a kernel that skips the masked blocks computes, so MFU
    compares with theirs. Each MTP module adds its block as one more layer and one more use of the output layer (the
    head's vocab x hidden matmul, per depth). No recomputation (hardware_flops_per_token adds it) and no optimizer work (Muon's Newton-Schulz is
    newton_schulz_flops): the same model and tokens give the same FLOPs however they are trained."""
    counts = param_counts(c, mtp_depth)
    if is_moe(c):
        widths = c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    else:
        widths = 2 * dense_widths(c)[0]
    layers = c.num_hidden_layers + mtp_depth
    heads = mtp_depth * c.vocab_size * c.hidden_size
    return 6 * (counts["activated_non_embedding"] + heads) + 6 * layers * seq_len * widths


def checkpointed_flops_per_token(c, seq_len: int, mtp_depth: int = 0) -> float:
    """FLOPs per token that activation checkpointing runs again in backward: the forward of every decoder layer (and
    of each MTP module's block, which gradient_checkpointing_enable reaches too) but its last matmul, the MLP's down
    projection (the shared experts' in a MoE layer): torch's non-reentrant checkpoint stops recomputing once the
    tensors backward needs are back, and nothing saves that projection's output, which only the residual adds. Only
    matmuls: a layer's forward is 2 x its matmul weights (the norms' are none) + 2 T x the attention widths.
    tests/test_mfu.py checks this against torch's FLOP counter on the dense and the MoE + MTP presets."""
    h = c.hidden_size
    if not is_moe(c):
        q, kv = dense_widths(c)
        weights = 2 * h * q + 2 * h * kv + 3 * h * c.intermediate_size
        return (c.num_hidden_layers + mtp_depth) * (2 * weights + 4 * seq_len * q - 2 * h * c.intermediate_size)
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    q = h * c.num_attention_heads * qk if not c.q_lora_rank else (h + c.num_attention_heads * qk) * c.q_lora_rank
    kv = h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * c.num_attention_heads * (
        c.qk_nope_head_dim + c.v_head_dim)  # fmt: skip
    attention = 2 * (q + kv + c.num_attention_heads * c.v_head_dim * h)
    attention += 2 * seq_len * c.num_attention_heads * (qk + c.v_head_dim)
    i = c.moe_intermediate_size
    routed = c.num_experts_per_tok * 3 * h * i + c.n_routed_experts * h  # with the router
    moe = attention + 2 * (routed + c.n_shared_experts * 3 * h * i) - 2 * h * c.n_shared_experts * i
    dense = attention + 2 * 3 * h * c.intermediate_size - 2 * h * c.intermediate_size
    n_dense = min(c.first_k_dense_replace, c.num_hidden_layers)
    return n_dense * dense + (c.num_hidden_layers - n_dense + mtp_depth) * moe


def loss_recomputed_flops_per_token(c, micro_tokens: int, chunk_tokens: int, mtp_depth: int = 0) -> float:
    """FLOPs per token the loss in chunks (lmloss.ChunkedLinearNLL) runs again in backward: the logits of every chunk
    of the micro-step's `micro_tokens` rows but the last (2 V h a row), for the main loss and each MTP depth's. None
    for the full logits (chunk_tokens 0) or a micro-step of one chunk."""
    if not chunk_tokens or micro_tokens <= chunk_tokens:
        return 0.0
    last = micro_tokens - chunk_tokens * ((micro_tokens - 1) // chunk_tokens)
    return 2 * c.vocab_size * c.hidden_size * (1 + mtp_depth) * (micro_tokens - last) / micro_tokens


def hardware_flops_per_token(c, seq_len: int, mtp_depth: int, checkpointing: bool, micro_tokens: int,
                             chunk_tokens: int) -> float:  # fmt: skip
    """The FLOPs per token the hardware runs, what HFU counts (PaLM's hardware FLOPs: with rematerialisation): the model
    FLOPs, the recomputed forward of checkpointed layers (checkpointing) and the chunked loss's recomputed logits.
    What a fused kernel recomputes inside itself (FlashAttention's backward its score matrix) is the kernel's own and
    not counted, as in Megatron's and torchtitan's HFU."""
    recomputed = checkpointed_flops_per_token(c, seq_len, mtp_depth) if checkpointing else 0.0
    recomputed += loss_recomputed_flops_per_token(c, micro_tokens, chunk_tokens, mtp_depth)
    return model_flops_per_token(c, seq_len, mtp_depth) + recomputed


def run_hardware_flops(cfg, c, depth: int, micro_batch_size: int) -> float:
    """hardware_flops_per_token of a run of train.py's Config (cfg) at a micro-batch."""
    return hardware_flops_per_token(c, cfg.seq_len, depth, cfg.gradient_checkpointing, micro_batch_size * cfg.seq_len,
                                    cfg.loss_chunk_tokens)  # fmt: skip


def recomputed(cfg, c, depth: int, micro_batch_size: int) -> str:
    """What a run of train.py's Config (cfg) recomputes, in words ("" for nothing)."""
    loss = loss_recomputed_flops_per_token(c, micro_batch_size * cfg.seq_len, cfg.loss_chunk_tokens, depth)
    return " and ".join((["the checkpointed layers' forward"] if cfg.gradient_checkpointing else [])
                        + ([f"the loss's logits (--loss_chunk_tokens {cfg.loss_chunk_tokens})"] if loss else []))


def activations_per_token(c, seq_len: int, attn: str, mtp_depth: int = 0) -> list[int]:
    """Values saved for backward per token, layer by layer (see memory_plan). DeepSeek-V3 layers: the two norm
    inputs, attention input, q and rotated q, the compressed kv, expanded k and v, attention output (MLA), then the
    MLP input and gate, up, SiLU and product of every expert the token goes to, and the router's scores. An MTP
    module: its block as the last layer's, and its embedding, two norms' inputs and projection input (5 h)."""
    layers = _layer_activations(c, seq_len, attn)
    return layers + [layers[-1] + 5 * c.hidden_size] * mtp_depth


def _layer_activations(c, seq_len: int, attn: str) -> list[int]:
    h, a = c.hidden_size, c.num_attention_heads
    eager = 2 * a * seq_len if attn == "eager" else 0
    if not is_moe(c):
        q, kv = dense_widths(c)
        qk_norm = (q + kv) * has_qk_norm(c)  # the normalised q and k, beside the projections' outputs
        return [4 * h + 3 * q + 3 * kv + qk_norm + 4 * c.intermediate_size + eager] * c.num_hidden_layers
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
    """The share of the peak a run reaches: MFU with model_flops_per_token, HFU with hardware_flops_per_token."""
    return tokens_per_s * flops_per_tok / peak_flops


def percent(share: float) -> str:
    """A utilisation as the plan and the console print it: 3 significant digits (35.4%, and 0.119% for a tiny model
    on a CPU, which one decimal would round to nothing)."""
    return f"{100 * share:.3g}%"


def gpu_peak_flops(device_name: str, precision: str) -> float | None:
    """Datasheet 16-bit peak of a known GPU for fp16/bf16 runs; None (time a matmul instead) for fp32 or unknown."""
    if precision not in ("fp16", "bf16"):
        return None
    matches = [key for key in GPU_PEAK_FLOPS if key in device_name]
    return GPU_PEAK_FLOPS[max(matches, key=len)] if matches else None
