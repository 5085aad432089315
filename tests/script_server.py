"""A pytest worker's server of script runs: `python train.py ...` in a real process of its own, forked from one that
has already imported what the scripts import, so that a run skips the interpreter's 3-4 s of imports (torch,
transformers, accelerate, DeepSpeed; ~14 s under the other worker's load). conftest.run sends it the single-process
runs of train.py, eval.py and prepare_data.py; every other command, and any run to which its test gives a variable a
module may read at import (HF_HUB_OFFLINE, OMP_NUM_THREADS, ...), starts as a plain subprocess.
TEST_FORK_SCRIPTS=0 starts every run as a plain subprocess (docs/testing.md).

What the forked run shares with `python script.py`: its own process and pid, the script executed from its file in a
__main__ module of its own, sys.argv, the working directory, the environment, stdin from /dev/null, stdout and stderr
to files, the exit code (sys.exit, an uncaught exception's 1 with its traceback, a signal's negative code), atexit
handlers, and multiprocessing's spawn (which starts fresh interpreters from the script's path). What differs: the
modules were imported before the run's own environment was set (hence the rule above); what a library prints or warns
once at import went to the server's stderr, not the run's (a test of that output runs the script with subprocess.run
itself); the process's resident memory holds the server's modules too; Python's start-up is not repeated, nor its
teardown: after the atexit handlers and a collection of the run's own garbage the process ends (os._exit), without
freeing the server's modules one object at a time (~2 s of CPU a run, every freed object's page copied first; an
object that only that teardown would finalise, held by a library's module, is not).

Launches too: `accelerate launch ...` and `torchrun ...` (the console scripts of this interpreter's environment) run
forked the same way, and the launcher's workers that run a Python script start as forks of the launcher
(fork_workers): the real launcher code (torch elastic's agent: its environment per rank, sessions, signals, restarts,
exit codes) starts each worker with subprocess.Popen as always, and the worker skips the interpreter's start-up
and imports (~6 s of CPU per process on a 2-core AMD EPYC). What a forked worker shares with an exec'd one: its
own pid and session as the agent's child, argv, the environment the agent gives it, stdout and stderr where the
agent sends them, Python's signal dispositions, garbage collector, warning filters and sys.path at start, the exit
(an uncaught exception through sys.excepthook, non-daemon threads joined, atexit handlers run, the exit code or the
signal's death). What differs, besides the script server's own caveats: the ranks share one string hash seed (set
iteration orders agree between ranks, where exec'd ranks may differ), and the launcher's atexit handlers come along
(docs/testing.md lists the rest).

Run as `python tests/script_server.py`: it reads one JSON request per line on stdin and answers two lines on stdout,
the run's pid and then its exit code."""

import atexit
import builtins
import ctypes
import faulthandler
import functools
import gc
import importlib.machinery
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
import types
import warnings
from pathlib import Path

# The environment variables a test may give a forked run, and that may differ between the worker's environment and the
# server's: each is read when the code runs, not when a module is imported (conftest.run's own two, pytest's name of
# the test it runs, the fault switches: cli.fault, tokenizer_pool; torch elastic's shutdown grace), or only by a
# library the server does not import (W&B's and trackio's, imported by a run that logs to them).
RUNTIME_ENV = {"PYTHONUNBUFFERED", "TOKENIZERS_PARALLELISM", "PYTEST_CURRENT_TEST", "TRAIN_TEST_FAULT",
               "TOKENIZER_TEST_FAULT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "WANDB_MODE", "WANDB_SILENT",
               "TRACKIO_DIR"}  # fmt: skip
# What libraries that tests import in-process add to the worker's environment as they go (torch's inductor when it
# compiles; lm-eval and scikit-learn at import): read when a compile runs (inductor's cache and C++ wrapper), or
# bearing only on what no run here does (a Hub download's speed, read at huggingface_hub's import; Intel's OpenMP
# runtime loaded twice). A forked run still gets them in its environment, as a subprocess would; the server is not
# replaced for them (~8 s of CPU each time).
DRIFT_ENV = {"TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "HF_XET_HIGH_PERFORMANCE",
             "KMP_DUPLICATE_LIB_OK"}  # fmt: skip
SCRIPTS = ("train.py", "eval.py", "prepare_data.py")
# Launchers: console scripts next to the interpreter (`.venv/bin/accelerate launch`, `.venv/bin/torchrun`).
LAUNCHERS = ("accelerate", "torchrun")


