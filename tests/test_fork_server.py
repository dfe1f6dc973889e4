"""The fork server every worker and rank starts from: a forked process takes the
environment its parent has when it is started, not the one the server started with, and
torch's threads follow it; it runs the interpreter's exit handlers before it ends."""

from __future__ import annotations

import atexit
import os
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from speccheck.speculator.fork_server import fork_context, run_exit_handlers, take_environment


def _report(environ: dict[str, str], out: Connection, marker: str) -> None:
    import torch

    take_environment(environ)
    atexit.register(Path(marker).write_text, "exit handlers ran")
    out.send((os.environ.get("SPECCHECK_FORK_PROBE"), torch.get_num_threads()))
    out.close()
    run_exit_handlers()


def _started(tmp_path: Path, name: str) -> tuple[str | None, int, str]:
    context = fork_context()
    receive, send = context.Pipe(duplex=False)
    marker = tmp_path / name
    process = context.Process(target=_report, args=(dict(os.environ), send, str(marker)))
    process.start()
    send.close()
    probe, threads = receive.recv()
    process.join(60)
    assert process.exitcode == 0
    return probe, threads, marker.read_text()


def test_a_forked_process_takes_the_environment_of_its_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert _started(tmp_path, "first")[:2] == (None, 1)  # the server runs from here on
    monkeypatch.setenv("SPECCHECK_FORK_PROBE", "set after the server started")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert _started(tmp_path, "second") == ("set after the server started", 2,
                                             "exit handlers ran")
