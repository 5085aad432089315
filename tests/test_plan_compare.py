"""The strategy planner (costs.py, `train.py --plan --compare`): its counts against hand counts, its recommendation
against its own one-config plan, and the checks a real run makes at start (host RAM, the link's content).
"""

import dataclasses
import itertools
import re
import sys
import time

import pytest
import torch
from conftest import REPO, TINY, launch_cmd, run

import train
from deepseek_zero3 import distributed
from deepseek_zero3.model import models
from deepseek_zero3.planning import costs, measure, model_math

GIB = 2**30


def gpu_launch(stage: int, offload: str = "none", params: bool = False, accum: int = 2, precision: str = "fp16"):
    return distributed.Launch(3, 1, precision, accum, offload, params, True, stage)


@pytest.fixture(scope="module")
def mini():
    """The mini preset and its parameter count from the built model (not from the planner's own count)."""
    from transformers import AutoModelForCausalLM

    c = models.load_model_config("mini", "", 128, None)
    return c, sum(p.numel() for p in AutoModelForCausalLM.from_config(c).parameters())


def test_traffic_per_step_by_hand(mini):
    c, p = mini
    counts = model_math.param_counts(c)
    assert counts["total"] == p
    ring = 2 / 3  # of each buffer, over 3 processes
    t = lambda launch, ckpt=False: costs.traffic(counts, launch, ckpt)
    # DDP: one all-reduce of the fp32 gradients per optimizer step, whatever the accumulation.
    assert t(gpu_launch(0))["link"] == pytest.approx(2 * ring * 4 * p)
    assert t(gpu_launch(0, accum=8))["link"] == t(gpu_launch(0))["link"]
    # ZeRO-2: 16-bit gradients all-reduced each of the 2 micro-steps (DeepSpeed's bucket all-reduce), parameters
    # all-gathered once.
    assert t(gpu_launch(2))["link"] == pytest.approx(2 * 2 * ring * 2 * p + ring * 2 * p)
    # ZeRO-3: per micro-step two all-gathers (forward, backward) + a reduce-scatter; a third gather to recompute.
    assert t(gpu_launch(3))["link"] == pytest.approx(2 * 3 * ring * 2 * p)
    assert t(gpu_launch(3), True)["link"] == pytest.approx(2 * 4 * ring * 2 * p)
    assert t(gpu_launch(3, precision="fp32"))["link"] == pytest.approx(2 * 3 * ring * 4 * p)
    # Offload over PCIe, per process: its 16-bit gradient shard down each micro-step, its parameters up once; with
    # parameter offload its shard up for each gather.
    assert t(gpu_launch(3, "cpu"))["pcie"] == pytest.approx(3 * 2 * p / 3)
    assert t(gpu_launch(3, "cpu", True))["pcie"] == pytest.approx(3 * 2 * p / 3 + 2 * 2 * 2 * p / 3)
    # NVMe: master weights and Adam states (12 B) read and written once per step.
    assert t(gpu_launch(3, "nvme"))["nvme"] == pytest.approx(2 * 12 * p)
    assert t(distributed.Launch(1, 1, "fp16", 2, "none", False, True, 3))["link"] == 0


