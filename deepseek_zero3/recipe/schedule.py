"""The learning-rate schedules: a pure function of the optimizer step, written into the optimizer's param groups each
step, so a resumed run has the same LRs and no scheduler state to save.

    cosine     linear warmup, then a cosine from the peak to min_lr_ratio x peak over the schedule's length (default)
    multistep  DeepSeek LLM's (arXiv:2401.02954, Section 2.3): linear warmup, the peak until 80% of the schedule, then
               x0.316 until 90%, then x0.316 again (fractions and factor are flags); its first 80% can be reused to
               train on
    wsd        warmup-stable-decay: warmup, the peak, then a decay to min_lr_ratio x peak over the last decay_fraction
               of the schedule, linear, 1-sqrt or cosine in shape

Any of them can be cut short by a decay branch (train.py --decay_branch K): from step branch_at, the LR decays from
where the schedule had it to the floor over K steps (branch_steps), in decay_shape.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from deepseek_zero3.cli import UserError

KINDS = ("cosine", "multistep", "wsd")
SHAPES = ("linear", "1-sqrt", "cosine")


def decayed(fraction: float, shape: str) -> float:
    """How much of the way from the top to the floor is left after `fraction` of a decay: 1 at 0, 0 at 1."""
    fraction = min(1.0, max(0.0, fraction))
    if shape == "linear":
        return 1.0 - fraction
    if shape == "1-sqrt":
        return 1.0 - math.sqrt(fraction)
    return 0.5 * (1.0 + math.cos(math.pi * fraction))


def first_step_past(fraction: float, length: int) -> int:
    """The first optimizer step whose tokens come after `fraction` of a schedule `length` steps long (steps 0..s-1
    have then trained on at least that share). Rounded so that 0.8 x 10 is 8, not 9."""
    return math.ceil(round(fraction * length, 9))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """peak_lr reached on step warmup_steps - 1; `length` steps in all (the cosine and the WSD decay reach the floor,
    min_lr_ratio x peak_lr, on step length - 1 and stay there)."""

    peak_lr: float
    warmup_steps: int
    length: int
    min_lr_ratio: float
    kind: str = "cosine"
    multistep_at: tuple[float, ...] = (0.8, 0.9)
    multistep_factor: float = 0.316
    decay_fraction: float = 0.2
    decay_shape: str = "linear"
    branch_at: int = 0  # a decay branch's first step (0: none)
    branch_steps: int = 0  # and its length: it reaches the floor on step branch_at + branch_steps - 1

    def lr(self, step: int) -> float:
        if self.branch_at and step >= self.branch_at:
            top, span = self.shape_lr(self.branch_at - 1), max(1, self.branch_steps)
            return self.floor + (top - self.floor) * decayed((step - self.branch_at + 1) / span, self.decay_shape)
        return self.shape_lr(step)

    @property
    def decay_start(self) -> int:
        """wsd: the first step of its decay, which spans the last decay_fraction of the schedule (at least one)."""
        return self.length - max(1, round(self.decay_fraction * self.length))

    @property
    def decline_start(self) -> int:
        """The last step the warmup may end on (reaching the peak on the step before) for the schedule to go down
        after it: cosine's last step, multistep's first cut, the WSD decay's first step."""
        if self.kind == "multistep":
            return first_step_past(self.multistep_at[0], self.length)
        return self.decay_start if self.kind == "wsd" else self.length - 1

    @property
    def floor(self) -> float:
        return self.peak_lr * self.min_lr_ratio

    def shape_lr(self, step: int) -> float:
        warm = self.peak_lr * (step + 1) / self.warmup_steps if step < self.warmup_steps else self.peak_lr
        if self.kind == "multistep":
            passed = sum(step >= first_step_past(f, self.length) for f in self.multistep_at)
            return warm * self.multistep_factor**passed
        if self.kind == "wsd":
            start = self.decay_start
            span = self.length - start
            if step < start:
                return warm
            return min(warm, self.floor + (self.peak_lr - self.floor) * decayed((step - start + 1) / span,
                                                                                 self.decay_shape))
        if step < self.warmup_steps:
            return warm
        top = max(self.warmup_steps - 1, 0)  # the step that holds the peak
        progress = (step - top) / max(1, self.length - 1 - top)
        return self.floor + (self.peak_lr - self.floor) * decayed(progress, "cosine")

    def describe(self) -> str:
        """One line for the console: the shape and its boundary steps, numbered as the log numbers them (the step
        logged as k trains with lr(k - 1))."""
        warm = f"warmup {self.warmup_steps} steps to {self.peak_lr:.3g}" if self.warmup_steps else "no warmup"
        if self.length == 1 and not self.branch_at:  # nothing after the first step: neither a warmup nor a decay
            return f"LR schedule {self.kind}: no warmup, {self.lr(0):.3g} for its one step"
        if self.kind == "multistep":
            cuts = ", ".join(f"x{self.multistep_factor:g} from step {first_step_past(f, self.length) + 1}"
                             for f in self.multistep_at)  # fmt: skip
            shape = f"multistep: {warm}, {cuts}"
        elif self.kind == "wsd":
            shape = (f"wsd: {warm}, constant, {self.decay_shape} decay to {self.floor:.3g} over steps "
                     f"{self.decay_start + 1}-{self.length}")  # fmt: skip
        else:
            start = "" if self.warmup_steps else f" from {self.peak_lr:.3g}"
            shape = f"cosine: {warm}, cosine{start} to {self.floor:.3g} at step {self.length}"
        if self.branch_at:
            end = self.branch_at + self.branch_steps
            shape += (f"; decay branch: from step {self.branch_at} ({self.lr(self.branch_at - 1):.3g}) to "
                      f"{self.floor:.3g} at step {end}, {self.decay_shape}")  # fmt: skip
        return f"LR schedule {shape}"


