"""The loss over the output layer in chunks (issue #25): equal to the full logits' loss and gradients (fp32 to 1e-6
relative, bf16 to what a bf16 matmul allows) on the Llama and DeepSeek-V3 presets, tied and untied, in one process
and under ZeRO-3 on 1 and 3 processes, where the output weight is gathered once per micro-step however many chunks
there are; train.py's --loss_chunk_tokens picks the path."""

import json
import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from conftest import REPO, launch_cmd, run

import train
from deepseek_zero3 import distributed
from deepseek_zero3.model import lmloss, models
from deepseek_zero3.planning import costs

VARIANTS = [("tiny", False), ("tiny", True), ("deepseek-v3-tiny", False)]


def build(preset: str, tied: bool, vocab: int = 1000, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    c = models.load_model_config(preset, "", 32, {"vocab_size": vocab, "eos_id": 0})
    c.tie_word_embeddings = tied
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(c, dtype=dtype)


def loss_and_grads(model, inputs, targets, chunk_tokens: int):
    model.zero_grad()
    nll, n = lmloss.model_nll(model, inputs, targets, chunk_tokens)
    (nll / n).backward()
    return float(nll / n), {k: p.grad.clone() for k, p in model.named_parameters()}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_equal_the_full_cross_entropy(dtype):
    """Uneven chunks, unscored (-100) targets: loss, d/d hidden and d/d weight as F.cross_entropy over whole logits."""
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=dtype, requires_grad=True)
    weight = (torch.randn(300, 16) * 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, 300, (37,))
    targets[[0, 5, 36]] = -100
    full = F.cross_entropy((hidden @ weight.T).float(), targets, reduction="sum")
    full_grads = torch.autograd.grad(full * 0.7, (hidden, weight))
    nll = lmloss.ChunkedLinearNLL.apply(hidden, weight, targets, 8)[0]
    grads = torch.autograd.grad(nll * 0.7, (hidden, weight), retain_graph=True)
    again = torch.autograd.grad(nll * 0.7, (hidden, weight))  # the kept last chunk was used up: recomputed
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16 keeps 8 bits of mantissa: 2^-8 = 4e-3 per rounding
    assert abs(float(nll) - float(full)) / float(full) < tol
    assert all(g.dtype == dtype and relative(g, f) < tol for g, f in zip(grads + again, full_grads + full_grads))


@pytest.mark.parametrize("preset,tied", [*VARIANTS, ("tiny-qk-norm", False)])  # QK-norm in-process only: not launched
def test_model_loss_and_gradients_equal_the_full_path(preset, tied):
    model = build(preset, tied)
    g = torch.Generator().manual_seed(1)
    inputs, targets = torch.randint(0, 1000, (3, 32), generator=g), torch.randint(0, 1000, (3, 32), generator=g)
    full_loss, full_grads = loss_and_grads(model, inputs, targets, 0)
    for chunk in (7, 96, 2048):  # many uneven chunks, one chunk exactly, one larger than the batch
        loss, grads = loss_and_grads(model, inputs, targets, chunk)
        assert abs(loss - full_loss) / full_loss < 1e-6, chunk
        worst = max(relative(grads[k], full_grads[k]) for k in full_grads)
        assert worst < 1e-6, (chunk, worst)
    assert lmloss._plain[model] is True  # the chunked path ran


