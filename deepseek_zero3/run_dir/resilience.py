"""What keeps a week-long run going without a person watching it (train.py uses all of it):

StopSignals  SIGTERM, SIGINT, SIGHUP or SIGQUIT (what torchrun passes on) asks the run to save and stop; after a
             hangup the console goes on in a file in OUT
any_process  a stop asked on any process stops every process after the same step (one tiny all-reduce a step)
lock_run_dir one run trains into an OUT at a time (an flock on OUT/.lock, released when its process dies)
Skips        a step whose loss or gradient norm is not finite is skipped on every process (DeepSpeed skips it
             itself, fp16 overflow or not; without DeepSpeed the loop does, or in fp16 torch's GradScaler), counted,
             and more than --max_skipped_steps in a row stop the run (fp16: its minimum loss scale does)
Watchdog     a phase (startup, step, validation, checkpoint) far past its limit: every process that can still run
             writes its Python stacks to OUT/hang-<time>-rank<R>.txt, one line names the phase and the ranks that
             answered (and a startup's torch build lock, if any), and the processes exit so that the launcher's
             restart (--max_restarts) takes over
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import fcntl
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import torch

from deepseek_zero3 import cli, distributed
from deepseek_zero3.cli import UserError
from deepseek_zero3.run_dir import checkpoint, metrics

# The signals torchrun's agent (under accelerate launch) catches and passes on to its workers before it kills them
# (TORCHELASTIC_SIGNALS_TO_HANDLE's default): each one asks the run to save and stop.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class StopSignals:
    """STOP_SIGNALS, caught: `received` lists those that came. After a hangup (a closed terminal, a dropped ssh) the
    terminal is gone and every write to it fails, so this process's console goes on in
    OUT/console-after-hangup-rank<R>.txt. The launcher starts its workers in their own session and passes the SIGHUP
    on a moment later: a write that fails with EIO first (the terminal is gone) counts as the hangup itself."""

    def __init__(self, out: Path, rank: int):
        self.received: list[int] = []
        self.console_file, self.hung_up = out / f"console-after-hangup-rank{rank}.txt", False
        if sys.stdout.isatty() or sys.stderr.isatty():
            sys.stdout, sys.stderr = _HangupSafe(sys.stdout, self._hangup), _HangupSafe(sys.stderr, self._hangup)
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGHUP:
            self._hangup()
        self.received.append(signum)

    def _hangup(self) -> None:
        if isinstance(sys.stdout, _HangupSafe) and not self.hung_up:
            self.hung_up = True
            cli.console_to_file(self.console_file)
            self.received.append(signal.SIGHUP)

    def name(self, accelerator) -> str:
        """The signal that stopped the run, whichever process got it (collective: called by every process)."""
        number = torch.tensor([self.received[0] if self.received else 0], device=accelerator.device)
        if accelerator.num_processes > 1:
            torch.distributed.all_reduce(number, op=torch.distributed.ReduceOp.MAX)
        return signal.Signals(int(number)).name if int(number) else "a stop asked by another process"


class _HangupSafe:
    """A console stream whose write or flush failing with EIO (a hung-up terminal) calls on_hangup, which points the
    stream's file descriptor elsewhere, and flushes again: what failed to go out is still in the stream's buffer
    (writing it again would say it twice)."""

    def __init__(self, stream, on_hangup):
        self.stream, self.on_hangup = stream, on_hangup

    def _on_eio(self, method: str, *args):
        try:
            return getattr(self.stream, method)(*args)
        except OSError as e:
            if e.errno != errno.EIO:
                raise
            self.on_hangup()
            self.stream.flush()
            return len(args[0]) if args else None

    def write(self, text: str) -> int:
        return self._on_eio("write", text)

    def flush(self) -> None:
        self._on_eio("flush")

    def __getattr__(self, name):
        return getattr(self.stream, name)


def any_process(accelerator, asked: bool) -> bool:
    """Whether any process was asked to stop: one all-reduce of a flag after every step, so that every process stops
    after the same step, the one the signal came in. Reading it a step later, to overlap it with compute, was not
    measurably faster on CPU processes (within the rounds' spread, BENCHMARKS.md) and cost a preempted run its
    checkpoint when a step is long: torchrun kills its workers 30 s after passing on a SIGTERM."""
    return bool(accelerator.reduce(torch.tensor([float(asked)], device=accelerator.device), "sum") > 0)


# This launch's id, and the open lock file of this machine's first process (held until the process exits).
_lock: dict = {"launch": None, "file": None}


def lock_run_dir(accelerator, out: Path) -> None:
    """One run trains into OUT at a time. The first process of each machine takes an flock on OUT/.lock for the whole
    run; the kernel releases it when that process dies, kill -9 included, so a dead run's lock is simply taken over.
    The holder writes its launch's id (rank 0's host, pid and a nonce, the same on every machine of one launch) into
    the file: a machine that finds OUT locked by its own launch (a filesystem shared by the machines) goes on, one that
    finds another launch's id (or none: the holder is still starting) refuses, and so does every process with it.
    Collective: every process calls it before anything in OUT is read, and again once OUT exists (a machine without
    OUT yet takes its lock then; one that holds it already does nothing)."""
    from accelerate.utils import broadcast_object_list, gather_object

    if _lock["launch"] is None:
        info = f"{socket.gethostname()}:{os.getpid()}:{os.urandom(6).hex()}"
        _lock["launch"] = broadcast_object_list([info])[0]
    launch, locked_by_other, problem = _lock["launch"], False, ""
    ours = out.is_dir() and (checkpoint.is_train_run(out) or all(p.name == checkpoint.LOCK for p in out.iterdir()))
    fd = None
    if accelerator.is_local_main_process and _lock["file"] is None and ours:  # else check_output_dir refuses OUT
        try:  # never through a symlink: the lock file is the only one written before OUT is known to be a run's
            fd = os.open(out / checkpoint.LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            problem = (
                f"{out / checkpoint.LOCK} is not a file train.py can lock ({e.strerror}); move it away"
                if e.errno in (errno.ELOOP, errno.EISDIR)
                else f"--output_dir {out}: cannot write its lock file ({e.strerror}); choose a writable one"
            )
    if fd is not None:
        handle = os.fdopen(fd, "r+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            started = time.strftime("%Y-%m-%d %H:%M:%S")
            handle.truncate(0)
            handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": started,
                                     "launch": launch}) + "\n")  # fmt: skip
            handle.flush()
            _lock["file"] = handle
        except BlockingIOError:
            handle.close()
            locked_by_other = True
    accelerator.wait_for_everyone()  # every holder has written its launch id
    if locked_by_other:
        try:
            holder = json.loads((out / checkpoint.LOCK).read_text())
        except (OSError, ValueError):
            holder = None
        if not isinstance(holder, dict) or holder.get("launch") != launch:
            if isinstance(holder, dict) and "pid" in holder:
                who = f"pid {holder['pid']} on {holder.get('host')}, started {holder.get('started')}"
                stop = f"kill -TERM {holder['pid']} on {holder.get('host')} saves a checkpoint first"
            else:
                who, stop = "a process still starting", "kill -TERM saves a checkpoint first"
            problem = (
                f"--output_dir {out} is in use by another train.py run ({who}); two runs in one directory overwrite "
                f"each other's checkpoints and metrics: wait for it to end, or stop it ({stop}) and then --resume "
                f"auto, or choose another --output_dir"
            )
    problems = [p for p in gather_object([problem]) if p]  # what one machine found stops all of them
    if problems:
        raise UserError(problems[0])


class Diverged(Exception):
    """Training cannot go on (exit 3); the message says why and how to continue from the last checkpoint."""


FP16_ADVICE = ("--resume auto from the last checkpoint with a lower --lr (a resume may change it), or train in bf16 "
               "(--mixed_precision bf16 at launch) in a new --output_dir (a checkpoint keeps its precision)")


def backward(accelerator, engine, loss: torch.Tensor, step: int) -> None:
    """train.py's backward: gradients only. Under DeepSpeed its engine's backward, told whether this micro-batch ends
    the step's accumulation (ZeRO-1/2 reduce then); else accelerator.backward. The crash tests' NaN loss enters here."""
    if cli.fault("nan_loss", accelerator.process_index, step):
        loss = loss * float("nan")
    if engine is None:
        accelerator.backward(loss)
        return
    with fp16_minimum_is_diverged(step):
        engine.set_gradient_accumulation_boundary(accelerator.sync_gradients)
        engine.backward(loss)


def engine_step(engine, step: int) -> None:
    """DeepSpeed's engine.step(): clip, step the optimizer or skip a non-finite step, zero the gradients."""
    with fp16_minimum_is_diverged(step):
        engine.step()