def fitted(schedule: Schedule, given: bool = False) -> tuple[Schedule, str | None]:
    """The schedule with a warmup that ends before it goes down (decline_start), and the note to print when it had to
    be shortened: a warmup as long as the schedule warmed up to its end and never decayed, while describe() promised
    the decay. Such a warmup becomes a tenth of the schedule, whether --warmup_steps was given (given: for the note;
    a smoke test of a few steps keeps its command line) or its default, so that the schedule stays a pure function of
    the run's settings: a resumed run (schedule_change_on_resume) and a decay branch fit it alike."""
    if schedule.warmup_steps <= schedule.decline_start:
        return schedule, None
    warmup = min(schedule.length // 10, schedule.decline_start)
    asked = f"--warmup_steps {schedule.warmup_steps}{'' if given else ' (the default)'}"
    return dataclasses.replace(schedule, warmup_steps=warmup), (
        f"note: {asked} does not fit the {schedule.length}-step {schedule.kind} LR schedule, which would never go "
        f"down: its warmup is {warmup} step(s), a tenth of it"
    )


def parse_fractions(text: str, flag: str) -> tuple[float, ...]:
    """--multistep_at '0.8,0.9': increasing fractions in (0, 1). Raises ValueError naming the flag."""
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} {text!r} must be fractions separated by commas, e.g. 0.8,0.9") from None
    if not values or any(not 0 < v < 1 for v in values) or list(values) != sorted(set(values)):
        raise ValueError(f"{flag} {text!r} must be increasing fractions between 0 and 1, e.g. 0.8,0.9")
    return values


def check_schedule_flags(cfg) -> None:
    """train.py's schedule flags (cfg: its Config), each refused in one line."""
    if cfg.lr_schedule not in KINDS:
        raise UserError(f"--lr_schedule {cfg.lr_schedule!r} must be one of {', '.join(KINDS)}")
    if cfg.decay_shape not in SHAPES:
        raise UserError(f"--decay_shape {cfg.decay_shape!r} must be one of {', '.join(SHAPES)}")
    if not 0 < cfg.multistep_factor <= 1:
        raise UserError(f"--multistep_factor {cfg.multistep_factor} must be in (0, 1] (DeepSeek LLM's: 0.316)")
    if not 0 < cfg.decay_fraction <= 1:
        raise UserError(f"--decay_fraction {cfg.decay_fraction} must be in (0, 1], e.g. 0.2 for the last 20%")
    try:
        parse_fractions(cfg.multistep_at, "--multistep_at")
    except ValueError as e:
        raise UserError(str(e)) from None


