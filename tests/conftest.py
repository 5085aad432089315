"""Shared fixtures: a prepared python-docs directory, and helpers that run the scripts as a user would."""

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import script_server
import torch

REPO = Path(__file__).resolve().parents[1]
# The unit tests import the scripts (train, eval, prepare_data) as modules, from the root, as Python runs them; with
# the root first, this checkout's deepseek_zero3 is the one imported even where a venv's editable install is another's.
sys.path.insert(0, str(REPO))
# bench/common.py holds what tests and benchmarks share (the harness command, a synthetic web corpus): one copy.
sys.path.append(str(REPO / "bench"))
# Real WikiText-2 text, when the checkout sits next to the project's shared/ folder (or WIKITEXT2_DIR points at it).
WIKITEXT2 = Path(os.environ.get("WIKITEXT2_DIR", REPO.parent / "shared" / "data" / "wikitext-2"))
needs_wikitext = pytest.mark.skipif(
    not (WIKITEXT2 / "wiki.test.raw").is_file(), reason=f"WikiText-2 copy not found at {WIKITEXT2} (set WIKITEXT2_DIR)"
)
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
# Threads. `make test` runs 2 pytest workers at once, each with its own tests and the processes they start. torch's
# default, a thread per core in every process, then puts more threads than cores to work, and OpenMP's threads spin
# waiting for each other: test_nll_equals_brute_force's call took 76 s beside the other worker's launches against
# 2.9 s on one thread (2-core EPYC, docs/testing.md). So each worker and every process it starts gets the cores
# divided by the workers, as torchrun gives each of its processes one; an OMP_NUM_THREADS the caller set is kept.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // WORKERS))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# The files with the longest runs first (by a full run's --durations, 3 workers): `make test`'s workers (pytest-xdist,
# --dist loadfile --no-loadscope-reorder, which keeps this order instead of xdist's own by number of tests) take whole
# files in collection order, so a long file handed out last would run alone while the other workers idle.
LONG_FIRST = ["test_gpu_check.py", "test_resilience.py", "test_eval.py", "test_data.py", "test_prepare_robustness.py",
              "test_precision.py", "test_train.py", "test_tiers.py", "test_multinode.py", "test_run_dir.py",
              "test_eval_tasks.py", "test_moe.py", "test_harness.py", "test_muon.py", "test_run_lock.py",
              "test_attention.py", "test_train_units.py", "test_reshard.py", "test_mixture.py", "test_recipe.py",
              "test_loss.py", "test_zero3_validation.py"]  # fmt: skip


# The test tiers (docs/testing.md). `make test-fast` runs every test not marked `launch`: pure functions, in-process
# runs, the scripts' own refusals. A test that starts several processes (accelerate launch, torchrun), itself or
# through a fixture, is marked `launch`: by its fixture's name here, or by @pytest.mark.launch. Under TEST_TIER=fast a
# launch from an unmarked test fails it, naming the marker, so the fast tier cannot silently grow slow.
LAUNCH_FIXTURES = {"ref_run", "trained", "moe_ref",  # conftest's, shared by many files
                   "zero3_results", "single", "runs", "wsd_run", "three_to_two", "zero2", "one_process"}  # one file's


def pytest_configure(config):
    config.addinivalue_line("markers", "launch: starts several processes (accelerate launch, torchrun); not in make "
                                       "test-fast")  # fmt: skip
    config.addinivalue_line("markers", "slow: one process but seconds to minutes (a script run in a child process, a "
                                       "compile); not in make test-fast")  # fmt: skip


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order is kept
    for item in items:
        if LAUNCH_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.launch)


def _split(text: str) -> list[str]:
    """A command line's words; a text that is no command line (a python -c script with an apostrophe) by spaces."""
    try:
        return shlex.split(text)
    except ValueError:
        return text.split()


def refuse_launch_in_fast_tier(args) -> None:
    if os.environ.get("TEST_TIER") != "fast":
        return
    words = _split(args) if isinstance(args, str) else [str(a) for a in args]
    words = [w for word in words for w in (_split(word) if " " in word else [word])]  # bash -c "..." too
    names = [Path(w).name for w in words]
    launcher = "torchrun" in names or any(
        n == "accelerate" and nxt == "launch" for n, nxt in zip(names, names[1:])
    ) or any(m in w for w in words for m in ("torch.distributed.run", "accelerate.commands.launch"))
    if launcher:
        pytest.fail(f"{' '.join(words[:4])} ... in make test-fast: mark this test @pytest.mark.launch", pytrace=False)


