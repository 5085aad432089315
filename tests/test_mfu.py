"""Issue #62 item 3: MFU as the field reports it. The model FLOPs (PaLM's count) and the hardware FLOPs (with what
activation checkpointing and the chunked loss recompute) against torch's own FLOP counter on real models; the plan's
assumed MFU against the MFU and HFU a run that meets its plan logs; a real checkpointed run that logs both."""

import dataclasses
import json
import math
import re
import sys

import pytest
import torch
from conftest import REPO, TINY, run

import train
from deepseek_zero3 import distributed
from deepseek_zero3.model import lmloss, models, mtp
from deepseek_zero3.planning import costs, model_math, plan
from deepseek_zero3.run_dir import metrics


def counted_flops(c, seq_len: int, micro: int, checkpointing: bool, chunk: int, depth: int) -> float:
    """Matmul FLOPs per token of one training micro-step (forward, loss, backward) of a model built from config c, as
    torch.utils.flop_counter counts them, with two ops it leaves out counted as it counts their kin: the in-place
    addmm_ (the chunked loss's weight gradient) and _grouped_mm (transformers' MoE experts), 2 M K N each. Eager
    attention, whose score matmuls are plain bmm over all T x T pairs."""
    from torch.utils.flop_counter import FlopCounterMode, mm_flop
    from transformers import AutoModelForCausalLM

    def grouped_mm(a, b, *rest, out_shape=None, **kwargs):
        assert len(a) == 2, a  # rows of all groups x K, against one (K, N) per group or (M, N) per group's rows
        return 2 * a[0] * a[1] * b[-1]

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(c, attn_implementation="eager", dtype=torch.float32)
    if depth:
        mtp.attach(model, depth, 0)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, c.vocab_size, (micro, seq_len + 1))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    depths = mtp.depth_targets(inputs, targets, None, depth) if depth else None
    mapping = {torch.ops.aten.addmm_: lambda s, a, b, out_shape=None, **k: mm_flop(a, b),
               torch.ops.aten._grouped_mm: grouped_mm}  # fmt: skip
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        nll, _ = lmloss.model_nll(model, inputs, targets, chunk, None, depths)
        nll.sum().backward()
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    # 6 N counts the norms' weights as parameters; they are no matmul's
    return counter.get_total_flops() / (micro * seq_len) + 6 * norms


@pytest.mark.parametrize(
    ("preset", "q_lora", "chunk", "depth"),
    [
        ("tiny", None, 16, 0),
        ("tiny-qk-norm", None, 16, 1),
        ("deepseek-v3-tiny", None, 16, 2),
        ("deepseek-v3-tiny", 16, 0, 1),
    ],
)
@pytest.mark.slow
def test_model_and_hardware_flops_are_what_torch_counts(preset, q_lora, chunk, depth):
    """Without checkpointing and with the full logits the count is the model FLOPs: PaLM's 6 N + the attention over
    all T x T pairs (eager attention computes them all); with checkpointing (and the loss in chunks) what the
    hardware runs: model_math's hardware FLOPs. A MoE preset with MTP modules (their block, eh_proj and each depth's
    output layer), and MLA with a low-rank query."""
    seq_len, micro = 32, 2
    c = models.load_model_config(preset, "", seq_len, {"vocab_size": 512, "eos_id": 0})
    if q_lora:
        c.q_lora_rank = q_lora
    model_flops = model_math.model_flops_per_token(c, seq_len, depth)
    assert counted_flops(c, seq_len, micro, False, 0, depth) == pytest.approx(model_flops, rel=1e-12)
    for checkpointing in (False, True):
        got = counted_flops(c, seq_len, micro, checkpointing, chunk, depth)
        hardware = model_math.hardware_flops_per_token(c, seq_len, depth, checkpointing, micro * seq_len, chunk)
        assert got == pytest.approx(hardware, rel=1e-12), (checkpointing, got - model_flops, hardware - model_flops)
    assert model_math.hardware_flops_per_token(c, seq_len, depth, True, micro * seq_len, chunk) > model_flops


GPU = distributed.Launch(3, 1, "bf16", 2, "none", False, True, 3)  # 3 GPUs, ZeRO-3, 2 micro-steps a step
LINKS = {"all_reduce": 10.0, "all_gather": 10.0, "reduce_scatter": 10.0, "memory": 900.0, "memory_fresh": 900.0}


def planned_and_logged(cfg, c, launch, machine, tokens_per_s=None) -> tuple[dict, dict]:
    """The plan's step (costs.step_costs, as plan_run takes it) and what metrics.utilisation logs for a run at
    tokens_per_s (default: the plan's), against the RunPlan plan_run makes of that step."""
    step = costs.step_costs(c, cfg, launch, cfg.micro_batch_size, machine, 3 * 2**30)
    planned = plan.RunPlan({}, step["model_flops_per_token"], machine.peak_flops_per_device * launch.world_size, "",
                           {}, step["hardware_flops_per_token"])  # fmt: skip
    return step, metrics.utilisation(tokens_per_s or step["tokens_per_s"], planned)


