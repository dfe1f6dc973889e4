"""The search for failing examples: hypothesis draws examples, each is run and checked,
and a failure is shrunk (within a time budget) to the smallest example found, which
becomes one of the backend's findings. Unless the budget says ``fail_fast``, the search
then goes on with the examples left, a later example counting as a failure only when it
fails something no finding has (:func:`~speccheck.checks.verify.report.failure_key`),
until the run's examples are spent: every check either failed or ran on all of them."""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky

from speccheck.checks.verify.comparisons import Outcome, mark_consequences
from speccheck.checks.verify.examples import BadExample, Example, example_json
from speccheck.checks.verify.one_line import RaisedError
from speccheck.checks.verify.report import (
    BackendReport,
    Failure,
    FailureKey,
    Finding,
    failure_key,
)
from speccheck.checks.verify.cells import BatchClass
from speccheck.checks.verify.strategies import (
    BatchLimits,
    draw_values,
    has_shape,
    target_derived_changes,
)
from speccheck.checks.verify.vocabulary import Check, Result, Status

ROUND_SEED_STRIDE = 2**32
"""Search round ``i`` (after ``i`` earlier rounds: one per finding, one per coverage search)
draws from ``seed + i * ROUND_SEED_STRIDE``: never the seed of another worker's first round
(``--jobs``: ``seed + worker``)."""


@dataclass(frozen=True)
class ExampleRun:
    """What running one example gave: every check's outcome, and how many derived metadata
    elements changed between the oracle run's steps (what the search aims to raise)."""

    outcomes: list[Outcome]
    derived_changes: int


@dataclass(frozen=True)
class SearchBudget:
    """How many examples to draw, from which seed, how long shrinking a failure may
    take (past it the smallest failure so far is kept), and whether the run ends at the
    first failure (``fail_fast``)."""

    examples: int
    seed: int
    shrink_seconds: float
    fail_fast: bool = False


@dataclass(frozen=True)
class FoundFailure:
    """The smallest example a search round shrank a failure to, its outcomes, and the
    example of the run (1-based) that failed first."""

    example: Example
    outcomes: list[Outcome]
    found_at: int


class ExampleRaised(Exception):
    """An example's run raised ``error`` (an adapter's kernel rejecting its input, say): what
    the search raises in its place, as hypothesis shrinks the example and when the search
    ends. It keeps the error as text only (:attr:`summary`, its traceback in the message),
    so that no raising example's frames, nor the device memory their locals hold (the KV
    snapshot of a serving-scale start state is a gigabyte), outlive the example: kept
    alive, a shrink of a few hundred raising candidates filled an H200."""

    def __init__(self, error: BaseException) -> None:
        self.raised = RaisedError.of(error)
        """The error as text, with where it was raised."""
        super().__init__(f"{self.raised.summary}\n{''.join(traceback.format_exception(error))}")


class ExampleFailed(Exception):
    """An example failed a check: ends the hypothesis test case, so that it shrinks."""

    def __init__(self, example: Example, outcomes: list[Outcome]) -> None:
        super().__init__(f"{sum(o.result == 'failed' for o in outcomes)} checks failed")
        self.example = example
        self.outcomes = outcomes


def new_failures(outcomes: list[Outcome], known: frozenset[FailureKey]) -> list[Outcome]:
    """The failed ``outcomes`` whose :func:`~speccheck.checks.verify.report.failure_key`
    is not ``known``."""
    return [o for o in outcomes
            if o.result is Result.FAILED and failure_key(o.check, o.field) not in known]


