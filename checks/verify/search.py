"""The search for a failing example: hypothesis draws examples, each is run and checked,
and the first failure is shrunk (within a time budget) to the smallest one found, which
becomes the backend's recorded failure."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky

from speccheck.checks.verify.comparisons import Outcome
from speccheck.checks.verify.examples import Example, example_json
from speccheck.checks.verify.report import BackendReport, Failure
from speccheck.checks.verify.strategies import target_derived_changes
from speccheck.checks.verify.vocabulary import Check, Result, Status


@dataclass(frozen=True)
class ExampleRun:
    """What running one example gave: every check's outcome, and how many derived metadata
    elements changed between the oracle run's steps (what the search aims to raise)."""

    outcomes: list[Outcome]
    derived_changes: int


@dataclass(frozen=True)
class SearchBudget:
    """How many examples to draw, from which seed, and how long shrinking a failure may
    take (past it the smallest failure so far is kept)."""

    examples: int
    seed: int
    shrink_seconds: float


class ExampleFailed(Exception):
    """An example failed a check: ends the hypothesis test case, so that it shrinks."""

    def __init__(self, example: Example, outcomes: list[Outcome]) -> None:
        super().__init__(f"{sum(o.result == 'failed' for o in outcomes)} checks failed")
        self.example = example
        self.outcomes = outcomes


def search(
    strategy: st.SearchStrategy[Example], budget: SearchBudget,
    run_example: Callable[[Example], ExampleRun], report: BackendReport,
    on_example: Callable[[int, Example], None],
) -> tuple[Example, list[Outcome]] | None:
    """Draw ``budget.examples`` examples from ``strategy`` and run each; return the smallest
    failing example found and its outcomes (``None`` when every example passed). Passing
    examples are counted and tallied in ``report``; a failure's outcomes are not (see
    :func:`record_failure`).

    ``on_example(index, example)`` is called before every example runs, shrink candidates
    included (same index): a worker killed mid-example names the right one.
    """
    shrinking, shrink_started = False, 0.0
    smallest: list[tuple[Example, list[Outcome]]] = []

    @seed(budget.seed)
    @settings(
        max_examples=budget.examples, database=None, deadline=None,
        phases=(Phase.generate, Phase.target, Phase.shrink), report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck), print_blob=False,
    )
    @given(strategy)
    def check(example: Example) -> None:
        nonlocal shrinking, shrink_started
        if not shrinking:
            report.examples += 1
        elif time.monotonic() - shrink_started > budget.shrink_seconds:
            return  # budget spent: every further candidate "passes", ending the shrink
        on_example(report.examples, example)
        run = run_example(example)
        target_derived_changes(run.derived_changes)
        if any(o.result is Result.FAILED for o in run.outcomes):
            if not shrinking:
                shrinking, shrink_started = True, time.monotonic()
            smallest[:] = [(example, run.outcomes)]  # hypothesis only tries smaller candidates
            raise ExampleFailed(example, run.outcomes)
        if not shrinking:
            report.tally(run.outcomes)

    try:
        check()
    except (ExampleFailed, Flaky):
        # Flaky: the final replay of the smallest failure passed because the shrink
        # budget was spent; that failure is still the one to report.
        if not smallest:
            raise
        return smallest[0]
    return None


def record_failure(
    report: BackendReport, example: Example, outcomes: list[Outcome],
    localise: Callable[[Example], str],
) -> None:
    """Record ``example`` as the backend's failure. A ``vs_fp32_reference`` failure gets
    ``localise(example)`` (where and why the oracle and the fp32 reference part) added to
    its first diagnosis."""
    report.tally(outcomes)
    failed = [o for o in outcomes if o.result is Result.FAILED]
    versus = [o for o in failed if o.check is Check.VS_FP32_REFERENCE]
    if versus:
        versus[0].diagnosis += f"; {localise(example)}"
    report.failures = [Failure(o.check, o.diagnosis, o.candidate, o.step, o.field)
                       for o in failed]
    report.minimal_example = example_json(example)
    report.status = Status.FAILED
