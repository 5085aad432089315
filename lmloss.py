"""The next-token loss arithmetic train.py and eval.py share: summed NLL over scored targets, rolling windows over a
document and their batched scoring (eval.py), and the validation loss of a ZeRO-3 model over windows of a token
file, split over all processes (train.py)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

import cli
import token_data


def nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed negative log-likelihood in nats, number of scored targets); targets of -100 are not scored."""
    nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    return nll.double(), (targets != -100).sum().double()


@torch.no_grad()
def validation_loss(model, accelerator, tokens: np.ndarray, seq_len: int, micro_batch_size: int) -> float:
    """Mean next-token loss over non-overlapping windows of the validation tokens, split over all processes.

    Every process runs the same number of forward passes (ZeRO-3 gathers parameters collectively); a process with
    fewer windows pads with a repeat whose tokens carry no weight.
    """
    trained_trace = zero3_coordinator(model) is not None and zero3_coordinator(model).is_complete_trace()
    model.eval()
    n = token_data.num_windows(len(tokens), seq_len)
    mine = list(range(accelerator.process_index, n, accelerator.num_processes))
    per_rank = -(-n // accelerator.num_processes)
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for start in range(0, per_rank, micro_batch_size):
        chunk = [mine[i] if i < len(mine) else None for i in range(start, min(start + micro_batch_size, per_rank))]
        rows = torch.from_numpy(
            np.stack([token_data.window(tokens, w if w is not None else 0, seq_len) for w in chunk])
        )
        targets = rows[:, 1:].clone()
        targets[[i for i, w in enumerate(chunk) if w is None]] = -100
        logits = model(input_ids=rows[:, :-1].to(accelerator.device), use_cache=False).logits
        total += torch.stack(nll_sum(logits, targets.to(accelerator.device)))
    total = accelerator.reduce(total, "sum")
    model.train()
    if not trained_trace:  # a trace recorded by training already covers these forwards; one recorded here does not
        forget_zero3_eval_trace(model)
    return float(total[0] / total[1])


def zero3_coordinator(engine):
    """DeepSpeed ZeRO-3's parameter coordinator of a prepared model; None without ZeRO-3."""
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    return offload.get_param_coordinator() if offload is not None else None


def forget_zero3_eval_trace(engine) -> None:
    """Make ZeRO-3 forget what forward-only passes taught it, so that validation costs only its own time.

    DeepSpeed 0.19's parameter coordinator records the order of sub-module calls on one pass and, once that trace is
    complete, decides after each sub-module's forward which of its gathered parameters to release: those not used
    again in the trace. That decision (`__params_to_release`) is memoised with functools.lru_cache on (coordinator,
    sub-module, position) and the cache is never cleared when the trace is invalidated or re-recorded. Validation
    before the first training step records a forward-only trace, in which no parameter is used again, so every
    forward position is cached as "release". The trace is later re-recorded with the backward pass, but the cached
    answers stay: every step then releases each parameter after its forward and gathers it again, one by one, in
    backward (30 extra all-gathers per step for the mini preset, counted; 17% of the default run's speed on 3 CPU
    processes). Hence: after validation, invalidate the trace (the next training step records it again, forward and
    backward) and clear that cache. Validation after training steps needs neither: the trace training recorded
    covers its forwards, and their cached answers are training's. The upstream fix is to clear the cache whenever
    the trace changes. A no-op without ZeRO-3."""
    import inspect

    coordinator = zero3_coordinator(engine)
    if coordinator is None:
        return
    if not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()
    decide = type(coordinator)._PartitionedParameterCoordinator__params_to_release
    memoised = inspect.getclosurevars(decide).nonlocals.get("func", decide)  # under DeepSpeed's NVTX wrapper
    if hasattr(memoised, "cache_clear"):
        memoised.cache_clear()


def rolling_windows(n_tokens: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """Windows over a sequence s = [prefix] + tokens, where tokens sit at positions 1..n_tokens.

    Returns (input_start, first_scored, end): the model reads s[input_start:end - 1] (at most max_length tokens) and
    the targets s[first_scored:end] are scored. Each target is scored exactly once; window k scores `stride` new
    targets and sees up to max_length - stride more tokens of left context (the last window sees a full context).
    """
    windows = []
    for first in range(1, n_tokens + 1, stride):
        end = min(first + stride, n_tokens + 1)
        windows.append((max(0, end - 1 - max_length), first, end))
    return windows


def make_windows(
    docs: list[str], tokenizer, prefix: int, max_length: int, stride: int
) -> list[tuple[list[int], list[int]]]:
    """(input ids, targets with -100 for context-only positions) of every window of every document."""
    out = []
    for ids in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        seq = [prefix] + ids
        for start, first, end in rolling_windows(len(ids), max_length, stride):
            inputs = seq[start : end - 1]
            targets = [-100] * (first - 1 - start) + seq[first:end]
            out.append((inputs, targets))
    return out


def separable_head(model, device: torch.device):
    """The model's output layer when its logits are exactly output_layer(base_model(ids).last_hidden_state), checked on
    a probe input; else None (e.g. a model that caps or scales its logits). With it the loss is taken one window at a
    time, so a batch's logits (windows x tokens x vocabulary) never sit in memory at once."""
    head = model.get_output_embeddings()
    if head is None or model.base_model is model:
        return None
    probe = (torch.arange(8, device=device) % model.config.vocab_size)[None]
    try:
        split = head(model.base_model(input_ids=probe, use_cache=False).last_hidden_state)
    except (TypeError, ValueError, AttributeError):
        return None
    return head if torch.equal(split, model(input_ids=probe, use_cache=False).logits) else None


def batch_nll(model, head, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """nll_sum of a batch of windows; with a separable head, window by window over the last hidden states."""
    if head is None:
        return nll_sum(model(input_ids=inputs, use_cache=False).logits, targets)
    hidden = model.base_model(input_ids=inputs, use_cache=False).last_hidden_state
    parts = [nll_sum(head(h[None]), t[None]) for h, t in zip(hidden, targets)]
    return torch.stack([p[0] for p in parts]).sum(), torch.stack([p[1] for p in parts]).sum()


@torch.inference_mode()
def score_windows(
    model, windows: list, batch_size: int, device: torch.device, pad_id: int, progress: bool = True
) -> tuple[float, int]:
    """Total NLL and scored-token count over windows, batched by length. Padding goes on the right, where a causal
    model's earlier positions cannot see it, and its targets are -100."""
    head = separable_head(model, device)
    order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
    total_nll = torch.zeros((), dtype=torch.float64, device=device)
    total_n = torch.zeros((), dtype=torch.float64, device=device)
    for b in cli.progress_bar(
        iterable=range(0, len(order), batch_size), desc="scoring windows", unit="batch", disable=not progress
    ):
        batch = [windows[i] for i in order[b : b + batch_size]]
        width = len(batch[0][0])
        inputs = torch.tensor([w[0] + [pad_id] * (width - len(w[0])) for w in batch], device=device)
        targets = torch.tensor([w[1] + [-100] * (width - len(w[1])) for w in batch], device=device)
        nll, n = batch_nll(model, head, inputs, targets)
        total_nll += nll
        total_n += n
    return total_nll, total_n
