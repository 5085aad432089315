"""train.py arithmetic: LR schedule, batch plan, sample layout, FLOPs and MFU."""

import math

import pytest

import train


def test_lr_warmup_then_cosine_to_floor():
    lr = [train.lr_at(s, 1.0, 10, 110, 0.1) for s in range(110)]
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)  # linear warmup reaches the peak
    assert all(a < b for a, b in zip(lr[:10], lr[1:10]))
    assert train.lr_at(60, 1.0, 10, 110, 0.1) == pytest.approx(0.55)  # half-way down the cosine
    assert all(a >= b for a, b in zip(lr[10:], lr[11:]))
    assert train.lr_at(110, 1.0, 10, 110, 0.1) == pytest.approx(0.1)
    assert train.lr_at(500, 1.0, 10, 110, 0.1) == pytest.approx(0.1)  # past the schedule: the floor


def test_batch_plan_and_steps():
    plan = train.batch_plan(4, 8, 3, 2048)
    assert plan["sequences_per_step"] == 96 and plan["tokens_per_step"] == 96 * 2048
    assert train.total_steps_for(0, 1.0, 1000, 96) == math.ceil(1000 / 96)
    assert train.total_steps_for(50, 1.0, 1000, 96) == 50


def test_sample_layout_depends_only_on_global_batch():
    three = train.batch_plan(2, 1, 3, 32)
    one = train.batch_plan(6, 1, 1, 32)
    accum = train.batch_plan(2, 3, 1, 32)
    for step in range(4):
        a = sorted(i for r in range(3) for i in train.sample_ids(step, 0, r, three))
        b = list(train.sample_ids(step, 0, 0, one))
        c = sorted(i for m in range(3) for i in train.sample_ids(step, m, 0, accum))
        assert a == b == c == list(range(6 * step, 6 * step + 6))


def test_flops_and_mfu():
    # DeepSeek 7B at 4096 tokens: 6 N + 12 L H T per token
    n = 6.9e9 - 102400 * 4096
    assert train.flops_per_token(n, 30, 4096, 4096) == pytest.approx(6 * n + 12 * 30 * 4096 * 4096)
    assert train.mfu(1000.0, 1e9, 4e12) == pytest.approx(0.25)


def test_round_up_vocab():
    assert train.round_up(8192, 64) == 8192 and train.round_up(50257, 64) == 50304


def _config(name):
    import json
    from transformers import AutoConfig

    d = json.loads((train.MODEL_CONFIG_DIR / f"{name}.json").read_text())
    return AutoConfig.for_model(d.pop("model_type"), **d)


def test_param_count_matches_the_real_model():
    from transformers import AutoModelForCausalLM

    c = _config("mini")
    model = AutoModelForCausalLM.from_config(c)
    counts = train.llama_param_counts(c)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["total"] - counts["non_embedding"] == model.get_input_embeddings().weight.numel()
    assert _config("deepseek-7b") and train.llama_param_counts(_config("deepseek-7b"))["total"] == pytest.approx(6.91e9, rel=0.01)


def test_memory_plan_agrees_with_deepspeed_estimator():
    c = _config("deepseek-7b")
    counts = train.llama_param_counts(c)
    # No offload: ours (16 B/param + the gathered largest tensor) vs DeepSpeed's (18 B/param + 4 B x largest).
    ours = train.memory_plan(c, 3, 1, 2048, "fp16", False, False, True, "sdpa")
    model_states = sum(ours["gpu"][k] for k in ("parameters", "gradients", "optimizer_states", "gathered_largest_tensor"))
    _, ds_gpu = train.deepspeed_estimate(counts["total"], counts["largest_tensor"], 3, 1, False, False)
    assert 0.85 < model_states / ds_gpu < 1.0
    assert model_states / 2**30 > 24  # 7B does not fit 24 GB per GPU without offload, whatever the activations
    # Optimizer and parameters offloaded: host RAM is DeepSpeed's 18 B/param times its 1.5 buffer factor.
    off = train.memory_plan(c, 3, 1, 2048, "fp16", True, True, True, "sdpa")
    ds_host, _ = train.deepspeed_estimate(counts["total"], counts["largest_tensor"], 3, 1, True, True)
    assert off["host_per_process"] * 3 * 1.5 == pytest.approx(ds_host, rel=1e-6)
    assert off["gpu"]["parameters"] == 0 and off["gpu"]["optimizer_states"] == 0


def test_plan_command_names_the_offload_config():
    import subprocess
    import sys

    cmd = [sys.executable, "train.py", "--plan", "--data_dir", "no-such-dir", "--model_config", "deepseek-7b",
           "--seq_len", "2048", "--micro_batch_size", "1", "--accelerate_config"]
    no = subprocess.run(cmd + ["accelerate_configs/zero3_3gpu.yaml"], cwd=train.MODEL_CONFIG_DIR.parent, capture_output=True, text=True)
    assert no.returncode == 0 and "does NOT fit" in no.stdout and "zero3_offload_3gpu.yaml" in no.stdout, no.stdout + no.stderr
    yes = subprocess.run(cmd + ["accelerate_configs/zero3_offload_3gpu.yaml", "--gradient_checkpointing"],
                         cwd=train.MODEL_CONFIG_DIR.parent, capture_output=True, text=True)
    assert "fits:" in yes.stdout and "host RAM" in yes.stdout, yes.stdout + yes.stderr
