"""The strategies beside ZeRO-3 (accelerate_configs/, one config per strategy), on CPU processes.

ZeRO-2 on 2 processes against one plain process (no DeepSpeed) on the same global batch of 6, and a ZeRO-2 run
stopped and resumed against the straight one; ZeRO-Infinity (optimizer states on NVMe) against the ZeRO-3 reference,
where DeepSpeed's async_io op can be built. The 1-process reference is not a ZeRO-3 one: zero.Init draws the initial
weights in another order, so ZeRO-3 and ZeRO-2 runs of the same seed start from different weights.
"""

import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, TINY, assert_processes, launch, launch_cmd, run, train_records

import train
from deepseek_zero3 import distributed

ZERO2 = "accelerate_configs/zero2_cpu.yaml"
TEN = ["--max_steps", "10"]


def weights(out_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(Path(out_dir) / "final" / "model.safetensors")


def assert_same_run(a_dir, b_dir, steps, loss_rel: float, weight_rel: float) -> None:
    a, b = train_records(a_dir), train_records(b_dir)
    for s in steps:
        assert abs(a[s]["loss"] - b[s]["loss"]) <= loss_rel * a[s]["loss"], (s, a[s]["loss"], b[s]["loss"])
        assert a[s]["lr"] == b[s]["lr"], (s, a[s]["lr"], b[s]["lr"])
    wa, wb = weights(a_dir), weights(b_dir)
    assert wa.keys() == wb.keys()
    for name in wa:
        diff = float((wa[name] - wb[name]).norm() / wa[name].norm())
        assert diff <= weight_rel, f"{name}: relative difference {diff:.2e}"


@pytest.fixture(scope="module")
def zero2(docs_data, tmp_path_factory):
    """2 ZeRO-2 processes x micro-batch 3, 10 steps, checkpoints at steps 5 and 10; returns (OUT, the launch)."""
    out = tmp_path_factory.mktemp("zero2") / "out"
    args = [*TINY, *TEN, "--micro_batch_size", "3", "--save_every", "5", "--data_dir", docs_data, "--output_dir", out]
    return out, launch(2, *args, config=ZERO2)


def test_zero2_two_processes_train_like_one_plain_process(zero2, docs_data, tmp_path):
    out, proc = zero2
    assert_processes(proc, 2)
    plan_line = next(line for line in proc.stdout.splitlines() if line.startswith("batch plan:"))
    assert "3 micro x 1 accumulation x 2 processes = 6 sequences" in plan_line and "DEEPSPEED, fp32" in plan_line
    assert "parameters held per process: 100.0% 100.0%" in proc.stdout  # ZeRO-2 keeps the weights whole
    # What DeepSpeed wrote is a ZeRO-2 checkpoint: one copy of the model, the optimizer state in one shard per rank.
    shards = out / "checkpoints" / "step_10" / "pytorch_model"
    assert sorted(p.name for p in shards.iterdir()) == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    saved = torch.load(shards / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    assert saved["ds_config"]["zero_optimization"]["stage"] == 2 and saved["dp_world_size"] == 2

    one = tmp_path / "one"  # one process, no DeepSpeed, no launcher: torch's AdamW on the whole batch of 6
    args = [*TINY, *TEN, "--micro_batch_size", "6", "--data_dir", docs_data, "--output_dir", one]
    plain = run([sys.executable, "train.py", *args])
    assert "6 micro x 1 accumulation x 1 processes" in plain.stdout and "; NO, fp32" in plain.stdout
    # Measured: losses equal to 1e-7, weights to 6e-7; only the order of the sums differs.
    assert_same_run(one, out, range(1, 11), loss_rel=1e-5, weight_rel=1e-5)


@pytest.mark.launch
def test_zero2_stop_and_resume_equals_the_straight_run(zero2, tmp_path):
    """A copy of the straight run's step-5 checkpoint, resumed elsewhere, ends where the straight run did."""
    straight, _ = zero2
    copy = tmp_path / "copy" / "step_5"
    shutil.copytree(straight / "checkpoints" / "step_5", copy)
    out = tmp_path / "resumed"
    proc = launch(2, "--resume", copy, "--output_dir", out, *TEN, config=ZERO2)
    assert f"resumed from {copy} at step 5" in proc.stdout
    assert sorted(train_records(out)) == [6, 7, 8, 9, 10]
    assert_same_run(straight, out, range(6, 11), loss_rel=0.0, weight_rel=0.0)


def test_optimizer_offload_trains_adamw():
    """With the optimizer offloaded, Accelerate hands DeepSpeed a CPU Adam of its own making from the optimizer it is
    given; it is AdamW (decoupled weight decay) only when that optimizer is torch's AdamW."""
    import deepspeed.ops.adam
    from accelerate.utils import map_pytorch_optim_to_deepspeed

    built = {}

    class CPUAdam:  # records what Accelerate builds, without compiling DeepSpeed's op
        def __init__(self, groups, **kwargs):
            built.update(kwargs, groups=groups)

    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.LayerNorm(4))
    cfg = train.Config(weight_decay=0.1, adam_beta2=0.95, adam_eps=1e-7)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(deepspeed.ops.adam, "DeepSpeedCPUAdam", CPUAdam)
        map_pytorch_optim_to_deepspeed(train.make_optimizer(model, cfg))
    assert built["adamw_mode"] is True
    assert [(g["weight_decay"], len(g["params"])) for g in built["groups"]] == [(0.1, 1), (0.0, 2)]
    assert all(g["betas"] == (0.9, 0.95) and g["eps"] == 1e-7 for g in built["groups"])


def async_io_problem() -> str | None:
    """Why DeepSpeed's async_io op (ZeRO-Infinity's NVMe swapping) cannot be built here; None when it can."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if AsyncIOBuilder().is_compatible(verbose=False):
        return None
    return (
        "DeepSpeed's async_io op cannot be built here: libaio's headers and libaio.so are missing (Debian: apt install "
        "libaio-dev; PyPI's `libaio` is only a ctypes wrapper of the system library), so ZeRO-Infinity cannot swap"
    )


@pytest.mark.launch
def test_zero3_nvme_offload_trains_like_zero3(request, docs_data, tmp_path):
    """zero3_nvme_3gpu.yaml on CPU processes, its path given as its header says, against the ZeRO-3 reference."""
    problem = async_io_problem()
    if problem:
        pytest.skip(problem)
    ref = request.getfixturevalue("ref_run")[0]  # conftest's 3-process ZeRO-3 run, only once this test runs
    config = yaml.safe_load((REPO / "accelerate_configs" / "zero3_nvme_3gpu.yaml").read_text())
    config.update(use_cpu=True, mixed_precision="no")
    config.pop("gpu_ids")
    (tmp_path / "nvme.yaml").write_text(yaml.safe_dump(config))
    nvme, out = tmp_path / "nvme", tmp_path / "out"
    nvme.mkdir()
    args = [*TINY, *TEN, "--micro_batch_size", "2", "--data_dir", docs_data, "--output_dir", out]
    env = {"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH": str(nvme)}
    proc = run(launch_cmd(3, *args, config=tmp_path / "nvme.yaml"), env=env, timeout=900)
    assert_processes(proc, 3)
    assert "offload optimizer=True" in proc.stdout
    assert sorted(p.name for p in (nvme / "zero_stage_3" / "optimizer").iterdir()) == ["rank0", "rank1", "rank2"]
    # Measured: 3e-7 (the CPU AdamW against torch's, in another order of operations).
    assert_same_run(ref, out, range(1, 11), loss_rel=1e-5, weight_rel=1e-4)


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "accelerate_configs").glob("*.yaml")))
def test_every_config_parses(name, monkeypatch):
    monkeypatch.chdir(REPO)  # a config names its DeepSpeed JSON relative to the repository, as the launcher reads it
    path = REPO / "accelerate_configs" / name
    config = yaml.safe_load(path.read_text())
    assert path.read_text().startswith("# ") and config["distributed_type"] in ("DEEPSPEED", "MULTI_GPU")
    ds_file = (config.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if ds_file:
        assert (REPO / ds_file).is_file(), ds_file
    launch_record = distributed.read_launch(str(Path("accelerate_configs") / name))
    assert launch_record.world_size == config["num_processes"]


@pytest.mark.launch
def test_zero2_resumes_on_another_number_of_processes(zero2, tmp_path):
    """Issue #38 under ZeRO-2: the 2-process step-5 checkpoint continues on 3 processes, each step's loss and gradient
    norm as the straight 2-process run's to 1e-5."""
    straight, _ = zero2
    copy = tmp_path / "copy" / "step_5"
    shutil.copytree(straight / "checkpoints" / "step_5", copy)
    three = tmp_path / "three"
    proc = launch(3, "--resume", copy, "--output_dir", three, *TEN, "--micro_batch_size", "2", config=ZERO2)
    assert "written by 2 processes, this run has 3" in proc.stdout
    a, b = train_records(straight), train_records(three)
    assert sorted(b) == list(range(6, 11))
    for s in b:
        for key in ("loss", "grad_norm"):
            assert b[s][key] == pytest.approx(a[s][key], rel=1e-5), (s, key, a[s][key], b[s][key])
