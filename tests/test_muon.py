"""Issue #41: --optimizer muon. The update is Muon's (against a Newton-Schulz iteration written here, in float64), the
parameters go to the groups DeepSpeed's rule gives, the plan counts Muon's matrices as the built model has them, and
real runs: 3 processes == 1 and stop/resume == straight under ZeRO-2 (Llama preset, against one plain process: the
single-device class) and under ZeRO-3 (DeepSeek-V3 preset with its MTP module, against one ZeRO-3 process), each with a
NaN loss at step 3 that every process skips, as with AdamW."""

import dataclasses
import io
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import MOE, REPO, TINY, assert_processes, launch, run, train_records
from transformers import AutoConfig, AutoModelForCausalLM

import train
from deepseek_zero3 import distributed
from deepseek_zero3.cli import UserError
from deepseek_zero3.model import mtp
from deepseek_zero3.planning import costs, model_math
from deepseek_zero3.recipe import optimizer as optimizer_lib
from deepseek_zero3.run_dir import checkpoint

EIGHT = ["--max_steps", "8", "--save_every", "4", "--optimizer", "muon"]
# The dtype DeepSpeed's Muon runs its (Gram) Newton-Schulz iteration in: fp16 where the accelerator has it (every GPU;
# a CPU whose oneDNN has fp16, the Xeons with AMX), else fp32 (an AMD EPYC); DeepSpeed exports it for tolerances. fp16
# rounds the normalised momentum to 11 bits: its updates are 0.5-2.9% off the fp64 iteration (relative Frobenius norm,
# measured on a Xeon with AMX; an update of the wrong momentum is 30% off), and the float noise of 3 processes'
# gradient sums against one's comes out of it larger (3.1e-5 relative in the loss by step 7 there, 1.2e-7 on an EPYC).
from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype  # noqa: E402

NS_DTYPE = ns_compute_dtype("gram")
STEP_TOLERANCE = 1e-4 if NS_DTYPE == torch.float32 else 5e-2
RUNS_TOLERANCE = 1e-5 if NS_DTYPE == torch.float32 else 3e-4
NAN_STEP = 3  # rank 0's loss is NaN at step 3 of the straight runs: every process skips it (weights, momentum, LR)
NAN = {"TRAIN_TEST_FAULT": f"nan_loss:0:{NAN_STEP}"}
SKIPPED = f"step {NAN_STEP}: skipped (the loss or gradient norm is not finite)"
# DeepSpeed's Muon with torch's AdamW for its AdamW half: no FusedAdam to build on first use (nvcc, ninja; issue #60),
# as the live engine says it at start. Seen failing without "torch_adam": "AdamW half: FusedAdam".
AUX_TORCH_ADAMW = "DeepSpeed: ZeRO-{stage}, MuonWithAuxAdam (AdamW half: AdamW)"


