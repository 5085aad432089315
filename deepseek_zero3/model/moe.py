"""DeepSeek-V3's load balancing for DeepseekV3ForCausalLM (DeepSeek-V3 technical report, section 2.1.2), which the
model itself leaves to the trainer.

- Auxiliary-loss-free balancing: each MoE layer's router adds a per-expert bias to its scores when it chooses experts
  (`e_score_correction_bias`, a buffer). After every optimizer step the bias moves by `speed`: down for experts that
  got more than the mean load, up for those that got less. Loads are counted over the whole global batch (summed over
  micro-steps and all-reduced over processes), so every process applies the same update and holds the same bias;
  ZeRO-3 does not partition buffers, so nothing else would keep them equal. An fp32 master copy is what moves (a
  16-bit buffer would round away steps of 0.001) and what checkpoints save.
- The sequence-wise auxiliary loss, alpha * sum_i f_i P_i per sequence: f_i = N_r / (K_r T) x the number of the
  sequence's tokens that chose expert i, P_i = the mean over its tokens of the expert's normalised affinity.
- MaxVio = max load / mean load - 1 per layer and step (the report's measure of imbalance).

Loads and the auxiliary loss are taken by forward hooks on the routers, only inside `collecting()`: the training
forward, not validation and not the forward that gradient checkpointing recomputes during backward (which builds the
same graph, unrecorded).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def routers(model) -> list:
    """The MoE routers of a model, in layer order: modules with DeepSeek-V3's `e_score_correction_bias`."""
    return [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]


class LoadBalancer:
    def __init__(self, model, speed: float, alpha: float):
        self.routers = routers(model)
        self.speed, self.alpha = speed, alpha
        first = self.routers[0]
        self.n_experts, self.top_k = first.num_experts, first.top_k
        self.bias = torch.stack([r.e_score_correction_bias.detach().float() for r in self.routers])  # --init_from's
        self.loads = torch.zeros_like(self.bias)
        self.aux_terms: list[torch.Tensor] = []
        self.interval = {"maxvio": []}
        self._collecting = False
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    @contextlib.contextmanager
    def collecting(self):
        self._collecting = True
        try:
            yield
        finally:
            self._collecting = False

    def _hook(self, layer: int):
        def hook(module, args, output):
            # The loss's graph is built whenever gradients are on, recorded only inside collecting(): the forward that
            # gradient checkpointing recomputes in backward must save the tensors the original forward saved, or
            # torch stops the backward (CheckpointError: a different number of tensors was saved).
            build = self.alpha > 0 and torch.is_grad_enabled()
            if not (self._collecting or build):
                return
            router_logits, _, topk_indices = output
            chosen = F.one_hot(topk_indices, self.n_experts).sum(1).float()  # tokens x experts, 0/1
            if self._collecting:
                self.loads[layer] += chosen.sum(0).detach()
            if build:
                batch, seq_len = args[0].shape[:2]
                scores = router_logits.float().sigmoid()
                affinity = (scores / scores.sum(-1, keepdim=True)).view(batch, seq_len, -1).mean(1)  # P_i
                share = chosen.view(batch, seq_len, -1).sum(1) * self.n_experts / (self.top_k * seq_len)  # f_i
                term = (share * affinity).sum(-1).mean()
                if self._collecting:
                    self.aux_terms.append(term)

        return hook

    def aux_loss(self) -> torch.Tensor | None:
        """The auxiliary loss of the forward passes collected since the last call (None when alpha is 0)."""
        if self.alpha == 0 or not self.aux_terms:
            self.aux_terms.clear()
            return None
        loss = self.alpha * torch.stack(self.aux_terms).sum()
        self.aux_terms.clear()
        return loss

    def update(self, accelerator) -> None:
        """After an optimizer step: the global batch's loads, MaxVio, and the bias step."""
        loads = accelerator.reduce(self.loads, "sum")
        mean = loads.mean(-1, keepdim=True)
        self.interval["maxvio"].append(loads.max(-1).values / mean.squeeze(-1) - 1)
        self.bias += self.speed * torch.sign(mean - loads)
        self._write_bias()
        self.loads.zero_()

    def metrics(self, accelerator) -> dict:
        """MaxVio of the worst layer and the mean over layers, averaged over the steps since the last call (the balance
        loss is one of train.py's lm_loss terms, logged with the others)."""
        maxvio = torch.stack(self.interval["maxvio"]).mean(0)
        self.interval = {"maxvio": []}
        return {"moe_maxvio_max": float(maxvio.max()), "moe_maxvio_mean": float(maxvio.mean())}

    def _write_bias(self) -> None:
        for router, bias in zip(self.routers, self.bias):
            router.e_score_correction_bias.copy_(bias)

    # Saved with every checkpoint (accelerator.register_for_checkpointing) and restored by accelerator.load_state.
    def state_dict(self) -> dict:
        return {"bias": self.bias.clone(), "loads": self.loads.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.bias.copy_(state["bias"])
        self.loads.copy_(state["loads"])
        self._write_bias()
