"""``computed_once`` (tests/fixtures/once_per_run.py), which the self-test catalogue fixture
runs through: under pytest-xdist, workers of one run that ask at once compute the value
once and all get it; a compute that raises leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.once_per_run import computed_once

ROOT = Path(__file__).resolve().parents[1]


class RunFolders:
    """Stands in for pytest's TempPathFactory, the one method ``computed_once`` calls: a
    worker's base folder inside the run's."""

    def __init__(self, base: Path) -> None:
        self.base = base

    def getbasetemp(self) -> Path:
        return self.base


WORKER = """
import json, sys, time
from pathlib import Path
from tests.fixtures.once_per_run import computed_once
from tests.test_once_per_run import RunFolders

def compute():
    with open(Path(sys.argv[1]) / "computed", "a") as log:
        log.write(sys.argv[2] + "\\n")
    time.sleep(1.0)  # long enough for the other worker to be waiting on the lock
    return {"by": sys.argv[2]}

folders = RunFolders(Path(sys.argv[1]) / sys.argv[2])
print(json.dumps(computed_once(folders, "value", compute)))
"""


def test_concurrent_workers_compute_once_and_read_the_same_value(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path), name],
                                cwd=ROOT, env={**env, "PYTEST_XDIST_WORKER": name},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for name in ("gw0", "gw1")]
    results = [w.communicate(timeout=60) for w in workers]
    assert [w.returncode for w in workers] == [0, 0], results
    (computer,) = (tmp_path / "computed").read_text().split()
    assert [json.loads(out) for out, _ in results] == [{"by": computer}] * 2


def test_a_compute_that_raises_leaves_nothing_and_the_next_worker_computes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    folders = RunFolders(tmp_path / "gw0")

    def broken() -> object:
        raise RuntimeError("the catalogue crashed")

    with pytest.raises(RuntimeError, match="the catalogue crashed"):
        computed_once(folders, "value", broken)  # type: ignore[arg-type]
    assert not (tmp_path / "value.json").exists()
    assert computed_once(folders, "value", lambda: [1, 2]) == [1, 2]  # type: ignore[arg-type]
    assert computed_once(folders, "value", broken) == [1, 2]  # type: ignore[arg-type]
