"""A mutated module in place of the original without touching the working tree: a copy of
the module's top-level package in a temporary folder, the mutation written there, and
``speccheck verify`` run in a fresh process with that folder first on ``PYTHONPATH``.

Why this shadows the installed package everywhere verify runs code: an editable install of
speccheck (and of most adapters) resolves imports through a finder that setuptools appends
to ``sys.meta_path``, after the path finder that reads ``sys.path``, where ``PYTHONPATH``
comes first; a regular install lives in ``site-packages``, after ``PYTHONPATH`` too. Verify's
worker processes inherit the environment (and run with the temporary folder as their
working directory, which ``python -m`` puts first as well). The unmutated coverage run
proves it on every run: its executed lines are recorded under the copy's paths, in the
workers (:mod:`speccheck.checks.mutate.coverage_run`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speccheck.checks.mutate.targets import TargetModule

logger = logging.getLogger(__name__)

VERIFY_ENTRY = "from speccheck.checks.cli.app import main; main()"
"""What the subprocess runs: the ``speccheck`` console script's entry point, imported
through ``sys.path`` (so from the shadow when it holds speccheck)."""

REPORT_NAME = "verify.json"
OUTPUT_LINES = 20
"""How many of the last lines of a run's output are kept (for a crash's detail)."""
POLL_SECONDS = 0.5
"""How often a waiting run looks at its deadline and its stop event."""


def _ignored(top: Path) -> Any:
    """:func:`shutil.copytree`'s ``ignore``: hidden entries everywhere, and at the package's
    top only files and the folders that are packages (a checkout's ``tests/``, ``docs/`` or
    virtual environment are not the package)."""

    def ignore(directory: str, names: list[str]) -> set[str]:
        skipped = {name for name in names if name.startswith(".")}
        if Path(directory) == top:
            skipped |= {name for name in names if (top / name).is_dir()
                        and not (top / name / "__init__.py").is_file()}
        return skipped

    return ignore


def shadowed_files(package_dir: Path) -> Iterator[Path]:
    """The files :func:`shadow_package` copies of ``package_dir`` (its ``__pycache__``
    folders left out), in a stable order: the code a mutant's run imports from the copy."""
    ignore = _ignored(package_dir)
    for directory, folders, names in os.walk(package_dir):
        skipped = ignore(directory, folders + names)
        folders[:] = sorted(f for f in folders if f not in skipped and f != "__pycache__")
        for name in sorted(names):
            if name not in skipped:
                yield Path(directory) / name


@contextmanager
def shadow_package(package: str, package_dir: Path) -> Iterator[Path]:
    """A temporary folder holding a copy of ``package_dir`` named ``package`` (compiled
    files included: they stay valid for the unchanged modules), removed on exit. Put the
    folder first on ``PYTHONPATH`` to shadow the installed package."""
    with tempfile.TemporaryDirectory(prefix="speccheck-mutant-") as folder:
        root = Path(folder)
        shutil.copytree(package_dir, root / package, ignore=_ignored(package_dir), symlinks=True)
        yield root


def write_module(root: Path, target: TargetModule, source: str) -> None:
    """Replace ``target``'s copy under ``root`` by ``source`` (and drop its compiled file,
    so nothing can mistake the old bytecode for it)."""
    path = root / target.package / target.relative
    path.write_text(source, encoding="utf-8")
    for compiled in (path.parent / "__pycache__").glob(path.stem + ".*.pyc"):
        compiled.unlink()


@dataclass(frozen=True)
class VerifyOutcome:
    """How one ``speccheck verify`` subprocess ended."""

    returncode: int | None
    """``None`` when it was killed at the timeout."""
    report: dict[str, Any] | None
    """The backend's entry of verify's JSON report, if it wrote one."""
    seconds: float
    output_tail: list[str]

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_verify(
    root: Path, backend: str, *, examples: int | None, timeout: float, fail_fast: bool,
    extra_env: Mapping[str, str] | None = None, stop: threading.Event | None = None,
) -> VerifyOutcome:
    """Run ``speccheck verify --backend BACKEND`` at its defaults (``--examples`` when
    given; no shrinking, which only makes a failure's example smaller; ``--fail-fast`` when
    ``fail_fast``, which ends the run at its first failure) with ``root`` first
    on ``PYTHONPATH`` and as working directory. A run still going after ``timeout`` seconds,
    or when ``stop`` is set, is killed with its whole process group (its workers included)
    and counts as timed out."""
    report_path = root / REPORT_NAME
    command = [sys.executable, "-c", VERIFY_ENTRY, "verify", "--backend", backend,
               "--json", str(report_path), "--shrink-seconds", "0"]
    if examples is not None:
        command += ["--examples", str(examples)]
    if fail_fast:
        command.append("--fail-fast")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    env.update(extra_env or {})
    started = time.monotonic()
    with tempfile.TemporaryFile() as output:
        proc = subprocess.Popen(command, cwd=root, env=env, stdin=subprocess.DEVNULL,
                                stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        returncode = _wait(proc, started + timeout, stop)
        output.seek(0)
        text = output.read().decode("utf-8", errors="replace")
    tail = [line for line in text.splitlines() if line.strip()][-OUTPUT_LINES:]
    logger.debug("verify in %s ended with %s after %.1f s", root, returncode,
                 time.monotonic() - started)
    return VerifyOutcome(returncode, _backend_report(report_path, backend),
                         time.monotonic() - started, tail)


def _wait(
    proc: subprocess.Popen[bytes], deadline: float, stop: threading.Event | None,
) -> int | None:
    """``proc``'s exit status, or ``None`` after killing its process group at ``deadline``
    or once ``stop`` is set."""
    while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        try:
            return proc.wait(timeout=POLL_SECONDS)
        except subprocess.TimeoutExpired:
            continue
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return None


def _backend_report(path: Path, backend: str) -> dict[str, Any] | None:
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return next((entry for entry in payload.get("backends", []) if entry.get("backend") == backend),
                None)