def test_memory_per_gpu_and_host_by_hand(mini):
    c, p = mini
    largest = c.vocab_size * c.hidden_size
    mem = lambda launch: costs.memory_plan(c, launch, 1, 128, False, "sdpa")
    ddp, zero2, zero3 = mem(gpu_launch(0)), mem(gpu_launch(2)), mem(gpu_launch(3))
    # DDP: fp32 weights + autocast's 16-bit copy, fp32 gradients + the reducer's buckets, Adam m and v, denominator.
    assert [ddp["gpu"][k] for k in ("parameters", "gradients", "optimizer_states", "optimizer_step_temporaries")] == [
        6 * p, 8 * p, 8 * p, 4 * p
    ]  # fmt: skip
    assert zero2["gpu"]["parameters"] == pytest.approx(2 * p)
    assert zero2["gpu"]["gradients"] == pytest.approx(6 * p / 3)
    assert zero2["gpu"]["optimizer_states"] == pytest.approx(12 * p / 3)
    assert zero3["gpu"]["parameters"] == pytest.approx(2 * p / 3)
    assert zero3["gpu"]["gathered_largest_tensor"] == 2 * largest
    assert zero3["host_per_process"] == 0
    off = mem(gpu_launch(3, "cpu"))
    assert off["gpu"]["optimizer_states"] == 0 and off["host_per_process"] == pytest.approx(16 * p / 3)
    both = mem(gpu_launch(3, "cpu", True))
    assert both["gpu"]["parameters"] == 0 and both["host_per_process"] == pytest.approx(18 * p / 3)
    nvme = mem(gpu_launch(3, "nvme"))
    # NVMe: fp32 gradients in RAM, and DeepSpeed's 4 pinned fp32 swap buffers of a sub-group (here the whole shard).
    assert nvme["host_per_process"] == pytest.approx(4 * p / 3 + 4 * (p / 3) * 4)
    assert nvme["nvme_per_process"] == pytest.approx(4 * p)
    # Host RAM of the machine: without zero.Init each of the 3 processes builds the fp32 model first.
    base = 2 * GIB
    assert costs.host_bytes(ddp, gpu_launch(0), base) == pytest.approx(3 * base + 3 * 4 * p)
    assert costs.host_bytes(off, gpu_launch(3, "cpu"), base) == pytest.approx(3 * base + 16 * p + 2 * p)


def test_bf16_under_zero_sums_gradients_in_fp32_and_the_plan_counts_it(mini, tmp_path, monkeypatch):
    """Issue #60: bf16 under ZeRO-2/3 sums the micro-steps' gradients in fp32 (train.py sets DeepSpeed's
    data_types.grad_accum_dtype), whichever config: YAML keys, a DeepSpeed JSON, or --mixed_precision bf16 at launch on
    an fp16 YAML. ZeRO-3's partition grows from 2 to 4 bytes a parameter (in host RAM with the optimizer offloaded);
    ZeRO-2 sums into the fp32 partition its step takes (4, not 16-bit 2 + the step's fp32 copy 4). A config that names
    its own grad_accum_dtype keeps it; ZeRO-1 and fp16 keep DeepSpeed's default, the model's dtype."""
    c, p = mini
    monkeypatch.chdir(REPO)
    yaml_bf16 = dataclasses.replace(distributed.read_launch("accelerate_configs/zero3_3gpu.yaml"), precision="bf16")
    for launch, dtype in ((yaml_bf16, "fp32"), (gpu_launch(2, precision="bf16"), "fp32"),
                          (gpu_launch(3), "fp16"), (gpu_launch(1, precision="bf16"), "bf16"),
                          (gpu_launch(0, precision="bf16"), "fp32"), (gpu_launch(3, precision="fp32"), "fp32")):
        assert launch.grad_accum_dtype == dtype, launch  # fmt: skip
    js = tmp_path / "ds.json"
    js.write_text('{"zero_optimization": {"stage": 3}, "data_types": {"grad_accum_dtype": "bfloat16"}}')
    (tmp_path / "c.yaml").write_text(f"distributed_type: DEEPSPEED\nmixed_precision: bf16\nnum_processes: 3\n"
                                     f"deepspeed_config:\n  deepspeed_config_file: {js}\n")  # fmt: skip
    assert distributed.read_launch(str(tmp_path / "c.yaml")).grad_accum_dtype == "bf16"
    mem = lambda launch: costs.memory_plan(c, launch, 1, 128, False, "sdpa")
    for stage, fp16_b, bf16_b in ((3, 2, 4), (2, 6, 4)):
        assert mem(gpu_launch(stage))["gpu"]["gradients"] == pytest.approx(fp16_b * p / 3), stage
        assert mem(gpu_launch(stage, precision="bf16"))["gpu"]["gradients"] == pytest.approx(bf16_b * p / 3), stage
    off16, off_bf16 = mem(gpu_launch(3, "cpu")), mem(gpu_launch(3, "cpu", precision="bf16"))
    assert off_bf16["gpu"]["gradients"] == off16["gpu"]["gradients"]
    assert off_bf16["host_per_process"] == pytest.approx(off16["host_per_process"] + 2 * p / 3)


