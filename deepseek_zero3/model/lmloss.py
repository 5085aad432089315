"""The next-token loss arithmetic train.py and eval.py share: summed NLL over scored targets, the loss of a model's
forward with its output layer taken a chunk of tokens at a time (model_nll: training, validation and scoring), rolling
windows over a document and their batched scoring (eval.py), and the validation loss of a ZeRO-3 model over windows of
a token file, split over all processes (train.py)."""

from __future__ import annotations

import contextlib
import weakref

import numpy as np
import torch
import torch.nn.functional as F

from deepseek_zero3 import cli
from deepseek_zero3.model import mtp
from deepseek_zero3.training_data import token_data

# Tokens per chunk of the output layer + cross-entropy (train.py's --loss_chunk_tokens default, eval.py's windows).
# Measured in BENCHMARKS.md (loss_memory): a chunk's fp32 logits are chunk x vocab x 4 bytes (1024 x 102,400: 0.4 GB).
DEFAULT_CHUNK_TOKENS = 1024
# Whether a model's logits are its output layer's result, unchanged (checked on its first call to model_nll).
_plain: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (a first batch that overflows must not pass for a transformed output)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed negative log-likelihood in nats, number of scored targets); targets of -100 are not scored."""
    nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    return nll.double(), (targets != -100).sum().double()


def document_positions(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Position ids that restart at 0 at each document's first token: the window's first token and every token after
    an EOS (prepare_data.py appends one to each document, so the EOS closes its document). Handed to a transformers
    model with no attention mask, they make its attention block-causal, each token seeing only its own document
    (model/attention.py: varlen_sdpa per document, transformers' packed-sequence paths for flash-attn's varlen kernel
    and FlexAttention, a dense mask for sdpa and eager)."""
    index = torch.arange(inputs.shape[-1], device=inputs.device).expand_as(inputs)
    starts = torch.ones_like(inputs, dtype=torch.bool)
    starts[..., 1:] = inputs[..., :-1] == eos_id
    return index - torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values


def validation_loss(model, accelerator, tokens, seq_len, micro_batch_size, chunk_tokens=DEFAULT_CHUNK_TOKENS,
                    eos_id=None) -> float:  # fmt: skip
    """validation_losses' main next-token loss."""
    return validation_losses(model, accelerator, tokens, seq_len, micro_batch_size, chunk_tokens, eos_id)[0]


