"""What keeps a week-long run going without a person watching it (train.py's loop uses all three):

StopVote   SIGTERM/SIGINT on any process stops every process after the same step, agreed by a collective that
           runs while the next step computes instead of holding up each step
Skips      a step whose loss or gradient norm is not finite is skipped on every process (DeepSpeed skips it
           itself, fp16 overflow or not; without DeepSpeed the loop does), counted, and more than
           --max_skipped_steps in a row stop the run
Watchdog   a step that takes far longer than the run's steps do: every process that can still run writes its
           Python stacks to OUT/hang-<time>-rank<R>.txt, one line names the step and the ranks that answered,
           and the processes exit so that the launcher's restart (--max_restarts) takes over
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import torch

import metrics


class StopVote:
    """Whether any process was asked to stop. The vote cast after step N is read after step N+1, so the all-reduce
    overlaps a step of compute and every process stops after the same step, one step after the signal."""

    def __init__(self, accelerator):
        self.device = accelerator.device
        self.distributed = accelerator.num_processes > 1 and torch.distributed.is_initialized()
        self.pending = None  # (work, tensor) of the vote in flight

    def _outcome(self) -> bool:
        if self.pending is None:
            return False
        work, tensor = self.pending
        work.wait()
        self.pending = None
        return bool(tensor.item() > 0)

    def _cast(self, asked: bool, async_op: bool):
        tensor = torch.tensor([float(asked)], device=self.device)
        work = torch.distributed.all_reduce(tensor, async_op=async_op)
        return work, tensor

    def after_step(self, asked: bool) -> bool:
        """Cast this process's vote for the step just taken; True when the previous step's vote said stop."""
        if not self.distributed:
            return asked
        outcome = self._outcome()
        self.pending = self._cast(asked, async_op=True)
        return outcome

    def now(self, asked: bool) -> bool:
        """Agree at once (after a checkpoint was written, where stopping right away saves a step and a checkpoint)."""
        if not self.distributed:
            return asked
        outcome = self._outcome()
        _, tensor = self._cast(asked, async_op=False)
        return outcome or bool(tensor.item() > 0)

    def settle(self) -> None:
        """Wait for the vote in flight (before the process group is used for anything else at the end)."""
        self._outcome()


class Diverged(Exception):
    """Training cannot go on (exit 3); the message says why and how to continue from the last checkpoint."""


class Skips:
    """Optimizer steps skipped because a loss or gradient norm was not finite (fp16 overflow included). DeepSpeed
    decides on its own, the same on every process (ZeRO-3 skips any step whose global gradient norm is inf or NaN,
    in every precision); without DeepSpeed the loop skips when the clipped norm is not finite and Accelerate's fp16
    scaler reports its own skips. `total` counts the whole run (it is saved in trainer_state.json). In bf16/fp32,
    more than `limit` in a row raise Diverged; fp16 goes on until DeepSpeed's loss scale reaches its minimum."""

    def __init__(self, parts, resumed_state: dict | None, limit: int, precision: str):
        self.parts, self.limit, self.precision = parts, limit, precision  # parts: train.py's Parts
        self.engine_seen = parts.engine.skipped_steps if parts.engine is not None else 0
        # A resumed run's count: its checkpoint's (one from before trainer_state.json counted them: DeepSpeed's).
        self.total = resumed_state.get("skipped_steps", self.engine_seen) if resumed_state is not None else 0
        self.in_a_row = 0

    def after_step(self, step: int, skipped_by_loop: bool) -> bool:
        """Whether `step` (just taken) was skipped; says so on the console."""
        engine, accelerator = self.parts.engine, self.parts.accelerator
        if engine is not None:
            skipped, self.engine_seen = engine.skipped_steps > self.engine_seen, engine.skipped_steps
        else:
            skipped = skipped_by_loop or bool(accelerator.optimizer_step_was_skipped)
        self.total += skipped
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if not skipped:
            return False
        if self.precision == "fp16":
            scale = metrics.fp16_loss_scale(engine, accelerator.scaler)
            accelerator.print(f"step {step}: skipped (fp16 overflow, loss scale now {scale:.0f}); {self.total} in all")
            return True
        accelerator.print(
            f"step {step}: skipped (the loss or gradient norm is not finite): weights and optimizer state unchanged; "
            f"{self.total} skipped in all, {self.in_a_row} in a row"
        )
        if self.in_a_row > self.limit:
            raise Diverged(
                f"steps {step - self.in_a_row + 1}-{step}: {self.in_a_row} steps in a row had a non-finite loss or "
                f"gradient norm (more than --max_skipped_steps {self.limit}); stopping without saving. The last "
                f"checkpoint is intact: lower --lr, raise --warmup_steps or check the data, then --resume auto"
            )
        return True


