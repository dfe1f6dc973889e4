"""Running mutants: each through ``speccheck verify`` in a fresh process with its mutated
package shadowing the installed one (:mod:`~speccheck.checks.mutate.shadow`), several at
once, and no new one started once the budget is spent; and what each run's ending means
(:class:`Outcome`, :class:`KillKind`)."""

from __future__ import annotations

import dataclasses
import enum
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from speccheck.checks.mutate.mutants import Mutant
from speccheck.checks.mutate.shadow import VerifyOutcome, run_verify, shadow_package, write_module
from speccheck.checks.verify.raise_site import TRITON_FRONT_END
from speccheck.checks.verify.vocabulary import Check, Status


class Outcome(enum.StrEnum):
    """How a mutant fared."""

    KILLED = "killed"
    """Verify failed a check."""
    KILLED_BY_CRASH = "killed_by_crash"
    """Verify's worker crashed (or the backend could not run, or no report came back)."""
    KILLED_BY_TIMEOUT = "killed_by_timeout"
    """Verify ran past the mutants' timeout."""
    SURVIVED = "survived"
    """Verify passed."""
    INVALID = "invalid"
    """The mutated module does not compile or leaves a name unbound (never run), or its run
    crashed reading a name whose binding it deleted (:func:`stillborn_read`) or in Triton's
    front end (a kernel that does not compile)."""
    NOT_RUN = "not_run"
    """Not started: the budget was spent."""

    @property
    def killed(self) -> bool:
        return self in (Outcome.KILLED, Outcome.KILLED_BY_CRASH, Outcome.KILLED_BY_TIMEOUT)


class KillKind(enum.StrEnum):
    """What killed a mutant, from the most to the least telling."""

    NAMED_FIELD = "named_field_check"
    """A failed check named the metadata field."""
    OTHER_CHECK = "other_check"
    """Checks failed, none naming a field, not ``vs_fp32_reference`` alone."""
    FP32_REFERENCE_ONLY = "vs_fp32_reference_only"
    """Only the comparison with the fp32 reference failed."""
    CRASH = "crash"
    """A crash or a timeout."""


@dataclass(frozen=True)
class MutantResult:
    """One mutant's outcome, with what verify said."""

    mutant: Mutant
    outcome: Outcome
    failed_checks: tuple[str, ...] = ()
    named_fields: tuple[str, ...] = ()
    seconds: float = 0.0
    detail: str = ""
    """For a crash: verify's detail or the last line of its output."""
    judged_by: str | None = None
    """The :func:`~speccheck.checks.mutate.fingerprint.verify_fingerprint` of the code that
    judged it (``None``: unknown, a report written before runs recorded it)."""

    @property
    def kill_kind(self) -> KillKind | None:
        if not self.outcome.killed:
            return None
        if self.outcome is not Outcome.KILLED:
            return KillKind.CRASH
        if self.named_fields:
            return KillKind.NAMED_FIELD
        if self.failed_checks == (Check.VS_FP32_REFERENCE.value,):
            return KillKind.FP32_REFERENCE_ONLY
        return KillKind.OTHER_CHECK


TRITON_FRONT_END_SITE = f"at {TRITON_FRONT_END}"
"""How a crashed report's ``raised_at`` begins for an error raised in Triton's language
front end (:func:`~speccheck.checks.verify.raise_site.raised_at`)."""

UNBOUND_READ = re.compile(
    r"UnboundLocalError\W+(?:cannot access local variable|local variable) '(\w+)'")
"""How Python reports a local read before any binding (3.11+, and older wording)."""


def stillborn_read(mutant: Mutant, detail: str) -> str | None:
    """The name a crash's ``detail`` says was read before any binding, where ``mutant``
    deleted a binding of it: the deletion left no binding on the path the code always
    takes (a flow-sensitive name checker, e.g. pyright's possibly-unbound check, rejects
    it), so the mutant is stillborn, not caught. ``None`` otherwise."""
    found = UNBOUND_READ.search(detail)
    if found is None or found.group(1) not in mutant.deleted_bindings:
        return None
    return found.group(1)


def judge(mutant: Mutant, run: VerifyOutcome) -> MutantResult:
    """The outcome of ``mutant`` from its verify run: a crash that reads a name whose
    binding the mutant deleted (:func:`stillborn_read`), or that Triton's language front end
    raised (:data:`TRITON_FRONT_END_SITE`: a kernel that cannot compile, whatever its
    input), is :attr:`Outcome.INVALID`."""
    result = _judged(mutant, run)
    site = str((run.report or {}).get("raised_at") or "")
    if result.outcome is Outcome.KILLED_BY_CRASH and site.startswith(TRITON_FRONT_END_SITE):
        return dataclasses.replace(
            result, outcome=Outcome.INVALID,
            detail="Triton's front end rejects the mutated kernel (non-viable: it does not "
                   f"compile for a GPU either): {result.detail}")
    if result.outcome is Outcome.KILLED_BY_CRASH:
        name = stillborn_read(mutant, result.detail)
        if name is not None:
            return dataclasses.replace(
                result, outcome=Outcome.INVALID,
                detail=f"reads {name} before any other binding (stillborn: a flow-sensitive "
                       "name checker rejects it)")
    return result


