"""fp16 and bf16 under DeepSpeed ZeRO-3 on CPU processes (issue #26): 3 processes train like 1 on the same global
batch, a stopped run resumes exactly (losses, and in fp16 the loss scale and skipped steps), and a checkpoint is
refused in another precision. DeepSpeed's CPU accelerator takes fp16 only where oneDNN has fp16
(`torch.ops.mkldnn._is_mkldnn_fp16_supported()`, e.g. Xeons with AMX); bf16 runs everywhere but is ~100x slower than
fp32 without bf16 units (AMX or AVX512-BF16), so each precision's tests skip, saying why, where the units are missing.
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY, assert_processes, launch_cmd, metrics, reloaded_model, run, train_records


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1] for line in text.splitlines() if line.startswith("flags")), "").split())


UNITS = {
    "fp16": (torch.ops.mkldnn._is_mkldnn_fp16_supported(), "oneDNN has no fp16 on this CPU: DeepSpeed refuses fp16"),
    "bf16": (
        bool(cpu_flags() & {"amx_bf16", "avx512_bf16"}),
        "no bf16 units (AMX or AVX512-BF16) on this CPU: bf16 runs ~100x slower than fp32",
    ),
}
STEPS = 10
COMMON = [*TINY, "--lr_decay_steps", str(STEPS), "--save_every", "5"]


def needs(precision: str):
    present, why = UNITS[precision]
    return pytest.mark.skipif(not present, reason=why)


def launch(nproc: int, precision: str, *args, check=True):
    cmd = launch_cmd(nproc, *COMMON, *args)
    proc = run(cmd[:2] + ["--mixed_precision", precision] + cmd[2:], check=check)
    if check:
        assert_processes(proc, nproc)
        assert f"DEEPSPEED, {precision}" in proc.stdout, proc.stdout[-2000:]
    return proc


@pytest.fixture(scope="module", params=["fp16", "bf16"])
def runs(request, docs_data, tmp_path_factory) -> dict:
    """Per precision: 3 processes x micro-batch 2 for 10 steps; 1 process x 6 on the same global batch; the 3-process
    run's step-5 checkpoint resumed by hand in a new --output_dir to step 10 (what a run stopped after it does; the
    resume of a run stopped by --max_steps is test_train.py's), on 3 processes and on 1."""
    precision = request.param
    present, why = UNITS[precision]
    if not present:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp(precision)
    data = ["--data_dir", docs_data]
    launch(3, precision, *data, "--micro_batch_size", "2", "--max_steps", STEPS, "--output_dir", tmp / "three")
    launch(1, precision, *data, "--micro_batch_size", "6", "--max_steps", STEPS, "--output_dir", tmp / "one")
    step_5 = tmp / "three" / "checkpoints" / "step_5"
    resumed = launch(3, precision, "--max_steps", STEPS, "--output_dir", tmp / "resumed", "--resume", step_5)
    assert "resumed from" in resumed.stdout
    # The same checkpoint on 1 process (issue #38), converted beside a copy of it.
    shutil.copytree(step_5, tmp / "copy" / "step_5")
    args = ["--max_steps", STEPS, "--micro_batch_size", "6", "--output_dir", tmp / "on_one"]
    on_one = launch(1, precision, *args, "--resume", tmp / "copy" / "step_5")
    assert "written by 3 processes, this run has 1" in on_one.stdout
    return {"precision": precision, "dir": tmp}


def test_three_processes_train_like_one(runs):
    """3 x 2 and 1 x 6 sequences reduce the same gradients in another order and partition; in bf16 (8-bit mantissa)
    and fp16 (11-bit) that order shows in the last bits of every step's weights. Measured on an Intel Xeon with AMX:
    at most 3.4e-4 nats (bf16) and 2.3e-4 (fp16) over 10 steps; the bound is the issue's 2e-3, about 6x the larger."""
    three, one = train_records(runs["dir"] / "three"), train_records(runs["dir"] / "one")
    assert sorted(three) == sorted(one) == list(range(1, STEPS + 1))
    for step in three:
        assert math.isfinite(three[step]["loss"])
        assert abs(three[step]["loss"] - one[step]["loss"]) < 2e-3, (step, three[step]["loss"], one[step]["loss"])


def test_stop_and_resume_equals_the_straight_run(runs):
    """The resumed run's steps 6-10 equal the straight run's: same losses (to 1e-6) and, in fp16, the same loss scale
    and skipped-step count, which the checkpoint carries."""
    straight, resumed = train_records(runs["dir"] / "three"), train_records(runs["dir"] / "resumed")
    for step in range(6, STEPS + 1):
        assert resumed[step]["loss"] == pytest.approx(straight[step]["loss"], rel=1e-6, abs=1e-6), step
        for key in ("loss_scale", "skipped_steps"):
            assert resumed[step].get(key) == straight[step].get(key), (step, key)
    if runs["precision"] == "fp16":
        assert "loss_scale" in straight[STEPS] and "skipped_steps" in straight[STEPS]