def preload(repo: str) -> None:
    """Import what the scripts import at their start and later (their model classes, the launcher's libraries),
    without running anything: no thread may be alive when the server forks."""
    sys.path.insert(0, repo)
    import importlib

    for name in ("train", "eval", "prepare_data", "accelerate", "deepspeed", "transformers.models.llama.modeling_llama",
                 "transformers.models.deepseek_v3.modeling_deepseek_v3", "transformers.models.gpt2.modeling_gpt2",
                 "transformers.models.auto.tokenization_auto", "transformers.convert_slow_tokenizer",
                 "torch.utils.cpp_extension", "accelerate.commands.accelerate_cli", "accelerate.commands.launch",
                 "torch.distributed.run", "deepspeed.launcher.runner", "deepspeed.runtime.zero.muon.muon_optimizer",
                 "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler"):  # fmt: skip
        try:
            importlib.import_module(name)
        except ImportError:  # a library this checkout does not need: the run imports (or lacks) it itself
            pass
    # pyplot with the backend the loss curve picks before it imports pyplot (run_dir/metrics.py's plot_losses), so a
    # run's curve is drawn as in a process of its own. Without pyplot, cpp_extension and the two tokenizer modules, a
    # forked tiny 10-step train.py run still imported ~200 modules (pyplot's, cpp_extension's setuptools, the
    # tokenizer's): 1.9 s of CPU, now 1.2 s (2-core AMD EPYC, idle, 3 runs each).
    try:
        import matplotlib

        matplotlib.use("Agg")
        importlib.import_module("matplotlib.pyplot")
    except ImportError:
        pass
    # transformers' table of checkpoint key conversions for every architecture, built once per process at its first
    # save_pretrained or from_pretrained (~930 regular expressions) and kept: built here, the runs share it.
    try:
        from transformers import conversion_mapping

        conversion_mapping.get_checkpoint_conversion_mapping("llama")
    except (ImportError, AttributeError):
        pass
    sys.path.remove(repo)
    IMPORTED_FILTERS[:] = warnings.filters
    given = pythonpath(os.environ)
    SERVER_PATH[:] = [p for p in sys.path[1:] if p not in given]
    assert threading.active_count() == 1, "a module started a thread at import: forking would copy its locks"
    assert not {"wandb", "trackio"} & set(sys.modules), "RUNTIME_ENV holds their variables: they read them at import"


def serve() -> None:
    requests = os.fdopen(os.dup(0), "r")
    answers = os.dup(1)
    for line in requests:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            requests.close()
            os.close(answers)
            run_child(req)  # never returns: the run ends the process (run_and_exit)
        os.write(answers, f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(answers, f"{os.waitstatus_to_exitcode(status)}\n".encode())


def run_child(req: dict) -> None:
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):  # fmt: skip
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    # The server's objects are frozen: the run's garbage collections pass over its own objects only, as a fresh
    # interpreter's would (a collection over the whole inherited heap would copy its pages), and nothing the server
    # left for collection is finalised in the run.
    gc.freeze()
    script = req["script"]
    if os.path.basename(script) in LAUNCHERS:
        fork_workers()
    sys.argv = [script, *req["args"]]  # as given; __file__ and sys.path[0] absolute, as Python sets them
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    run_and_exit(script)


def fork_workers() -> None:
    """In a forked launcher: torch elastic's agent starts each worker that runs a Python script (`python -u
    script.py`: train.py, eval.py, a test's own) as a fork of this process, which already holds the imports.
    subprocess.Popen forks as always (session, stdout and stderr files, the Popen object the agent polls, signals and
    waits on); the fork then becomes the worker in preexec_fn, before the exec it never reaches (become_worker)."""
    import torch
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    handler = subprocess_handler.SubprocessHandler
    exec_popen = handler._popen

    def _popen(self, args, env):
        words = [str(a) for a in args]
        if not (len(words) > 2 and words[:2] == [sys.executable, "-u"] and words[2].endswith(".py")):
            return exec_popen(self, args, env)  # a module (-m), another program (--no_python)
        if torch.cuda.is_available():  # the launcher has initialised CUDA (device_count): a fork could not use it
            return exec_popen(self, args, env)
        worker = functools.partial(become_worker, words[2], words[3:], dict(env))
        return subprocess.Popen(words, env=env, stdout=self._stdout, stderr=self._stderr, start_new_session=True,
                                preexec_fn=worker)  # fmt: skip

    handler._popen = _popen