def search(
    strategy: st.SearchStrategy[Example], budget: SearchBudget,
    run_example: Callable[[Example], ExampleRun], report: BackendReport,
    on_example: Callable[[int, Example], None], known: frozenset[FailureKey] = frozenset(),
) -> FoundFailure | None:
    """One round: draw up to ``budget.examples`` examples from ``strategy`` and run each;
    return the smallest example that fails something not ``known`` (:func:`new_failures`)
    and its outcomes (``None`` when none did). Examples without a new failure are counted
    and tallied in ``report``; a new failure's outcomes are not (see
    :func:`record_failure`).

    ``on_example(index, example)`` is called before every example runs, shrink candidates
    included (same index): a worker killed mid-example names the right one. An example
    whose run raises (but :class:`~speccheck.checks.verify.examples.BadExample`) is
    shrunk within the same budget and ends the search as :class:`ExampleRaised`, its
    smallest example the last one ``on_example`` was told.
    """
    shrinking, shrink_started, found_at = False, 0.0, 0
    smallest: list[tuple[Example, list[Outcome]]] = []
    smallest_raised: list[tuple[Example, ExampleRaised]] = []

    @seed(budget.seed)
    @settings(
        max_examples=budget.examples, database=None, deadline=None,
        phases=(Phase.generate, Phase.target, Phase.shrink), report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck), print_blob=False,
    )
    @given(strategy)
    def check(example: Example) -> None:
        nonlocal shrinking, shrink_started, found_at
        if not shrinking:
            report.examples += 1
        elif time.monotonic() - shrink_started > budget.shrink_seconds:
            return  # budget spent: every further candidate "passes", ending the shrink
        on_example(report.examples, example)
        raised = None
        try:
            run = run_example(example)
        except BadExample:
            raise
        except Exception as error:
            raised = ExampleRaised(error)  # raised below, once the error's frames are gone
        if raised is not None:
            if not shrinking:
                shrinking, shrink_started, found_at = True, time.monotonic(), report.examples
            smallest_raised[:] = [(example, raised)]
            raise raised
        target_derived_changes(run.derived_changes)
        if new_failures(run.outcomes, known):
            if not shrinking:
                shrinking, shrink_started, found_at = True, time.monotonic(), report.examples
            smallest[:] = [(example, run.outcomes)]  # hypothesis only tries smaller candidates
            raise ExampleFailed(example, run.outcomes)
        if not shrinking:
            report.tally(run.outcomes)

    try:
        check()
    except (ExampleFailed, Flaky):
        # Flaky: the final replay of the smallest failure passed because the shrink
        # budget was spent (or the error did not recur); that failure is still the one to
        # report.
        if smallest:
            return FoundFailure(*smallest[0], found_at)
        if not smallest_raised:
            raise
        example, raised = smallest_raised[0]
        on_example(report.examples, example)
        raise raised from None
    return None


Record = Callable[[BackendReport, Example, list[Outcome], int, frozenset[FailureKey]], None]
"""Records a found failure in a report: ``(report, example, outcomes, found_at, known)``
(:meth:`BackendVerifier.record_failure <speccheck.checks.verify.engine.BackendVerifier.
record_failure>`)."""


@dataclass(frozen=True)
class Coverage:
    """A claimed batch class every run must include: ``strategy`` draws examples from that
    class (a K and a batch), and ``limits_for(k)`` gives the limits an example of ``k``
    draft steps is judged in."""

    shape: BatchClass
    limits_for: Callable[[int], BatchLimits]
    strategy: st.SearchStrategy[Example]

    def covers(self, example: Example) -> bool:
        """Whether ``example``'s batch is of the class (:func:`~speccheck.checks.verify.
        strategies.has_shape`)."""
        k, batch = example
        return has_shape(self.shape, batch, self.limits_for(k))

    @property
    def examples(self) -> st.SearchStrategy[Example]:
        """:attr:`strategy` kept to examples the class covers (a draw of the mixed class can
        give requests of one width)."""
        return self.strategy.filter(self.covers)


def draw_covering(strategy: st.SearchStrategy[Example], coverage: Sequence[Coverage],
                  total: int, seed_value: int) -> list[Example]:
    """``total`` examples drawn once (generation only, :func:`~speccheck.checks.verify.
    strategies.draw_values`, deterministic in ``seed_value``) under :func:`search_all`'s
    rule: one example per ``coverage`` class is held back and goes to a class none of the
    others had, the rest to ``strategy``."""
    held_back = min(len(coverage), total)
    drawn = [] if held_back == total else draw_values(strategy, total - held_back, seed_value)
    for shape in coverage:
        if len(drawn) < total and not any(shape.covers(example) for example in drawn):
            drawn += draw_values(shape.examples, 1, seed_value)
    if len(drawn) < total:
        drawn += draw_values(strategy, total - len(drawn), seed_value + 1)
    return drawn


