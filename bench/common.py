"""Helpers shared by the benchmark scripts: where results go and how a row is recorded; and, shared with tests/ (which
import this file), lm-evaluation-harness's wikitext task on local pages and a synthetic web-like corpus."""

import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

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


def held_out_words(data: Path) -> list[list[str]]:
    """The words of the first 16 held-out documents of a prepared data directory with at least 16 words each (fewer
    where it holds fewer)."""
    texts = [json.loads(line)["text"] for line in (data / "validation.jsonl").read_text().splitlines()]
    return [t.split() for t in texts if len(t.split()) >= 16][:16]


def multiple_choice_rows(words: list[list[str]]) -> list[dict]:
    """A local multiple-choice task (tests and benches): the first 10 words of a document, then its next 6 words
    among 3 other documents' (4 choices, the right one at position i % 4)."""
    rows = []
    for i, w in enumerate(words):
        others = [" ".join(words[(i + k) % len(words)][10:16]) for k in (1, 2, 3)]
        choices = others[: i % 4] + [" ".join(w[10:16])] + others[i % 4 :]
        rows.append({"question": " ".join(w[:10]), "choices": [" " + c for c in choices], "answer": i % 4})
    return rows


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
            "--optimizer",
            "adamw",  # what the bare loops and DDP run: --optimizer auto would pick Muon for mini and small
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
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
    records = [r for r in lines if r.get("loss") is not None][1:]
    planned = re.search(r"^  step: .* = ([\d,]+) tokens/s", proc.stdout, re.MULTILINE)
    peak = re.search(r"peak ([\d.]+) TFLOP/s \(([^)]*)\)", proc.stdout)
    compute = re.search(r"^  step: .* compute at ([\d.e+-]+) TFLOP/s per \w+ \(([^)]*)\)", proc.stdout, re.MULTILINE)
    link = re.search(
        r"all-reduce ([\d.]+), all-gather ([\d.]+), reduce-scatter ([\d.]+) GB/s, measured\) .* in place at ([\d.]+) "
        r"GB/s, .* into fresh buffers at ([\d.]+) GB/s",
        proc.stdout,
    )
    return {
        "tokens_per_s": sum(r["tokens_per_s"] for r in records) / len(records),
        "mfu": sum(r["mfu"] for r in records) / len(records),
        "distributed_type": plan.group(2),
        "precision": plan.group(3),
        "final_val_loss": next((r["val_loss"] for r in reversed(lines) if "val_loss" in r), None),
        "planned_tokens_per_s": float(planned.group(1).replace(",", "")) if planned else None,
        "peak_tflops": float(peak.group(1)) if peak else None,
        "peak_source": peak.group(2) if peak else None,
        "planned_compute_tflops": float(compute.group(1)) if compute else None,  # per process
        "planned_compute_source": compute.group(2) if compute else None,
        "links": dict(
            zip(("all_reduce", "all_gather", "reduce_scatter", "memory", "memory_fresh"), map(float, link.groups()))
        )
        if link
        else None,
        "accum": int(re.search(r"x (\d+) accumulation x", proc.stdout).group(1)),
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
    tok.encode_special_tokens = True  # as prepare_data.py's tokenizer processes read documents
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


HARNESS_TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {pages}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: !function harness_wikitext.wikitext_detokenizer
process_results: !function harness_wikitext.process_results
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def write_harness_wikitext_task(pages: list[str], directory: Path, name: str = "wikitext_local") -> str:
    """lm-evaluation-harness's `wikitext` task on local pages (its Hub dataset out of reach): the same output type,
    metrics, detokenizer and process_results, imported from the harness, with the pages from a JSONL. Run it with
    `lm_eval --tasks NAME --include_path DIRECTORY ...`. Returns NAME."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "pages.jsonl").write_text("".join(json.dumps({"page": p}) + "\n" for p in pages))
    (directory / f"{name}.yaml").write_text(
        HARNESS_TASK_YAML.format(name=name, pages=(directory / "pages.jsonl").resolve())
    )
    (directory / "harness_wikitext.py").write_text(
        "from lm_eval.tasks.wikitext.preprocess_wikitext import process_results, wikitext_detokenizer  # noqa: F401\n"
    )
    return name


def harness_command(model_dir, task_dir: Path, name: str, batch_size: int, output_path: Path) -> list[str]:
    """`lm_eval` on the task write_harness_wikitext_task made, fp32 on the CPU, as a user runs it (offline: run it with
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1). read_harness_results reads what it writes."""
    return [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={model_dir},dtype=float32",
        "--tasks",
        name,
        "--include_path",
        str(task_dir),
        "--batch_size",
        str(batch_size),
        "--device",
        "cpu",
        "--output_path",
        str(output_path),
    ]


def read_harness_results(output_path: Path, name: str) -> dict:
    """The task's metrics from the one results_*.json lm_eval wrote under output_path, e.g. {"word_perplexity": ...}."""
    (results,) = Path(output_path).rglob("results_*.json")
    return {k.split(",")[0]: v for k, v in json.loads(results.read_text())["results"][name].items()}


def synthetic_web_documents(n_bytes: int, seed: int = 0) -> Iterator[str]:
    """Web-like documents for benchmarks and tests, about n_bytes of UTF-8 in all, deterministic for a seed: a long
    tail of lengths, paragraphs, 30,000 made-up words drawn with Zipf frequencies, numbers, URLs and some non-ASCII
    text (accents, CJK, Cyrillic, Arabic, emoji)."""
    rng = np.random.default_rng(seed)
    syllables = [
        c + v
        for c in ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "tr", "ch"]
        for v in ["a", "e", "i", "o", "u", "ai", "ou", "er", "an", "in"]
    ]
    lengths = rng.integers(1, 5, 30_000)
    vocab = np.array(["".join(syllables[j] for j in rng.integers(0, len(syllables), n)) for n in lengths])
    cdf = np.cumsum(1 / np.arange(1, len(vocab) + 1))
    cdf /= cdf[-1]
    extra = ["café", "naïve", "Zürich", "São Paulo", "東京", "数据", "モデル", "Привет", "مرحبا", "🙂", "→", "€12.50"]
    done = 0
    while done < n_bytes:
        paragraphs = []
        for _ in range(int(rng.integers(1, 12))):
            n = int(rng.lognormal(3.8, 0.8)) + 3
            words = vocab[np.minimum(np.searchsorted(cdf, rng.random(n)), len(vocab) - 1)].tolist()
            for j in np.nonzero(rng.random(n) < 0.03)[0]:
                words[j] = extra[int(rng.integers(0, len(extra)))]
            for j in np.nonzero(rng.random(n) < 0.02)[0]:
                words[j] = (
                    str(int(rng.integers(0, 10**6)))
                    if rng.random() < 0.7
                    else f"https://example.org/{int(rng.integers(0, 10**5))}"
                )
            for j in np.nonzero(rng.random(n) < 0.06)[0]:
                words[j] += ","
            paragraphs.append(" ".join(words).capitalize() + ".")
        doc = "\n\n".join(paragraphs)
        done += len(doc.encode("utf-8"))
        yield doc
