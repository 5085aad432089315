"""An exponential moving average of the weights (train.py --ema_decay): after every optimizer step that was taken,
    ema = decay * ema + (1 - decay) * w
in fp32, for every trainable parameter (the MTP modules' too), kept where the weights are: under ZeRO-3 each process
holds the average of its own partition (model/weights.local_weights), so it costs 4 bytes per parameter divided by the
processes and no communication; elsewhere every process holds it whole. It starts at the weights of the first step
it sees (a fresh run's initial weights; a run resumed from a checkpoint that had none: the resumed weights, said so).
A skipped step (a non-finite loss or gradient) does not move it.

It is checkpoint state (train.py's checkpoint_state): saved with every checkpoint, per process under ZeRO-3, and cut
again on another number of processes (`reshard`), so a resume is exact. At the end train.py exports it as a
Hugging Face model directory, OUT/final_ema, beside OUT/final; eval.py scores it like any model.
"""

from __future__ import annotations

import torch

from deepseek_zero3.model import weights


class EMA:
    def __init__(self, model, decay: float):
        self.decay = decay
        self.model = model
        self.sharded = weights.is_sharded(model)  # checkpoint_state: saved per process, resharded on load
        self.numel = weights.full_numel(model)
        self.average = {name: w.detach().float().clone() for name, w in weights.local_weights(model)}
        self.updates = 0

    @torch.no_grad()
    def restart(self) -> None:
        """Start again from the weights as they are now (run_dir/state.py: a resumed checkpoint that holds no EMA)."""
        for name, w in weights.local_weights(self.model):
            self.average[name].copy_(w.float())
        self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        """After the update line: move the average toward the weights just written."""
        for name, w in weights.local_weights(self.model):
            self.average[name].lerp_(w.float(), 1 - self.decay)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"average": self.average, "updates": self.updates, "decay": self.decay}

    def load_state_dict(self, state: dict) -> None:
        missing = set(self.average) ^ set(state["average"])
        if missing:
            raise ValueError(f"the checkpoint's EMA has other parameters: {sorted(missing)[:3]}")
        for name, tensor in state["average"].items():
            if tensor.shape != self.average[name].shape:
                raise ValueError(f"the checkpoint's EMA of {name} has shape {tuple(tensor.shape)}, this model "
                                 f"{tuple(self.average[name].shape)}")  # fmt: skip
            self.average[name].copy_(tensor)
        self.updates = int(state["updates"])

    def reshard(self, states: list[dict], rank: int, world: int) -> dict:
        """The state of this process out of the states the processes of another launch saved (in rank order)."""
        average = {name: weights.repartition([s["average"][name] for s in states], self.numel[name], rank, world)
                   for name in states[0]["average"]}  # fmt: skip
        return {"average": average, "updates": states[0]["updates"], "decay": states[0]["decay"]}

    def whole(self, main_process: bool) -> dict[str, torch.Tensor]:
        """Every parameter's average, whole, on the CPU, in the model's parameter names, on the main process ({} on the
        others). Collective under ZeRO-3: every process calls it; one parameter is gathered at a time."""
        shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in
                  weights.core_model(self.model).named_parameters()}  # fmt: skip
        whole = {}
        for name, average in self.average.items():
            tensor = weights.gather_whole(average, self.numel[name], shapes[name], self.sharded)
            if main_process:
                whole[name] = tensor.cpu()
        core = weights.core_model(self.model)
        first = {id(p): n for n, p in reversed(list(core.named_parameters(remove_duplicate=False)))}
        for name, p in core.named_parameters(remove_duplicate=False):  # a tied weight under each of its names
            if main_process and name not in whole and first[id(p)] in whole:
                whole[name] = whole[first[id(p)]]
        return whole