@contextlib.contextmanager
def fp16_minimum_is_diverged(step: int):
    """DeepSpeed's "loss scale already at minimum" (fp16 overflowing at scale 1, raised on every rank at once) as
    Diverged."""
    try:
        yield
    except Exception as e:
        if "loss scale already at minimum" not in str(e):
            raise
        raise Diverged(
            f"step {step}: the fp16 loss scale is at its minimum and gradients still overflow; {FP16_ADVICE}"
        ) from None


def stop_vote(accelerator, stop_signals, step: int) -> bool:
    """After a step: whether any process was asked to stop (any_process). The crash tests' after-step fault points
    (a preemption, a killed, a stopped or a slow process) are hit here, where the loop hands over each step."""
    for kind in ("sigterm_launcher", "sigkill_rank", "sigstop_rank", "slow_step"):
        cli.fault(kind, accelerator.process_index, step)
    return any_process(accelerator, bool(stop_signals.received))


class Skips:
    """Optimizer steps skipped because a loss or gradient norm was not finite (fp16 overflow included). DeepSpeed
    decides on its own, the same on every process (ZeRO-3 skips any step whose global gradient norm is inf or NaN,
    in every precision); without DeepSpeed the loop skips when the clipped norm is not finite, and in fp16 torch's
    GradScaler skips the step (Accelerate's, or distributed.cpu_fp16_autocast's on CPUs). `total` counts the whole run
    (it is saved in trainer_state.json). In bf16/fp32, more than `limit` in a row raise Diverged; fp16 goes on until its
    loss scale reaches the minimum: DeepSpeed's (1, raised in backward), or below 1 for GradScaler.

    GradScaler's skip is read from its scale, which its update() (inside Accelerate's optimizer step) multiplies by
    the backoff factor (0.5) exactly when it found an inf or NaN gradient, the same value on every process. Accelerate's
    own signal, `optimizer_step_was_skipped`, is False for an optimizer that handles the scaler itself: torch's fused
    AdamW (`_step_supports_amp_scaling`) is called on an overflow and skips inside its kernel."""

    def __init__(self, training, resumed_state: dict | None, limit: int, precision: str):
        self.training, self.limit, self.precision = training, limit, precision  # training: train.py's TrainingObjects
        self.engine_seen = training.engine.skipped_steps if training.engine is not None else 0
        self.scale_seen = self._scaler_scale()  # a resumed run's: loaded with its checkpoint before this
        # A resumed run's count: its checkpoint's (one from before trainer_state.json counted them: DeepSpeed's).
        self.total = resumed_state.get("skipped_steps", self.engine_seen) if resumed_state is not None else 0
        self.in_a_row = 0

    def _scaler_scale(self) -> float | None:
        """GradScaler's scale (without DeepSpeed, in fp16), else None."""
        scaler = self.training.accelerator.scaler if self.training.engine is None else None
        return float(scaler.get_scale()) if scaler is not None else None

    def after_step(self, step: int, skipped_by_loop: bool) -> bool:
        """Whether `step` (just taken) was skipped; says so on the console."""
        engine, accelerator = self.training.engine, self.training.accelerator
        if engine is not None:
            skipped, self.engine_seen = engine.skipped_steps > self.engine_seen, engine.skipped_steps
        else:
            scale = self._scaler_scale()
            backed_off = scale is not None and scale < self.scale_seen
            skipped, self.scale_seen = skipped_by_loop or backed_off, scale
        self.total += skipped
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if not skipped:
            return False
        if self.precision == "fp16":
            scale = metrics.fp16_loss_scale(engine, accelerator.scaler)
            accelerator.print(f"step {step}: skipped (fp16 overflow, loss scale now {scale:.10g}); {self.total} in all")
            if engine is None and scale < 1:  # DeepSpeed's own minimum (1) raises in backward
                raise Diverged(
                    f"step {step}: the fp16 loss scale fell below 1 ({scale:.10g}) after {self.in_a_row} overflowing "
                    f"steps in a row; {FP16_ADVICE}"
                )
            return True
        accelerator.print(
            f"step {step}: skipped (the loss or gradient norm is not finite): weights and optimizer state unchanged; "
            f"{self.total} skipped in all, {self.in_a_row} in a row"
        )
        if self.in_a_row > self.limit:
            raise Diverged(
                f"steps {step - self.in_a_row + 1}-{step}: {self.in_a_row} steps in a row had a non-finite loss or "
                f"gradient norm (more than --max_skipped_steps {self.limit}); stopping without saving. The last "
                f"checkpoint is intact: --resume auto with a lower --lr or a higher --warmup_steps (a resume may "
                f"change them), or check the data"
            )
        return True