class Watchdog:
    """A thread in each process that ends a hung run. The loop calls beat() when it starts a step, a validation or a
    checkpoint; a phase still running past its deadline (a rank stopped or dead inside a collective, a wedged GPU, a
    dead mount) fires: this process writes its Python stacks (faulthandler) to OUT/hang-<time>-rank<R>.txt and says
    so on the process group's key-value store, waits a few seconds for the others to do the same, and the lowest
    rank that answered prints one line naming the step and the ranks that did not answer. Ranks on this machine that
    did not answer are killed (a stopped process never exits by itself), and every process that answered exits 3, so
    the launcher's restart (--max_restarts) takes over, or the run ends.

    timeout_s > 0: the limit for a step (validations and checkpoints get 10x); < 0 (auto): 30 min until the run is
    warm, then 20x the slowest of the first warm steps, at least 5 min; 0: off."""

    STARTUP_S, FLOOR_S, STEP_FACTOR, PAUSE_FACTOR, WARM_STEPS, ANSWER_WAIT_S = 1800.0, 300.0, 20.0, 10.0, 8, 5.0

    def __init__(self, out_dir: Path, rank: int, world_size: int, timeout_s: float):
        self.out, self.rank, self.world = Path(out_dir), rank, world_size
        self.limit = timeout_s if timeout_s > 0 else None  # None: auto, not measured yet
        self.auto = timeout_s < 0
        self.warm: list[float] = []  # durations of the first steps after the start (auto)
        self.beats = 0
        self.phase, self.step, self.started, self.deadline = "step", 0, time.monotonic(), None
        self.store = _default_store()
        self.attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if timeout_s == 0:
            return
        self._call_store(lambda st: st.set(self._key("pid", rank), f"{socket.gethostname()} {os.getpid()}"))
        threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    def step_limit(self) -> float:
        return self.limit if self.limit is not None else self.STARTUP_S

    def beat(self, step: int, phase: str = "step") -> None:
        """`phase` starts now, after optimizer step `step`; the previous phase ended."""
        now = time.monotonic()
        self.beats += 1
        if self.auto and phase == self.phase == "step" and self.beats > 3:  # past the first steps' warm-up
            self.warm.append(now - self.started)  # a step with no validation or checkpoint inside it
            if len(self.warm) == self.WARM_STEPS:
                self.limit = max(self.FLOOR_S, self.STEP_FACTOR * max(self.warm))
        limit = self.step_limit() * (1 if phase == "step" else self.PAUSE_FACTOR)
        self.phase, self.step, self.started, self.deadline = phase, step, now, now + limit

    def stop(self) -> None:
        self.deadline = None

    def _key(self, what: str, rank: int) -> str:
        return f"watchdog/{self.attempt}/{what}/{rank}"

    def _call_store(self, fn, timeout_s: float = 10.0):
        """A store call that cannot hang the watchdog itself (the store's host may be what died)."""
        result = []
        if self.store is None:
            return None
        worker = threading.Thread(target=lambda: result.append(fn(self.store)), daemon=True)
        worker.start()
        worker.join(timeout_s)
        return result[0] if result else None

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline:
                self._fire()

    def _fire(self) -> None:
        waited = time.monotonic() - self.started
        what = f"step {self.step + 1}" if self.phase == "step" else f"the {self.phase} after step {self.step}"
        dump = self.out / f"hang-{time.strftime('%Y%m%d-%H%M%S')}-rank{self.rank}.txt"
        try:
            with open(dump, "w") as f:
                f.write(f"rank {self.rank} (pid {os.getpid()} on {socket.gethostname()}): {what} made no progress "
                        f"for {waited:.0f} s\n")  # fmt: skip
                faulthandler.dump_traceback(f, all_threads=True)
        except OSError as e:  # the mount the run writes to may be what hangs
            dump = f"(stacks not written: {e})"
        self._call_store(lambda st: st.set(self._key("hang", self.rank), str(self.step)))
        time.sleep(self.ANSWER_WAIT_S)
        answered = [r for r in range(self.world) if self._call_store(lambda st, r=r: st.check([self._key("hang", r)]))]
        silent = [r for r in range(self.world) if r not in answered] if self.store is not None else []
        for r in silent:  # a stopped or wedged rank on this machine: kill it, so the launcher need not wait for it
            pid = self._call_store(lambda st, r=r: st.get(self._key("pid", r)).decode())
            if pid and pid.split()[0] == socket.gethostname():
                try:
                    os.kill(int(pid.split()[1]), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
        if not answered or self.rank == min(answered):
            sys.stderr.write(
                f"error: {what} made no progress for {waited:.0f} s ({'automatic limit' if self.auto else 'limit'} "
                f"{self.deadline - self.started:.0f} s, --step_timeout_s): "
                f"{_ranks(answered) or 'no rank'} answered, {_ranks(silent) or 'no rank'} did not (killed where "
                f"they shared a machine with one that did); Python stacks in {self.out}/hang-*-rank*.txt. Exiting; "
                f"with --max_restarts the launcher restarts the run and --resume auto continues from the last "
                f"checkpoint\n"
            )
            sys.stderr.flush()
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