if os.environ.get("TEST_TIER") == "fast":  # every child process a test starts, not only those conftest.run starts
    _popen_init = subprocess.Popen.__init__

    def _guarded_popen_init(self, args, *more, **kw):
        refuse_launch_in_fast_tier(args)
        _popen_init(self, args, *more, **kw)

    subprocess.Popen.__init__ = _guarded_popen_init


CPU_CONFIG = "accelerate_configs/zero3_cpu.yaml"
# A tiny run: 64-wide 2-layer model, 32-token sequences, global batch 6 on 3 processes.
TINY = [
    "--model_config",
    "tiny",
    "--seq_len",
    "32",
    "--log_every",
    "1",
    "--eval_every",
    "0",
    "--eval_tokens",
    "2048",
    "--save_every",
    "0",
    "--warmup_steps",
    "2",
    "--lr",
    "3e-3",
    "--sample_tokens",  # no samples at validation: 3 ZeRO-3 processes take ~8 s for 3 x 32 tokens (ref_run takes some)
    "0",
]


# The single-process runs of the three scripts start from a server that has already imported what they import
# (script_server.py: 3-4 s less each, ~14 s under load; TEST_FORK_SCRIPTS=0 starts them as plain subprocesses).
SCRIPTS = script_server.Client(REPO)


@pytest.fixture(scope="session", autouse=True)
def _script_server():
    yield
    SCRIPTS.close()


# What every command a test runs gets on top of the worker's environment: output as it is written, and tokenizers that
# start no threads of their own (the runs' own processes are the parallelism).
RUN_ENV = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


def run(args, check=True, env=None, timeout=600, cwd=REPO, **kw):
    """Run a command from the repository root, as a user would; returns the CompletedProcess (text). A single-process
    run of train.py, eval.py or prepare_data.py is forked from the worker's script server (script_server.py). (Under
    make test-fast, a launch is refused by the guard on subprocess.Popen.)"""
    given = {**RUN_ENV, **(env or {})}
    full_env = {**os.environ, **given}
    # `python train.py ...`: forked from a process that has its imports (None: not one it takes, or it is busy)
    proc = SCRIPTS.run(args, full_env, cwd, timeout) if SCRIPTS.takes(args, given, kw) else None
    if proc is None:
        proc = subprocess.run(args, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, args))} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- "
            f"stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_cmd(nproc: int, *train_args, config=CPU_CONFIG, script="train.py", accum=1, launcher_args=()):
    return [
        ACCELERATE,
        "launch",
        "--config_file",
        config,
        "--num_processes",
        str(nproc),
        "--gradient_accumulation_steps",
        str(accum),
        "--main_process_port",
        str(free_port()),
        *launcher_args,
        script,
        *map(str, train_args),
    ]


def assert_processes(proc, nproc: int, accum: int = 1) -> None:
    """The run's own batch-plan line says how many processes really trained: a launcher that quietly starts one
    process (accelerate's simple launcher does, for MULTI_CPU configs) fails here."""
    plan = re.search(r"batch plan: (\d+) micro x (\d+) accumulation x (\d+) processes", proc.stdout)
    assert plan, proc.stdout[-3000:]
    assert (int(plan.group(2)), int(plan.group(3))) == (accum, nproc), plan.group(0)


def launch(nproc: int, *train_args, check=True, env=None, config=CPU_CONFIG, accum=1):
    """`accelerate launch` of train.py on `nproc` CPU processes (DeepSpeed ZeRO-3, gloo, fp32); a successful run is
    checked to have trained on exactly `nproc` processes with `accum` accumulation steps."""
    proc = run(launch_cmd(nproc, *train_args, config=config, accum=accum), check=check, env=env)
    if check:
        assert_processes(proc, nproc, accum)
    return proc


def metrics(out_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train_records(out_dir) -> dict[int, dict]:
    return {r["step"]: r for r in metrics(out_dir) if "loss" in r}


# --log_with wandb (offline) and trackio, kept local: W&B's files in OUT/wandb/, trackio's database in TRACKIO_DIR.
def tracker_env(tmp_path) -> dict:
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "TRACKIO_DIR": str(tmp_path / "trackio")}


def wandb_history(out_dir) -> tuple[set[str], list[tuple[int, float | None]], list[dict]]:
    """What W&B's offline files under OUT/wandb/ hold, segment after segment (a resume or restart opens one): the run
    ids, every logged row's (step, loss) in order, and each segment's logged settings."""
    from deepseek_zero3.run_dir.trackers import wandb_offline_history

    ids, rows, configs = wandb_offline_history(Path(out_dir) / "wandb")
    return ids, [(step, row.get("loss")) for step, row in rows], configs


