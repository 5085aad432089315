"""Two runs, one directory; a closed terminal (issue #35): the second run is refused while the first trains, a dead
run's lock is taken over, and a hangup saves and stops like SIGTERM.

The lock cases run `python train.py` in one process (seconds per run); the hangup is a real 2-process
`accelerate launch` on a pseudo-terminal that is closed under it.
"""

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, TINY, launch_cmd, metrics, run, train_records
from test_run_dir import assert_refused

import train
from deepseek_zero3.run_dir import metrics as run_metrics
from deepseek_zero3.run_dir import resilience

RUN = [*TINY, "--micro_batch_size", "2", "--save_every", "2"]


def start(*args, env=None, **kw) -> subprocess.Popen:
    """train.py in one process, in the background."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.Popen([sys.executable, "train.py", *map(str, args)], cwd=REPO, env=full_env, text=True, **kw)


def wait_for_step(out, step: int, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (out / "metrics.jsonl").is_file() and step in train_records(out):
            return
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before step {step}"
        time.sleep(0.2)
    raise AssertionError(f"no step {step} in {out / 'metrics.jsonl'} after {timeout_s} s")


@pytest.mark.slow
def test_a_second_run_is_refused_and_a_killed_runs_lock_is_taken_over(docs_data, tmp_path):
    """While the first run trains (slowed to 4 s a step), a second command into its directory (with --resume auto or
    without) is refused in one line that names it. Then kill -9 leaves OUT/.lock behind with the dead run's pid in it;
    the kernel released the flock, so --resume auto goes on from the last checkpoint. That resume also takes the
    advice of a diverged or hung run's message: a lower --lr and a longer --step_timeout_s are accepted, used and
    recorded in metrics.jsonl at the resume step. Every step is logged once, the refusals left no trace. (The first
    run is held with SIGSTOP while the refusals run, so a loaded machine cannot let it finish first.)"""
    out = tmp_path / "out"
    args = [*RUN, "--max_steps", "4", "--data_dir", docs_data, "--output_dir", out]
    started = time.monotonic()
    first = start(*args, env={"TRAIN_TEST_FAULT": "slow_step:0:2-4"}, stdout=subprocess.DEVNULL)
    try:
        wait_for_step(out, 2, first)  # logged after its 4 s sleep, then checkpoint step_2 is written:
        while not (out / "checkpoints" / "step_2" / "manifest.json").is_file():  # a stop mid-save would lose it
            assert first.poll() is None and time.monotonic() < started + 300, "no checkpoint step_2"
            time.sleep(0.1)
        first.send_signal(signal.SIGSTOP)  # in step 3 or its 4 s sleep: it holds the lock, and stays before step 4
        for resume in (["--resume", "auto"], []):  # without --resume too: the holder, not "pass --resume auto"
            second = run([sys.executable, "train.py", *map(str, args), *resume], check=False)
            assert_refused(second, 2, f"--output_dir {out} is in use by another train.py run (pid {first.pid} on ",
                           f"kill -TERM {first.pid} on ")  # fmt: skip
    finally:
        first.kill()
        first.wait()
    assert f'"pid": {first.pid}' in (out / ".lock").read_text()
    retuned = ["--lr", "1.5e-3", "--step_timeout_s", "600"]
    proc = run([sys.executable, "train.py", *map(str, args), "--resume", "auto", *retuned])
    assert "resumed from" in proc.stdout and "step_2" in proc.stdout
    assert f'"pid": {first.pid}' not in (out / ".lock").read_text()
    assert "changed from step_2: --lr 0.003 -> 0.0015, --step_timeout_s -1 -> 600.0" in proc.stdout
    changes = [r for r in metrics(out) if r.get("event") == "change"]
    assert changes == [
        {"step": 2, "event": "change", "setting": "lr", "from": 3e-3, "to": 1.5e-3},
        {"step": 2, "event": "change", "setting": "step_timeout_s", "from": -1, "to": 600},
    ]
    kept, torn = run_metrics.read_metrics(out / "metrics.jsonl")  # what the next resume keeps of metrics.jsonl
    assert torn == 0 and [r for r in kept if r.get("event") == "change"] == changes
    assert [r["step"] for r in kept if "loss" in r] == [1, 2, 3, 4]  # step 3 again after the resume, logged once
    assert train_records(out)[3]["lr"] == pytest.approx(train.Schedule(1.5e-3, 2, 4, 0.1).lr(2), rel=1e-12)
    saved = json.loads((out / "checkpoints" / "step_4" / "trainer_state.json").read_text())["config"]
    assert (saved["lr"], saved["step_timeout_s"]) == (1.5e-3, 600)  # the next --resume auto keeps them
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("odd", ["symlink", "directory"])
@pytest.mark.slow
def test_a_lock_that_is_not_a_file_is_refused(odd, docs_data, tmp_path):
    """OUT/.lock as a symlink to a file elsewhere (it would be truncated through the link) or as a directory: refused
    in one line before anything is written, the link's target untouched."""
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("precious")
    (out / ".lock").symlink_to(victim) if odd == "symlink" else (out / ".lock").mkdir()
    proc = run([sys.executable, "train.py", *RUN, "--max_steps", "2", "--data_dir", docs_data, "--output_dir", out],
               check=False)  # fmt: skip
    assert_refused(proc, 2, f"{out / '.lock'} is not a file train.py can lock", "move it away")
    assert victim.read_text() == "precious" and sorted(p.name for p in out.iterdir()) == [".lock"]


