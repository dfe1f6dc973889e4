"""The speccheck pytest plugin (entry point ``pytest11``, name ``speccheck``): an adapter's
repository gates its backend with one marked test function, and every check becomes a test
item of its own::

    import pytest

    @pytest.mark.speccheck(backend="my_backend", examples=50)
    def test_speccheck() -> None:
        \"\"\"Collected as one test item per check; this body never runs.\"\"\"

The marker takes :func:`speccheck.verify`'s arguments, from which it builds the
:class:`~speccheck.checks.verify.run.VerifyRun` it plans (``backend`` a name, ``"all"`` or a
builder class; ``matrix`` relative to the test file's folder; ``config``, ``examples``,
``seed``, ``steps``, ``capture_sizes``, ``max_new_tokens``, ``audit_claims``,
``example_timeout``, ``fail_fast``, ...: the run's fields). The marked
function becomes a collector of one item per backend and check: ``run[BACKEND]`` first (the
backend ran in its worker: skipped or crashed otherwise), then ``CHECK[BACKEND]`` in report
order: passed, failed (the diagnosis, the minimal example and the ``speccheck verify ...
--reproduce`` command of the failure that check is part of), or skipped (why: the check
needs what the run did not have, the backend did not run, or ``fail_fast`` stopped the run
before the check ran on every example: never passed when a failure cut it short). Bad
marker arguments are one collection error with one line.

The verification runs once per distinct plan per session, when its first item runs (so
``--collect-only`` and deselection cost nothing), in worker processes exactly like
``speccheck verify``: the CPU tier without CUDA, real CUDA graphs with it. A summary section
at the end of the session names each backend's tier and verdict. Disable the plugin with
``-p no:speccheck``.

Importing this module imports pytest only; speccheck's engine is imported when a marked
function is collected.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from speccheck.checks.api import VerifyPlan, VerifyReport
    from speccheck.checks.verify.vocabulary import Check

MARKER = "speccheck"

_RESULTS = pytest.StashKey[dict[str, "VerifyReport | BaseException"]]()
"""Per session: each plan's report (or what its run raised), by :func:`_plan_key`."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(backend, *, matrix=None, config=None, examples=50, seed=0, steps=None, "
        "capture_sizes=None, max_new_tokens=None, audit_claims=False, "
        "example_timeout=300.0, fail_fast=False): verify an "
        "attention backend with speccheck; the marked test function is collected as one "
        "test item per check (see docs/api.md)",
    )
    config.stash[_RESULTS] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(
    collector: pytest.Module | pytest.Class, name: str, obj: object
) -> SpeccheckGate | None:
    """A test function carrying the ``speccheck`` marker is collected as a
    :class:`SpeccheckGate`; anything else is left to pytest."""
    marks = [m for m in getattr(obj, "pytestmark", []) if getattr(m, "name", None) == MARKER]
    if not marks or not inspect.isfunction(obj) or not collector.istestfunction(obj, name):
        return None
    gate: SpeccheckGate = SpeccheckGate.from_parent(collector, name=name, marks=marks,
                                                     function=obj)
    return gate