def compare_7b(capsys, host_gib: float, **flags) -> tuple[str, str]:
    cfg = train.Config(plan=True, compare=True, data_dir="none", model_config="deepseek-7b", seq_len=2048,
                       micro_batch_size=1, gradient_checkpointing=True, host_memory_gib=host_gib, **flags)  # fmt: skip
    assert train.run_plan(cfg) == 0
    out = capsys.readouterr().out
    return out, re.search(r"^recommended: (.*)$", out, re.MULTILINE).group(1)


def test_more_host_ram_never_makes_the_plan_worse(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    speeds, fitting = [], []
    for host in (16, 32, 64, 128, 160, 256, 512, 1024):
        out, _ = compare_7b(capsys, host)
        rows = re.findall(r"^(\S+\.yaml) .* ([\d,]+)  (yes|no)", out, re.MULTILINE)
        assert len(rows) == len(costs.STRATEGIES), out
        fitting.append({name for name, _, fits in rows if fits == "yes"})
        speeds.append(max([float(s.replace(",", "")) for _, s, fits in rows if fits == "yes"], default=0.0))
    assert all(a <= b for a, b in itertools.pairwise(fitting)), fitting
    assert all(a <= b for a, b in itertools.pairwise(speeds)), speeds
    assert speeds[0] == 0 and speeds[-1] > 0


def test_7b_recommendation_by_host_ram_and_plan_agrees(capsys, monkeypatch):
    """The issue's check: 7B on 3 x 24 GB with 512 and with 32 GiB of host RAM."""
    monkeypatch.chdir(REPO)
    big, rec_big = compare_7b(capsys, 512)
    _, rec_small = compare_7b(capsys, 32)
    assert rec_big != rec_small
    assert "zero3_offload_3gpu.yaml" not in rec_big  # parameter offload only where nothing else fits
    for rec in (rec_big, rec_small):
        names = re.findall(r"(\w+\.yaml)", rec)
        assert names and all((REPO / "accelerate_configs" / n).is_file() for n in names), rec
    # --plan on the recommended config, micro-batch and accumulation agrees with the row.
    config, micro, accum = re.fullmatch(
        r"(accelerate_configs/\S+) --micro_batch_size (\d+) --gradient_accumulation_steps (\d+)", rec_big
    ).groups()
    row = re.search(
        rf"^{re.escape(config.split('/')[1])} +{micro} x {accum} +([\d.]+) .* ([\d,]+)  yes", big, re.MULTILINE
    )
    cfg = train.Config(plan=True, data_dir="none", model_config="deepseek-7b", seq_len=2048, host_memory_gib=512,
                       micro_batch_size=int(micro), gradient_checkpointing=True, accelerate_config=config,
                       gradient_accumulation_steps=int(accum))  # fmt: skip
    assert train.run_plan(cfg) == 0
    one = capsys.readouterr().out
    assert f"= {row.group(2)} tokens/s" in one, (row.group(0), one)
    assert f"fits: needs {row.group(1)} GiB of 24 GiB per GPU" in one, (row.group(0), one)


@pytest.mark.slow
def test_a_run_needing_more_host_ram_than_the_machine_is_refused(docs_data, tmp_path):
    out = tmp_path / "out"
    proc = run([sys.executable, "train.py", *TINY, "--data_dir", docs_data, "--output_dir", out, "--max_steps", "2",
                "--host_memory_gib", "0.25"], check=False)  # fmt: skip
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "host RAM" in errors[0], proc.stdout + proc.stderr
    assert "does NOT fit: host needs" in proc.stdout
    assert not out.exists() or not any(out.iterdir())  # nothing written
    # A CPU run's plan computes at the rate it timed on its own model (issue #26), not at an assumed MFU.
    assert re.search(r"compute at [\d.e-]+ TFLOP/s per process \(measured on this model: ", proc.stdout), proc.stdout


@pytest.mark.slow
def test_cpu_plan_on_paper_times_the_model(capsys, monkeypatch):
    """`--plan` for CPU processes times the model in this process (one thread for each of several processes, and
    their share of the cores); past the size a copy may have, the plan falls back to --assumed_mfu of a nominal core."""
    monkeypatch.chdir(REPO)
    cfg = train.Config(plan=True, data_dir="none", model_config="tiny", seq_len=32, micro_batch_size=2)
    assert train.run_plan(cfg) == 0  # the CPU config: 3 processes
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  step:"))
    assert float(re.search(r"compute at ([\d.e-]+) TFLOP/s per process \(measured on this model", line)[1]) > 0, line
    state = torch.get_rng_state()  # the timing leaves the run's random state alone
    assert measure.measure_model_rate(models.load_model_config("tiny", "", 32, None), 2, 32, "fp32", "sdpa", 16) > 0
    assert torch.equal(state, torch.get_rng_state())
    monkeypatch.setattr(measure, "MEASURED_COPY_MAX_PARAMS", 0)
    assert train.run_plan(cfg) == 0
    assert "compute at 0.035 TFLOP/s per process (35% MFU of 0.1 TFLOP/s)" in capsys.readouterr().out


@pytest.mark.parametrize("preset", ["tiny", "deepseek-v3-tiny"])
@pytest.mark.slow
def test_timed_copy_keeps_zero3_processes_in_step_at_every_layer(preset):
    """Each timed pass of the 2-layer copy waits at every layer's start and again when its backward ends, and at the
    timed (second) layer's forward end and backward start: 6 waits a pass, the forward's before the backward's."""
    calls = []
    c = models.load_model_config(preset, "", 32, None)
    assert measure.measure_model_rate(c, 2, 32, "fp32", "sdpa", 16, sync=lambda: calls.append(torch.is_grad_enabled()))
    # grad mode is off in backward
    assert calls == [True, True, True, False, False, False] * measure.MEASURED_PASSES, calls


@pytest.mark.slow
def test_a_model_whose_layers_are_not_found_is_timed_whole_without_lock_step(monkeypatch):
    """No decoder-layer list to time or to wait at: the 2-layer copy's pass per 2 layers, and no sync (which every
    process skips alike: same config), rather than no measured rate at all."""
    c = models.load_model_config("tiny", "", 32, None)
    timed = measure.measure_model_rate(c, 2, 32, "fp32", "sdpa", 16)
    monkeypatch.setattr(measure, "decoder_layers", lambda model, layers: None)
    calls = []
    whole = measure.measure_model_rate(c, 2, 32, "fp32", "sdpa", 16, sync=lambda: calls.append(1))
    assert whole > 0 and not calls
    assert whole < 2 * timed  # the same copy's passes, not a rate from elsewhere (both vary with the machine's load)


def test_ddp_all_reduce_hides_behind_the_syncing_micro_steps_backward_but_its_last_bucket():
    """DDP all-reduces its buckets during the backward of the micro-step that syncs: the plan hides what fits in that
    backward (2/3 of its compute), never the last bucket (25 MiB, or the input embedding's gradient when larger: DDP
    gives it a bucket of its own, and the backward makes it last); ZeRO and one process hide nothing."""
    ddp = distributed.Launch(2, 1, "fp32", 4, "none", False, False, 0)
    p, small = 100 * 2**20 / 4, 2**20  # 100 MiB of fp32 gradients (4 buckets); an embedding of 4 MiB
    assert costs.ddp_hidden_s(p, small, ddp, 1.0, 100.0) == pytest.approx(0.75)  # a long backward: all but 25 MiB
    assert costs.ddp_hidden_s(p, small, ddp, 1.0, 3.0) == pytest.approx(0.5)  # 2/3 x 3 s / 4 micro-steps
    # an embedding over a bucket is a bucket of its own, and its gradient the backward's last: 40 of 100 MiB exposed
    assert costs.ddp_hidden_s(p, 40 * 2**20 / 4, ddp, 1.0, 100.0) == pytest.approx(0.6)
    assert costs.ddp_hidden_s(p, small, dataclasses.replace(ddp, zero_stage=2), 1.0, 100.0) == 0.0
    assert costs.ddp_hidden_s(p, small, dataclasses.replace(ddp, world_size=1), 1.0, 100.0) == 0.0
    assert costs.ddp_hidden_s(1e6, small, ddp, 1.0, 100.0) == 0.0  # one bucket holds it all: nothing to overlap


def test_time_layer_times_the_layers_forward_and_backward_and_nothing_else():
    """The plan scales the model by one layer's time: the layer's own forward and backward (50 ms of sleep here), not
    any of the rest of the pass around it (200 ms before it and after it, forward and backward)."""

    def sleeping(forward_s, backward_s):
        class Sleep(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                time.sleep(forward_s)
                return x * 2

            @staticmethod
            def backward(ctx, grad):
                time.sleep(backward_s)
                return grad * 2

        return Sleep.apply

    layer_op, rest = sleeping(0.02, 0.03), sleeping(0.2, 0.2)

    class Layer(torch.nn.Module):
        def forward(self, x):
            return layer_op(x)

    layer = Layer()
    seconds = measure.time_layer(layer)
    for _ in range(2):
        x = torch.ones(3, requires_grad=True)
        rest(layer(rest(x))).sum().backward()
    assert len(seconds) == 2 and all(0.05 <= s < 0.2 for s in seconds), seconds  # any of the rest: >= 0.25


def test_lock_step_never_hooks_a_list_of_experts():
    """Ranks call different experts: a sync in one would hang the others. A model whose experts are a ModuleList as
    long as its layers list gets the layers hooked; one with no list named like layers gets none."""
    calls = []

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

        def forward(self, x):
            return self.experts[0](x)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Block(), Block()])
    measure.lock_step(model, lambda: calls.append(1), 2)
    x = torch.ones(1, 4, requires_grad=True)
    for block in model.layers:
        x = block(x)
    x.sum().backward()
    assert len(calls) == 4, calls  # 2 layers x (forward, backward); the experts' lists are as long but not named so
    odd = torch.nn.Module()
    odd.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    odd.blocks_of_other_name = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    measure.lock_step(odd, lambda: calls.append(1), 2)
    odd.experts[0](torch.ones(1, 4))
    assert len(calls) == 4


