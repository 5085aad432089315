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


def prepare_docs(tmp: str, vocab: int = 8192) -> Path:
    """python-docs with a BPE of `vocab` tokens in tmp/data, through prepare_data.py as a user runs it."""
    data = Path(tmp) / "data"
    sh(["python", "prepare_data.py", "--dataset", "python-docs", "--tokenizer", f"bpe:{vocab}", "--output_dir", str(data)])
    return data


def train_py_rate(launcher: list[str], data: Path, out: Path, model_config: str, seq_len: int, batch: int, steps: int,
                  intervals: int = 3) -> dict:
    """Run train.py (after `launcher`, e.g. ["python"] or an accelerate launch prefix) and return its mean logged
    tokens/s and MFU over the log intervals after the first, which holds the warm-up."""
    sh(launcher + ["train.py", "--data_dir", str(data), "--model_config", model_config, "--output_dir", str(out),
                   "--seq_len", str(seq_len), "--micro_batch_size", str(batch), "--max_steps", str(steps),
                   "--log_every", str(max(1, steps // intervals)), "--eval_every", "0", "--eval_tokens", "4096", "--save_every", "0"])
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in l][1:]
    return {"tokens_per_s": sum(r["tokens_per_s"] for r in records) / len(records), "mfu": sum(r["mfu"] for r in records) / len(records)}