def test_a_console_write_into_a_hung_up_terminal_is_the_hangup(tmp_path):
    """The launcher passes SIGHUP on a moment after the terminal goes: a write in between fails with EIO (a real
    hung-up pseudo-terminal here) and must move the console to the file and go on, not end the run."""
    master, terminal = pty.openpty()
    stream = os.fdopen(os.dup(terminal), "w", buffering=1)
    os.close(master)  # the terminal is gone: writes to it fail with EIO
    log = tmp_path / "console.txt"
    hangups = []

    def on_hangup():
        hangups.append(True)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, stream.fileno())
        os.close(fd)

    safe = resilience._HangupSafe(stream, on_hangup)
    safe.write("step 3/30 | loss 5.0\n")
    safe.flush()
    assert hangups == [True] and log.read_text() == "step 3/30 | loss 5.0\n"
    os.close(terminal)


@pytest.mark.launch
def test_a_closed_terminal_saves_and_stops_like_sigterm(docs_data, tmp_path):
    """The launcher and its 2 workers write to a terminal; it is closed (its master side) and the launcher's process
    group gets SIGHUP, as a shell sends its jobs when the terminal or the ssh connection goes. The workers save a
    checkpoint and stop: metrics.jsonl records the stop and its signal, and the console, which can no longer be
    written, goes on in OUT/console-after-hangup-rank0.txt."""
    out = tmp_path / "out"
    args = [*TINY, "--micro_batch_size", "2", "--max_steps", "30", "--data_dir", docs_data, "--output_dir", out]
    master, terminal = pty.openpty()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRAIN_TEST_FAULT": "slow_step:0:2-30"}
    launcher = subprocess.Popen(launch_cmd(2, *args), cwd=REPO, env=env, stdin=terminal, stdout=terminal,
                                stderr=terminal, start_new_session=True)  # fmt: skip
    os.close(terminal)
    seen, deadline = b"", time.monotonic() + 300
    try:
        while b"step 2/30 |" not in seen:
            assert time.monotonic() < deadline and launcher.poll() is None, seen.decode(errors="replace")[-3000:]
            if select.select([master], [], [], 1)[0]:
                try:
                    seen += os.read(master, 65536)
                except OSError:  # EIO: every writer has gone
                    break
        os.close(master)  # the terminal goes away...
        os.killpg(launcher.pid, signal.SIGHUP)  # ...and the shell hangs up its jobs
        launcher.wait(timeout=300)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 1  # torch's agent re-raises the signal it passed on (the README says so)
    assert b"processes = 4 sequences" in seen, seen.decode(errors="replace")[-3000:]  # 2 processes trained
    stops = [r for r in metrics(out) if r.get("event") == "stop"]
    assert len(stops) == 1 and stops[0]["signal"] == "SIGHUP", metrics(out)
    step = stops[0]["step"]
    assert 2 <= step < 30
    assert (out / "checkpoints" / f"step_{step}" / "trainer_state.json").is_file()
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{step}"
    console = (out / "console-after-hangup-rank0.txt").read_text()
    assert re.search(rf"stopped by signal after step {step} \(SIGHUP\); the same command with --resume auto", console)