def become_worker(script: str, args: list[str], env: dict) -> None:
    """The rest of a worker's life, in the child subprocess.Popen forked (preexec_fn): never returns."""
    try:
        # Python's dispositions at start: a handler the launcher set (torch elastic's SIGTERM) is not the worker's.
        python_handlers_to_default()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        # Popen turns the garbage collector off in the child it forks for preexec_fn; an exec'd process has it on. The
        # launcher's objects are frozen first: none of them is finalised in the worker, on descriptors since reused.
        gc.freeze()
        gc.enable()
        # What Popen closes before its exec (close_fds), among them its pipe that reports the exec: closed here, the
        # agent's Popen returns as after an exec.
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        os.environ.clear()
        os.environ.update(env)
        if env.get("OMP_NUM_THREADS", "").isdigit():  # read by torch when it starts; this process started earlier
            import torch

            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        # `python -u`'s stdout and stderr on the files Popen put at 1 and 2; the launcher's objects stay referenced,
        # so what they might still hold is never written into the worker's files.
        LAUNCHER_STREAMS.extend((sys.stdout, sys.stderr))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
        sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr
        # The warning filters the imports left, not those the launcher set since; no fault handler unless asked for.
        warnings.filters[:] = IMPORTED_FILTERS
        warnings._filters_mutated()
        if not env.get("PYTHONFAULTHANDLER"):
            faulthandler.disable()
        sys.argv = [script, *args]
        # sys.path as Python builds it: the script's directory, then PYTHONPATH's entries (Accelerate's DeepSpeed
        # launch gives its workers the working directory there), then the interpreter's own.
        given = pythonpath(env)
        sys.path[:] = [os.path.dirname(os.path.abspath(script)), *given, *(p for p in SERVER_PATH if p not in given)]
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    run_and_exit(script)


def run_and_exit(script: str) -> None:
    """Run `script` as __main__ and end the process in the order CPython 3.11's exit does: an uncaught exception
    through sys.excepthook, non-daemon threads joined, the atexit handlers (an error in a step reported, the next
    steps still run), Python's signal handlers back to the defaults, the run's own unreachable objects finalised (the
    server's are frozen), stdout and stderr flushed (exit code 120 when that fails) and the C library's buffers too,
    then the exit code (an uncaught KeyboardInterrupt: death by SIGINT). Never returns. What it skips is the teardown
    of the modules the server imported (~2 s of CPU a run, each freed object's page copied first) and, with it, the
    C library's atexit handlers and C++ static destructors (train.py's launched workers skip them too:
    cli.exit_process)."""
    code = 1
    main = types.ModuleType("__main__")
    try:
        run_as_main(script, main)
        code = 0
    except SystemExit as e:
        code = exit_code(e.code)
    except BaseException as e:  # as the interpreter reports it: through sys.excepthook (W&B's records the crash)
        code = -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1
        reported(sys.excepthook, type(e), e, e.__traceback__)
    reported(threading._shutdown)
    reported(atexit._run_exitfuncs)
    python_handlers_to_default()  # a late signal now ends the process, as it would a finalising interpreter
    reported(clear_module, main)  # the teardown's first step for __main__: what a file left open still held is written
    if gc.isenabled():
        gc.collect()
    for stream in (sys.stdout, sys.stderr):
        if not reported(stream.flush):
            code = 120
    ctypes.CDLL(None).fflush(None)  # what C code (a library's printf) buffered
    if code < 0:  # Python's own death by an uncaught KeyboardInterrupt: by the signal, whatever the run set for it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def run_as_main(script: str, main: types.ModuleType) -> None:
    """The script's code in `main`, installed as sys.modules["__main__"], as `python script.py` runs it (runpy would
    put the server's __main__ back afterwards, leaving the script's module to the garbage collector)."""
    path = os.path.abspath(script)
    main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins, __spec__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))  # fmt: skip
    sys.modules["__main__"] = main
    with open(path, "rb") as f:
        source = f.read()
    exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)


def clear_module(module: types.ModuleType) -> None:
    """A module's names set to None as the interpreter's teardown does (those with one leading underscore first), so
    each object only they held is finalised now, in order, and not left in a cycle the garbage collector would break
    in any order (a file left open then loses what it still buffered)."""
    names = module.__dict__
    for first in (True, False):
        for name in list(names):
            if name != "__builtins__" and (not first or (name.startswith("_") and not name.startswith("__"))):
                names[name] = None