@pytest.mark.parametrize(("checkpointing", "chunk"), [(False, 0), (True, 0), (False, 1024), (True, 1024)])
def test_a_run_that_meets_its_plan_logs_the_plans_mfu(checkpointing, chunk):
    """--assumed_mfu is MFU: a run whose compute takes the planned compute time logs exactly that MFU, with or without
    checkpointing (it logged 26% for 35% with it: the plan had counted the recomputed forward as model FLOPs); a run
    that takes the planned step time logs the MFU the plan states; HFU = MFU x (1 + the recomputed share) beside it
    wherever something is recomputed (checkpointing; the loss in chunks of a micro-step over one chunk), not else."""
    c = models.load_model_config("deepseek-1.3b", "", 2048, None)
    cfg = train.Config(data_dir="none", seq_len=2048, micro_batch_size=2, gradient_checkpointing=checkpointing,
                       loss_chunk_tokens=chunk, assumed_mfu=0.35)  # fmt: skip
    machine = costs.machine_for(cfg, GPU, 165.2e12, LINKS, 24.0)
    step, logged = planned_and_logged(cfg, c, GPU, machine)
    flops = model_math.model_flops_per_token(c, 2048)
    tokens = step["tokens"]
    assert step["compute_s"] == pytest.approx(flops * tokens / (3 * 0.35 * 165.2e12), rel=1e-12)
    assert metrics.utilisation(tokens / step["compute_s"], plan.RunPlan({}, flops, 3 * 165.2e12, "", {},
                               step["hardware_flops_per_token"]))["mfu"] == pytest.approx(0.35, rel=1e-12)  # fmt: skip
    assert logged["mfu"] == pytest.approx(step["mfu"], rel=1e-12) and 0 < step["mfu"] < 0.35
    recomputed = (model_math.checkpointed_flops_per_token(c, 2048) if checkpointing else 0) + (
        model_math.loss_recomputed_flops_per_token(c, 2 * 2048, chunk))  # fmt: skip
    assert (recomputed > 0) == (checkpointing or chunk > 0)
    if recomputed:
        assert logged["hfu"] == pytest.approx(logged["mfu"] * (1 + recomputed / flops), rel=1e-12)
        assert step["hfu"] == pytest.approx(logged["hfu"], rel=1e-12)
    else:
        assert "hfu" not in logged and step["hfu"] is None


def test_a_cpu_plan_timed_without_checkpointing_adds_the_recomputed_forward():
    """A CPU run's plan computes at the rate it timed on a copy of its model without checkpointing: a checkpointed step
    takes the recomputed forward on top, and a run that meets that plan logs the plan's MFU and HFU."""
    c = models.load_model_config("tiny", "", 32, {"vocab_size": 512, "eos_id": 0})
    launch = dataclasses.replace(GPU, precision="fp32", gpu=False)
    steps = {}
    for checkpointing in (False, True):
        cfg = train.Config(data_dir="none", seq_len=32, micro_batch_size=2, gradient_checkpointing=checkpointing)
        machine = costs.machine_for(cfg, launch, 0.1e12, LINKS, model_rate=0.02e12)
        assert machine.timed_without_checkpointing
        steps[checkpointing], logged = planned_and_logged(cfg, c, launch, machine)
        assert logged["mfu"] == pytest.approx(steps[checkpointing]["mfu"], rel=1e-12)
        if checkpointing:
            assert logged["hfu"] == pytest.approx(steps[checkpointing]["hfu"], rel=1e-12)
        else:
            assert "hfu" not in logged and steps[checkpointing]["hfu"] is None
    again = model_math.checkpointed_flops_per_token(c, 32) / model_math.model_flops_per_token(c, 32)
    assert steps[True]["compute_s"] == pytest.approx(steps[False]["compute_s"] * (1 + again), rel=1e-12)


