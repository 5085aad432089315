"""The GPU check in two halves (bench/gpu_check.sh is the entry point):

    bash bench/gpu_check.sh prepare      here, where pip reaches PyPI: wheels of what the GPU box lacks (gpu_wheels.py)
    bash bench/gpu_check.sh run          there, on one CUDA GPU with no network, in one command of under 8 minutes
    bash bench/gpu_check.sh run --cpu    the same steps at tiny size on 2 CPU processes (tests/test_gpu_check.py)

`run` installs the wheels of .gpu_wheels/ with `pip install --no-index --no-deps --target` into a scratch directory put
first on PYTHONPATH (the machine's own torch is never touched) and checks that what they require is there; then each
step runs under its own timeout (Mode.timeouts_s: on the GPU they sum under 8 minutes), one row each in a table printed
at the end and written, with the JSON and the steps' logs, to $OUT (default bench/results/gpu_check, or gpu_check_cpu
with --cpu):

  environment      the wheels installed and their requirements met (GPU); versions and device
  data             prepare_data.py: python-docs with a BPE tokenizer, once
  dense/moe <p>    train.py, one process per GPU (2 CPU processes), ZeRO-3: the 1.3B-class dense preset and a
                   DeepSeek-V3 preset in bf16 and fp16, and the dense one without document masking: tokens/s and MFU
                   (the mean of the log intervals after the first, which holds the warm-up), peak memory beside the
                   plan's for the device, the plan's tokens/s. A speed run ends by the fault switch's SIGKILL after its
                   last measured step (cli.FAULTS, sigkill_rank), so that it writes nothing: train.py always saves a
                   checkpoint and exports final/ at its last step, ~22 GB for the 1.3B preset.
  masking cost     the dense runs of the first precision: masked over unmasked tokens/s and peak memory
  moe vs dense     PENDING until issue 62: the MoE preset against a dense one of the same activated FLOPs per token
  train 20         a small model, 20 steps with document masking in fp32; its checkpoint and export at the end
  stop             the same run stopped by SIGTERM to the launcher after step 10 (TRAIN_TEST_FAULT=sigterm_launcher)
  resume           `--resume auto` to step 20: its losses against the straight run's, step by step
  eval             eval.py on the resumed run's export: its val_loss against the run's last validation

On the CPU a bf16 or fp16 row runs only where the CPU has the units (else SKIPPED, saying why). A step that fails is a
row saying FAILED with the last error line of its log, the steps that need it say SKIPPED, and the exit status is 1
when any row FAILED (2: no GPU, no wheels, a damaged wheel). What the runs write goes to a scratch directory, deleted
at the end (a speed run's right after it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gpu_wheels
from common import REPO, cpu_bf16_units, free_port

from deepseek_zero3 import cli


@dataclasses.dataclass(frozen=True)
class Shape:
    """How one model trains in a mode."""

    preset: str
    seq_len: int
    micro_batch_size: int
    checkpointing: bool = False


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    config: str  # the accelerate config, launched with --num_processes `processes` and accumulation 1
    processes: int
    precisions: tuple[str, ...]  # of the speed rows; the first one's dense run is also measured without masking
    dense: Shape
    moe: Shape
    small: Shape  # train 20, stop, resume (fp32) and eval
    tokenizer: str
    log_every: int  # speed runs: steps per log interval
    intervals: int  # speed runs: log intervals; the first (the warm-up) is not counted
    eval_tokens: int
    tolerance: float  # relative: resumed losses against the straight run's, eval.py's val_loss against the run's
    timeouts_s: dict  # by kind of step: environment, data, dense, moe, train, stop, resume, eval


GPU = Mode(
    name="gpu", config="accelerate_configs/zero3_3gpu.yaml", processes=1, precisions=("bf16", "fp16"),
    dense=Shape("deepseek-1.3b", 2048, 4, checkpointing=True), moe=Shape("deepseek-v3-mini", 1024, 8),
    small=Shape("mini", 256, 8), tokenizer="bpe:32000", log_every=3, intervals=3, eval_tokens=16384,
    tolerance=1e-4,  # the masked runs' attention backward (memory-efficient SDPA) adds in no fixed order on a GPU
    # Estimates (no GPU has run this yet): 470 s in all, under the 8 minutes of one command on the device tool.
    timeouts_s={"environment": 50, "data": 35, "dense": 60, "moe": 45, "train": 30, "stop": 30, "resume": 30,
                "eval": 25},
)  # fmt: skip
CPU = Mode(
    name="cpu", config="accelerate_configs/zero3_cpu.yaml", processes=2, precisions=("bf16", "fp16"),
    dense=Shape("tiny", 32, 2), moe=Shape("deepseek-v3-tiny", 32, 2), small=Shape("tiny", 32, 2), tokenizer="bpe:512",
    log_every=2, intervals=2, eval_tokens=2048, tolerance=1e-6,
    # Generous: the CPUs this runs on are shared (the test suite's workers, other jobs).
    timeouts_s=dict.fromkeys(("environment", "data", "dense", "moe", "train", "stop", "resume", "eval"), 600),
)  # fmt: skip
RESUME_STEPS, STOP_AFTER = 20, 10


def timeouts_sum_s(mode: Mode) -> int:
    """The longest a mode's steps can take: each row's timeout, once."""
    t = mode.timeouts_s
    speed = len(mode.precisions) * (t["dense"] + t["moe"]) + t["dense"]  # and the dense run without masking
    return t["environment"] + t["data"] + speed + t["train"] + t["stop"] + t["resume"] + t["eval"]


@dataclasses.dataclass
class Row:
    """One step's line in the table and its record in the JSON."""

    name: str
    status: str = "NOT RUN"  # OK, FAILED, SKIPPED (and why), PENDING (a slot for a later issue)
    detail: str = ""
    seconds: float | None = None
    timeout_s: float | None = None
    command: str = ""
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_mem_gib: float | None = None
    planned_mem_gib: float | None = None
    planned_tokens_per_s: float | None = None
    values: dict = dataclasses.field(default_factory=dict)

    def done(self, detail: str, **values) -> None:
        self.status, self.detail = "OK", detail
        self.values.update(values)

    def fail(self, why: str) -> None:
        self.status, self.detail = "FAILED", why

    def skip(self, why: str) -> None:
        self.status, self.detail = "SKIPPED", why


