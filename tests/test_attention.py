"""Which attention kernel and MoE expert path a run takes (model/attention.py), what the plan counts for the mask,
and the run's first lines. The exactness of the kernels against each document scored alone, and against the dense
mask with and without activation checkpointing: tests/test_mixture.py; under ZeRO-3 on 3 processes: test_train.py's
and test_moe.py's comparisons of 3 processes (auto: varlen_sdpa) with 1 (the dense sdpa fallback)."""

import dataclasses
import subprocess
import sys

import pytest

from deepseek_zero3 import distributed
from deepseek_zero3.model import attention, models
from deepseek_zero3.planning import costs

CPU_FP32 = distributed.Launch(1, 1, "fp32", 1, "none", False, False, 3)


@pytest.mark.parametrize(
    "requested, device, precision, masking, flash, expected",
    [
        ("auto", "cpu", "fp32", True, False, "varlen_sdpa"),  # FlexAttention has no backward on a CPU
        ("auto", "cpu", "bf16", True, True, "varlen_sdpa"),
        ("auto", "cuda", "bf16", True, True, "flash_attention_2"),
        ("auto", "cuda", "fp16", True, False, "flex_attention"),  # flash-attn not installed
        ("auto", "cuda", "fp32", True, True, "flex_attention"),  # flash-attn takes 16-bit only
        ("auto", "cuda", "bf16", False, True, "sdpa"),  # no documents to keep apart: SDPA's causal path
        ("auto", "mps", "fp32", True, False, "varlen_sdpa"),
        ("sdpa", "cuda", "bf16", True, True, "sdpa"),  # what is asked is what runs
        ("eager", "cpu", "fp32", True, False, "eager"),
    ],
)
def test_kernel_by_device_dtype_and_masking(requested, device, precision, masking, flash, expected):
    assert attention.choose(requested, device, precision, masking, flash) == expected


def test_kernels_that_cannot_train_here_are_refused():
    assert attention.refusal("varlen_sdpa", "cpu", "fp32", False) is None
    assert "cannot train on a CPU" in attention.refusal("flex_attention", "cpu", "fp32", False)
    assert attention.refusal("flex_attention", "cuda", "fp32", False) is None
    assert "flash_attn missing" in attention.refusal("flash_attention_2", "cuda", "bf16", False)
    assert "needs a CUDA GPU, fp16 or bf16" in attention.refusal("flash_attention_2", "cuda", "fp32", True)
    assert "must be one of auto, varlen_sdpa" in attention.refusal("flash", "cpu", "fp32", False)


@pytest.mark.parametrize(
    "capability, precision, name",
    [
        ((8, 9), "fp16", "grouped_mm (loop)"),  # RTX 4090, the 3-GPU configs' fp16
        ((8, 9), "bf16", "grouped_mm (loop)"),  # the fast kernel is sm90/sm100 only
        ((9, 0), "bf16", "grouped_mm (fast)"),  # H100
        ((10, 0), "bf16", "grouped_mm (fast)"),  # B200
        ((9, 0), "fp16", "grouped_mm (loop)"),
        ((7, 5), "fp16", "loop"),  # below 8.0: transformers' own loop
    ],
)
def test_expert_path_by_capability_and_dtype(capability, precision, name):
    """The capability is an argument (no GPU here): only it is made up, the rule is attention.expert_path's."""
    got, cost = attention.expert_path("cuda", capability, precision, True)
    assert got == name
    assert ("device-to-host" in cost) == (name != "grouped_mm (fast)")
    assert attention.expert_path("cpu", None, "fp32", True)[0] == "grouped_mm (CPU)"
    assert attention.expert_path("cuda", capability, precision, False)[0] == "loop"


def test_plan_counts_the_mask_each_kernel_keeps():
    """The dense fallback: a b x T^2 boolean mask and a float bias per layer (one with checkpointing); FlexAttention:
    its block index; the varlen kernels: the position ids; no masking: nothing. bench/document_masking_memory.py
    measured the dense one on a CPU (BENCHMARKS.md)."""
    c = models.load_model_config("tiny", "", 512, None)
    layers, b, t = c.num_hidden_layers, 8, 512
    mask = lambda kernel, masking=True, ckpt=False, launch=CPU_FP32: costs.memory_plan(
        c, launch, b, t, ckpt, kernel, document_masking=masking
    )["gpu"]["attention_mask"]
    assert mask("sdpa") == b * t * t + b * t * t * 4 * layers
    assert mask("sdpa", ckpt=True) == b * t * t + b * t * t * 4
    assert mask("sdpa", masking=False) == 0
    assert mask("varlen_sdpa") == mask("auto") == b * t * 8  # auto on a CPU launch: varlen_sdpa
    gpu_bf16 = dataclasses.replace(CPU_FP32, precision="bf16", gpu=True)
    assert mask("auto", launch=gpu_bf16) == mask("flex_attention") == 4 * b * (t // 128) ** 2 * 4
    assert mask("sdpa", launch=gpu_bf16) == b * t * t + b * t * t * 2 * layers
    dense = costs.memory_plan(c, CPU_FP32, b, t, False, "sdpa", document_masking=True)
    assert dense["gpu_total"] - costs.memory_plan(c, CPU_FP32, b, t, False, "sdpa")["gpu_total"] == mask("sdpa")


@pytest.mark.slow
def test_plan_names_the_kernel_and_the_expert_path():
    """train.py --plan on paper for the 3-GPU config (fp16, an RTX 4090 assumed): FlexAttention for the masked
    documents, and the MoE preset's experts on torch's slow grouped_mm path; bf16 on the same card is no faster."""
    cmd = [sys.executable, "train.py", "--plan", "--model_config", "deepseek-v3-tiny", "--seq_len", "512",
           "--accelerate_config", "accelerate_configs/zero3_3gpu.yaml"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "  attention: flex_attention, FlexAttention, a block mask from the position ids" in out
    assert "  MoE experts (sm89, fp16): grouped_mm (loop), torch's grouped_mm without its fast kernel" in out
    assert "+ document mask 0.00" in out
    dense = subprocess.run([*cmd, "--attn_implementation", "sdpa"], capture_output=True, text=True, check=True).stdout
    assert "a dense (batch, 1, T, T) document mask: the fallback" in dense


@pytest.mark.slow
def test_run_names_its_kernel_and_refuses_one_that_cannot_train(docs_data, tmp_path):
    """The first line of a run says which kernel it takes; flex_attention on a CPU is one error line, exit 2."""
    args = [sys.executable, "train.py", "--model_config", "tiny", "--seq_len", "32", "--data_dir", str(docs_data)]
    bad = subprocess.run([*args, "--output_dir", str(tmp_path / "flex"), "--attn_implementation", "flex_attention"],
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.startswith("error: --attn_implementation flex_attention cannot train")
    assert not (tmp_path / "flex").exists()
    unknown = subprocess.run([*args, "--output_dir", str(tmp_path / "u"), "--attn_implementation", "flash"],
                             capture_output=True, text=True)  # fmt: skip
    assert unknown.returncode == 2 and "error: --attn_implementation 'flash' must be one of auto" in unknown.stderr
    ok = subprocess.run([*args, "--output_dir", str(tmp_path / "ok"), "--max_steps", "1", "--eval_tokens", "2048",
                         "--eval_every", "0", "--save_every", "0", "--no_eval_at_start"],
                        capture_output=True, text=True, check=True)  # fmt: skip
    assert ok.stdout.splitlines()[0].startswith("attention: varlen_sdpa, SDPA's causal kernel on each document")
