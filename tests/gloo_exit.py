"""How the tests' FSDP2 jobs on gloo end: without the interpreter's teardown, once their work is done.

A gloo worker thread drops its reference to a finished collective a moment after the waiting Python
thread has gone on. If that is the last reference to a tensor Python has seen, the thread must take the
GIL to release it, and during interpreter teardown that kills the thread inside a ``noexcept``
destructor: the process aborts ("terminate called without an active exception", SIGABRT, exit -6)
after everything it did has succeeded. A core dump of such an abort shows the main thread in
``Py_FinalizeEx`` and a ``ProcessGroupGloo::runLoop`` thread in ``~AsyncAllgatherCoalescedWork``
(pytorch/pytorch PR #179291 describes the same crash). ``destroy_process_group`` does not prevent it in
an FSDP2 job: ``fully_shard``'s hooks keep the process group, and so its threads, alive until teardown.
It happened in about 1 of 40 runs of a 2-rank FSDP2 job on 2 cores, so each test would fail that often.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_without_teardown(code: int = 0) -> NoReturn:
    """Flush what the job printed and logged, then leave the process with ``code`` at once."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
