"""DeepSeek LLM's scaling laws (arXiv:2401.02954, Section 3), applied to a planned run: the compute budget C, the
optimal peak LR and global batch for that C, and the compute-optimal split of C into model scale and tokens.

The paper's definitions, as fitted (dense models, its data):
    model scale  M = 72 n_layer d_model^2 + 12 n_layer d_model l_seq   non-embedding FLOPs per token, attention
                                                                       included (Eq. 2)
    compute      C = M D                                               D: training tokens (Section 3.2)
    hyper-       eta_opt = 0.3118 C^-0.1250                            peak learning rate (Eq. 1)
    parameters   B_opt   = 0.2920 C^0.3271                             global batch, in tokens (Eq. 1)
    scale        M_opt = 0.1715 C^0.5243,  D_opt = 5.8316 C^0.4757     (Eq. 4)
Checked against the paper's Table 2 (tests/test_recipe.py): for DeepSeek LLM 7B (30 layers, d_model 4096, 4096-token
context, 2T tokens) Eq. 1 gives 4.25e-4 and 9.2M tokens, the table 4.2e-4 and 2304 x 4096 = 9.4M; for 67B (95 layers,
8192) 3.1e-4 and 20.6M tokens, the table 3.2e-4 and 4608 x 4096 = 18.9M.
"""

from __future__ import annotations

from deepseek_zero3.planning.model_math import is_moe

OFF_BY = 2.0  # a run's LR or batch further than this factor from the optimum gets a line of advice


def model_scale(n_layers: int, d_model: int, seq_len: int) -> float:
    """M, non-embedding FLOPs per token (Eq. 2)."""
    return 72 * n_layers * d_model**2 + 12 * n_layers * d_model * seq_len


def optimal_lr(compute: float) -> float:
    return 0.3118 * compute**-0.1250  # Eq. 1


def optimal_batch_tokens(compute: float) -> float:
    return 0.2920 * compute**0.3271  # Eq. 1


def optimal_scale(compute: float) -> tuple[float, float]:
    """(M_opt in FLOPs per token, D_opt in tokens), Eq. 4."""
    return 0.1715 * compute**0.5243, 5.8316 * compute**0.4757


def off(ours: float, best: float) -> str:
    ratio = ours / best
    return f"{ratio:.2g}x" if ratio >= 1 else f"1/{1 / ratio:.2g}"


def deepseek_lines(model_config, seq_len: int, lr: float, tokens_per_step: int, total_steps: int) -> list[str]:
    """The plan's lines for a run of total_steps steps of tokens_per_step tokens at peak `lr`."""
    head = "DeepSeek LLM's scaling laws (arXiv:2401.02954 Sec. 3)"
    if is_moe(model_config):
        return [f"{head}: fitted on dense models, not shown for a MoE model"]
    if total_steps <= 0:
        return [f"{head}: give --max_steps to see the optimal LR and batch for this run's compute"]
    m = model_scale(model_config.num_hidden_layers, model_config.hidden_size, seq_len)
    tokens = total_steps * tokens_per_step
    compute = m * tokens
    best_lr, best_batch = optimal_lr(compute), optimal_batch_tokens(compute)
    best_m, best_d = optimal_scale(compute)
    lines = [
        f"{head}: compute C = M x D = {m:.3g} FLOP/token (M, non-embedding, Eq. 2) x {tokens:.3g} tokens = "
        f"{compute:.3g} FLOPs",
        f"  optimal for this C (Eq. 1): peak LR {best_lr:.3g} (this run: {lr:.3g}), global batch "
        f"{best_batch:,.0f} tokens (this run: {tokens_per_step:,})",
        f"  compute-optimal split of C (Eq. 4): M {best_m:.3g} FLOP/token and D {best_d:.3g} tokens (this run: "
        f"{m:.3g} and {tokens:.3g})",
    ]
    for name, ours, best in (("peak LR", lr, best_lr), ("global batch", tokens_per_step, best_batch)):
        if not 1 / OFF_BY <= ours / best <= OFF_BY:
            lines.append(f"  advice: this run's {name} is {off(ours, best)} the paper's optimum for its compute")
    return lines