def _judged(mutant: Mutant, run: VerifyOutcome) -> MutantResult:
    if run.timed_out:
        return MutantResult(mutant, Outcome.KILLED_BY_TIMEOUT, seconds=run.seconds,
                            detail=f"verify ran past {run.seconds:.0f} s")
    report = run.report
    last_line = run.output_tail[-1] if run.output_tail else f"exit status {run.returncode}"
    if report is None:
        return MutantResult(mutant, Outcome.KILLED_BY_CRASH, seconds=run.seconds,
                            detail=f"no report: {last_line}")
    status = Status(report["status"])
    if status is Status.PASSED:
        return MutantResult(mutant, Outcome.SURVIVED, seconds=run.seconds)
    if status is not Status.FAILED:
        return MutantResult(mutant, Outcome.KILLED_BY_CRASH, seconds=run.seconds,
                            detail=f"{status.value}: {report.get('detail') or last_line}")
    failed = tuple(name for name, tally in report["checks"].items() if tally["failed"])
    fields = tuple(dict.fromkeys(f["field"] for f in report["failures"] if f.get("field")))
    return MutantResult(mutant, Outcome.KILLED, failed_checks=failed, named_fields=fields,
                        seconds=run.seconds)


@dataclass
class RunSettings:
    """How the mutants run."""

    backend: str
    examples: int | None
    """``--examples`` for verify; ``None``: verify's default."""
    jobs: int
    budget: float
    """Seconds after ``started`` past which no mutant is started."""
    timeout: float
    """Seconds one mutant's verify may take."""
    started: float = field(default_factory=time.monotonic)
    stop_after: float | None = None
    """Seconds after ``started`` at which the mutants under way are stopped and reported
    :attr:`Outcome.NOT_RUN` (``None``: they run to their end), so that a run cut by an
    outside time limit still reports what it finished."""
    unreached: frozenset[int] = frozenset()
    """Numbers of the mutants whose lines the unmutated gate never executed
    (:meth:`~speccheck.checks.mutate.coverage_run.CoverageRun.never_reached`): they
    survive without a run."""
    judged_by: str | None = None
    """The verify fingerprint every result of this run carries
    (:attr:`MutantResult.judged_by`)."""


UNREACHED_DETAIL = "the unmutated gate never executed its lines: it survives without a run"
"""What an unreached mutant's result says (:attr:`RunSettings.unreached`)."""


def run_mutants(
    mutants: Sequence[Mutant], settings: RunSettings,
    on_result: Callable[[MutantResult], None] | None = None,
) -> list[MutantResult]:
    """Every mutant's result, in ``mutants``' order: invalid and unreached ones without
    running, the rest through verify with ``--fail-fast`` (a mutant is killed, and its kind
    decided, by the first failure of its first failing cell, which the default search finds
    the same way before it would search on), ``settings.jobs`` at a time; once
    ``settings.budget`` is spent the ones not started are :attr:`Outcome.NOT_RUN`.
    ``on_result`` sees each result as it comes (from the worker threads, one at a time).
    At ``settings.stop_after``, or on ``SIGTERM`` (an outside time limit's first signal;
    handled where this runs on the main thread), the runs under way are killed and are not
    run either, and the results return. Interrupted (``KeyboardInterrupt``), it kills the
    verify runs under way before it re-raises."""
    lock = threading.Lock()
    stop = threading.Event()
    cut = threading.Event()
    """Set at ``settings.stop_after`` or on ``SIGTERM``: a run stopped then was not judged."""

    def cut_now(*_: object) -> None:
        cut.set()
        stop.set()

    watchdog = None
    if settings.stop_after is not None:
        left = settings.started + settings.stop_after - time.monotonic()
        watchdog = threading.Timer(max(0.0, left), cut_now)
        watchdog.daemon = True
        watchdog.start()
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, cut_now) if on_main_thread else None

    def one(mutant: Mutant) -> MutantResult:
        if not mutant.valid:
            result = MutantResult(mutant, Outcome.INVALID, detail=mutant.invalid_reason)
        elif mutant.number in settings.unreached:
            result = MutantResult(mutant, Outcome.SURVIVED, detail=UNREACHED_DETAIL)
        elif time.monotonic() - settings.started > settings.budget or cut.is_set():
            result = MutantResult(mutant, Outcome.NOT_RUN)
        else:
            with shadow_package(mutant.target.package, mutant.target.package_dir) as root:
                write_module(root, mutant.target, mutant.source)
                run = run_verify(root, settings.backend, examples=settings.examples,
                                 timeout=settings.timeout, fail_fast=True, stop=stop)
            result = (MutantResult(mutant, Outcome.NOT_RUN) if run.timed_out and cut.is_set()
                      else judge(mutant, run))
        if result.outcome is Outcome.NOT_RUN:
            return result
        result = dataclasses.replace(result, judged_by=settings.judged_by)
        if on_result is not None:
            with lock:
                on_result(result)
        return result

    pool = ThreadPoolExecutor(max_workers=settings.jobs, thread_name_prefix="mutant")
    try:
        return list(pool.map(one, mutants))
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if watchdog is not None:
            watchdog.cancel()
        if on_main_thread:  # None: a handler not set from Python, i.e. the default
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