def search_all(
    strategy: st.SearchStrategy[Example], budget: SearchBudget,
    run_example: Callable[[Example], ExampleRun], report: BackendReport,
    on_example: Callable[[int, Example], None], record: Record,
    coverage: Sequence[Coverage] = (),
) -> None:
    """Search rounds (:func:`search`) until ``budget.examples`` examples ran, each round
    drawing the examples left from a seed of its own (:data:`ROUND_SEED_STRIDE`) and
    looking for what no earlier finding failed; each round's failure goes to ``record``.
    With ``budget.fail_fast`` the first failure ends the run (``report.stopped_at`` says
    where, when examples were left).

    Every ``coverage`` shape is run, whatever the draw and ``target()`` favour: the last
    ``len(coverage)`` examples (all, where the budget is smaller) are held back, and once
    the others ran, each shape none of the examples run so far had gets one of them, a
    search of its own strategy kept to examples it covers (shrunk within that shape like
    any failure); examples held back and not needed go to the main strategy."""
    report.examples_asked = budget.examples
    known: frozenset[FailureKey] = frozenset()
    covered: set[BatchClass] = set()
    calls = 0

    def seen(index: int, example: Example) -> None:
        covered.update(shape.shape for shape in coverage if shape.covers(example))
        on_example(index, example)

    def rounds_until(drawn: st.SearchStrategy[Example], total: int) -> bool:
        """Rounds of ``drawn`` until ``total`` examples ran; ``False`` where a
        ``fail_fast`` failure ended the run."""
        nonlocal known, calls
        while report.examples < total:
            left = total - report.examples
            found = search(
                drawn, dataclasses.replace(
                    budget, examples=left, seed=budget.seed + calls * ROUND_SEED_STRIDE),
                run_example, report, seen, known)
            calls += 1
            if found is None:
                return True
            record(report, found.example, found.outcomes, found.found_at, known)
            known |= report.findings[-1].keys
            if budget.fail_fast:
                if report.examples < budget.examples:
                    report.stopped_at = report.examples
                return False
        return True

    held_back = min(len(coverage), budget.examples)
    if not rounds_until(strategy, budget.examples - held_back):
        return
    for shape in coverage:
        if shape.shape not in covered and report.examples < budget.examples:
            if not rounds_until(shape.examples, report.examples + 1):
                return
    rounds_until(strategy, budget.examples)


def record_failure(
    report: BackendReport, example: Example, outcomes: list[Outcome],
    localise: Callable[[Example], str], found_at: int = 1,
    known: frozenset[FailureKey] = frozenset(),
) -> None:
    """Record ``example`` as a finding of the backend: its failures not ``known`` (failed by
    an earlier finding), output and KV failures that follow from a ``step_metadata``
    failure marked so (:func:`~speccheck.checks.verify.comparisons.mark_consequences`)
    and listed after the causes. A
    ``vs_fp32_reference`` failure gets ``localise(example)`` (where and why the oracle and
    the fp32 reference part) added to its first diagnosis. The first finding's example is
    the report's minimal example."""
    report.tally(outcomes)
    effects = {id(outcome) for outcome in mark_consequences(outcomes)}
    failed = sorted(new_failures(outcomes, known), key=lambda o: id(o) in effects)
    versus = [o for o in failed if o.check is Check.VS_FP32_REFERENCE]
    if versus:
        versus[0].diagnosis += f"; {localise(example)}"
    failures = [Failure(o.check, o.diagnosis, o.candidate, o.step, o.field) for o in failed]
    report.findings.append(Finding(failures, example_json(example), found_at))
    report.failures += failures
    if report.minimal_example is None:
        report.minimal_example = example_json(example)
    report.status = Status.FAILED
