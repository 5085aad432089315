"""The GPU check (bench/gpu_check.sh, issue 60): its CPU half runs here in full, so that the steps the GPU half runs
(the same code at other sizes) cannot rot between GPU runs; its GPU half's own parts (the wheel folder's checks, the
timeouts) are tested on what they read. No GPU runs here: the GPU branch is the CPU one with Mode GPU's sizes, the
wheels installed first, and no DS_ACCELERATOR."""

import dataclasses
import importlib.metadata
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import gpu_check
import gpu_wheels
import pytest
import torch
from conftest import REPO, run

from deepseek_zero3 import cli


def cpu_has(precision: str) -> bool:
    """What the check reads too: bf16 units in /proc/cpuinfo, fp16 in oneDNN."""
    if precision == "bf16":
        return gpu_check.cpu_bf16_units() != "none"
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


@pytest.mark.launch
def test_cpu_check_runs_every_step(tmp_path):
    """`run --cpu` as a user runs it: every row OK (bf16/fp16 SKIPPED, saying why, where this CPU lacks the units), 2
    processes in every launch, the speed runs leaving nothing on disk, the resumed losses equal to the straight run's,
    eval.py's val_loss equal to the run's; one table on the console and in summary.md, the same rows in the JSON."""
    out = tmp_path / "out"
    proc = run(["bash", "bench/gpu_check.sh", "run", "--cpu"], timeout=1800,
               env={"PYTHON": sys.executable, "OUT": str(out), "TMPDIR": str(tmp_path)})  # fmt: skip
    report = json.loads((out / "gpu_check.json").read_text())
    rows = {r["name"]: r for r in report["rows"]}
    speed = ["dense bf16", "dense fp16", "dense bf16 unmasked", "moe bf16", "moe fp16"]
    assert list(rows) == ["environment", "data", "dense bf16", "dense fp16", "dense bf16 unmasked", "masking cost",
                          "moe bf16", "moe fp16", "moe vs dense", "train 20", "stop", "resume", "eval"]  # fmt: skip
    for name in speed:
        precision = name.split()[1]
        if not cpu_has(precision):
            assert rows[name]["status"] == "SKIPPED" and "on this CPU" in rows[name]["detail"], rows[name]
            continue
        r = rows[name]
        assert r["status"] == "OK", r
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["peak_mem_gib"] > 0, r
        assert r["planned_mem_gib"] is not None and r["planned_tokens_per_s"] > 0, r
        assert r["values"]["last_record"]["step"] == 4 and r["values"]["written"] == [], r  # no checkpoint, no final/
    assert rows["masking cost"]["status"] == ("OK" if cpu_has("bf16") else "SKIPPED")
    assert rows["moe vs dense"]["status"] == "PENDING" and "issue 62" in rows["moe vs dense"]["detail"]
    for name in ("environment", "data", "train 20", "stop", "resume", "eval"):
        assert rows[name]["status"] == "OK", rows[name]
    assert rows["train 20"]["values"]["written"] == ["checkpoints/step_20", "final"]
    assert rows["resume"]["values"]["max_rel_diff_after_resume"] <= 1e-6
    assert rows["eval"]["values"]["val_loss"] == pytest.approx(rows["eval"]["values"]["run_val_loss"], rel=1e-6)
    assert report["ok"] and report["mode"] == "cpu"
    # Every launch trained on 2 processes (the check refuses a run whose batch plan says otherwise; seen here too).
    logs = (out / "logs.txt").read_text()
    launched = sum(r["status"] == "OK" for n, r in rows.items() if n in speed) + 3
    assert len(re.findall(r"batch plan: 2 micro x 1 accumulation x 2 processes", logs)) == launched
    table = (out / "summary.md").read_text()
    assert table.strip() in proc.stdout
    assert all(f"| {name} | {r['status']} |" in table for name, r in rows.items())
    assert not list(tmp_path.glob("gpu-check-*")), "the scratch directory was left behind"


def test_gpu_timeouts_fit_one_command():
    """On the GPU box one command may run 10 minutes; the check's steps, with installing, stay under 8."""
    assert gpu_check.timeouts_sum_s(gpu_check.GPU) <= 8 * 60