class SpeccheckGate(pytest.Collector):
    """A marked test function: plans the verification while collecting (bad arguments are
    a collection error), and holds one :class:`SpeccheckItem` per backend and check."""

    def __init__(self, *, marks: list[pytest.Mark], function: Callable[..., Any],
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.marks = marks
        self.function = function
        self._plan: VerifyPlan | None = None

    def collect(self) -> Iterable[pytest.Item | pytest.Collector]:
        from speccheck.checks.api import VerifyInputError, checked_run, plan_verification
        from speccheck.checks.verify.vocabulary import Check
        from speccheck.contract.matrix_loader import MatrixError

        if len(self.marks) != 1:
            raise self.CollectError(f"@pytest.mark.{MARKER}: one marker per test function, "
                                    f"got {len(self.marks)}")
        (mark,) = self.marks
        options = dict(mark.kwargs)
        if isinstance(options.get("matrix"), (str, Path)):
            options["matrix"] = self.path.parent / options["matrix"]
        if len(mark.args) > 1:
            raise self.CollectError(f"@pytest.mark.{MARKER}: takes the backend as its only "
                                    f"positional argument, got {len(mark.args)}")
        try:
            self._plan = plan_verification(checked_run(*mark.args, **options))
        except TypeError as exc:
            raise self.CollectError(f"@pytest.mark.{MARKER}: {exc}") from None
        except (VerifyInputError, MatrixError) as exc:
            raise self.CollectError(f"@pytest.mark.{MARKER}: {exc}") from None
        items: list[pytest.Item] = []
        for backend in self._plan.names:
            items.append(SpeccheckItem.from_parent(self, name=f"run[{backend}]",
                                                   backend=backend, check=None))
            items += [SpeccheckItem.from_parent(self, name=f"{check.value}[{backend}]",
                                                backend=backend, check=check)
                      for check in Check]
        return items

    @property
    def plan(self) -> VerifyPlan:
        """The plan collected from the marker (its :attr:`~speccheck.checks.api.VerifyPlan.
        verify_run` is the run the marker's arguments build)."""
        assert self._plan is not None, "collected before use"
        return self._plan

    def report(self) -> VerifyReport:
        """The plan's report: run on first use, then shared by every gate of the session
        with the same plan (what a run raised is raised again, not rerun; bad input found
        by a worker, a ``reproduce`` example it cannot take, fails the item with its
        line)."""
        from speccheck.checks.api import VerifyInputError

        results = self.config.stash[_RESULTS]
        key = _plan_key(self.plan)
        if key not in results:
            try:
                results[key] = self.plan.run()
            except Exception as exc:  # kept so the other items report it without a rerun
                results[key] = exc
        result = results[key]
        if isinstance(result, VerifyInputError):
            pytest.fail(f"@pytest.mark.{MARKER}: {result}", pytrace=False)
        if isinstance(result, BaseException):
            raise result
        return result

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, self.function.__code__.co_firstlineno - 1, self.name


class SpeccheckItem(pytest.Item):
    """``run[BACKEND]`` (``check`` is ``None``): the backend ran in its worker; or one
    check of one backend, passed, failed or skipped as the report says."""

    def __init__(self, *, backend: str, check: Check | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backend = backend
        self.check = check

    def runtest(self) -> None:
        from speccheck.checks.verify.vocabulary import Status

        gate = self.parent
        assert isinstance(gate, SpeccheckGate)
        report = gate.report()
        if self.check is None:
            backend = report.backend(self.backend)
            if backend.status is Status.SKIPPED:
                pytest.skip(f"{self.backend}: skipped: {backend.detail}")
            if backend.status is Status.CRASHED:
                lines = [f"{self.backend}: crashed: {backend.detail}"]
                if backend.reproduce:
                    lines.append(f"reproduce: {backend.reproduce}")
                pytest.fail("\n".join(lines), pytrace=False)
            return
        verdict = next(v for v in report.verdicts(self.backend) if v.check is self.check)
        if verdict.status is Status.FAILED:
            pytest.fail(verdict.message, pytrace=False)
        if verdict.status is Status.SKIPPED:
            pytest.skip(verdict.message)

    def reportinfo(self) -> tuple[Path, int, str]:
        gate = self.parent
        assert isinstance(gate, SpeccheckGate)
        what = "run" if self.check is None else self.check.value
        line = gate.function.__code__.co_firstlineno - 1
        return self.path, line, f"speccheck {self.backend} {what}"


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    """One section naming each verified backend's tier, verdict and examples, and the
    command's summary lines (fused or not and why, the claims audit, failures)."""
    from speccheck.checks.verify.vocabulary import Status

    reports = [r for r in config.stash.get(_RESULTS, {}).values()
               if not isinstance(r, BaseException)]
    if not reports:
        return
    terminalreporter.write_sep("-", "speccheck")
    for report in reports:
        for backend in report.backends:
            line = (f"{backend.backend}: {backend.status.value} on the "
                    f"{report.tier.value.upper()} tier ({report.device})")
            if backend.status in (Status.PASSED, Status.FAILED):
                fused = "allowed" if backend.fused_allowed else "not allowed"
                line += f", {backend.examples} examples, fused {fused}"
            terminalreporter.write_line(line)
        for line in report.summary_lines():
            terminalreporter.write_line(line)


def _plan_key(plan: VerifyPlan) -> str:
    """What makes two plans the same run: their :class:`~speccheck.checks.verify.run.
    VerifyRun` (planned on the same machine, equal runs verify the same)."""
    return plan.verify_run.model_dump_json()