def last_error_line(log: str) -> str:
    """The line of a log that says what went wrong: the scripts' own `error:` line, else the last exception line, else
    the last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for pattern in (r"^error: ", r"^\w+(\.\w+)*(Error|Exception)\b", r"(Error|Exception)\b"):
        found = [line for line in lines if re.search(pattern, line)]
        if found:
            return found[-1][:300]
    return lines[-1][:300] if lines else "(no output)"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def launched_as(output: str, processes: int, precision: str) -> str:
    """Why a run's own batch-plan line contradicts the launch asked for, accumulation 1 on `processes` in `precision`
    (a launcher can quietly start one process, a config set another precision); empty when it agrees."""
    plan = re.search(r"batch plan: \d+ micro x (\d+) accumulation x (\d+) processes = .*; \w+, (\w+), on", output)
    if plan and (int(plan[1]), int(plan[2]), plan[3]) == (1, processes, precision):
        return ""
    return f"launched for {processes} processes, accumulation 1, {precision}; the run says: {plan[0] if plan else '?'}"


def plan_figures(output: str) -> tuple[float | None, float | None]:
    """The plan's memory per device (per process on a CPU) and its tokens/s, from the lines train.py prints at start."""
    memory = re.search(r"^  per (?:device|process): .* = ([\d.]+) GiB$", output, re.MULTILINE)
    rate = re.search(r"^  step: .* = ([\d,]+) tokens/s", output, re.MULTILINE)
    return (float(memory[1]) if memory else None, float(rate[1].replace(",", "")) if rate else None)