def test_bf16_model_within_bf16_tolerance():
    model = build("deepseek-v3-tiny", False, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    inputs, targets = torch.randint(0, 1000, (3, 32), generator=g), torch.randint(0, 1000, (3, 32), generator=g)
    full_loss, full_grads = loss_and_grads(model, inputs, targets, 0)
    loss, grads = loss_and_grads(model, inputs, targets, 7)
    assert abs(loss - full_loss) / full_loss < 4e-3
    assert max(relative(grads[k], full_grads[k]) for k in full_grads) < 3e-2


class VocabMatmuls(TorchDispatchMode):
    """The dtypes of every matmul that has an operand with a vocabulary-sized dimension (the output layer's)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.dtypes = vocab, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if any(self.vocab in t.shape for t in tensors):
                self.dtypes |= {t.dtype for t in tensors}
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_under_autocast_the_chunks_compute_in_its_dtype_like_plain_cross_entropy(precision):
    """DDP and one process train in bf16/fp16 under autocast (Accelerate wraps the model's forward in it; backward runs
    outside it). The chunked loss then computes all its output-layer matmuls, backward's three included, in autocast's
    dtype, and its gradients are plain cross-entropy's under autocast within one 16-bit rounding (2^-8 in bf16, 2^-11
    in fp16; measured: 0.25% and 0.04%, in a layer-0 projection, the head's to 3e-6 with one chunk), whether the batch
    is one chunk or 14, and as close to fp32's. Before, backward ran its matmuls in fp32 (slow on tensor cores)
    against the log-sum-exp of 16-bit logits: 0.75% from plain cross-entropy's gradient in bf16 (measured)."""
    from test_precision import UNITS

    present, why = UNITS[precision]
    if not present:
        pytest.skip(why)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    model = build("tiny", False)
    g = torch.Generator().manual_seed(1)
    inputs, targets = torch.randint(0, 1000, (3, 32), generator=g), torch.randint(0, 1000, (3, 32), generator=g)
    grads, matmuls = {}, {}
    # The summed NLL: gradients in fp16's normal range, where a loss scaler keeps them (the mean's underflow).
    for chunk, autocast in ((0, False), (0, True), (96, True), (7, True)):  # full logits, one chunk, 14 chunks
        model.zero_grad()
        with VocabMatmuls(model.config.vocab_size) as seen:
            with torch.autocast("cpu", dtype=dtype, enabled=autocast):
                nll, n = lmloss.model_nll(model, inputs, targets, chunk)
            nll.backward()
        grads[chunk if autocast else "exact"] = {k: p.grad.clone() for k, p in model.named_parameters()}
        matmuls[chunk] = seen.dtypes
    exact = grads["exact"]  # fp32, no autocast
    assert all(g.dtype == torch.float32 for grad in grads.values() for g in grad.values())
    assert matmuls[0] == matmuls[96] == matmuls[7] == {dtype}, matmuls
    rounding = {torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    assert relative(grads[96]["lm_head.weight"], grads[0]["lm_head.weight"]) < 1e-5
    for chunk in (96, 7):
        assert max(relative(grads[chunk][k], grads[0][k]) for k in exact) < rounding, chunk
    for k in exact:  # as close to fp32 as plain cross-entropy under autocast
        assert relative(grads[7][k], exact[k]) <= relative(grads[0][k], exact[k]) + rounding, k


def test_the_z_term_is_the_squared_log_normaliser_with_its_gradient():
    """model_nll(..., z_loss=True): the summed log(sum(exp(logits)))^2 of the scored positions, in chunks and whole,
    and a loss with a z-loss term (PaLM's 1e-4 x its mean) backpropagates what autograd gives over whole logits, beside
    the NLL. The chunked path is seen to matter: without the z branch of its backward the gradients differ."""
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = (torch.randn(300, 16) * 0.5).requires_grad_()
    targets = torch.randint(0, 300, (37,))
    targets[[0, 5, 36]] = -100
    logits = hidden @ weight.T
    scored = targets != -100
    z_full = logits.logsumexp(-1)[scored].square().sum()
    full = F.cross_entropy(logits, targets, reduction="sum") + 3.0 * z_full
    full_grads = torch.autograd.grad(full, (hidden, weight))
    nll, z = lmloss.ChunkedLinearNLL.apply(hidden, weight, targets, 8)
    assert float(z) == pytest.approx(float(z_full), rel=1e-6)
    grads = torch.autograd.grad(nll + 3.0 * z, (hidden, weight))
    assert all(relative(g, f) < 1e-6 for g, f in zip(grads, full_grads))
    model = build("tiny", False)
    inputs, ids = torch.randint(0, 1000, (2, 32)), torch.randint(0, 1000, (2, 32))
    for chunk in (16, 0):  # chunked and whole logits
        nll, n, z = lmloss.model_nll(model, inputs, ids, chunk, z_loss=True)
        whole = model(input_ids=inputs).logits.float().logsumexp(-1).square().sum()
        assert float(z) == pytest.approx(float(whole), rel=1e-5) and float(n) == 64
        assert len(lmloss.model_nll(model, inputs, ids, chunk)) == 2


def test_train_lm_loss_takes_the_path_its_flag_names(monkeypatch):
    calls = []
    apply = lmloss.ChunkedLinearNLL.apply
    monkeypatch.setattr(lmloss.ChunkedLinearNLL, "apply", lambda *a: calls.append(a[3]) or apply(*a))
    model = build("tiny", False)
    inputs, targets = torch.randint(0, 1000, (2, 32)), torch.randint(0, 1000, (2, 32))
    full, _ = train.lm_loss(model, (inputs, targets, None), train.Config(loss_chunk_tokens=0))
    chunked, _ = train.lm_loss(model, (inputs, targets, None), train.Config(loss_chunk_tokens=16))
    assert calls == [16] and float(chunked) == pytest.approx(float(full), rel=1e-6)
    assert train.Config().loss_chunk_tokens == lmloss.DEFAULT_CHUNK_TOKENS > 0
    assert "chunks of 16 tokens" in lmloss.loss_path(16)
    assert "full logits" in lmloss.loss_path(0)


def test_the_loss_unwraps_its_model_once_not_at_every_micro_step(monkeypatch):
    """Accelerate's extract_model_from_parallel parses DeepSpeed's package metadata at each call (~3 ms of CPU): the
    loss asks it once per wrapper (weights.core_model), and forgets a model that is gone. Seen failing before: one call
    per model_nll, 5.2 s of a 21 s 10-step tiny run in cProfile."""
    import gc

    import accelerate.utils

    from deepseek_zero3.model import weights

    calls = []
    extract = accelerate.utils.extract_model_from_parallel
    monkeypatch.setattr(accelerate.utils, "extract_model_from_parallel", lambda m: calls.append(m) or extract(m))
    model, inputs = build("tiny", False), torch.randint(0, 1000, (2, 32))
    for _ in range(3):
        lmloss.model_nll(model, inputs, inputs, 16)
    assert calls == [model] and weights.core_model(model) is model  # a plain model is its own core; the ZeRO-3 runs
    alone = build("tiny", False)  # unwrap DeepSpeed's engine through the same call
    assert weights.core_model(alone) is alone and len(calls) == 2
    before = len(weights._CORES)
    del alone, calls[:]
    gc.collect()
    assert len(weights._CORES) == before - 1  # the weak cache lets a model go


# Under ZeRO-3 (DeepSpeed engines built here, fp32, each process its own batch): the loss and the full gradients of
# every parameter, chunked (8 chunks of 8 tokens) against the full logits, and how often the output weight is
# all-gathered in a micro-step, counted at every ZeRO-3 parameter's gather entry points (the coordinator's, and
# GatheredParameters'), whichever parameter of a coalesced gather carries it.
ZERO3 = r"""
import json, sys
sys.path[:0] = [{repo!r}, {repo!r} + "/tests"]
import torch, deepspeed
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.utils import safe_get_full_grad
from transformers import DeepseekV3ForCausalLM, LlamaForCausalLM  # imported before zero.Init patches construction
from deepseek_zero3.cli import exit_process
from deepseek_zero3.model import lmloss
from test_loss import VARIANTS, build


def count_gathers(engine, weight) -> list:
    count = [0]

    def wrap(gather, key):
        def counted(*args, **kwargs):
            params = args[0] if args else kwargs.get(key)
            if params and any(p is weight for p in params) and weight.ds_status == ZeroParamStatus.NOT_AVAILABLE:
                count[0] += 1
            return gather(*args, **kwargs)
        return counted

    for p in engine.module.parameters():
        p.all_gather_coalesced = wrap(p.all_gather_coalesced, "params")
        p.all_gather = wrap(p.all_gather, "param_list")
    return count


acc = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
ds = json.load(open({repo!r} + "/accelerate_configs/zero3_cpu.json"))
ds.update(train_micro_batch_size_per_gpu=2, train_batch_size=2 * acc.num_processes, gradient_accumulation_steps=1,
          gradient_clipping=0.0, fp16={{"enabled": False}}, bf16={{"enabled": False}})
results = {{}}
for preset, tied in VARIANTS:
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = build(preset, tied)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=ds)
    gathers = count_gathers(engine, engine.module.get_output_embeddings().weight)
    g = torch.Generator().manual_seed(acc.process_index)
    x, y = torch.randint(0, 1000, (2, 32), generator=g), torch.randint(0, 1000, (2, 32), generator=g)
    out = {{}}
    # Each path twice: recording DeepSpeed's trace of the micro-step (after it is forgotten), then following it.
    for chunk, record in ((8, True), (0, True), (0, False), (8, False)):
        if record:
            lmloss.forget_zero3_eval_trace(engine)
        gathers[0] = 0
        nll, n = lmloss.model_nll(engine, x, y, chunk)
        loss = (nll / n).float()
        engine.backward(loss)
        grads = {{k: safe_get_full_grad(p).clone() for k, p in engine.module.named_parameters()}}
        engine.optimizer.zero_grad()
        out.setdefault(chunk, []).append((acc.reduce(loss.detach(), "mean").item(), grads, gathers[0]))
    full_loss, full_grads, _ = out[0][0]
    results[preset + ("-tied" if tied else "")] = {{
        "plain": lmloss._plain[engine.module],
        "loss_rel": max(abs(loss - full_loss) / full_loss for loss, _, _ in out[8]),
        "grad_rel": max(((grads[k] - g).norm() / g.norm()).item() for _, grads, _ in out[8]
                        for k, g in full_grads.items()),
        "gathers_chunked": [n for _, _, n in out[8]],
        "gathers_full": [n for _, _, n in out[0]],
    }}
acc.print("RESULT " + json.dumps(results))
exit_process(0)  # past the gloo teardown abort (see cli.exit_process)
"""


@pytest.fixture(scope="module")
def zero3_results(tmp_path_factory) -> dict[int, dict]:
    script = tmp_path_factory.mktemp("zero3_loss") / "zero3_loss.py"
    script.write_text(ZERO3.format(repo=str(REPO)))
    results = {}
    for nproc in (1, 3):
        proc = run(launch_cmd(nproc, script=str(script)))
        results[nproc] = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
    return results


@pytest.mark.parametrize("nproc", [1, 3])
def test_zero3_chunked_equals_full_and_gathers_the_head_once(zero3_results, nproc):
    results = zero3_results[nproc]
    assert set(results) == {"tiny", "tiny-tied", "deepseek-v3-tiny"}
    for name, r in results.items():
        assert r["plain"] is True, name  # the chunked path ran under the DeepSpeed engine
        assert r["loss_rel"] < 1e-6 and r["grad_rel"] < 1e-6, (name, r)
        # 8 chunks, and the output weight is gathered as often as for the full logits (per chunk: 8 or 16 times). While
        # DeepSpeed records its trace: in forward and again in backward (tied: for the embedding too); once it follows
        # the trace, once (kept for backward: the output layer is the last module of forward and the first of backward).
        assert r["gathers_chunked"] == r["gathers_full"], (name, r)
        assert r["gathers_full"] == ([4, 1] if name.endswith("-tied") else [2, 1]), (name, r)


def test_planner_counts_the_loss_of_each_path_and_fits_a_larger_micro_batch(monkeypatch):
    # Full logits in fp32: logits, log-softmax and gradient, 12 bytes a logit; in chunks: one chunk's fp32 logits, the
    # fp32 output-weight gradient and a log-sum-exp per token, whatever the micro-batch.
    tokens, vocab, hidden = 512 * 8, 102_400, 64
    assert costs.loss_bytes(tokens, vocab, hidden, 4, 0) == tokens * vocab * 12
    assert costs.loss_bytes(tokens, vocab, hidden, 4, 1024) == 1024 * vocab * 4 + vocab * hidden * 4 + tokens * 4
    assert costs.loss_bytes(tokens, vocab, hidden, 4, 1024) < 0.1 * costs.loss_bytes(tokens, vocab, hidden, 4, 0)
    monkeypatch.chdir(REPO)
    launch = distributed.read_launch("accelerate_configs/zero3_3gpu.yaml")
    c = models.load_model_config("deepseek-1.3b", "", 2048, None)
    reports = {}
    for chunk in (1024, 0):
        cfg = train.Config(seq_len=2048, micro_batch_size=4, gradient_checkpointing=True, loss_chunk_tokens=chunk)
        machine = costs.machine_for(cfg, launch, 165e12)
        reports[chunk] = "\n".join(costs.plan_report(cfg, c, launch, machine, 3 * 2**30, 0)[0])
    assert "loss 1.37 (chunks of 1024 tokens; full logits: 7.81)" in reports[1024], reports[1024]
    assert "loss 7.81 (full logits)" in reports[0], reports[0]
    largest = re.search(
        r"fits: (\d+) with the loss in chunks of 1024 tokens, (\d+) with the full logits", reports[1024]
    )
    assert largest and int(largest.group(1)) > 2 * int(largest.group(2)) >= 2, reports[1024]
