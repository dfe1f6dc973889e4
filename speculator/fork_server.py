"""The fork server the helper processes of a run start from: DP and DCP ranks
(:mod:`~speccheck.speculator.dp_launch`) and verify workers
(:mod:`~speccheck.checks.verify.worker_process`).

``multiprocessing``'s ``forkserver`` start method: one fresh interpreter per parent
process, started on first use with the parent's environment of that moment, imports
:data:`PRELOADED` and forks a process for each request. A forked process starts with those
imports done (about 1.6 s a process otherwise), with nothing of the parent's state, the
parent's ``sys.path`` and working directory, and no CUDA context: nothing the server
imports touches a device, so each process initialises CUDA itself. Its environment is the
server's until it calls :func:`take_environment`; it ends in ``os._exit``, so it calls
:func:`run_exit_handlers` where an interpreter's exit would run them.

This module imports neither torch nor anything that does: a command may start a worker
before it imports torch itself.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
from collections.abc import Mapping
from multiprocessing.context import ForkServerContext

PRELOADED = ("torch", "torch.distributed", "numpy", "hypothesis", "pydantic", "yaml")
"""What the server imports before it forks: modules whose import reads no environment
variable a process could need changed and initialises no device (not Triton: its
decorators read ``TRITON_INTERPRET``, which the process's own environment must set)."""


def fork_context() -> ForkServerContext:
    """The ``forkserver`` context, its server to preload :data:`PRELOADED` (read when the
    server starts, once per parent process)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOADED))
    return context


def take_environment(environ: Mapping[str, str]) -> None:
    """Make ``environ`` (the parent's, sent with the request) this forked process's
    environment; torch's intra-op threads follow its ``OMP_NUM_THREADS`` where it sets one
    (the server's torch read the server's)."""
    os.environ.clear()
    os.environ.update(environ)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def run_exit_handlers() -> None:
    """Run the interpreter's exit handlers (``atexit``), which a forked process's
    ``os._exit`` skips: a line tracer writes what it recorded."""
    atexit._run_exitfuncs()
