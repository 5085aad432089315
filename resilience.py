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

    def __init__(self, parts, total: int, limit: int, precision: str):
        self.parts, self.limit, self.precision = parts, limit, precision  # parts: train.py's Parts
        self.engine_seen = parts.engine.skipped_steps if parts.engine is not None else 0
        self.total, self.in_a_row = total, 0

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
