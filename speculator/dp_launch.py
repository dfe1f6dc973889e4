"""Run a function on ``dp_size`` real processes joined by one default process group.

Each rank is a process of its own, forked from this process's fork server
(:mod:`~speccheck.speculator.fork_server`: torch imported, no CUDA context, nothing of the
parent's state). ``fn`` and ``args`` travel pickled, so ``fn`` must be a module-level
function of a module the children can import (they get the parent's ``sys.path`` and
working directory), and classes in ``args`` likewise; they are unpickled after the rank has
taken the parent's environment of the moment of the call. Ranks meet over TCP on loopback
(``GLOO_SOCKET_IFNAME=lo``, a free port found by binding port 0).

The group's backends are a :class:`~speccheck.speculator.collectives.Collectives` decided
once, in the parent (:func:`~speccheck.speculator.collectives.rank_collectives`): with at
least one GPU per rank, rank ``r`` makes ``cuda:r`` its current device and the group is
``"cpu:gloo,cuda:nccl"`` (CPU tensors over gloo, CUDA tensors over NCCL); otherwise plain
gloo, ranks sharing the device (NCCL refuses two ranks on one GPU). NCCL's own bootstrap is
kept on loopback too (``NCCL_SOCKET_IFNAME=lo`` unless already set); on one host its data
moves over NVLink, PCIe peer-to-peer or shared memory, not sockets. Every other variable of
the parent's environment (``NCCL_NVLS_ENABLE``, ``CUDA_VISIBLE_DEVICES``, ...) reaches the
ranks unchanged.

A rank that raises, dies, or does not report within ``timeout_s`` ends the run: the other
ranks are terminated and :class:`RankFailed` or :class:`RanksTimedOut` names the rank.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from speccheck.speculator.collectives import Collectives, rank_collectives
from speccheck.speculator.fork_server import fork_context, run_exit_handlers, take_environment
from speccheck.speculator.raise_frames import RaiseFrames, raise_frames

logger = logging.getLogger(__name__)

R = TypeVar("R")

_DRAIN_S = 1.0
"""How long to keep reading results after a rank is seen dead (it may have reported first)."""
_BLAME_GRACE_S = 1.0
"""How long a rank's reported error waits for another rank to be seen dead before it is
raised: a dead rank's sockets close as it exits, so a peer's collective can fail, and the
peer report it, before the parent can reap the dead one (seen on a loaded 2-core CI
machine: the peer was blamed)."""
_JOIN_S = 5.0
"""How long ranks that all reported get to tear down before they are terminated."""


class RankError(RuntimeError):
    """A DP run that did not complete."""


class RankFailed(RankError):
    """Rank ``rank`` raised (``exc_type``, ``message``, its ``traceback`` text and
    :func:`raise_frames`) or died (no traceback, no frames)."""

    def __init__(self, rank: int, dp_size: int, exc_type: str, message: str, tb: str = "",
                 frames: RaiseFrames = ()) -> None:
        self.rank = rank
        self.dp_size = dp_size
        self.exc_type = exc_type
        self.message = message
        self.traceback = tb
        self.frames = frames
        text = f"DP rank {rank} of {dp_size} failed: {exc_type}: {message}"
        if tb:
            text += f"\n--- traceback of DP rank {rank} ---\n{tb.rstrip()}"
        super().__init__(text)


class RanksTimedOut(RankError):
    """Ranks ``ranks`` had not reported when the ``timeout_s`` deadline passed."""

    def __init__(self, ranks: Sequence[int], dp_size: int, timeout_s: float) -> None:
        self.ranks = tuple(ranks)
        self.dp_size = dp_size
        self.timeout_s = timeout_s
        super().__init__(
            f"DP rank(s) {', '.join(map(str, self.ranks))} of {dp_size} did not finish within "
            f"{timeout_s:g} s (hung in a collective or in their work); all ranks were terminated"
        )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_device(dp_rank: int) -> torch.device:
    """The device a DP rank runs on: ``cuda:<rank mod GPU count>`` (so every rank shares
    ``cuda:0`` on a one-GPU machine), else the CPU. Under
    :attr:`~speccheck.speculator.collectives.Collectives.GLOO_CPU_NCCL_CUDA` (at least one
    GPU per rank) this is ``cuda:<rank>``, the device :func:`run_ranks` makes current."""
    if torch.cuda.is_available():
        return torch.device("cuda", dp_rank % torch.cuda.device_count())
    return torch.device("cpu")


def run_ranks(
    fn: Callable[..., R],
    dp_size: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 120.0,
    threads_per_rank: int | None = None,
    collectives: Collectives | None = None,
) -> list[R]:
    """``[fn(0, dp_size, *args), ..., fn(dp_size - 1, dp_size, *args)]``, each call in a
    process of its own (forked from the fork server), inside an initialised default process
    group of ``dp_size`` ranks (destroyed afterwards). Results must be picklable.

    ``collectives`` picks the group's backends (default: :func:`rank_collectives` for
    ``dp_size``); under ``GLOO_CPU_NCCL_CUDA`` each rank runs with ``rank_device(rank)``
    current. Raises ``ValueError`` for ``GLOO_CPU_NCCL_CUDA`` on a machine where
    :func:`rank_collectives` would not choose it (no CUDA or NCCL, or fewer GPUs than ranks).

    ``timeout_s`` bounds the whole run, process start-up included, and is also the process
    group's timeout (a collective waiting on a dead peer fails after it). ``threads_per_rank``
    sets each rank's ``torch.set_num_threads`` (default: the CPU count shared among ranks).

    Raises :class:`RankFailed` for the first rank that raised or died, :class:`RanksTimedOut`
    when ranks had not reported by the deadline; either way no rank process is left running.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size} must be >= 1")
    fitting = rank_collectives(dp_size)
    chosen = fitting if collectives is None else collectives
    if chosen.one_gpu_per_rank and fitting is not chosen:
        raise ValueError(
            f"collectives {chosen.backend!r} need CUDA, NCCL and one GPU for each of the "
            f"{dp_size} ranks; this machine has {torch.cuda.device_count()} GPU(s)"
        )
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // dp_size)
    payload = pickle.dumps((fn, tuple(args)))
    port = free_port()
    ctx = fork_context()
    results = ctx.Queue()
    environ = dict(os.environ)
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, dp_size, port, payload, results, timeout_s, threads, chosen,
                  environ),
            name=f"dp-rank-{rank}",
            daemon=True,
        )
        for rank in range(dp_size)
    ]
    started = time.monotonic()
    for p in procs:
        p.start()
    logger.info("started %d ranks on port %d: collectives %s, devices %s", dp_size, port,
                chosen.backend, ", ".join(str(rank_device(r)) for r in range(dp_size)))
    try:
        collected = _collect(procs, results, dp_size, started + timeout_s, timeout_s)
    except BaseException:
        _stop(procs, grace_s=0.0)
        raise
    _stop(procs, grace_s=_JOIN_S)
    return [pickle.loads(collected[rank]) for rank in range(dp_size)]


