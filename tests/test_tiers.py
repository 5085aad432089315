"""make test-fast's guard (conftest.refuse_launch_in_fast_tier): under TEST_TIER=fast, a multi-process launch from a
test not marked `launch` fails that test, however the command is spelled (every child process goes through the guard:
conftest wraps subprocess.Popen in that tier). Seen failing with the guard reading only the first word. And the
script server (script_server.py) every tier runs the scripts' single-process runs from, and the full suite its launches:
what a run gives back is what `python script.py` or `accelerate launch` in a subprocess gives."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, RUN_ENV, SCRIPTS, TINY, assert_processes, launch_cmd, metrics, refuse_launch_in_fast_tier

LAUNCHES = [
    ["accelerate", "launch", "--num_processes", "3", "train.py"],
    ["/venv/bin/accelerate", "launch", "train.py"],
    ["timeout", "300", "accelerate", "launch", "train.py"],
    ["bash", "-c", "accelerate launch --num_processes 2 train.py"],
    "accelerate launch train.py",
    ["python", "-m", "accelerate.commands.launch", "train.py"],
    ["python", "-m", "torch.distributed.run", "--nproc_per_node", "2", "train.py"],
    ["torchrun", "--nproc_per_node", "2", "train.py"],
]
NOT_LAUNCHES = [["python", "train.py", "--plan"], ["accelerate", "env"], ["python", "eval.py", "--model", "accelerate"],
                ["python", "-c", "import sys  # it's one process"]]  # a script no shell could split


@pytest.mark.parametrize("args", LAUNCHES)
def test_a_launch_in_the_fast_tier_fails_its_test(args, monkeypatch):
    monkeypatch.setenv("TEST_TIER", "fast")
    with pytest.raises(pytest.fail.Exception, match="mark this test @pytest.mark.launch"):
        refuse_launch_in_fast_tier(args)
    monkeypatch.delenv("TEST_TIER")
    refuse_launch_in_fast_tier(args)  # make test runs it


@pytest.mark.parametrize("args", NOT_LAUNCHES)
def test_one_process_is_not_a_launch(args, monkeypatch):
    monkeypatch.setenv("TEST_TIER", "fast")
    refuse_launch_in_fast_tier(args)


def both(args, plain_args=None, **env):
    """The run of `args` forked by the script server, and of `plain_args` (else the same) as a plain subprocess (what
    TEST_FORK_SCRIPTS=0 runs), under the same environment."""
    full = {**os.environ, **RUN_ENV, **env}  # as conftest.run gives it
    assert SCRIPTS.takes(args, env, {}) and not SCRIPTS.takes(args, {**env, "HF_HUB_OFFLINE": "x"}, {})
    forked = SCRIPTS.run(args, full, REPO, timeout=300)
    plain = subprocess.run(plain_args or args, cwd=REPO, env=full, capture_output=True, text=True, timeout=300)
    return forked, plain


@pytest.mark.slow
def test_a_forked_script_run_gives_what_a_subprocess_gives(tmp_path, monkeypatch):
    """A refusal (exit 2, its one line), a run that writes files and prints (exit 0), the same bytes on stdout and
    stderr; another script's refusal; a signal's negative code; a timeout raised as subprocess.run raises
    it, the run killed; a server started under another environment than the worker's now is replaced; a run while
    another thread's holds the server is left to a subprocess. Seen failing with the server answering 0 for every
    exit code, and in CI's suite with the worker's environment grown by in-process tests (torch's
    TORCHINDUCTOR_CACHE_DIR), which sent every later run to a subprocess."""
    refused, plain = both([sys.executable, "train.py", "--max_steps", "-1"])
    assert (refused.returncode, refused.stdout, refused.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    assert refused.returncode == 2 and refused.stderr.startswith("error: --max_steps"), refused.stderr
    from common import synthetic_web_documents

    web = tmp_path / "web.jsonl"  # ~60 kB: the run's tokens and its output, not its size, are compared
    web.write_text("".join(json.dumps({"text": t}) + "\n" for t in synthetic_web_documents(60_000)))
    prepare = lambda name: [sys.executable, "prepare_data.py", "--dataset", web, "--tokenizer", "bpe:300",  # noqa: E731
                            "--num_proc", "1", "--validation_fraction", "0.3", "--output_dir",
                            tmp_path / name]  # fmt: skip
    prepared, plain = both(prepare("forked"), prepare("plain"))
    assert prepared.returncode == plain.returncode == 0, (prepared.stderr, plain.stderr)
    assert (tmp_path / "forked" / "train.bin").read_bytes() == (tmp_path / "plain" / "train.bin").read_bytes()
    first = lambda p: p.stdout.splitlines()[0]  # noqa: E731 (the last line names its own directory and seconds)
    assert first(prepared) == first(plain), (prepared.stdout, plain.stdout)
    # A failed run: its code and its words (TRAIN_TEST_FAULT may differ from the server's: read when the code runs).
    failed, plain = both([sys.executable, "eval.py", "--model", tmp_path / "none", "--dataset", tmp_path / "forked",
                          "--split", "validation"], TRAIN_TEST_FAULT="")  # fmt: skip
    assert failed.returncode == plain.returncode == 2 and failed.stderr == plain.stderr, (failed, plain)
    # Killed by a signal: its negative number, what the run printed before it.
    train = [sys.executable, "train.py", "--model_config", "tiny", "--seq_len", "32", "--max_steps", "3",
             "--eval_every", "0", "--sample_tokens", "0", "--log_every", "1",
             "--data_dir", tmp_path / "forked"]  # fmt: skip
    fault = lambda spec: {**os.environ, "TRAIN_TEST_FAULT": spec}  # noqa: E731
    killed = SCRIPTS.run([*train, "--output_dir", tmp_path / "killed"], fault("sigkill_rank:0:2"), REPO, 300)
    assert killed.returncode == -9 and "step 1/3" in killed.stdout and "step 3/3" not in killed.stdout, killed
    with pytest.raises(subprocess.TimeoutExpired):  # its steps 1-3 take 4 s each
        SCRIPTS.run([*train, "--output_dir", tmp_path / "slow"], fault("slow_step:0:1-3"), REPO, timeout=1)
    assert SCRIPTS.run([sys.executable, "train.py", "--help"], dict(os.environ), REPO, 60).returncode == 0  # serves on
    with SCRIPTS.busy:  # another thread's run meanwhile: this one is left to a subprocess
        assert SCRIPTS.run([sys.executable, "train.py", "--help"], dict(os.environ), REPO, 60) is None
    server = SCRIPTS.proc.pid
    monkeypatch.setenv("SCRIPT_SERVER_TEST_DRIFT", "1")  # as torch adds to the environment when a test runs it
    assert SCRIPTS.run([sys.executable, "train.py", "--help"], dict(os.environ), REPO, 60).returncode == 0
    assert SCRIPTS.proc.pid != server and SCRIPTS.base["SCRIPT_SERVER_TEST_DRIFT"] == "1"


@pytest.mark.launch
def test_a_forked_launch_gives_what_a_launch_gives(docs_data, tmp_path):
    """`accelerate launch` forked by the script server, its workers forked from the launcher
    (script_server.fork_workers), against the same launch as a plain subprocess: 2 processes each, the same losses
    to the bit, the same step lines. A refusal under the launcher: the same exit code and the worker's one error line.
    (The kills, hangs, restarts and preemptions of test_resilience.py and test_train.py run forked too.) Seen failing
    with the launcher's Popen never returning, its exec pipe left open in the worker."""

    if os.environ.get("TEST_FORK_SCRIPTS") == "0":
        pytest.skip("TEST_FORK_SCRIPTS=0: every launch runs as plain processes, none forked to compare")

    def launch_both(*args):
        return both(launch_cmd(2, *args, "--output_dir", tmp_path / "forked"),
                    launch_cmd(2, *args, "--output_dir", tmp_path / "plain"))  # fmt: skip

    args = [*TINY, "--max_steps", "2", "--micro_batch_size", "2", "--eval_tokens", "128", "--data_dir", docs_data]
    forked, plain = launch_both(*args)
    for proc in (forked, plain):
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert_processes(proc, 2)
    assert [(r["step"], r.get("loss")) for r in metrics(tmp_path / "forked")] == [
        (r["step"], r.get("loss")) for r in metrics(tmp_path / "plain")
    ]
    steps = lambda p: [line for line in p.stdout.splitlines() if line.startswith("step ")]  # noqa: E731
    assert [line.split(" | ")[:2] for line in steps(forked)] == [line.split(" | ")[:2] for line in steps(plain)]
    refused = launch_both("--max_steps", "-1")
    for proc in refused:
        assert proc.returncode == 1 and proc.stderr.count("error: --max_steps -1") == 1, proc.stderr[-3000:]
