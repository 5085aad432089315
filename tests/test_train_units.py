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