def model_of(preset: str, vocab: int = 96):
    c = AutoConfig.for_model(**{**json.loads((REPO / "model_configs" / f"{preset}.json").read_text()),
                                "vocab_size": vocab})  # fmt: skip
    return c, AutoModelForCausalLM.from_config(c)


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's orthogonalisation as Jordan et al. write it: the matrix over its Frobenius norm, then `steps` quintic
    iterations X <- a X + (b A + c A^2) X with A = X X^T, a, b, c = 3.4445, -4.7750, 2.0315, on the wide side."""
    x = g.double()
    wide = x.shape[0] <= x.shape[1]
    x = x if wide else x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x if wide else x.T


def test_the_step_is_the_orthogonalised_momentum_and_the_rest_is_adamw():
    torch.manual_seed(0)
    _, model = model_of("tiny")
    cfg = train.Config(optimizer="muon", lr=2e-3, muon_lr=0.02, muon_weight_decay=0.1, weight_decay=0.1)
    opt = optimizer_lib.make(model, cfg, None)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # a CPU compiles nothing (compile_newton_schulz)
    names = dict(model.named_parameters())
    q, embed, norm = (names[n] for n in ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight",
                                         "model.norm.weight"))  # fmt: skip
    ref = {p: p.detach().clone().requires_grad_() for p in (embed, norm)}
    adamw = torch.optim.AdamW([{"params": [ref[embed]], "weight_decay": 0.1}, {"params": [ref[norm]],
                               "weight_decay": 0.0}], lr=2e-3, betas=(0.9, 0.95), eps=1e-8)  # fmt: skip
    momentum = torch.zeros_like(q, dtype=torch.float64)
    for _ in range(3):
        tokens = torch.randint(0, 96, (2, 16))
        model(tokens, labels=tokens).loss.backward()
        g, before = q.grad.double(), q.detach().double().clone()
        for p, r in ref.items():
            r.grad = p.grad.clone()
        opt.step()
        adamw.step()
        opt.zero_grad()
        momentum = 0.95 * momentum + 0.05 * g
        expected = newton_schulz(0.05 * g + 0.95 * momentum) * max(1, q.shape[0] / q.shape[1]) ** 0.5
        taken = (before * (1 - 0.02 * 0.1) - q.detach().double()) / 0.02
        error = float((taken - expected).norm() / expected.norm())
        assert error <= STEP_TOLERANCE, (NS_DTYPE, error)
        for p, r in ref.items():  # embedding and norms: torch's AdamW, decay on the 2-D one only
            torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    optimizer_lib.set_lr(opt, 1e-3, cfg)  # the schedule's LR: AdamW's as given, Muon's x muon_lr / lr
    assert sorted(g["lr"] for g in opt.param_groups) == pytest.approx([1e-3, 1e-3, 0.01])
    # The independent iteration is the orthogonalisation: a wrong coefficient moves it far outside the tolerance.
    g = torch.randn(16, 40, dtype=torch.float64)
    assert (newton_schulz(g) - newton_schulz(g * 3)).abs().max() < 1e-6
    singular = torch.linalg.svdvals(newton_schulz(g))
    assert singular.min() > 0.5 and singular.max() < 1.5, singular


def test_a_cpu_run_compiles_nothing_unless_it_asked_accelerate_to(monkeypatch):
    from torch._dynamo import eval_frame

    torch.compiler.set_stance("default")
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")  # accelerate launch --dynamo_backend inductor
    assert "compiled (torch.compile)" in optimizer_lib.compile_newton_schulz(torch.device("cpu"))
    assert eval_frame._stance.stance == "default"
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND")
    assert "eager" in optimizer_lib.compile_newton_schulz(torch.device("cpu"))
    assert eval_frame._stance.stance == "force_eager"


@pytest.mark.slow
def test_a_compiler_that_does_not_work_leaves_newton_schulz_eager_and_says_so(docs_data, tmp_path):
    """Issue #60: where Muon's update is compiled (GPUs: Triton; here a CPU run that asked Accelerate to compile, as
    `accelerate launch --dynamo_backend inductor` does) and the compiler does not work on the machine, the run says so
    in its first lines and trains eagerly. The broken compiler is real: CXX names none, so inductor's C++ compile fails
    as Triton's does without a C compiler (a fresh inductor cache: no kernel compiled before). Seen failing before:
    InductorError (InvalidCxxCompiler) in a traceback at the first forward."""
    out = tmp_path / "eager"
    env = {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR", "CXX": str(tmp_path / "no-compiler" / "g++"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # fmt: skip
    proc = run([sys.executable, "train.py", *TINY, "--optimizer", "muon", "--max_steps", "2", "--micro_batch_size",
                "2", "--no_eval_at_start", "--data_dir", docs_data, "--output_dir", out], env=env)  # fmt: skip
    note = next((line for line in proc.stdout.splitlines() if line.startswith("note: torch.compile")), "")
    assert "does not work on this machine (InductorError: InvalidCxxCompiler" in note, proc.stdout[-3000:]
    assert "runs eagerly" in note and proc.stdout.index(note) < proc.stdout.index("step 1/2")
    assert sorted(train_records(out)) == [1, 2] and all(r["loss"] < 7 for r in train_records(out).values())


def test_a_checkpoint_of_deepspeeds_own_adam_half_continues_under_torchs():
    """DeepSpeed's Muon now runs its AdamW half with torch's AdamW ("torch_adam"); a checkpoint from before (DeepSpeed's
    FusedAdam, or its inline update: an int step count per parameter) stopped torch's AdamW at its first step
    ("API has changed, `state_steps` ..."). after_load turns the counts into tensors, and the AdamW half continues as
    the inline update would have. Real: DeepSpeed's MuonWithAuxAdam with its inline update and with torch's AdamW, a
    state dict saved and loaded. Not real: the ZeRO wrapper around it (a stand-in holding it as .optimizer); a real
    resume of a checkpoint the code before this change wrote was run by hand (issue #60's report). Seen failing
    without the conversion: that RuntimeError."""
    from types import SimpleNamespace

    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    def optimizer(params, adam):
        groups = [{"params": [params[0]], "use_muon": True, "lr": 0.02},
                  {"params": [params[1]], "use_muon": False, "lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}]
        return MuonWithAuxAdam(groups, adam_optimizer=adam, adam_optimizer_kwargs={"foreach": None} if adam else None)

    def step(opt, params, seed):
        g = torch.Generator().manual_seed(seed)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()

    torch.manual_seed(0)
    old = [torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(16))]
    new = [torch.nn.Parameter(p.detach().clone()) for p in old]
    with torch.compiler.set_stance("force_eager"):  # as a CPU run takes it (compile_newton_schulz)
        inline, torchs = optimizer(old, None), optimizer(new, torch.optim.AdamW)
        assert torchs.aux_optimizer is not None and inline.aux_optimizer is None
        for seed in (1, 2):
            step(inline, old, seed)
        buffer = io.BytesIO()
        torch.save(inline.state_dict(), buffer)  # as a checkpoint holds it
        saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
        assert saved["state"][1]["step"] == 2  # an int
        with torch.no_grad():
            for p, q in zip(new, old):
                p.copy_(q)
        torchs.load_state_dict(saved)
        optimizer_lib.after_load(SimpleNamespace(optimizer=SimpleNamespace(optimizer=torchs)))
        step(torchs, new, 3)
        step(inline, old, 3)
    assert float(torchs.state[new[1]]["step"]) == 3
    torch.testing.assert_close(new[1].detach(), old[1].detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("preset,depth", [("tiny", 0), ("deepseek-v3-tiny", 1), ("deepseek-v3-tiny", 0)])
def test_groups_follow_deepspeeds_rule_and_the_plan_counts_them(preset, depth):
    c, model = model_of(preset)
    if depth:
        mtp.attach(model, depth, 0)
    cfg = train.Config(optimizer="muon")
    groups = optimizer_lib.groups(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for p in groups[0]["params"]}
    adam = {names[id(p)] for g in groups[1:] for p in g["params"]}
    assert not muon & adam and len(muon | adam) == len(names)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= adam
    assert all(p.dim() >= 2 for p in groups[0]["params"]) and all("norm" in n for n in adam if n.endswith("m.weight"))
    if preset != "tiny":  # MLA's projections, the fused experts (3-D), the router, the MTP projection
        for part in ("kv_a_proj_with_mqa", "kv_b_proj", "experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight"):
            assert any(part in n for n in muon), part
        assert any(p.dim() == 3 for p in groups[0]["params"])
        assert ("mtp.0.eh_proj.weight" in muon) == bool(depth)
    real = sum(p.numel() for p in groups[0]["params"])
    assert model_math.muon_params(c, depth) == real
    described = optimizer_lib.describe(model, cfg)
    assert f"Muon: {len(muon)} tensors, {real / 1e6:.2f}M parameters" in described
    assert "model.layers.*.self_attn" in described and "AdamW: " in described


def test_the_plan_counts_muons_state_and_newton_schulz():
    c, _ = model_of("small", 4096)
    launch = distributed.Launch(3, 1, "bf16", 1, "none", False, True, 3)
    adamw = costs.memory_plan(c, launch, 1, 128, False, "sdpa")
    muon = costs.memory_plan(c, launch, 1, 128, False, "sdpa", muon=model_math.muon_params(c))
    freed = adamw["gpu"]["optimizer_states"] - muon["gpu"]["optimizer_states"]
    assert freed == pytest.approx(4 * model_math.muon_params(c) / 3)  # one fp32 momentum, not Adam's two moments
    h, f = c.hidden_size, c.intermediate_size  # one layer's q: 5 x (4 h^3 + 2 h^3); gate: m = h, n = f
    assert model_math.newton_schulz_flops(c) > c.num_hidden_layers * 5 * (2 * 6 * h**3 + 3 * (4 * h * h * f + 2 * h**3))
    cfg = train.Config(optimizer="muon", seq_len=128, micro_batch_size=1)
    machine = costs.machine_for(cfg, launch, 1e12)
    one = costs.step_costs(c, cfg, launch, 1, machine, 0)
    assert one["newton_schulz_s"] == pytest.approx(model_math.newton_schulz_flops(c) / 3 / machine.flops_per_device)
    offload = costs.step_costs(c, cfg, distributed.Launch(3, 1, "bf16", 1, "cpu", False, True, 3), 1, machine, 0)
    assert not offload["fits"] and "Muon" in offload["why"]


def test_the_plan_on_paper_takes_the_optimizer_a_run_would(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    plan = dict(plan=True, data_dir="none", model_config="small", seq_len=128, micro_batch_size=1)
    assert train.run_plan(train.Config(**plan, compare=True)) == 0  # auto: AdamW where the optimizer is offloaded
    rows = dict(re.findall(r"^(zero3_\w+_3gpu\.yaml) .* (yes|no: .*)$", capsys.readouterr().out, re.MULTILINE))
    assert rows == dict.fromkeys(["zero3_offload_opt_3gpu.yaml", "zero3_offload_3gpu.yaml", "zero3_nvme_3gpu.yaml"],
                                 "yes"), rows  # fmt: skip
    assert train.run_plan(train.Config(**plan, compare=True, optimizer="muon")) == 0
    assert capsys.readouterr().out.count("no: Muon does not run with the optimizer offloaded") == 3
    for compare in (False, True):  # as the run refuses it (--compare: on the configs without offload)
        assert train.run_plan(train.Config(**plan, max_grad_norm=1.0, compare=compare), {"max_grad_norm"}) == 2
        assert "auto's choice for --model_config small" in capsys.readouterr().err
    c, _ = model_of("small", 4096)  # each row: Muon's Newton-Schulz where the optimizer is on the GPUs, else AdamW's
    machine = costs.machine_for(train.Config(), distributed.Launch(3, 1, "bf16", 1, "none", False, True, 3), 1e12)
    for offload, muon in (("none", True), ("cpu", False)):
        launch = distributed.Launch(3, 1, "bf16", 1, offload, False, True, 3)
        _, k = costs.largest_fitting(c, train.Config(model_config="small", seq_len=128), launch, machine, 0, 1)
        assert k["fits"] and (k["newton_schulz_s"] > 0) == muon, (offload, k["why"], k["newton_schulz_s"])


def test_flags_and_strategies_muon_refuses():
    offloaded = distributed.Launch(3, 1, "bf16", 1, "cpu", False, True, 3)
    with pytest.raises(UserError, match="zero3_3gpu.yaml"):
        optimizer_lib.check(train.Config(optimizer="muon"), offloaded)
    optimizer_lib.check(train.Config(optimizer="adamw"), offloaded)
    for bad in ({"optimizer": "sgd"}, {"muon_lr": -1.0}, {"muon_lr": float("nan")}, {"muon_momentum": 1.0}):
        with pytest.raises(UserError):
            optimizer_lib.check(train.Config(**bad), None)
    cfg = train.Config(optimizer="muon")
    assert optimizer_lib.resolve(cfg, set()).max_grad_norm == 0
    with pytest.raises(UserError, match="unclipped"):
        optimizer_lib.resolve(cfg, {"max_grad_norm"})
    assert optimizer_lib.resolve(train.Config(), {"max_grad_norm"}).max_grad_norm == 1.0


def test_a_muon_checkpoint_on_another_zero_process_count_is_refused_before_anything_is_written():
    from deepseek_zero3.run_dir import reshard
    from deepseek_zero3.training_data.token_data import BatchPlan

    state = {"micro_batch_size": 2, "grad_accum_steps": 1, "world_size": 3, "step": 4, "config": {"optimizer": "muon"}}
    zero3 = lambda n: distributed.Launch(n, 1, "fp32", 1, "none", False, False, 3)
    with pytest.raises(UserError, match="holds Muon's momentum.*resume on 3 processes"):
        reshard.check_launch(state, zero3(2), BatchPlan(3, 1, 2, 32), Path("ckpt"))
    reshard.check_launch(state, zero3(3), BatchPlan(2, 1, 3, 32), Path("ckpt"))  # its own count
    adamw = {**state, "config": {"optimizer": "adamw"}}
    reshard.check_launch(adamw, zero3(2), BatchPlan(3, 1, 2, 32), Path("ckpt"))  # Adam's state reshards
    ddp = distributed.Launch(2, 1, "fp32", 1, "none", False, False, 0)
    reshard.check_launch(state, ddp, BatchPlan(3, 1, 2, 32), Path("ckpt"))  # DDP checkpoints hold whole tensors


def test_auto_picks_muon_for_the_presets_it_won_on_and_old_runs_stay_adamw():
    pick = lambda **kw: optimizer_lib.pick(train.Config(**kw)).optimizer
    assert pick(model_config="mini") == pick(model_config="small") == "muon"  # bench/muon.py: 0.49x and 0.40x
    assert pick(model_config="tiny") == "adamw"
    assert pick(model_config="mini", optimizer="adamw") == "adamw"
    assert pick(model_config="mini", init_from="some/model") == "adamw"  # not the preset's weights: not benchmarked
    offloaded = distributed.Launch(3, 1, "bf16", 1, "cpu", False, True, 3)
    assert optimizer_lib.pick(train.Config(model_config="mini"), offloaded).optimizer == "adamw"  # Muon cannot
    with pytest.raises(UserError, match="auto's choice for --model_config mini"):
        optimizer_lib.resolve(train.Config(model_config="mini"), {"max_grad_norm"})
    # A checkpoint saved before --optimizer existed trained with AdamW: its resume keeps it, --optimizer auto included.
    saved = {f: v for f, v in dataclasses.asdict(train.Config()).items() if f != "optimizer"}
    for flags_given in (set(), {"optimizer"}):
        cfg, taken, _ = checkpoint.config_for_resume(train.Config(), flags_given, saved)
        assert cfg.optimizer == "adamw" and taken["optimizer"] == "adamw", flags_given


def assert_same(a_dir, b_dir, steps, rel: float, steps_of_nan=()) -> None:
    a, b = train_records(a_dir), train_records(b_dir)
    assert all(s in a and s in b for s in steps), (sorted(a), sorted(b))
    for s in steps:
        if s == NAN_STEP and s in steps_of_nan:
            assert a[s]["loss"] is None and b[s]["loss"] is None, (s, a[s]["loss"], b[s]["loss"])  # skipped
            continue
        assert abs(a[s]["loss"] - b[s]["loss"]) <= rel * a[s]["loss"], (s, a[s]["loss"], b[s]["loss"])


def resumed(straight: Path, tmp_path: Path, config: str) -> Path:
    copy = tmp_path / "copy" / "step_4"
    shutil.copytree(straight / "checkpoints" / "step_4", copy)
    out = tmp_path / "resumed"
    proc = launch(3, "--resume", copy, "--output_dir", out, "--max_steps", "8", config=config)
    assert f"resumed from {copy} at step 4" in proc.stdout
    assert sorted(train_records(out)) == [5, 6, 7, 8]
    return out


@pytest.mark.launch
def test_zero2_llama_three_processes_train_like_one_and_resume_exactly(docs_data, tmp_path):
    config = "accelerate_configs/zero2_cpu.yaml"
    one = tmp_path / "one"  # one plain process: DeepSpeed's single-device Muon on the whole batch of 6
    plain = run([sys.executable, "train.py", *TINY, *EIGHT, "--micro_batch_size", "6", "--data_dir", docs_data,
                 "--output_dir", one], env=NAN)  # fmt: skip
    assert "; NO, fp32" in plain.stdout and "optimizer: Muon + AdamW" in plain.stdout and SKIPPED in plain.stdout
    three = tmp_path / "three"
    proc = launch(3, *TINY, *EIGHT, "--micro_batch_size", "2", "--data_dir", docs_data, "--output_dir", three,
                  config=config, env=NAN)  # fmt: skip
    assert_processes(proc, 3)
    assert "optimizer: Muon + AdamW" in proc.stdout and "  Muon: 14 tensors" in proc.stdout and SKIPPED in proc.stdout
    assert AUX_TORCH_ADAMW.format(stage=2) in proc.stdout, proc.stdout[-3000:]
    assert_same(one, three, range(1, 9), rel=RUNS_TOLERANCE, steps_of_nan=[NAN_STEP])  # fp32 NS: 6e-8 (the sums' order)
    assert_same(three, resumed(three, tmp_path, config), range(5, 9), rel=0.0)


@pytest.mark.launch
def test_zero3_deepseek_v3_three_processes_train_like_one_and_resume_exactly(docs_data, tmp_path):
    args = [*MOE, *EIGHT, "--data_dir", docs_data]
    one, three = tmp_path / "one", tmp_path / "three"
    # One thread in the one process, as torchrun gives each of the 3: MKL's float32 matmul on an AMD EPYC (issue #44),
    # or with its AVX2 kernels anywhere, rounds differently on 2 threads, and a router's tie to that noise sends a token
    # to another expert (test_moe.py).
    single = launch(1, *args, "--micro_batch_size", "6", "--output_dir", one, env={**NAN, "OMP_NUM_THREADS": "1"})
    assert SKIPPED in single.stdout and "on cpu, torch threads per process: 1" in single.stdout
    proc = launch(3, *args, "--micro_batch_size", "2", "--output_dir", three, env=NAN)
    assert "mtp.*.eh_proj.weight" in proc.stdout and "experts.gate_up_proj" in proc.stdout and SKIPPED in proc.stdout
    assert AUX_TORCH_ADAMW.format(stage=3) in proc.stdout, proc.stdout[-3000:]
    assert_same(one, three, range(1, 9), rel=RUNS_TOLERANCE, steps_of_nan=[NAN_STEP])  # fp32 NS: 1.2e-7
    assert_same(three, resumed(three, tmp_path, "accelerate_configs/zero3_cpu.yaml"), range(5, 9), rel=0.0)
