"""Helpers shared by the benchmark scripts: where results go and how a row is recorded."""

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO))


def machine() -> str:
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("model name")), platform.processor())
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def record(name: str, result: dict) -> None:
    """Print one benchmark's result and keep it as JSON under bench/results/ (make_report.py turns them into BENCHMARKS.md)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {"name": name, "machine": machine(), "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", *sys.argv]), **result}
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def sh(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc
