"""What every script does at its edges: refuse bad input, write files whole, keep the console readable, and leave.

- field / flags_given_in / parse_config: a Config dataclass's fields, which of them a command line sets, and the
  Config of a command line (an unknown flag is one `error:` line).
- UserError: a mistake of the user's (a flag, a file, a directory). The message is one line that names the value,
  the constraint and the fix; main() prints it as `error: ...` and exits 2, before anything is half-written.
- check_path / shown / one_line: a path flag's value that no file can have (a name past the filesystem's limit,
  bytes that are not UTF-8), or an output path whose deepest file would be past it, refused at the start; a path, and
  any message, in one line.
- write_atomic / write_json_atomic / replace_dir / remove: a reader, or a crash, sees the old file or directory or
  the whole new one, never a part; remove deletes a symlink, never what it points to.
- quiet_console / without_noise / progress_bar: third-party start-up lines that carry no information are dropped,
  and progress bars show only on a terminal.
- print_error: the one `error:` line a failed process leaves, seen in every kind of launch.
- console_to_file: where the console goes once the terminal is gone.
- FAULTS / fault: the crash tests' switch (TRAIN_TEST_FAULT), every point it can hit in one table, inert unless set.
- exit_process: the end of a launched process (see its docstring for the crash it avoids).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path


class UserError(Exception):
    """A user mistake; the message is one line naming the value, the constraint and the fix."""


def one_line(text: str) -> str:
    """text with its control characters (a newline, a terminal's escape: valid bytes of a file name) and the bytes of a
    name that are not UTF-8 (surrogates) escaped as Python writes them: one line, as it reads."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)


def shown(path) -> str:
    """A path as one line of a message (one_line), a very long one cut in the middle, with its length."""
    text = one_line(str(path))
    return text if len(text) <= 160 else f"{text[:70]}...{text[-70:]} ({len(text):,} characters)"


def check_path(flag: str, value, below_bytes: int | None = None, beside: str = "{}") -> None:
    """Refuse a path flag's value, before anything is read or written, where the filesystem or the libraries cannot
    take it: bytes that are not UTF-8 (the tokenizers and safetensors libraries open UTF-8 paths only), a name past the
    filesystem's NAME_MAX bytes, or a path past its PATH_MAX. An input (below_bytes None) with such a name cannot
    exist; an output is checked with what the script writes there: files up to below_bytes deeper, and `beside`, the
    name it also gives the path's last part (prepare_data.py's work directory .NAME.partial: ".{}.partial"). Without
    this, Python's own checks raise OSError ("File name too long") on such a path, or the first save fails, days in."""
    text = os.fspath(value)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{flag} {shown(text)} is not valid UTF-8 (the tokenizers and safetensors libraries open UTF-8 "
                        f"paths only); rename it in UTF-8") from None  # fmt: skip
    path = os.path.abspath(os.path.expanduser(text))
    existing = path
    while not os.path.exists(existing):  # os.path.exists, unlike Path.exists, says False for a name too long
        existing = os.path.dirname(existing)
    name_max, path_max = _pathconf(existing, "PC_NAME_MAX", 255), _pathconf(existing, "PC_PATH_MAX", 4096)
    script = Path(sys.argv[0]).name if sys.argv[0].endswith(".py") else "the script"
    parts = path.split(os.sep)
    for name in parts:
        if len(os.fsencode(name)) > name_max:
            what = "no file can have that name" if below_bytes is None else "choose a shorter name"
            raise UserError(f"{flag} {shown(text)}: a name of {len(os.fsencode(name))} bytes, over the {name_max} "
                            f"bytes a name may have on that filesystem; {what}")  # fmt: skip
    extra = len(os.fsencode(beside.format(parts[-1]))) - len(os.fsencode(parts[-1]))
    if below_bytes is not None and len(os.fsencode(parts[-1])) + extra > name_max:
        raise UserError(f"{flag} {shown(text)}: {script} also writes {beside.format('NAME')} beside it, a name of "
                        f"{len(os.fsencode(parts[-1])) + extra} bytes, over the {name_max} bytes a name may have on "
                        f"that filesystem; choose a name of at most {name_max - extra} bytes")  # fmt: skip
    deepest = len(os.fsencode(path)) + (below_bytes or 0)
    if deepest >= path_max:  # PATH_MAX counts the terminating NUL
        below = f", and {script} writes files up to {below_bytes} bytes below it" if below_bytes else ""
        what = "no file can have that path" if below_bytes is None else "choose a shorter path"
        raise UserError(f"{flag} {shown(text)} is {len(os.fsencode(path)):,} bytes long{below}: over the "
                        f"{path_max - 1:,} bytes a path may have on that filesystem; {what}")  # fmt: skip


def _pathconf(path: str, name: str, default: int) -> int:
    try:
        return os.pathconf(path, name)
    except (OSError, ValueError):  # a filesystem that does not say
        return default


RESUME_POLICIES = ("fixed", "free", "retune", "length", "own")


class Help(str):
    """A field's --help text that also carries its resume policy (HfArgumentParser hands every metadata key to
    argparse, so the policy rides on the one key it takes)."""

    def __new__(cls, text: str, resume: str):
        help_text = super().__new__(cls, text)
        help_text.resume = resume
        return help_text


def field(default, doc: str, resume: str = "fixed"):
    """A Config field: its default, its --help text, and what a resumed run does with it (train.py's Config says
    what each policy means; checkpoint.config_for_resume applies it: resume_policy)."""
    assert resume in RESUME_POLICIES, resume
    return dataclasses.field(default=default, metadata={"help": Help(doc, resume)})


def resume_policy(f: dataclasses.Field) -> str:
    return getattr(f.metadata.get("help"), "resume", "fixed")


def flags_given_in(config_class, argv: list[str]) -> set[str]:
    """The fields of a Config dataclass that the command line sets (argparse abbreviations included), as opposed to
    those left at their default."""
    import argparse

    from transformers import HfArgumentParser

    parser = HfArgumentParser(config_class)
    for action in parser._actions:  # set_defaults would not do: argparse type-converts string defaults
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_known_args(argv)[0]))