def test_the_plan_states_mfu_and_hfu_and_refuses_an_impossible_hfu(capsys, monkeypatch):
    """`--plan` for the 3-GPU config with checkpointing: the step line's MFU and HFU, HFU / MFU the hardware over the
    model FLOPs; an --assumed_mfu whose HFU would pass the peak is refused in one line."""
    monkeypatch.chdir(REPO)
    flags = ["--plan", "--data_dir", "none", "--model_config", "deepseek-1.3b", "--seq_len", "2048",
             "--micro_batch_size", "1", "--accelerate_config", "accelerate_configs/zero3_3gpu.yaml"]  # fmt: skip
    assert train.main([*flags, "--gradient_checkpointing"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  step:"))
    got = re.search(r"tokens/s, MFU ([\d.]+)% \(HFU ([\d.]+)%: the checkpointed layers' forward and the loss's logits "
                    r"\(--loss_chunk_tokens 1024\) run again\)", line)  # fmt: skip
    assert got, line
    c = models.load_model_config("deepseek-1.3b", "", 2048, None)
    hardware = model_math.hardware_flops_per_token(c, 2048, 0, True, 2048, 1024)
    ratio = hardware / model_math.model_flops_per_token(c, 2048)
    assert float(got[2]) == pytest.approx(float(got[1]) * ratio, rel=0.01), line
    assert "compute at 57.8 TFLOP/s per device (35% MFU of 165 TFLOP/s)" in line  # MFU x peak: model FLOP/s
    assert train.main([*flags, "--loss_chunk_tokens", "0"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  step:"))
    assert re.search(r"tokens/s, MFU [\d.]+%$", line) and "HFU" not in line, line
    assert train.main([*flags, "--gradient_checkpointing", "--assumed_mfu", "0.8"]) == 2
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "--assumed_mfu 0.8 is MFU; with the checkpointed" in errors[0], errors
    assert errors[0].endswith(f"{0.8 * ratio:.0%} of its peak: give at most {math.floor(100 / ratio) / 100:g}"), errors
    assert train.main([*flags, "--assumed_mfu", "1.5"]) == 2
    assert "--assumed_mfu 1.5 must be at most 1" in capsys.readouterr().err


@pytest.mark.slow
def test_a_checkpointed_run_logs_mfu_and_hfu_everywhere(docs_data, tmp_path):
    """One CPU process of the tiny-qk-norm preset (the tiny one with "qk_norm": true, issue #61: this run is also the
    one of train.py with QK-norm), 3 steps with --gradient_checkpointing: every training record of metrics.jsonl has
    `mfu` and `hfu` with HFU / MFU = 1 + the recomputed share of the model FLOPs, as the console line, the plan's step
    line, TensorBoard and the model card say; final/ is the Qwen3 model that QK-norm is in transformers."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from deepseek_zero3.training_data import token_data

    out = tmp_path / "out"
    tiny_qk_norm = ["tiny-qk-norm" if arg == "tiny" else arg for arg in TINY]
    proc = run([sys.executable, "train.py", *tiny_qk_norm, "--max_steps", "3", "--micro_batch_size", "2",
                "--gradient_checkpointing", "--no_eval_at_start", "--log_with", "tensorboard", "--data_dir", docs_data,
                "--output_dir", out])  # fmt: skip
    assert "x 1 processes" in proc.stdout, proc.stdout  # the batch plan line: one process
    c = models.load_model_config("tiny-qk-norm", "", 32, token_data.read_meta(docs_data))
    share = model_math.checkpointed_flops_per_token(c, 32) / model_math.model_flops_per_token(c, 32)
    assert model_math.hardware_flops_per_token(c, 32, 0, True, 64, 1024) == model_math.model_flops_per_token(
        c, 32) * (1 + share)  # fmt: skip # 64 tokens a micro-step, one chunk: nothing else recomputed
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert 0 < r["mfu"] < r["hfu"] and r["hfu"] == pytest.approx(r["mfu"] * (1 + share), rel=1e-12), r
        assert f"MFU {model_math.percent(r['mfu'])} (HFU {model_math.percent(r['hfu'])})" in proc.stdout
    step_line = next(line for line in proc.stdout.splitlines() if line.startswith("  step:"))
    planned = re.search(r"MFU ([\d.]+)% \(HFU ([\d.]+)%: the checkpointed layers' forward run again\)", step_line)
    assert planned and float(planned[2]) == pytest.approx(float(planned[1]) * (1 + share), rel=0.01), step_line
    assert "with the checkpointed layers' forward again" in step_line  # the timed rate had no recomputation
    board = EventAccumulator(str(out / "deepseek-zero3"))
    board.Reload()
    for key in ("mfu", "hfu"):
        assert [e.value for e in board.Scalars(key)] == pytest.approx([r[key] for r in records], rel=1e-6)
    card = (out / "final" / "README.md").read_text()
    seconds = [64 / r["tokens_per_s"] for r in records]  # each record one step of 2 x 32 tokens
    mean = lambda key: sum(r[key] * s for r, s in zip(records, seconds)) / sum(seconds)
    assert f"MFU {model_math.percent(mean('mfu'))} (model FLOPs per token" in card, card
    assert f", HFU {model_math.percent(mean('hfu'))} (the FLOPs" in card, card
    assert math.isclose(mean("hfu"), mean("mfu") * (1 + share), rel_tol=1e-12)
    assert json.loads((out / "final" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