def pythonpath(env) -> list[str]:
    """The directories PYTHONPATH puts on sys.path in the environment `env`, absolute, in order."""
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def python_handlers_to_default() -> None:
    """Every signal handled by a Python function back to the operating system's default."""
    for sig in signal.valid_signals():
        if callable(signal.getsignal(sig)):
            signal.signal(sig, signal.SIG_DFL)


def reported(step, *args) -> bool:
    """Call step(*args); an exception it raises is printed, as the interpreter's exit prints one and goes on."""
    try:
        step(*args)
        return True
    except BaseException:
        try:
            traceback.print_exc()
        except BaseException:
            pass
        return False


LAUNCHER_STREAMS: list = []
IMPORTED_FILTERS: list = []  # warnings.filters after preload: what a fresh interpreter's imports leave
SERVER_PATH: list = []  # sys.path after preload, without the script's directory and PYTHONPATH's entries


def exit_code(value) -> int:
    """The exit code Python gives sys.exit(value)."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


class Client:
    """The pytest worker's end: started at its first run, one run at a time (a worker runs one test at a time)."""

    def __init__(self, repo) -> None:
        self.repo, self.proc, self.base, self.pending = str(repo), None, None, b""
        self.busy = threading.Lock()  # a test's second thread running a script meanwhile gets None: a subprocess
        self.files = Path(tempfile.mkdtemp(prefix="script-server-"))

    def takes(self, args, env: dict, kw: dict) -> bool:
        """Whether a run of `args` may be forked: `python <script>` of the three, nothing but cwd among subprocess.run's
        other arguments, and in `env` (what the test sets on top of the worker's environment) only RUNTIME_ENV or a
        value the worker's environment has already."""
        if os.environ.get("TEST_FORK_SCRIPTS", "1") == "0" or kw or len(args) < 2:
            return False
        script = args[1] if args[0] == sys.executable else args[0]
        launcher = Path(args[0]).name in LAUNCHERS and Path(args[0]).parent == Path(sys.executable).parent
        if not (str(script) in SCRIPTS or launcher):
            return False
        return all(k in RUNTIME_ENV or os.environ.get(k) == v for k, v in env.items())

    def answer(self, timeout: float | None) -> int | None:
        """The server's next line as a number; None when `timeout` seconds pass first."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            if not select.select([fd], [], [], timeout)[0]:
                return None
            chunk = os.read(fd, 64)
            if not chunk:
                raise RuntimeError(f"the script server ended (exit code {self.proc.wait()}; its error is on the "
                                   "worker's stderr): TEST_FORK_SCRIPTS=0 runs the scripts as plain subprocesses")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return int(line)

    def run(self, args, env: dict, cwd, timeout: float) -> subprocess.CompletedProcess | None:
        """The run of `args` under the whole environment `env`, as subprocess.run(capture_output=True, text=True); None
        while another thread's run holds the server."""
        if not self.busy.acquire(blocking=False):
            return None
        try:
            return self._run(args, env, cwd, timeout)
        finally:
            self.busy.release()

    def _run(self, args, env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
        # The server imports under the worker's environment as it is now: a test's monkeypatch changes it, and a
        # subprocess would inherit the change, so a server started under another is replaced (DRIFT_ENV aside).
        base = {k: v for k, v in os.environ.items() if k not in RUNTIME_ENV | DRIFT_ENV}
        if self.proc is None or self.proc.poll() is not None or base != self.base:
            self.stop()
            self.base, self.pending = base, b""
            self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         cwd=self.repo, env={**base, "PYTHONUNBUFFERED": "1"})  # fmt: skip
        stdout, stderr = self.files / "stdout", self.files / "stderr"
        script, *rest = args[1:] if args[0] == sys.executable else args
        req = {"script": str(script), "args": [str(a) for a in rest], "env": env, "cwd": str(cwd),
               "stdout": str(stdout), "stderr": str(stderr)}  # fmt: skip
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        pid = self.answer(None)
        code = self.answer(timeout)
        if code is None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended as the time ran out; the server answers its code all the same
                pass
            self.answer(None)
        read = [p.read_text() for p in (stdout, stderr)]  # decoded as subprocess.run(text=True) would
        if code is None:
            raise subprocess.TimeoutExpired(list(map(str, args)), timeout, output=read[0], stderr=read[1])
        return subprocess.CompletedProcess(list(map(str, args)), code, *read)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()  # the server ends at the end of its requests
            self.proc.wait(timeout=60)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.files, ignore_errors=True)


if __name__ == "__main__":
    preload(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.stdout.flush()
    serve()