@torch.no_grad()
def validation_losses(
    model,
    accelerator,
    tokens: np.ndarray,
    seq_len: int,
    micro_batch_size: int,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    eos_id: int | None = None,
    mtp_depth: int = 0,
) -> list[float]:
    """Mean next-token loss over non-overlapping windows of the validation tokens, split over all processes, then
    each MTP depth's (mtp_depth of them); with eos_id, each document of a window attends only to itself
    (document_positions), as training does.

    Every process runs the same number of forward passes (ZeRO-3 gathers parameters collectively); a process with
    fewer windows pads with a repeat whose tokens carry no weight.
    """
    trained_trace = zero3_coordinator(model) is not None and zero3_coordinator(model).is_complete_trace()
    model.eval()
    n = token_data.num_windows(len(tokens), seq_len)
    mine = list(range(accelerator.process_index, n, accelerator.num_processes))
    per_rank = -(-n // accelerator.num_processes)
    total = torch.zeros(2, 1 + mtp_depth, dtype=torch.float64, device=accelerator.device)
    for start in range(0, per_rank, micro_batch_size):
        chunk = [mine[i] if i < len(mine) else None for i in range(start, min(start + micro_batch_size, per_rank))]
        rows = torch.from_numpy(
            np.stack([token_data.window(tokens, w if w is not None else 0, seq_len) for w in chunk])
        )
        targets = rows[:, 1:].clone()
        targets[[i for i, w in enumerate(chunk) if w is None]] = -100
        inputs, targets = rows[:, :-1].to(accelerator.device), targets.to(accelerator.device)
        positions = document_positions(inputs, eos_id) if eos_id is not None else None
        depths = mtp.depth_targets(inputs, targets, positions, mtp_depth) if mtp_depth else None
        nll, n = model_nll(model, inputs, targets, chunk_tokens, positions, depths)
        total += torch.stack([nll, n]).view(2, -1)
    if accelerator.num_processes > 1:  # an Accelerator (train.py) or a PartialState (eval.py)
        torch.distributed.all_reduce(total)
    model.train()
    if not trained_trace:  # a trace recorded by training already covers these forwards; one recorded here does not
        forget_zero3_eval_trace(model)
    return (total[0] / total[1]).tolist()


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
    """(input ids, targets with -100 for context-only positions) of every window of every document. A special token's
    text in a document is text, as prepare_data.py tokenizes it (a literal `<|endoftext|>` is not an EOS there)."""
    out = []
    for ids in tokenizer(docs, add_special_tokens=False, split_special_tokens=True)["input_ids"]:
        seq = [prefix] + ids
        for start, first, end in rolling_windows(len(ids), max_length, stride):
            inputs = seq[start : end - 1]
            targets = [-100] * (first - 1 - start) + seq[first:end]
            out.append((inputs, targets))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The loss over the output layer, a chunk of tokens at a time
# ---------------------------------------------------------------------------------------------------------------------


class ChunkedLinearNLL(torch.autograd.Function):
    """Summed NLL of `targets` (-100: not scored) under softmax(hidden @ weight.T), `chunk_tokens` rows at a time, and
    beside it the summed squared log-normaliser log(sum(exp(logits)))^2 of the same rows (a z-loss's term, PaLM
    section 5: free here, the forward has the log-sum-exp anyway): returns [nll, z], both differentiable.

    A chunk's logits are computed in the compute dtype, as the output layer computes them, and the softmax in fp32.
    Forward keeps each row's log-sum-exp and the last chunk's softmax; backward takes that chunk first and recomputes
    the logits of the others, so the [tokens, vocabulary] logits, their fp32 copy and their gradient never exist whole.
    Keeping the last chunk costs no peak memory (backward starts with this loss, where recomputing it would allocate
    the same buffer) and saves its recomputation, one of the chunk's four matmuls with the output weight: all the
    recomputation when the micro-batch is one chunk. The weight's gradient is accumulated in fp32.

    The compute dtype: the weight's, or under autocast (DDP or one process in bf16/fp16: Accelerate wraps the model's
    forward in it) autocast's, for the inputs and for all five matmuls, backward's included. That is what
    torch.amp.custom_fwd(cast_inputs=<autocast dtype>) and custom_bwd do, with the device type and dtype read from the
    call rather than fixed where the class is defined, and the gradients handed back in the inputs' own dtypes (the
    weight's fp32 sum not rounded to 16 bits on the way). Without it the forward's matmul ran in bf16 under autocast
    while backward, which autocast does not reach, recomputed the logits in fp32 against a log-sum-exp of the bf16
    ones (a softmax that does not sum to 1) and ran its three matmuls in fp32: slower on tensor cores and further from
    the plain cross-entropy's gradient. Under ZeRO-3 DeepSpeed casts the model itself and autocast is off: the
    weight's dtype.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens: int, weight_cast=None):
        """weight_cast: the weight already in the compute dtype (model_nll makes one for the main loss and every MTP
        depth, as autocast's cache would), or None."""
        device = hidden.device.type
        ctx.grad_dtypes = (hidden.dtype, weight.dtype)
        weight = weight_cast if weight_cast is not None else weight.to(compute_dtype(device, weight.dtype))
        hidden = hidden.to(weight.dtype)
        lse = torch.empty(len(hidden), dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float64, device=hidden.device)
        z_total = torch.zeros((), dtype=torch.float64, device=hidden.device)
        starts = range(0, len(hidden), chunk_tokens)
        with torch.autocast(device, enabled=False):
            for start in starts:
                rows = slice(start, start + chunk_tokens)
                t = targets[rows]
                logits = (hidden[rows] @ weight.T).float()
                picked = logits.gather(1, t.clamp(min=0)[:, None])[:, 0]
                top = logits.amax(dim=-1)  # log-sum-exp in place: one chunk-sized buffer, not two
                sums = logits.sub_(top[:, None]).exp_().sum(dim=-1)
                lse[rows] = sums.log().add_(top)
                total += torch.where(t != -100, lse[rows] - picked, 0.0).sum(dtype=torch.float64)
                z_total += torch.where(t != -100, lse[rows].square(), 0.0).sum(dtype=torch.float64)
                if start == starts[-1] and any(ctx.needs_input_grad[:2]):
                    ctx.last_softmax = logits.div_(sums[:, None])  # exp(logits - top) / sum: the softmax, in place
                del logits, picked, top  # before the next chunk's, or two chunks' logits are held at once
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_tokens = chunk_tokens
        return torch.stack([total, z_total])

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_total, grad_z = grad_out[0], grad_out[1]
        with_z = bool(grad_z != 0)  # a z-loss in the objective: d z / d logits = 2 lse softmax
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        with torch.autocast(hidden.device.type, enabled=False):  # a backward called inside autocast: still ours
            for start in reversed(range(0, len(hidden), ctx.chunk_tokens)):  # the kept last chunk first, then freed
                rows = slice(start, start + ctx.chunk_tokens)
                t = targets[rows]
                # d NLL / d logits = softmax - one_hot(target), for scored rows only
                grad, ctx.last_softmax = getattr(ctx, "last_softmax", None), None  # a second backward recomputes it
                if grad is None:
                    grad = (hidden[rows] @ weight.T).float().sub_(lse[rows, None]).exp_()
                scored = t != -100
                if with_z:
                    grad.mul_(torch.where(scored, grad_total.float() + 2 * grad_z.float() * lse[rows], 0.0)[:, None])
                    grad[torch.arange(len(t), device=t.device), t.clamp(min=0)] -= torch.where(scored, grad_total, 0.0)
                else:
                    grad[torch.arange(len(t), device=t.device), t.clamp(min=0)] -= 1.0
                    grad.mul_(torch.where(scored, grad_total.float(), 0.0)[:, None])
                grad = grad.to(hidden.dtype)
                if grad_hidden is not None:
                    grad_hidden[rows] = grad @ weight
                if ctx.needs_input_grad[1] and grad.dtype == torch.float32:
                    grad_weight.addmm_(grad.T, hidden[rows])
                elif ctx.needs_input_grad[1]:
                    grad_weight += (grad.T @ hidden[rows]).float()
                del grad  # before the next chunk's
        hidden_dtype, weight_dtype = ctx.grad_dtypes
        return (
            grad_hidden.to(hidden_dtype) if grad_hidden is not None else None,
            grad_weight.to(weight_dtype) if ctx.needs_input_grad[1] else None,
            None,
            None,
            None,
        )


def compute_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a matmul on device_type runs in: autocast's where it is on, else `dtype` (the weight's)."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else dtype


def loss_path(chunk_tokens: int) -> str:
    """The loss path model_nll takes, in words, for the startup line."""
    if chunk_tokens == 0:
        return "full logits (--loss_chunk_tokens 0)"
    return f"output layer + cross-entropy in chunks of {chunk_tokens} tokens, all but the last recomputed in backward"


def model_nll(
    model,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    position_ids: torch.Tensor | None = None,
    mtp_depths: list | None = None,
    z_loss: bool = False,
) -> tuple[torch.Tensor, ...]:
    """nll_sum of a causal LM's next-token predictions (targets of -100 are not scored); position_ids restarting at a
    document's first token keep each document's attention to itself (document_positions). With z_loss, a third value:
    the summed squared log-normaliser of the scored positions (log(sum(exp(logits)))^2; PaLM's z-loss is 1e-4 x its
    mean), differentiable like the NLL.

    With chunk_tokens > 0 the model runs its own forward (ZeRO-3's hooks gather the output weight once, as for its
    logits, and once again in backward), but its output layer, while called, returns the summed NLL of its hidden
    states taken chunk by chunk (ChunkedLinearNLL) instead of logits.
    That is the loss only if the model returns what its output layer returned as its logits, unchanged: checked on a
    model's first call (ZeRO-3 hands back a copy, so by value). A model that caps, scales or reshapes its logits, or
    whose output layer has a bias, is named once and takes the full logits path.

    With mtp_depths (mtp.depth_targets of the batch) the model's MTP modules run inside the output layer's call, on
    the hidden states it received, and the output layer returns [main, depth 1, .., depth D] summed NLLs: one output,
    so ZeRO-3 gathers its weight before any of their backward passes. The sum and count are then such vectors.
    """
    from deepseek_zero3.model.weights import core_model

    core = core_model(model)
    head = core.get_output_embeddings() if chunk_tokens or mtp_depths else None
    if isinstance(head, torch.nn.Linear) and head.bias is None and _plain.get(core, True):
        flat_targets = targets.reshape(-1)

        def nll(hidden: torch.Tensor, targets: torch.Tensor, weight_cast=None) -> torch.Tensor:
            hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
            return ChunkedLinearNLL.apply(hidden, head.weight, targets, chunk_tokens or len(hidden), weight_cast)

        def loss_forward(hidden: torch.Tensor) -> torch.Tensor:
            if not mtp_depths:
                return nll(hidden, flat_targets)
            dtype = compute_dtype(hidden.device.type, head.weight.dtype)
            cast = head.weight.detach().to(dtype)  # under autocast one 16-bit copy for every depth, not one each
            depths = mtp.run_depths(core, capture, hidden, mtp_depths, lambda h, t: nll(h, t, cast))
            return torch.stack([nll(hidden, flat_targets, cast), *depths])

        returned = []
        head.forward = loss_forward
        hook = head.register_forward_hook(lambda module, args, output: returned.append(output))
        capture = mtp.Capture(core) if mtp_depths else None  # its model has decoder layers (a GPT-2's are `h`)
        try:
            with capture.active() if mtp_depths else contextlib.nullcontext():
                logits = model(input_ids=inputs, position_ids=position_ids, use_cache=False).logits
        except torch.OutOfMemoryError:  # not a property of the model: it must not switch the loss path
            raise
        except (RuntimeError, IndexError):  # a model that reshapes or slices its logits
            if core in _plain or mtp_depths:
                raise
            logits = None
        finally:
            del head.forward
            hook.remove()
        n = torch.stack([(t != -100).sum() for t in [targets] + [t for _, t in mtp_depths or []]]).double()
        if core in _plain or (len(returned) == 1 and logits is not None and _same(logits, returned[0])):
            _plain[core] = True
            nll, z = logits[..., 0], logits[..., 1]  # ChunkedLinearNLL's [nll, z] (per depth with MTP)
            n = n if mtp_depths else n[0]
            return (nll, n, z) if z_loss else (nll, n)
        if mtp_depths:
            raise ValueError(f"{type(core).__name__} changes its output layer's logits: its MTP loss cannot be taken")
        _plain[core] = False
        _print_once(f"note: {type(core).__name__} changes its output layer's logits; the loss takes them whole")
    logits = model(input_ids=inputs, position_ids=position_ids, use_cache=False).logits
    if not z_loss:
        return nll_sum(logits, targets)
    scored = targets != -100
    z = torch.where(scored, logits.float().logsumexp(-1).square(), 0.0).sum(dtype=torch.float64)
    return (*nll_sum(logits, targets), z)


def _print_once(line: str) -> None:
    """Print on the first process only (every process takes the same path)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(line, flush=True)


@torch.inference_mode()
def score_windows(
    model, windows: list, batch_size: int, device: torch.device, pad_id: int, progress: bool = True
) -> tuple[float, int]:
    """Total NLL and scored-token count over windows, batched by length. Padding goes on the right, where a causal
    model's earlier positions cannot see it, and its targets are -100."""
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
        nll, n = model_nll(model, inputs, targets, DEFAULT_CHUNK_TOKENS)
        total_nll += nll
        total_n += n
    return total_nll, total_n