def trackio_history(trackio_dir, project="deepseek-zero3") -> dict[str, list[tuple[int, float | None]]]:
    """Each trackio run of the project in TRACKIO_DIR: its logged rows' (step, loss), in a fresh process."""
    code = (f"import json; from trackio.sqlite_storage import SQLiteStorage as S; print(json.dumps({{r: [(l['step'], "
            f"l.get('loss')) for l in S.get_logs({project!r}, r)] for r in S.get_runs({project!r})}}))")  # fmt: skip
    proc = run([sys.executable, "-c", code], env={"TRACKIO_DIR": str(trackio_dir)})
    return {name: [tuple(row) for row in rows] for name, rows in json.loads(proc.stdout.splitlines()[-1]).items()}


def docs_prepare_args(out: Path) -> list:
    """prepare_data.py's arguments for docs_data: two sources of very different sizes, kept apart in the token files."""
    from common import synthetic_web_documents

    web = out.parent / "web.jsonl"
    if not web.is_file():
        web.write_text("".join(json.dumps({"text": t}) + "\n" for t in synthetic_web_documents(150_000)))
    return ["--dataset", "python-docs", "--dataset", web, "--tokenizer", "bpe:512", "--output_dir", out,
            "--validation_fraction", "0.05", "--num_proc", "2"]  # fmt: skip


def once_for_all_workers(tmp_path_factory, name: str, make):
    """A session fixture's result made once for all of make test's workers (pytest-xdist gives each worker a session
    of its own, so each would make it again): the first worker to ask makes it under a file lock in the directory the
    workers share, the others wait and read it back. Only for what no test changes: each test copies what it alters.
    make(directory) returns something picklable."""
    import pickle

    from filelock import FileLock

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make(tmp_path_factory.mktemp(name))
    root = tmp_path_factory.getbasetemp().parent
    with FileLock(root / f"{name}.lock"):
        done = root / f"{name}.pickle"
        if done.is_file():
            return pickle.loads(done.read_bytes())
        shutil.rmtree(root / name, ignore_errors=True)  # what a worker that failed to make it left: made again
        (root / name).mkdir()
        result = make(root / name)
        done.write_bytes(pickle.dumps(result))
        return result


@pytest.fixture(scope="session")
def docs_data(tmp_path_factory) -> Path:
    """The built-in python-docs corpus (~1.9 MB) and ~150 kB of synthetic web text (web.jsonl) with a 512-token BPE:
    small, offline, real. Every run on it draws from a mixture of two sources (in proportion to their sizes unless
    --data_mix says otherwise), with document masking on, as train.py does by default."""

    def make(directory: Path) -> Path:
        run([sys.executable, "prepare_data.py", *docs_prepare_args(directory / "python-docs")])
        return directory / "python-docs"

    return once_for_all_workers(tmp_path_factory, "data", make)


@pytest.fixture(scope="session")
def ref_run(docs_data, tmp_path_factory):
    """The reference run: 3 processes x micro-batch 2 = global batch 6, 10 steps, checkpoints at steps 4, 8 and 10
    (test_reshard.py resumes step 4 on other numbers of processes), an EMA of the weights (--ema_decay: per ZeRO-3
    partition, which every resume on 3, 2 or 1 processes must carry exactly), validation with samples of 4 tokens at
    steps 0, 5 and 10 (the runs compared with it do not sample at step 5 and train on: samples change no training);
    returns (OUT, the CompletedProcess)."""

    def make(directory: Path):
        args = [*TINY, "--max_steps", "10", "--micro_batch_size", "2", "--data_dir", docs_data, "--output_dir",
                directory / "out", "--save_every", "4", "--keep_last", "3", "--ema_decay", "0.9", "--eval_every", "5",
                "--sample_tokens", "4"]  # fmt: skip
        return directory / "out", launch(3, *args)

    return once_for_all_workers(tmp_path_factory, "ref", make)


@pytest.fixture(scope="session")
def trained(docs_data, tmp_path_factory) -> Path:
    """A tiny model trained for 30 steps on 3 ZeRO-3 processes (validation at steps 0, 15, 30); returns OUT."""
    return once_for_all_workers(tmp_path_factory, "trained", lambda directory: train_for_30_steps(docs_data, directory))


def train_for_30_steps(docs_data: Path, directory: Path) -> Path:
    out = directory / "out"
    launch(
        3,
        *TINY,
        "--max_steps",
        "30",
        "--micro_batch_size",
        "4",
        "--eval_every",
        "15",
        "--data_dir",
        docs_data,
        "--output_dir",
        out,
        "--log_with",
        "tensorboard",
    )
    return out