def test_a_checkpoint_of_three_processes_continues_on_one(runs):
    """Issue #38 in 16 bits: the step-5 checkpoint resumed on 1 process x 6 carries the weights, the fp32 master copy,
    the moments and, in fp16, the loss scale and skipped-step count. The loss of step 6 (the loaded weights, before
    any update) equals the straight run's to 1e-3; later steps reduce 16-bit gradients in the 1-process order, so
    they stay within the 2e-3 that 3 processes and 1 keep from each other (test_three_processes_train_like_one)."""
    straight, on_one = train_records(runs["dir"] / "three"), train_records(runs["dir"] / "on_one")
    assert sorted(on_one) == list(range(6, STEPS + 1))
    assert on_one[6]["loss"] == pytest.approx(straight[6]["loss"], rel=1e-3)
    for step in on_one:
        assert abs(on_one[step]["loss"] - straight[step]["loss"]) < 2e-3, (step, on_one[step], straight[step])
        assert on_one[step].get("loss_scale") == straight[step].get("loss_scale"), step
        assert on_one[step].get("skipped_steps") == straight[step].get("skipped_steps"), step


def test_export_loads_in_its_precision_and_scores_like_the_last_validation(runs, docs_data):
    """OUT/final of a 16-bit run holds 16-bit weights (ZeRO-3 gathers them: stage3_gather_16bit_weights_on_model_save)
    that from_pretrained loads as they are, and whose loss on the validation windows in a fresh process equals the
    run's last val_loss to 2e-3 relative (16-bit rounding of weights and logits); an fp32 export fails the dtype
    check."""
    from safetensors import safe_open

    final = runs["dir"] / "three" / "final"
    with safe_open(final / "model.safetensors", "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    expected = {"fp16": torch.float16, "bf16": torch.bfloat16}[runs["precision"]]
    assert dtypes == {expected}, dtypes
    fresh = reloaded_model(final, docs_data)
    last = [r for r in metrics(runs["dir"] / "three") if "val_loss" in r][-1]["val_loss"]
    assert fresh["class"].endswith("ForCausalLM") and fresh["dtype"] == str(expected)
    assert fresh["val_loss"] == pytest.approx(last, rel=2e-3), (fresh["val_loss"], last)


@needs("fp16")
@pytest.mark.launch
def test_an_fp16_checkpoint_is_refused_in_bf16(runs):
    """Before, DeepSpeed died with FileNotFoundError for bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt."""
    if runs["precision"] != "fp16":
        pytest.skip("the fp16 runs' checkpoint is the one to resume")
    out = runs["dir"] / "resumed"
    before = (out / "metrics.jsonl").read_text()
    proc = launch(3, "bf16", "--output_dir", out, "--resume", "auto", "--max_steps", STEPS, check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "precision='fp16'" in errors[0] and "precision='bf16'" in errors[0], proc.stderr[-3000:]
    assert (out / "metrics.jsonl").read_text() == before


@needs("fp16")
@pytest.mark.launch
def test_fp16_overflow_skips_halves_the_scale_and_stops_at_the_minimum(docs_data, tmp_path):
    """From step 3 on, rank 0's loss is NaN: DeepSpeed's fp16 scaler skips every step (weights and Adam moments stay
    those of step 2: two checkpoints after it are equal), keeps the scale on the first overflow (hysteresis 2) and
    halves it on each one after; at scale 1 the run stops with one line of advice (exit 3), last checkpoint intact."""
    from test_resilience import zero_state

    out = tmp_path / "overflow"
    args = ["--max_steps", "40", "--micro_batch_size", "2", "--save_every", "8", "--no_eval_at_start"]
    cmd = launch_cmd(1, *TINY, *args, "--data_dir", docs_data, "--output_dir", out)
    proc = run(
        cmd[:2] + ["--mixed_precision", "fp16"] + cmd[2:], check=False, env={"TRAIN_TEST_FAULT": "nan_loss:0:3-40"}
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "fp16 loss scale is at its minimum" in errors[0], proc.stderr[-3000:]
    records = train_records(out)
    last = max(records)
    assert [records[s]["loss_scale"] for s in range(1, 5)] == [65536, 65536, 65536, 32768]
    assert all(records[s]["loss_scale"] == records[s - 1]["loss_scale"] / 2 for s in range(5, last + 1))
    assert records[last]["loss_scale"] == 1 and records[last]["skipped_steps"] == last - 2
    assert "step 4: skipped (fp16 overflow, loss scale now 32768); 2 in all" in proc.stdout
    ckpts = out / "checkpoints"
    newest = ckpts / (ckpts / "latest").read_text().strip()
    assert not (out / "final").exists() and newest.name == f"step_{last - last % 8}"
    before, after = zero_state(ckpts / "step_8", 0), zero_state(newest, 0)  # both after step 2, all skipped since
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@needs("bf16")
@pytest.mark.launch
def test_bf16_zero3_sums_gradients_in_fp32(docs_data, tmp_path):
    """Issue #60: a bf16 ZeRO-3 run's engine sums the gradients of its micro-steps in fp32 (DeepSpeed's default is the
    model's dtype: bf16 rounds the sum to 8 bits of mantissa at every micro-step). 2 processes, accumulation 2: the
    line train.py prints from the live engine's ZeRO optimizer. Seen failing with the rule broken: it said bf16."""
    out = tmp_path / "accum"
    cmd = launch_cmd(2, *TINY, "--max_steps", "2", "--micro_batch_size", "2", "--no_eval_at_start", "--data_dir",
                     docs_data, "--output_dir", out, accum=2)  # fmt: skip
    proc = run(cmd[:2] + ["--mixed_precision", "bf16"] + cmd[2:])
    assert_processes(proc, 2, accum=2)
    assert "DEEPSPEED, bf16" in proc.stdout
    assert "DeepSpeed: ZeRO-3, AdamW; gradients summed over 2 micro-step(s) per step in fp32" in proc.stdout, (
        proc.stdout[-3000:]
    )
    assert all(math.isfinite(r["loss"]) for r in train_records(out).values())


# One ZeRO-3 process in bf16: the gradient of 8 micro-steps accumulated by an engine with the launch's accumulation
# dtype (distributed.Launch.grad_accum_dtype, what train.py sets) and, for contrast, with DeepSpeed's default (bf16),
# against the exact sum of each micro-step's bf16 gradient, taken one micro-step at a time (loss / 8 scales every bf16
# gradient by a power of two, exactly).
ACCUMULATION = r"""
import json, sys
sys.path.insert(0, {repo!r})
import torch, deepspeed
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from deepspeed.utils import safe_get_full_grad
from transformers import LlamaForCausalLM  # imported before zero.Init patches construction
from deepseek_zero3 import distributed
from deepseek_zero3.cli import exit_process
from deepseek_zero3.model import lmloss
from test_loss import build

acc = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
MICRO = 8


def engine_for(accum: int, accum_dtype: str):
    ds = json.load(open({repo!r} + "/accelerate_configs/zero3_cpu.json"))
    ds.update(train_micro_batch_size_per_gpu=2, train_batch_size=2 * accum, gradient_accumulation_steps=accum,
              gradient_clipping=0.0, fp16={{"enabled": False}}, bf16={{"enabled": True}},
              data_types={{"grad_accum_dtype": accum_dtype}})
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = build("tiny", False)
    return deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=ds)[0]


def backward(engine, x, y):
    nll, n = lmloss.model_nll(engine, x, y, 1024)
    engine.backward((nll / n).float())
    return {{k: safe_get_full_grad(p).double().clone() for k, p in engine.module.named_parameters()}}


g = torch.Generator().manual_seed(0)
batches = [(torch.randint(0, 1000, (2, 32), generator=g), torch.randint(0, 1000, (2, 32), generator=g))
           for _ in range(MICRO)]
one = engine_for(1, "fp32")
exact = {{}}
for x, y in batches:
    for k, grad in backward(one, x, y).items():
        exact[k] = exact.get(k, 0) + grad / MICRO
    one.optimizer.zero_grad()
launch = distributed.Launch(1, 1, "bf16", MICRO, "none", False, False, 3)
results = {{}}
for name, accum_dtype in (("launch", launch.grad_accum_dtype), ("deepspeed_default", "bf16")):
    engine = engine_for(MICRO, accum_dtype)
    for x, y in batches:
        summed = backward(engine, x, y)
    error = max(((summed[k] - exact[k]).norm() / exact[k].norm()).item() for k in exact)
    results[name] = {{"dtype": distributed.describe_engine(engine, MICRO).split()[-1], "error": error}}
acc.print("RESULT " + json.dumps(results))
exit_process(0)
"""


@needs("bf16")
@pytest.mark.launch
def test_fp32_accumulation_sums_the_micro_steps_exactly(tmp_path):
    """Measured: 2.5e-9 from the exact sum of 8 micro-steps' bf16 gradients with the launch's fp32 accumulation,
    4.3e-3 with DeepSpeed's default bf16 one. Seen failing with Launch.grad_accum_dtype giving bf16 for bf16 ZeRO-3."""
    from conftest import REPO

    script = tmp_path / "accumulation.py"
    script.write_text(ACCUMULATION.format(repo=str(REPO)))
    proc = run(launch_cmd(1, script=str(script)), env={"PYTHONPATH": str(REPO / "tests")})
    results = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert results["launch"]["dtype"] == "fp32" and results["launch"]["error"] < 1e-6, results
    assert results["deepspeed_default"]["dtype"] == "bf16" and results["deepspeed_default"]["error"] > 5e-4, results