# accelerate launch's own flags (spelled with _ here; it takes - too), often put after the script by mistake
# fmt: off
LAUNCHER_FLAGS = ("--config_file", "--num_processes", "--num_machines", "--machine_rank", "--main_process_ip",
                  "--main_process_port", "--mixed_precision", "--use_deepspeed", "--zero_stage", "--gpu_ids", "--cpu",
                  "--multi_gpu", "--deepspeed_config_file", "--num_cpu_threads_per_process", "--max_restarts")
# fmt: on


class _BadCommandLine(Exception):
    pass


def _refuse(message: str):
    raise _BadCommandLine(message)


def parse_config(config_class, argv: list[str] | None, doc: str):
    """The Config of a command line, or None after one `error:` line when a word is no flag's (a typo, a flag of the
    launcher) or argparse refuses one (a bad value, a missing one, an ambiguous prefix). Unhandled, the first is
    HfArgumentParser's ValueError traceback and the others argparse's usage block, from every process. Launched,
    every process parses the same line: rank 0 says it, and the launcher stops the others when rank 0 exits."""
    import difflib

    from transformers import HfArgumentParser

    parser = HfArgumentParser(config_class, description=doc)
    parser.error = _refuse  # argparse prints its usage and exits on its own; here it says why in one line
    script = Path(sys.argv[0]).name if sys.argv[0].endswith(".py") else "the script"
    rank = int(os.environ.get("RANK", "0"))  # the launcher's: Accelerate has not started yet
    try:
        with contextlib.redirect_stdout(io.StringIO()) if rank else contextlib.nullcontext():  # --help once
            cfg, rest = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True)
    except _BadCommandLine as e:
        rest, said = None, f"{e}; python {script} --help lists the flags"
    if rest == []:
        return cfg
    if rest:
        word = ([w for w in rest if w.startswith("-")] or rest)[0].split("=")[0]
        flags = [name for action in parser._actions for name in action.option_strings]
        close = difflib.get_close_matches(word, flags, n=1, cutoff=0.8)
        if word.startswith("--") and "--" + word[2:].replace("-", "_") in LAUNCHER_FLAGS:
            said = f"{word}: a flag of accelerate launch, not of {script}: put it before {script}"
        elif not word.startswith("-"):
            said = f"{word!r}: a word no flag of {script} takes; python {script} --help lists the flags"
        else:
            hint = f"did you mean {close[0]}? " if close else ""
            said = f"{word}: no such flag of {script} ({hint}python {script} --help lists the flags)"
        said += f"; the command line's words not taken: {' '.join(map(repr, rest))}"
    print_error(said, rank)
    return None


