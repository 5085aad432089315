"""Leaving a torch.distributed process without the crash at interpreter teardown.

With the gloo backend, a worker thread of a process group can still be releasing the tensors of a finished collective
while Python finalizes; that thread then needs the GIL, finds the interpreter gone and aborts the process
("terminate called without an active exception", SIGABRT, exit code -6) after all the work was done and saved. We saw
it in about 1 of 40 two-process runs on the CPU; a core dump shows ProcessGroupGloo worker threads alive in
Py_FinalizeEx and one of them in THPVariable_dealloc -> take_gil -> pthread_exit -> std::terminate. (PyTorch's attempt
to destroy process groups at exit, pytorch/pytorch#179291, was abandoned.) DeepSpeed keeps references to its process
groups, so destroy_process_group() does not stop those threads.

The scripts therefore end a launched process with os._exit once everything is written, closed and flushed.
"""

from __future__ import annotations

import os
import sys


def exit_process(code: int) -> None:
    """sys.exit(code), except in a process started by a distributed launcher (torchrun, accelerate launch): there,
    flush and leave at once, skipping the interpreter teardown that races the gloo threads."""
    if "LOCAL_RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