def speed_detail(records: list[dict], row: Row, shape: Shape) -> str:
    last = records[-1]
    parts = [f"{shape.preset}, {shape.micro_batch_size} x {shape.seq_len} tokens"
             + (", checkpointing" if shape.checkpointing else ""),
             f"loss {records[0]['loss']:.3f} -> {last['loss']:.3f}"]  # fmt: skip
    if row.planned_tokens_per_s:
        parts.append(f"plan {row.planned_tokens_per_s:,.0f} tokens/s")
    if row.planned_mem_gib:
        parts.append(f"peak/plan memory {row.peak_mem_gib / row.planned_mem_gib:.2f}")
    if "loss_scale" in last:
        parts.append(f"loss scale {last['loss_scale']:.0f}, {last['skipped_steps']} skipped")
    if "moe_maxvio_mean" in last:
        parts.append(f"MaxVio {last['moe_maxvio_mean']:.2f} mean")
    return "; ".join(parts)


# Run by the Python the steps run, with their PYTHONPATH: what every launch imports, and what it runs on.
PROBE = """
import json, platform, importlib.metadata as md
import torch
import deepspeed  # every launch needs it
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "cpu": platform.machine(),
        "cpu_fp16": bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())}
try:
    info["cpu"] = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
except (OSError, StopIteration):
    pass
for name in ("transformers", "accelerate", "deepspeed", "datasets", "huggingface_hub", "tokenizers", "lm_eval"):
    try:
        info[name] = md.version(name)
    except md.PackageNotFoundError:
        info[name] = None
print(json.dumps(info))
"""
VERSIONS = ("python", "torch", "cuda", "transformers", "accelerate", "deepspeed", "datasets", "huggingface_hub",
            "tokenizers", "lm_eval")  # fmt: skip


class Check:
    """The steps of one `run`: their rows, their logs, the scratch directory they write to."""

    def __init__(self, mode: Mode, work: Path, python: str):
        self.mode, self.work, self.python = mode, work, python
        self.rows: list[Row] = []
        self.logs: dict[str, str] = {}
        self.info: dict = {}  # PROBE's
        self.data = work / "data"
        # Offline: the box has no network and nothing here needs the Hub (a lookup would wait out its timeouts). The
        # fault switch is set by the steps that use it, never inherited.
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                    "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
        self.env.pop("TRAIN_TEST_FAULT", None)
        if mode.name == "cpu":
            self.env["DS_ACCELERATOR"] = "cpu"  # as quickstart.sh: DeepSpeed does not look for a GPU

    def row(self, name: str) -> Row:
        self.rows.append(Row(name))
        return self.rows[-1]

    def get(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)

    def ok(self, name: str) -> bool:
        return any(r.name == name and r.status == "OK" for r in self.rows)

    def execute(self, row: Row, kind: str, cmd: list, env: dict | None = None) -> tuple[int | None, str]:
        """Run cmd from the repository root within what is left of the row's timeout (its kind's; a row may run
        several commands); returns (the exit status, None when it timed out and its process group was killed; the
        output)."""
        row.timeout_s = self.mode.timeouts_s[kind]
        cmd = list(map(str, cmd))
        row.command = " ".join(cmd)
        log_path = self.work / "logs" / f"{re.sub(r'[^A-Za-z0-9]+', '_', row.name)}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                    env={**self.env, **(env or {})}, start_new_session=True)  # fmt: skip
            try:
                code = proc.wait(timeout=max(row.timeout_s - (row.seconds or 0), 1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers
                proc.wait()
                code = None
        row.seconds = (row.seconds or 0) + time.perf_counter() - t0
        output = log_path.read_text(errors="replace")
        self.logs[row.name] = self.logs.get(row.name, "") + output
        return code, output

    def failed_run(self, row: Row, code: int | None, output: str) -> None:
        said = f"timed out after {row.timeout_s:.0f} s" if code is None else f"exit {code}"
        row.fail(f"{said}: {last_error_line(output)}")

    def launch_cmd(self, precision: str, *train_args) -> list:
        return [self.python, "-m", "accelerate.commands.launch", "--config_file", self.mode.config, "--num_processes",
                self.mode.processes, "--gradient_accumulation_steps", 1, "--main_process_port", free_port(),
                "--mixed_precision", "no" if precision == "fp32" else precision, "train.py", *train_args]  # fmt: skip

    # -- environment -----------------------------------------------------------------------------------------------

    def environment(self, wheels: Path) -> None:
        row = self.row("environment")
        if self.mode.name == "gpu" and not self.install_wheels(row, wheels):
            return
        code, output = self.execute(row, "environment", [self.python, "-c", PROBE])
        if code != 0:
            self.failed_run(row, code, output)
            return
        self.info = json.loads(output.strip().splitlines()[-1])
        if self.mode.name == "gpu" and not self.info["gpu"]:
            raise cli.UserError(f"torch {self.info['torch']} sees no CUDA device here: on a machine without one, run "
                                "`bash bench/gpu_check.sh run --cpu`")  # fmt: skip
        device = self.info["gpu"] or f"{self.info['cpu']} (bf16 units: {cpu_bf16_units()})"
        versions = ", ".join(f"{k} {self.info[k]}" for k in VERSIONS if self.info.get(k))
        row.done("; ".join(filter(None, [row.detail, device, versions])), **self.info)

    def install_wheels(self, row: Row, wheels: Path) -> bool:
        """The carried wheels into WORK/site, first on the PYTHONPATH of every later step, once their files match the
        manifest; then what they require, checked against what is installed."""
        if not (wheels / gpu_wheels.MANIFEST).is_file():
            if self.has_module("deepspeed"):
                row.detail = f"no {wheels.name}/: this machine's own packages"
                return True
            raise cli.UserError(f"no {wheels / gpu_wheels.MANIFEST} and no DeepSpeed here: run `bash "
                                "bench/gpu_check.sh prepare` where pip reaches PyPI and bring the folder along (the "
                                "device tool: carry it)")  # fmt: skip
        listed = gpu_wheels.verify(wheels)
        site = self.work / "site"
        cmd = [self.python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile", "--target",
               site, *(wheels / w["file"] for w in listed)]  # fmt: skip
        code, output = self.execute(row, "environment", cmd)
        if code != 0:
            self.failed_run(row, code, output)
            return False
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), self.env.get("PYTHONPATH")]))
        if unmet := gpu_wheels.unmet(self.python, self.env, listed):
            row.fail(f"what the carried wheels require is not here: {'; '.join(unmet)}")
            return False
        row.detail = f"{len(listed)} wheels, {sum(w['size'] for w in listed) / 2**20:.1f} MiB, installed; needs met"
        return True

    def has_module(self, name: str) -> bool:
        code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({name!r}) is None)"
        return subprocess.run([self.python, "-c", code], check=False, env=self.env, capture_output=True).returncode == 0

    def prepare_data(self) -> None:
        row = self.row("data")
        if not self.ok("environment"):
            return row.skip("needs environment")
        cmd = [self.python, "prepare_data.py", "--dataset", "python-docs", "--tokenizer", self.mode.tokenizer,
               "--output_dir", self.data, "--validation_fraction", 0.05]  # fmt: skip
        code, output = self.execute(row, "data", cmd)
        if code != 0:
            return self.failed_run(row, code, output)
        wrote = re.search(r"^wrote .*$", output, re.MULTILINE)
        row.done(f"python-docs, {self.mode.tokenizer}: {wrote[0] if wrote else 'prepared'}")

    # -- speed -----------------------------------------------------------------------------------------------------

    def precision_missing(self, precision: str) -> str:
        """Why this CPU cannot train in `precision` (empty where it can; always empty on a GPU)."""
        if self.mode.name == "gpu":
            return ""
        if precision == "bf16" and cpu_bf16_units() == "none":
            return "no bf16 units (AMX or AVX512-BF16) on this CPU: bf16 runs ~100x slower than fp32"
        if precision == "fp16" and not self.info.get("cpu_fp16"):
            return "oneDNN has no fp16 on this CPU: DeepSpeed refuses fp16"
        return ""

    def speed(self, kind: str, precision: str, masking: bool = True) -> None:
        shape, m = getattr(self.mode, kind), self.mode
        row = self.row(f"{kind} {precision}" + ("" if masking else " unmasked"))
        if not self.ok("data"):
            return row.skip("needs data")
        if why := self.precision_missing(precision):
            return row.skip(why)
        last = m.log_every * m.intervals
        out = self.work / "runs" / row.name.replace(" ", "_")
        args = ["--data_dir", self.data, "--model_config", shape.preset, "--output_dir", out, "--seq_len",
                shape.seq_len, "--micro_batch_size", shape.micro_batch_size, "--max_steps", 1000, "--warmup_steps", 10,
                "--lr", 3e-4, "--log_every", m.log_every, "--eval_every", 0, "--no_eval_at_start", "--save_every", 0,
                "--optimizer", "adamw", *(["--gradient_checkpointing"] if shape.checkpointing else []),
                *([] if masking else ["--no_document_masking"])]  # fmt: skip
        # Every process kills itself after the step past the last logged one; should one be left waiting on a dead
        # peer, the launcher kills it 5 s after its SIGTERM, not 30.
        kill = ",".join(f"sigkill_rank:{rank}:{last + 1}" for rank in range(m.processes))
        code, output = self.execute(row, kind, self.launch_cmd(precision, *args),
                                    {"TRAIN_TEST_FAULT": kill, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"})  # fmt: skip
        records = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
        written = sorted(str(p.relative_to(out)) for p in (*out.glob("checkpoints/step_*"), *out.glob("final")))
        cli.remove(out)
        if not records or records[-1]["step"] != last:
            return self.failed_run(row, code, output)
        if err := launched_as(output, m.processes, precision):
            return row.fail(err)
        measured = records[1:]
        row.tokens_per_s = sum(r["tokens_per_s"] for r in measured) / len(measured)
        row.mfu = sum(r["mfu"] for r in measured) / len(measured)
        row.peak_mem_gib = max(r["peak_mem_gib"] for r in records)
        row.planned_mem_gib, row.planned_tokens_per_s = plan_figures(output)
        row.done(speed_detail(records, row, shape), last_record=records[-1], written=written,
                 shape=dataclasses.asdict(shape), masking=masking)  # fmt: skip

    def masking_cost(self) -> None:
        p = self.mode.precisions[0]
        masked, unmasked = self.get(f"dense {p}"), self.get(f"dense {p} unmasked")
        row = self.row("masking cost")
        if not masked.status == unmasked.status == "OK":
            return row.skip(f"needs dense {p} and dense {p} unmasked")
        speed, memory = masked.tokens_per_s / unmasked.tokens_per_s, masked.peak_mem_gib / unmasked.peak_mem_gib
        row.done(f"document masking: {speed:.3f}x the tokens/s and {memory:.3f}x the peak memory of the unmasked run",
                 tokens_per_s_ratio=speed, peak_mem_ratio=memory)  # fmt: skip

    def moe_vs_dense(self) -> None:
        row = self.row("moe vs dense")
        row.status = "PENDING"
        row.detail = (
            "issue 62 item 5: the MoE preset's tokens/s against a dense preset of the same activated FLOPs per token "
            "(bench/moe_throughput.py's dense_twin makes one), measured here once that lands"
        )

    # -- stop and resume, eval -------------------------------------------------------------------------------------

    def small_run(self, out: Path, *extra) -> list:
        s = self.mode.small
        return self.launch_cmd(
            "fp32", "--data_dir", self.data, "--model_config", s.preset, "--output_dir", out, "--seq_len", s.seq_len,
            "--micro_batch_size", s.micro_batch_size, "--max_steps", RESUME_STEPS, "--warmup_steps", 5, "--lr", 2e-3,
            "--log_every", 1, "--eval_every", 0, "--no_eval_at_start", "--eval_tokens", self.mode.eval_tokens,
            "--save_every", 0, "--optimizer", "adamw", *extra,
        )  # fmt: skip

    def train_straight(self, out: Path) -> None:
        row = self.row(f"train {RESUME_STEPS}")
        if not self.ok("data"):
            return row.skip("needs data")
        code, output = self.execute(row, "train", self.small_run(out))
        if code != 0 or not (out / "final" / "config.json").is_file():
            return self.failed_run(row, code, output)
        if err := launched_as(output, self.mode.processes, "fp32"):
            return row.fail(err)
        losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
        written = sorted(str(p.relative_to(out)) for p in (*out.glob("checkpoints/step_*"), *out.glob("final")))
        row.done(f"{self.mode.small.preset}, document masking, fp32: loss {losses[0]:.3f} -> {losses[-1]:.3f}; wrote "
                 f"{', '.join(written)}", written=written)  # fmt: skip

    def stop(self, out: Path) -> None:
        row = self.row("stop")
        if not self.ok(f"train {RESUME_STEPS}"):
            return row.skip(f"needs train {RESUME_STEPS}")
        fault = {"TRAIN_TEST_FAULT": f"sigterm_launcher:0:{STOP_AFTER}"}
        code, output = self.execute(row, "stop", self.small_run(out), fault)
        said = re.search(r"stopped by signal after step (\d+)", output)
        if not said or not (out / "checkpoints" / f"step_{said[1]}" / "trainer_state.json").is_file():
            return self.failed_run(row, code, output)
        row.done(f"SIGTERM to the launcher after step {STOP_AFTER}: stopped after step {said[1]}, step_{said[1]} saved",
                 step=int(said[1]))  # fmt: skip

    def resume(self, straight: Path, out: Path) -> None:
        row = self.row("resume")
        if not self.ok("stop"):
            return row.skip("needs stop")
        step = self.get("stop").values["step"]
        code, output = self.execute(row, "resume", self.small_run(out, "--resume", "auto"))
        if code != 0 or f"step_{step}" not in output:
            return self.failed_run(row, code, output)
        ref = {r["step"]: r["loss"] for r in read_jsonl(straight / "metrics.jsonl") if "loss" in r}
        got = {r["step"]: r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r}  # the last by step
        if sorted(got) != sorted(ref) or len(ref) != RESUME_STEPS:
            return row.fail(f"steps logged: {sorted(got)}; by the straight run: {sorted(ref)}")
        rel = {s: abs(got[s] - ref[s]) / abs(ref[s]) for s in ref}
        before, after = max(rel[s] for s in ref if s <= step), max(rel[s] for s in ref if s > step)
        said = (f"steps {step + 1}-{RESUME_STEPS} after the resume: losses within {after:.1e} (relative) of the "
                f"straight run's; steps 1-{step} within {before:.1e}; tolerance {self.mode.tolerance:.0e}")  # fmt: skip
        if after > self.mode.tolerance:
            return row.fail(said)
        row.done(said, max_rel_diff_before_stop=before, max_rel_diff_after_resume=after)

    def evaluate(self, run_dir: Path) -> None:
        row = self.row("eval")
        if not self.ok("resume"):
            return row.skip("needs resume")
        report = self.work / "eval.json"
        cmd = [self.python, "eval.py", "--model", run_dir / "final", "--dataset", self.data, "--split", "validation",
               "--packed_seq_len", self.mode.small.seq_len, "--eval_tokens", self.mode.eval_tokens, "--dtype",
               "float32", "--output_json", report]  # fmt: skip
        code, output = self.execute(row, "eval", cmd)
        if code != 0 or not report.is_file():
            return self.failed_run(row, code, output)
        scored = json.loads(report.read_text())["val_loss"]
        logged = [r["val_loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "val_loss" in r][-1]
        rel = abs(scored - logged) / abs(logged)
        said = f"eval.py on final/: val_loss {scored:.5f}, the run's last validation {logged:.5f} (relative {rel:.1e})"
        if rel > self.mode.tolerance:
            return row.fail(said)
        row.done(said, val_loss=scored, run_val_loss=logged)

    def steps(self, wheels: Path) -> list:
        straight, stopped = self.work / "runs" / "straight", self.work / "runs" / "stopped"
        p = self.mode.precisions
        return [
            lambda: self.environment(wheels), self.prepare_data,
            *(lambda q=q: self.speed("dense", q) for q in p), lambda: self.speed("dense", p[0], masking=False),
            self.masking_cost, *(lambda q=q: self.speed("moe", q) for q in p), self.moe_vs_dense,
            lambda: self.train_straight(straight), lambda: self.stop(stopped), lambda: self.resume(straight, stopped),
            lambda: self.evaluate(stopped),
        ]  # fmt: skip


def table(rows: list[Row]) -> str:
    def num(value, spec):
        return "" if value is None else format(value, spec)

    lines = ["| step | status | tokens/s | MFU | peak GiB | plan GiB | seconds | detail |",
             "|---|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r.name} | {r.status} | {num(r.tokens_per_s, ',.0f')} | {num(r.mfu, '.1%')} | "
                     f"{num(r.peak_mem_gib, '.2f')} | {num(r.planned_mem_gib, '.2f')} | {num(r.seconds, '.0f')} | "
                     f"{r.detail.replace('|', '/')} |")  # fmt: skip
    return "\n".join(lines)


def exit_status(rows: list[Row]) -> int:
    return 1 if any(r.status == "FAILED" for r in rows) else 0


def run(mode: Mode, out: Path, wheels: Path, python: str) -> int:
    """Every step, then the table on the console and, in OUT, gpu_check.json, summary.md and logs.txt."""
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    check = Check(mode, work, python)
    try:
        for step in check.steps(wheels):
            before = len(check.rows)
            try:
                step()
            except cli.UserError:
                raise
            except Exception as e:  # noqa: BLE001 - a bug of the check's own fails its row, not the rows after it
                if len(check.rows) == before:
                    check.row(f"step {before + 1}")
                check.rows[-1].fail(f"the check itself: {type(e).__name__}: {e}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    device = check.info.get("gpu") or check.info.get("cpu") or "unknown"
    versions = ", ".join(f"{k} {check.info[k]}" for k in VERSIONS if check.info.get(k))
    text = (
        f"GPU check ({mode.name}) on {device}, {time.strftime('%Y-%m-%d')}, {time.time() - started:.0f} s; {versions}"
    )
    text += "\n\n" + table(check.rows)
    report = {"mode": mode.name, "device": device, "date": time.strftime("%Y-%m-%d"), "seconds": time.time() - started,
              "environment": check.info, "ok": not exit_status(check.rows),
              "rows": [dataclasses.asdict(r) for r in check.rows]}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    cli.write_json_atomic(out / "gpu_check.json", report)
    cli.write_atomic(out / "summary.md", text + "\n")
    cli.write_atomic(out / "logs.txt", "".join(f"===== {name}\n{log[-200_000:]}\n" for name, log in check.logs.items()))
    print(text)
    print(f"\nwrote {out / 'gpu_check.json'}, {out / 'summary.md'}, {out / 'logs.txt'}")
    return exit_status(check.rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="The GPU check's run half (bash bench/gpu_check.sh run [--cpu]).")
    ap.add_argument("--cpu", action="store_true", help="the same steps at tiny size on 2 CPU processes, with this "
                                                       "environment's packages")  # fmt: skip
    args = ap.parse_args(argv)
    try:
        mode = CPU if args.cpu else GPU
        out = Path(os.environ.get("OUT") or REPO / "bench" / "results" / f"gpu_check{'_cpu' if args.cpu else ''}")
        return run(mode, out, gpu_wheels.WHEELS, sys.executable)
    except cli.UserError as e:
        cli.print_error(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