# The crash tests' switch, TRAIN_TEST_FAULT=kind:rank:step[-last][@attempt][,...]: the points below, at one step or
# every step of a range, on every launch or only on the launcher's attempt number `attempt` (0: before any restart).
# Real signals and real NaNs; inert unless the variable names this exact point.
FAULTS = {
    "nan_loss": "train.py: the loss of step `step` on rank `rank` becomes NaN (the caller multiplies it)",
    "sigterm_launcher": "train.py: after step `step`, rank `rank` sends SIGTERM to its launcher (a preemption)",
    "sigkill_rank": "train.py: after step `step`, rank `rank` kills itself with SIGKILL (a crashed process)",
    "sigstop_rank": "train.py: after step `step`, rank `rank` stops itself with SIGSTOP (a hung process)",
    "slow_step": "train.py: after step `step`, rank `rank` sleeps 4 s (a slow step, not a hung one)",
    "sigkill_in_save": "checkpoint.py: rank `rank` is killed after writing its shards of checkpoint `step`",
    "sigkill_in_reshard": "reshard.py: rank `rank` is killed while it converts checkpoint `step` (once files appear)",
    "sigterm_in_save": "checkpoint.py: rank `rank` gets SIGTERM while checkpoint `step` is written",
    "enospc_in_save": "checkpoint.py: rank `rank` finds its disk full (ENOSPC) writing checkpoint `step`",
    "corrupt_link": "measure.py: rank `rank` sees one changed integer in the link check at start (`step` 0)",
    "fsize_in_export": "checkpoint.py: rank `rank` writes OUT/final under a 64 KB file size limit (`step` 0)",
}
SIGNALS = {"sigkill_rank": signal.SIGKILL, "sigstop_rank": signal.SIGSTOP, "sigkill_in_save": signal.SIGKILL,
           "sigkill_in_reshard": signal.SIGKILL}  # fmt: skip


def fault(kind: str, rank: int, step: int) -> bool:
    """Whether TRAIN_TEST_FAULT names this point; the signal faults are sent here."""
    assert kind in FAULTS, kind
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for spec in filter(None, os.environ.get("TRAIN_TEST_FAULT", "").split(",")):
        named = re.fullmatch(r"(\w+):(\d+):(\d+)(?:-(\d+))?(?:@(\d+))?", spec)
        if (
            not named
            or named[1] != kind
            or int(named[2]) != rank
            or not int(named[3]) <= step <= int(named[4] or named[3])
        ):
            continue
        if named[5] is not None and int(named[5]) != attempt:
            continue
        if kind == "sigterm_launcher":
            os.kill(os.getppid(), signal.SIGTERM)
        elif kind == "fsize_in_export":  # a real limit: the writes after it fail as on a full disk
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        elif kind == "slow_step":
            time.sleep(4)
        elif kind.startswith("sig"):
            os.kill(os.getpid(), SIGNALS.get(kind, signal.SIGTERM))
        return True
    return False


def write_atomic(path: Path, text: str) -> None:
    """Write text so that a reader, or a crash, sees the old file or the whole new one. The temporary name is fixed,
    so what a killed writer left is overwritten by the next one, not left beside it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:  # a full disk or a file size limit: the old file stays, and no half-written copy beside it
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps(data, indent=2) + "\n")


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished directory tmp to final. An existing final is renamed aside (.NAME.stale) first and deleted
    last, so nothing is deleted before the new directory is in place; a crash between the two renames leaves the old
    one as .NAME.stale and the new one under tmp's name."""
    stale = final.with_name(f".{final.name}.stale")
    remove(stale)
    if final.exists() or final.is_symlink():  # a user's symlink (dangling or not) is moved aside like a directory
        os.replace(final, stale)
    os.replace(tmp, final)
    remove(stale)


