"""Helpers shared by the benchmark scripts: where results go and how a row is recorded."""

import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO))


def cpu_bf16_units() -> str:
    """The CPU's native bf16 instructions (AMX, AVX512-BF16) as /proc/cpuinfo names them, or "none"."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((set(l.split(":", 1)[1].split()) for l in info.splitlines() if l.startswith("flags")), set())
    return ", ".join(sorted(flags & {"amx_bf16", "avx512_bf16"})) or "none"


def machine() -> str:
    cpu = next(
        (
            l.split(":", 1)[1].strip()
            for l in Path("/proc/cpuinfo").read_text().splitlines()
            if l.startswith("model name")
        ),
        platform.processor(),
    )
    return f"{cpu}, {os.cpu_count()} cores, bf16 units: {cpu_bf16_units()}, Python {platform.python_version()}"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_zero3_vs_ddp_args(ap) -> None:
    """The run shape both ZeRO-3-against-DDP benchmarks share: model, sequence, micro batch, steps, rounds."""
    ap.add_argument("--model_config", default="small")
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)


def record(name: str, result: dict) -> None:
    """Print one benchmark's result and keep it as JSON under bench/results/ (make_report.py turns them into
    BENCHMARKS.md)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {
        "name": name,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python", *sys.argv]),
        **result,
    }
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
    sh(
        [
            "python",
            "prepare_data.py",
            "--dataset",
            "python-docs",
            "--tokenizer",
            f"bpe:{vocab}",
            "--output_dir",
            str(data),
        ]
    )
    return data


def train_py_rate(
    launcher: list[str],
    data: Path,
    out: Path,
    model_config: str,
    seq_len: int,
    batch: int,
    steps: int,
    processes: int,
    intervals: int = 3,
    env: dict | None = None,
    extra: list[str] = (),
) -> dict:
    """Run train.py (after `launcher`, e.g. ["python"] or an accelerate launch prefix) and return its mean logged
    tokens/s and MFU over the log intervals after the first, which holds the warm-up. Stops unless the run's own
    batch-plan line says it trained on `processes` processes (a launcher can quietly start one)."""
    proc = sh(
        launcher
        + [
            "train.py",
            "--data_dir",
            str(data),
            "--model_config",
            model_config,
            "--output_dir",
            str(out),
            "--seq_len",
            str(seq_len),
            "--micro_batch_size",
            str(batch),
            "--max_steps",
            str(steps),
            "--log_every",
            str(max(1, steps // intervals)),
            "--eval_every",
            "0",
            "--eval_tokens",
            "4096",
            "--save_every",
            "0",
            *extra,
        ],
        env=env,
    )
    plan = re.search(r"batch plan: .* x (\d+) processes = .*; (\w+), (\w+)", proc.stdout)
    if not plan or int(plan.group(1)) != processes:
        raise SystemExit(
            f"{' '.join(launcher)} was to train on {processes} processes; its batch plan says: "
            f"{plan.group(0) if plan else 'nothing'}"
        )
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in l][1:]
    return {
        "tokens_per_s": sum(r["tokens_per_s"] for r in records) / len(records),
        "mfu": sum(r["mfu"] for r in records) / len(records),
        "distributed_type": plan.group(2),
        "precision": plan.group(3),
    }


def _count_tokens(tok, docs: list[str]) -> int:
    return sum(
        len(e.ids)
        for i in range(0, len(docs), 1000)
        for e in tok.encode_batch_fast(docs[i : i + 1000], add_special_tokens=False)
    )


def _raw_encode(tokenizer_json: str, docs: list[str], ready, go, results) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    ready.put(None)
    go.wait()
    n = _count_tokens(tok, docs)
    results.put((n, time.monotonic()))


def raw_tokenizer_rate(tokenizer_json: Path, docs: list[str], processes: int) -> tuple[float, int]:
    """(tokens/s, tokens) of the raw `tokenizers` batch encode over docs: one process with the tokenizer's own threads,
    or `processes` spawned processes with a share each (threads off), timed from a common start signal, once each
    has its share and its tokenizer, to the last one's end."""
    from multiprocessing import get_context

    os.environ["TOKENIZERS_PARALLELISM"] = "true" if processes == 1 else "false"
    if processes == 1:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_json))
        t0 = time.perf_counter()
        n = _count_tokens(tok, docs)
        return n / (time.perf_counter() - t0), n
    ctx = get_context("spawn")
    ready, go, results = ctx.Queue(), ctx.Event(), ctx.Queue()
    workers = [
        ctx.Process(target=_raw_encode, args=(str(tokenizer_json), docs[i::processes], ready, go, results))
        for i in range(processes)
    ]
    for w in workers:
        w.start()
    for _ in workers:
        ready.get()
    t0 = time.monotonic()
    go.set()
    done = [results.get() for _ in workers]
    for w in workers:
        w.join()
    return sum(n for n, _ in done) / (max(t for _, t in done) - t0), sum(n for n, _ in done)