def test_paper_plan_gives_zero3_processes_beyond_the_cores_turns(monkeypatch):
    """3 processes on 2 cores in lock step take two turns per layer: half a core each; apart they share 2/3."""
    monkeypatch.setattr(measure, "measure_model_rate", lambda *a, **k: 1.0)
    monkeypatch.setattr(measure.os, "sched_getaffinity", lambda pid: {0, 1})
    cfg = train.Config(data_dir="none")
    launch = distributed.read_launch(str(REPO / "accelerate_configs/zero3_cpu.yaml"))
    assert (launch.world_size, launch.zero_stage) == (3, 3)
    assert measure.paper_cpu_rate(cfg, None, launch) == 0.5
    assert measure.paper_cpu_rate(cfg, None, dataclasses.replace(launch, zero_stage=2)) == pytest.approx(2 / 3)
    assert measure.paper_cpu_rate(cfg, None, dataclasses.replace(launch, world_size=2)) == 1.0


@pytest.mark.launch
def test_data_changed_on_the_link_stops_the_run_with_the_p2p_advice(docs_data, tmp_path):
    out = tmp_path / "out"
    args = [*TINY, "--data_dir", docs_data, "--output_dir", out, "--max_steps", "2"]
    proc = run(launch_cmd(2, *args), check=False, env={"TRAIN_TEST_FAULT": "corrupt_link:1:0"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and errors and "NCCL_P2P_DISABLE=1" in errors[0], proc.stdout + proc.stderr
    assert "x 2 processes" in proc.stdout  # both processes started and took part in the check
    assert "rank 0's on rank 1)" in errors[0]
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--pcie_gb_s", "0"], "--pcie_gb_s 0.0 must be positive"),
        (["--interconnect_gb_s", "-1"], "--interconnect_gb_s -1.0 must be positive"),
        (["--host_memory_gib", "-5"], "--host_memory_gib -5.0 must not be negative"),
        (["--micro_batch_size", "0"], "--micro_batch_size 0 must be at least 1"),
        (["--gradient_accumulation_steps", "-2"], "--gradient_accumulation_steps -2 must not be negative"),
        (["--accelerate_config", "accelerate_configs/zero2_cpu.json"], "is not an accelerate config"),
        (["--accelerate_config", "accelerate_configs/zero3_multinode.yaml"], "--compare weighs the 3-GPU configs"),
        (["--accelerate_config", "accelerate_configs/zero3_cpu.yaml"], "3 CPU processes on 1 machine(s)"),
    ],
)
def test_plan_refuses_odd_flags_and_files_in_one_line(flags, says, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert train.main(["--plan", "--compare", "--data_dir", "none", *flags]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in errors[0], errors