def test_a_failed_step_is_a_failed_row(tmp_path):
    """A step that exits non-zero, or outlives its timeout (its whole process group killed), is a FAILED row with the
    line of its log that says why, and the check's exit status is 1."""
    mode = dataclasses.replace(gpu_check.CPU, timeouts_s={"data": 2, "eval": 60})
    check = gpu_check.Check(mode, tmp_path, sys.executable)
    # A worker's error line, then what the launcher prints after it (accelerate launch: ChildFailedError).
    failing = ("import sys; print('error: --data_dir nope does not exist', file=sys.stderr, flush=True); "
               "print('Traceback (most recent call last):'); print('torch.distributed.elastic.multiprocessing.errors."
               "ChildFailedError:'); print('train.py FAILED'); sys.exit(1)")  # fmt: skip
    row = check.row("failing")
    check.failed_run(row, *check.execute(row, "eval", [sys.executable, "-c", failing]))
    slow = check.row("slow")
    check.failed_run(slow, *check.execute(slow, "data", ["bash", "-c", "sleep 30 & echo started; wait"]))
    assert (row.status, row.detail) == ("FAILED", "exit 1: error: --data_dir nope does not exist")
    assert slow.status == "FAILED" and slow.detail == "timed out after 2 s: started" and slow.seconds < 10
    assert gpu_check.exit_status(check.rows) == 1
    assert "| failing | FAILED |" in gpu_check.table(check.rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check would run")
@pytest.mark.slow
def test_gpu_run_without_a_gpu_is_refused(tmp_path):
    """`run` (the GPU half) on a machine without CUDA, with this environment's DeepSpeed and no wheel folder: refused
    in one line (main prints it as `error: ...` and exits 2) once the probe has run, nothing written to OUT."""
    out = tmp_path / "out"
    with pytest.raises(cli.UserError, match=r"^torch \S+ sees no CUDA device here: .* run --cpu`$"):
        gpu_check.run(gpu_check.GPU, out, tmp_path / "no-wheels", sys.executable)
    assert not out.exists()


def write_wheel(path: Path, name: str, requires: list[str]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        meta = ["Metadata-Version: 2.1", f"Name: {name}", "Version: 1.0", *(f"Requires-Dist: {r}" for r in requires)]
        z.writestr(f"{name}-1.0.dist-info/METADATA", "\n".join(meta) + "\n\nA description: with a colon\n")
    return path


def test_wheel_folder_checks(tmp_path):
    """prepare refuses a wheel whose requirement is neither carried nor on the box (extras and other platforms' markers
    do not count); run refuses a file that differs from the manifest, and names what the installed packages lack."""
    ok = write_wheel(tmp_path / "good-1.0-py3-none-any.whl", "good",
                     ["numpy>=1", "pytest-cov; extra == 'dev'", "pywin32; sys_platform == 'win32'"])  # fmt: skip
    assert [r["name"] for r in gpu_wheels.check_wheels([ok])] == ["good"]
    bad = write_wheel(tmp_path / "bad-1.0-py3-none-any.whl", "bad", ["numpy>=1", "not-a-package-here>=2"])
    with pytest.raises(cli.UserError, match=r"bad-1.0-py3-none-any.whl requires not-a-package-here>=2, neither"):
        gpu_wheels.check_wheels([ok, bad])
    rows = [{"file": bad.name, "name": "bad", "requires": ["numpy>=1", "not-a-package-here>=2", "numpy<1"]}]
    numpy = importlib.metadata.version("numpy")
    assert gpu_wheels.unmet(sys.executable, {}, rows) == [
        f"{bad.name}: not-a-package-here>=2 (found none)", f"{bad.name}: numpy<1 (found {numpy})"
    ]  # fmt: skip
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / ok.name).write_bytes(ok.read_bytes())
    manifest = {"wheels": [{"file": ok.name, "size": ok.stat().st_size, "sha256": gpu_wheels.file_sha256(ok)}]}
    (folder / gpu_wheels.MANIFEST).write_text(json.dumps(manifest))
    assert gpu_wheels.verify(folder) == manifest["wheels"]
    (folder / ok.name).write_bytes(ok.read_bytes()[:-1] + b"x")
    with pytest.raises(cli.UserError, match="differs from .*MANIFEST.json: copy the folder again"):
        gpu_wheels.verify(folder)


def test_carried_versions_are_the_pinned_ones():
    """The wheels carried for requirements.txt's packages are its pins (None in CARRIED: the box runs what the tests
    ran), and the folder is git-ignored."""
    pins = gpu_wheels.requirements_pins()
    for name, version in gpu_wheels.CARRIED.items():
        assert (version is None) == (name in pins), name
    assert subprocess.run(["git", "check-ignore", "-q", ".gpu_wheels/x.whl"], cwd=REPO, check=False).returncode == 0