def _collect(
    procs: list[Any], results: Any, dp_size: int, deadline: float, timeout_s: float
) -> dict[int, bytes]:
    """Read one report per rank until the deadline. A rank's error is raised at once, except
    that a rank that died without reporting is blamed first: its peers' collectives fail
    only because it went away."""
    collected: dict[int, bytes] = {}

    def died() -> list[int]:
        return [r for r, p in enumerate(procs) if r not in collected and p.exitcode is not None]

    def crashed(reporter: int) -> list[int]:
        """Ranks other than ``reporter`` that died with a non-zero exit code and no report
        (a rank that reported its own error exits with 0, its report still in the pipe)."""
        return [r for r in died() if r != reporter and procs[r].exitcode != 0]

    def exited(rank: int, then: str = "") -> RankFailed:
        return RankFailed(
            rank, dp_size, "ProcessExited",
            f"exit code {procs[rank].exitcode} before reporting a result (killed, crashed, or "
            f"unable to unpickle its function and arguments){then}",
        )

    def take(message: tuple[Any, ...]) -> None:
        kind, rank = message[0], message[1]
        if kind == "ok":
            collected[rank] = message[2]
            return
        error = RankFailed(rank, dp_size, *message[2:])
        settled = time.monotonic() + _BLAME_GRACE_S
        dead = crashed(rank)
        while not dead and time.monotonic() < settled:
            time.sleep(0.05)
            dead = crashed(rank)
        if dead:
            raise exited(dead[0], f"; then rank {rank} failed: {error.exc_type}: {error.message}")
        raise error

    while len(collected) < dp_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RanksTimedOut([r for r in range(dp_size) if r not in collected], dp_size, timeout_s)
        try:
            take(results.get(timeout=min(0.2, remaining)))
            continue
        except queue.Empty:
            pass
        dead = died()
        if dead:
            # A rank that reported just before exiting may still be in the pipe.
            drain_until = time.monotonic() + _DRAIN_S
            while time.monotonic() < drain_until and any(r not in collected for r in dead):
                try:
                    take(results.get(timeout=0.1))
                except queue.Empty:
                    pass
            for r in dead:
                if r not in collected:
                    raise exited(r)
    return collected


def _stop(procs: list[Any], grace_s: float) -> None:
    """Give the rank processes ``grace_s`` to exit, then terminate, then kill, the rest."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(1.0)
        if p.is_alive():
            p.kill()
            p.join()


def _rank_main(
    rank: int, dp_size: int, port: int, payload: bytes, results: Any, timeout_s: float,
    threads: int, collectives: Collectives, environ: dict[str, str],
) -> None:
    """Body of one rank process: take the parent's ``environ``, (one GPU per rank: make
    ``rank_device(rank)`` current) join the group, run the function, report.

    The report is flushed into the pipe *before* the process group is torn down: a peer
    blocked in a collective fails only once this rank's sockets close, so the parent reads
    the root cause before any error that it caused in other ranks.
    """
    take_environment(environ)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if collectives.one_gpu_per_rank:
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    torch.set_num_threads(threads)
    joined = False
    try:
        fn, args = pickle.loads(payload)
        if collectives.one_gpu_per_rank:
            torch.cuda.set_device(rank_device(rank))
        dist.init_process_group(
            collectives.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
            world_size=dp_size,
            timeout=timedelta(seconds=timeout_s),
        )
        joined = True
        results.put(("ok", rank, pickle.dumps(fn(rank, dp_size, *args))))
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the parent
        results.put(("error", rank, type(exc).__name__, str(exc), traceback.format_exc(),
                     raise_frames(exc)))
    finally:
        results.close()
        results.join_thread()
        if joined:
            dist.destroy_process_group()
        run_exit_handlers()
