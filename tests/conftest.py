"""Test-suite setup. TRITON_INTERPRET must be set before any kernel module is imported
(the decorator reads it), so it is set here, at the very top, when there is no GPU.

Torch runs on one CPU thread, in this process and (through ``OMP_NUM_THREADS``) in every
process a test starts, as ``speccheck verify`` runs its workers
(:data:`~speccheck.checks.verify.worker_process.WORKER_ENV`): the tests' tensors are small, and
contending intra-op threads run them several times slower (the whole suite: 13 minutes
against 24 on a loaded 2-core machine). An environment that sets ``OMP_NUM_THREADS`` keeps
its own count."""

from __future__ import annotations

import os
from collections.abc import Iterator

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from speccheck.checks.triton_interpreter import interpret_triton_without_cuda

interpret_triton_without_cuda()

import pytest
from hypothesis import HealthCheck, settings

from speccheck.checks.device_memory import release_device_memory
from tests.fixtures.once_per_run import computed_once
from tests.fixtures.reference_at_defaults import VerifyCommandRun, run_reference_at_defaults
from tests.fixtures.selftest_catalogue import SelftestRun, run_selftest_command

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


CATALOGUE = "selftest_catalogue"
"""The session fixture of the self-test's one run (below)."""


@pytest.hookimpl(trylast=True)  # after ``-m``/``-k`` have deselected what will not run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` are skipped, visibly, on machines without a CUDA device; the
    tests that read the self-test catalogue are ordered as :func:`_catalogue_readers_last`
    says."""
    _catalogue_readers_last(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _catalogue_readers_last(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: the first test that reads :data:`CATALOGUE` runs first,
    the others last (each group in collection order). pytest-xdist's schedulers hand each
    worker a contiguous share of this order, so the worker with the first share starts the
    catalogue's run at once, and the other workers run their own shares meanwhile instead
    of waiting on it."""
    readers = [item for item in items if CATALOGUE in getattr(item, "fixturenames", ())]
    if not readers:
        return
    rest = [item for item in items if CATALOGUE not in getattr(item, "fixturenames", ())]
    items[:] = [readers[0], *rest, *readers[1:]]


@pytest.fixture(autouse=True)
def release_device_memory_after_cuda_tests(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a CUDA test, what its verifiers held (serving-scale KV caches, graph pools:
    gigabytes) goes back to the driver before the next test. On the H200 the FA3
    ten-seed test followed by the ten real-graph mutant tests in one process ran out of
    memory (docs/notes/device-memory-between-tests.md); each of the two tests that failed
    passed in a fresh process."""
    yield
    if "cuda" in request.keywords and torch.cuda.is_available():
        release_device_memory(torch.device("cuda"))


@pytest.fixture(scope="session", name=CATALOGUE)
def selftest_catalogue(tmp_path_factory: pytest.TempPathFactory) -> SelftestRun:
    """``speccheck selftest`` at its defaults on this machine, run once per pytest run (by
    whichever xdist worker asks first): every known-bad builder's verification, which the
    tests of the self-test's table, of its failures' reproduce commands and of the first
    of the ten seeds read instead of verifying the builders again."""
    return SelftestRun.from_json(
        computed_once(tmp_path_factory, "selftest-catalogue", run_selftest_command))


@pytest.fixture(scope="session")
def reference_at_defaults(tmp_path_factory: pytest.TempPathFactory) -> VerifyCommandRun:
    """``speccheck verify --backend reference`` at its defaults (the shipped backend and
    matrix, every configuration cell), run once per pytest run (by whichever xdist worker
    asks first): the passing run the tests of the shipped reference at the defaults read
    instead of verifying it again each."""
    return VerifyCommandRun.from_json(
        computed_once(tmp_path_factory, "reference-at-defaults", run_reference_at_defaults))