# DeepSeek-V3 tiny (MLA + DeepSeekMoE) runs: see tests/test_moe.py for the choice of the bias speed.
STEPS = 24
HALF = 12
MOE = ["--model_config", "deepseek-v3-tiny", "--seq_len", "32", "--log_every", "1", "--eval_every", "0",
       "--eval_tokens", "2048", "--warmup_steps", "2", "--lr", "3e-3", "--moe_bias_update_speed", "0.003",
       "--sample_tokens", "0"]  # fmt: skip


def train_moe(nproc: int, out, data, *extra, micro_batch_size=None):
    """A run of the MoE preset on `nproc` processes of one torch thread each. torchrun gives each of several processes
    one thread but leaves a single process every core, and the thread count is part of a CPU's float arithmetic (MKL's
    float32 matmul on an AMD EPYC, issue #44, or with its AVX2 kernels anywhere, rounds differently on 2 threads than
    on 1): runs compared with each other compute alike, as far as their process counts let them (see test_moe.py)."""
    micro = micro_batch_size or 6 // nproc
    return launch(nproc, *MOE, "--micro_batch_size", micro, "--data_dir", data, "--output_dir", out, *extra,
                  env={"OMP_NUM_THREADS": "1"})  # fmt: skip


@pytest.fixture(scope="session")
def moe_ref(docs_data, tmp_path_factory):
    """The DeepSeek-V3 tiny reference run: 3 ZeRO-3 processes x micro-batch 2, 24 steps, checkpoints at steps 12 and
    24, final/ exported; returns (OUT, the launch's CompletedProcess)."""

    def make(directory: Path):
        return directory / "ref", train_moe(3, directory / "ref", docs_data, "--max_steps", STEPS, "--save_every", HALF)

    return once_for_all_workers(tmp_path_factory, "moe", make)


def ema_of(ckpt: Path) -> dict:
    """The EMA a checkpoint holds (run_dir/state.py's files: one per process under ZeRO-3, else one), whole: each
    parameter's flat average, its processes' partitions put together (saved without ZeRO-3's padding, whose values are
    whatever memory DeepSpeed left there: weights.local_weights)."""
    from deepseek_zero3.model import weights

    shards = sorted(ckpt.glob("state-ema-rank*.pt"), key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
    states = [torch.load(p, weights_only=False)["state"] for p in shards] or [torch.load(ckpt / "state-ema.pt")]
    names = states[0]["average"]
    model = [s["average"] for s in states]
    return {n: weights.repartition([m[n] for m in model], sum(len(m[n]) for m in model), 0, 1) for n in names}


def assert_same_ema(a: Path, b: Path, rel: float) -> None:
    """Two checkpoints' EMAs agree to `rel` (relative norm of each parameter's difference), whatever number of
    processes wrote each (a partition is saved without ZeRO-3's padding: every element compared is a weight's)."""
    ema_a, ema_b = ema_of(a), ema_of(b)
    assert ema_a.keys() == ema_b.keys() and ema_a
    for name in ema_a:
        x, y = ema_a[name], ema_b[name]
        assert x.shape == y.shape, (name, x.shape, y.shape)
        assert float((x - y).norm() / x.norm()) <= rel, (name, float((x - y).norm() / x.norm()))


def reloaded_model(final_dir, data_dir) -> dict:
    """OUT/final in a fresh process, as a user loads it: its class, its mean loss on the first 2048 validation tokens in
    32-token windows, each document attending to itself (what train.py's runs here log as val_loss/python-docs, the
    first source), and the length of a greedy 4-token continuation."""
    script = f"""
import sys; sys.path.insert(0, "."); import json, torch, numpy as np
from deepseek_zero3.training_data import token_data
from deepseek_zero3.model import lmloss
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained("{final_dir}").eval()
tokens = token_data.load_split("{data_dir}", "validation")[: 2048 + 1]
n = token_data.num_windows(len(tokens), 32)
rows = torch.from_numpy(np.stack([token_data.window(tokens, i, 32) for i in range(n)]))
with torch.no_grad():
    positions = lmloss.document_positions(rows[:, :-1], token_data.read_meta("{data_dir}")["eos_id"])
    nll, n = lmloss.nll_sum(m(input_ids=rows[:, :-1], position_ids=positions, use_cache=False).logits, rows[:, 1:])
    generated = m.generate(rows[:1, :8], max_new_tokens=4, do_sample=False)
print(json.dumps({{"class": type(m).__name__, "dtype": str(m.dtype), "val_loss": float(nll / n),
                  "generated": generated.shape[1]}}))
"""
    return json.loads(run([sys.executable, "-c", script]).stdout.strip().splitlines()[-1])