def branch_settings(cfg, flags_given: set[str], resume):
    """--decay_branch K: the run's Config for a decay branch from the checkpoint resume names (checkpoint.Resume): it
    ends K steps after that checkpoint's step N, decaying from step N, in a new --output_dir; the schedule before N
    keeps the run's length. A branch resumed from its own checkpoints keeps the step it branched at."""
    if resume is None:
        raise UserError(
            f"--decay_branch {cfg.decay_branch} decays from a checkpoint: give one with --resume "
            "OUT/checkpoints/step_N and a new --output_dir"
        )
    if cfg.decay_start_step:  # this branch's own checkpoint
        ran = resume.state.get("config", {})
        if ran.get("decay_branch") != cfg.decay_branch:
            raise UserError(f"cannot resume: this branch decays over --decay_branch {ran.get('decay_branch')} steps; "
                            f"drop --decay_branch {cfg.decay_branch} (or branch anew from the original run's "
                            "checkpoint)")  # fmt: skip
        if "max_steps" in flags_given and cfg.max_steps != ran.get("max_steps"):
            raise UserError(f"cannot resume: this branch ends at step {ran.get('max_steps')}; drop --max_steps "
                            f"{cfg.max_steps} (a longer decay is a new branch from the original run)")  # fmt: skip
        return cfg
    ran = resume.state.get("config", {})
    changed = sorted(
        f for f in flags_given & {"max_steps", "num_epochs", "lr_decay_steps"} if getattr(cfg, f) != ran.get(f)
    )
    if changed:  # the run's own command repeated is fine
        raise UserError("--decay_branch K sets the run's length (the checkpoint's step + K): drop "
                        + " ".join(f"--{f} {getattr(cfg, f)}" for f in changed))  # fmt: skip
    out, original = Path(cfg.output_dir).resolve(), resume.path.resolve().parent.parent
    if out == original or original in out.parents:
        raise UserError(
            f"--decay_branch writes a new run: give a new --output_dir outside {original} (not {cfg.output_dir}), "
            "whose run keeps its constant phase and can go on with --resume auto"
        )
    if (out / "final").exists() or any((out / "checkpoints").glob("step_*")):
        raise UserError(
            f"--decay_branch writes a new run, and {cfg.output_dir} holds one (its checkpoints or final/): give a new "
            "--output_dir; a branch of yours stopped there continues with --resume auto --decay_branch "
            f"{cfg.decay_branch}"
        )
    # The schedule runs on the steps taken (a skipped step does not move it): the branch starts where the LR was.
    step, length = resume.state["step"], cfg.lr_decay_steps or resume.state["total_steps"]
    start = step - resume.state.get("skipped_steps", 0)
    ran_schedule = Schedule(cfg.lr, cfg.warmup_steps, length, cfg.min_lr_ratio, cfg.lr_schedule,
                            parse_fractions(cfg.multistep_at, "--multistep_at"), cfg.multistep_factor,
                            cfg.decay_fraction)  # fmt: skip
    warmup = max(1, fitted(ran_schedule)[0].warmup_steps)  # a branch at 0 would be none (branch_at)
    if start < warmup or cfg.decay_branch > length:
        raise UserError(
            f"--decay_branch {cfg.decay_branch} from step {step}: branch from a checkpoint after the warmup (step "
            f"{warmup} on), over at most the run's {length} scheduled steps"
        )
    return dataclasses.replace(cfg, decay_start_step=start, max_steps=step + cfg.decay_branch, lr_decay_steps=length)


def schedule_change_on_resume(schedule: Schedule, state: dict, flags_given: set[str]) -> str | None:
    """A resumed run keeps its schedule's length unless the command re-plans it with --lr_decay_steps (--max_steps
    alone would stretch the decay under the run's feet: refused). A new length, --lr, --warmup_steps, --min_lr_ratio
    or a decay branch returns the line to print, with the LR at the resume step before and after."""
    ran, new, step = state.get("config", {}), schedule.length, state["step"]
    taken = step - state.get("skipped_steps", 0)  # the schedule's step: a skipped step does not move it
    old = ran.get("lr_decay_steps") or state["total_steps"]
    keys = {"peak_lr": "lr", "warmup_steps": "warmup_steps", "min_lr_ratio": "min_lr_ratio",
            "branch_at": "decay_start_step", "branch_steps": "decay_branch"}  # Schedule: Config  # fmt: skip
    saved = dataclasses.replace(schedule, length=old, **{k: ran[f] for k, f in keys.items() if f in ran})
    saved = fitted(saved)[0]  # as the run fitted it at its start
    if saved == schedule:
        return None
    change = f"the LR of step {step + 1} goes from {saved.lr(taken):.3g} to {schedule.lr(taken):.3g}"
    if new == old:
        return f"changed LR schedule: {change}"
    if "lr_decay_steps" not in flags_given:
        raise UserError(
            f"cannot resume: this command makes the LR schedule {new} steps long, the run's is {old} ({change}); "
            f"give --lr_decay_steps {new} to re-plan the schedule, or --lr_decay_steps {old} to keep it and train "
            f"on at its floor"
        )
    return f"re-planned LR schedule: {old} -> {new} steps; {change}"