def check_validation(record: dict, step: int) -> None:
    """A validation loss that is not finite, or so large that its perplexity is past the largest float (over ~709.8
    nats per token, where a uniform guess over a vocabulary of 100k tokens costs 11.5), is a diverged model: the run
    stops (Diverged, exit 3) before this step's checkpoint would be written. record: metrics.validation_record's."""
    if not math.isfinite(record["val_ppl"]):
        raise Diverged(
            f"step {step}: the validation loss is {record['val_loss']:.4g} nats per token (perplexity "
            f"{record['val_ppl']}): the run diverged; stopping without saving this step. The last checkpoint is "
            f"intact: --resume auto with a lower --lr or a higher --warmup_steps (a resume may change them), or check "
            f"the data"
        )


class Watchdog:
    """A thread in each process that ends a hung run. The script calls beat() when it starts a phase: startup (from
    before the process group exists, so a restarted attempt that hangs while it joins or loads is caught too), each
    step, each validation and checkpoint. A phase still running past its deadline (a rank stopped or dead inside a
    collective, a wedged GPU, a dead mount) fires: this process writes its Python stacks (faulthandler) to
    OUT/hang-<time>-rank<R>.txt and says so on the process group's key-value store, waits a few seconds for the others
    to do the same, and the lowest rank that answered prints one line naming the phase and the ranks that did not
    answer. Ranks on this machine that did not answer are killed (a stopped process never exits by itself, and the
    launcher would wait 30 s for it), and every process that answered exits 3, so that the launcher's restart
    (--max_restarts) takes over, or the run ends. A process whose phase ended while it waited goes on instead.

    timeout_s > 0: the limit for a step (startup, validations and checkpoints get 10x); -1 (auto): 30 min until the
    run is warm, then 20x the slowest of the first warm steps, at least 5 min (10x that for the other phases);
    0: off."""

    STARTUP_S, FLOOR_S, STEP_FACTOR, PAUSE_FACTOR, WARM_STEPS, ANSWER_WAIT_S = 1800.0, 300.0, 20.0, 10.0, 8, 5.0

    def __init__(self, out_dir: str, timeout_s: float):
        self.out = Path(out_dir)
        self.rank, self.world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self.warm: list[float] = []  # durations of the first steps after the start (auto)
        self.beats, self.registered, self.watching = 0, False, False
        self.phase, self.step, self.started, self.deadline = "startup", 0, time.monotonic(), None
        self.attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.set_timeout(timeout_s)
        if timeout_s != 0:
            self.beat(0, "startup")

    def set_timeout(self, timeout_s: float) -> None:
        """The limit (see the class); called again once a resumed run knows its own (the checkpoint's, or a changed
        --step_timeout_s)."""
        self.timeout_s = timeout_s
        self.limit = timeout_s if timeout_s > 0 else None  # None: auto, not measured yet
        self.auto = timeout_s < 0
        if timeout_s == 0:
            self.deadline = None
        elif not self.watching:
            self.watching = True
            threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    def beat(self, step: int, phase: str = "step") -> None:
        """`phase` starts now, after optimizer step `step`; the previous phase ended."""
        if self.timeout_s == 0:
            return
        now = time.monotonic()
        self.beats += 1
        if self.auto and phase == self.phase == "step" and len(self.warm) < self.WARM_STEPS and self.beats > 4:
            self.warm.append(now - self.started)  # a whole step, past the first ones, with no pause inside it
            if len(self.warm) == self.WARM_STEPS:
                self.limit = max(self.FLOOR_S, self.STEP_FACTOR * max(self.warm))
        if not self.registered and _default_store() is not None:  # who this process is, for the others to kill
            self.registered = True
            self._call_store(lambda st: st.set(self._key("pid", self.rank), f"{socket.gethostname()} {os.getpid()}"))
        if self.limit is None:
            limit = self.STARTUP_S
        else:
            limit = self.limit * (1 if phase == "step" else self.PAUSE_FACTOR)
        self.phase, self.step, self.started, self.deadline = phase, step, now, now + limit

    def stop(self) -> None:
        self.deadline = None

    def _key(self, what: str, rank: int) -> str:
        return f"watchdog/{self.attempt}/{what}/{rank}"

    def _call_store(self, fn, timeout_s: float = 10.0):
        """A store call that cannot hang the watchdog itself (the store's host may be what died)."""
        store, result = _default_store(), []
        if store is None:
            return None
        worker = threading.Thread(target=lambda: result.append(fn(store)), daemon=True)
        worker.start()
        worker.join(timeout_s)
        return result[0] if result else None

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline:
                self._fire(deadline)

    def _fire(self, deadline: float) -> None:
        beats, limit, waited = self.beats, deadline - self.started, time.monotonic() - self.started
        what = f"step {self.step + 1}" if self.phase == "step" else f"the {self.phase} after step {self.step}"
        if self.phase == "startup":
            what = "the startup (process group, model, checkpoint)"
        dump = self.out / f"hang-{time.strftime('%Y%m%d-%H%M%S')}-rank{self.rank}.txt"
        try:
            dump.parent.mkdir(parents=True, exist_ok=True)
            with open(dump, "w") as f:
                f.write(f"rank {self.rank} (pid {os.getpid()} on {socket.gethostname()}): {what} made no progress "
                        f"for {waited:.0f} s\n")  # fmt: skip
                faulthandler.dump_traceback(f, all_threads=True)
        except OSError as e:  # the mount the run writes to may be what hangs
            dump = f"(stacks not written: {e})"
        self._call_store(lambda st: st.set(self._key("hang", self.rank), str(self.step)))
        time.sleep(self.ANSWER_WAIT_S)
        if self.beats != beats:  # it was slow, not stuck: its phase ended while the others were asked
            self._call_store(lambda st: st.delete_key(self._key("hang", self.rank)))
            print(f"warning: {what} took {waited:.0f} s (limit {limit:.0f} s) and then went on; stacks: {dump}",
                  file=sys.stderr, flush=True)  # fmt: skip
            return
        grouped = _default_store() is not None and self.world > 1
        answered = [r for r in range(self.world) if self._call_store(lambda st, r=r: st.check([self._key("hang", r)]))]
        silent = [r for r in range(self.world) if r not in answered] if grouped else []
        printer = not grouped or self.rank == min(answered, default=self.rank)
        if printer:
            ranks = (f"{_ranks(answered) or 'no rank'} answered, {_ranks(silent) or 'no rank'} did not (killed where "
                     f"they shared a machine with one that did); ") if grouped else ""  # fmt: skip
            locks = distributed.extension_build_locks() if self.phase == "startup" else []
            waits = (f"torch's build lock {', '.join(map(str, locks))} exists (a launch killed while DeepSpeed built "
                     "its op leaves it, and the build waits for it forever): delete it if no build runs, then "
                     "relaunch; ") if locks else ""  # fmt: skip
            sys.stderr.write(
                f"error: {what} made no progress for {waited:.0f} s ({'automatic ' if self.auto else ''}limit "
                f"{limit:.0f} s, --step_timeout_s): {waits}{ranks}Python stacks in {self.out}/hang-*-rank*.txt. "
                f"Exiting; with --max_restarts the launcher restarts the run and --resume auto continues from the last "
                f"checkpoint\n"
            )
            sys.stderr.flush()
        if not printer:  # a killed rank wakes every main thread with an error: the line first
            time.sleep(2)
        for r in silent:  # stopped or wedged ranks on this machine: killed, so that the launcher need not wait
            pid = self._call_store(lambda st, r=r: st.get(self._key("pid", r)).decode())
            if pid and pid.split()[0] == socket.gethostname():
                try:
                    os.kill(int(pid.split()[1]), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
        os._exit(3)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks)) if ranks else ""


def _default_store():
    """The process group's key-value store (torchrun's, on the launcher); None without a process group."""
    if not torch.distributed.is_initialized():
        return None
    try:
        return torch.distributed.distributed_c10d._get_default_store()  # private, but the only handle to it
    except (AttributeError, RuntimeError):
        return None