def remove(path: Path) -> None:
    """Delete a file, a directory tree, or a symlink (the link, never what it points to); nothing if absent."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


# Third-party lines that say nothing a user can act on. Matched on the message; everything else passes.
NOISE = (
    "Setting accelerator to CPU",  # DeepSpeed on a machine without a GPU: the batch plan line says "cpu" already
    "deepspeed_shm_comm_op built successfully",  # DeepSpeed's CPU shared-memory collectives, once per rank
)


def _is_noise(message: str) -> bool:
    return any(noise in message for noise in NOISE)


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _is_noise(record.getMessage())


class _NoiseFreeStream:
    """A stream without NOISE lines. print() writes a line and its newline separately: a dropped line drops both."""

    def __init__(self, stream):
        self.stream, self.dropped = stream, False

    def write(self, text: str) -> int:
        if text == "\n" and self.dropped:
            self.dropped = False
            return 1
        kept = "".join(line for line in text.splitlines(keepends=True) if not _is_noise(line))
        self.dropped = kept != text
        self.stream.write(kept)
        return len(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def without_noise():
    """Run a block (e.g. DeepSpeed's start-up, which print()s NOISE on every rank) with NOISE kept off stdout."""
    with contextlib.redirect_stdout(_NoiseFreeStream(sys.stdout)):
        yield


def quiet_console() -> None:
    """Drop NOISE from DeepSpeed's logger, and, when stderr is not a terminal, transformers' progress bars (one line
    per redraw in a log file). Called before DeepSpeed is imported, which is when it logs the first."""
    for name in ("DeepSpeed", "deepspeed"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise())
    if not sys.stderr.isatty():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def progress_bar(**kwargs):
    """tqdm when stderr is a terminal; otherwise disabled, since a redrawn bar in a log file is one line per redraw.
    The scripts print their own log lines either way."""
    from tqdm.auto import tqdm

    disable = kwargs.pop("disable", False) or not sys.stderr.isatty()
    return tqdm(**kwargs, disable=disable)


def print_error(message: str, rank: int | None = None, wait: bool = False) -> None:
    """The one `error:` line on stderr. When one process fails, the launcher kills the others at once; so that the
    line is printed exactly once and always, rank 0 prints at once and any other rank only if it is still alive a few
    seconds later (rank 0 did not fail the same way, or is slower to). rank: the process group's when it is up, else
    this one (a launched process before its process group starts: the launcher's RANK), else none: print at once.
    wait: this error follows another process's (rank 0 too waits, and is usually stopped by the launcher first)."""
    import torch.distributed as dist

    if rank is None and dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
    if rank or wait:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # train.py's stop handler must not outlive the launcher's kill
        time.sleep(5)
        message = f"(rank {rank}) {message}"
    print(f"error: {one_line(message)}", file=sys.stderr, flush=True)


def console_to_file(path: Path) -> None:
    """Point this process's stdout and stderr at the end of `path` (a hung-up terminal: every write to it fails with
    EIO, and an error raised by a print would end the run before its checkpoint)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (1, 2):
        os.dup2(fd, stream)
    os.close(fd)


def exit_process(code: int) -> None:
    """sys.exit(code), except in a process started by a distributed launcher (torchrun, accelerate launch): there,
    flush and leave at once with os._exit, skipping the interpreter teardown.

    Why: with the gloo backend a worker thread of a process group can still be releasing the tensors of a finished
    collective while Python finalizes; that thread then needs the GIL, finds the interpreter gone and aborts the
    process ("terminate called without an active exception", SIGABRT, exit code -6) after all the work was done and
    saved. It happened in about 1 of 40 two-process runs on the CPU; a core dump showed ProcessGroupGloo worker
    threads alive in Py_FinalizeEx, one of them in THPVariable_dealloc -> take_gil -> pthread_exit ->
    std::terminate. DeepSpeed keeps references to its process groups, so destroy_process_group() does not stop them.
    """
    if "LOCAL_RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        sys.exit(code)
    if code in (2, 3) and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0:
        # A bad flag, a diverged run or a full disk fails the same way every time: stop the launcher's restarts
        # (--max_restarts) by stopping the launcher, which ends every process of this machine. A crash or a hang
        # (the watchdog exits through os._exit, not here) is left to the restarts.
        if os.environ.get("RANK", "0") == "0":
            print("not restarting: the launcher's --max_restarts cannot fix this", file=sys.stderr)
        os.kill(os.getppid(), signal.SIGTERM)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
