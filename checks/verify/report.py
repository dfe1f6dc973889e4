"""What a verification run found: per-check tallies, failures, the claims audit, and their
renderings as JSON and JUnit XML."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from xml.etree import ElementTree

from speccheck.checks.verify.vocabulary import Check, Result, Status, Tier

if TYPE_CHECKING:  # imports torch; this module is imported by torch-free commands
    from speccheck.checks.verify.input_fit import ExampleDoesNotFit


@dataclass
class CheckTally:
    """How often one check gave each :class:`Result` over a run."""

    passed: int = 0
    failed: int = 0
    indeterminate: int = 0
    skipped: int = 0

    def add(self, result: Result) -> None:
        match result:
            case Result.PASSED:
                self.passed += 1
            case Result.FAILED:
                self.failed += 1
            case Result.INDETERMINATE:
                self.indeterminate += 1
            case Result.SKIPPED:
                self.skipped += 1

    def include(self, other: CheckTally) -> None:
        """Add ``other``'s counts to these: one check's tallies over several workers or
        ranks."""
        self.passed += other.passed
        self.failed += other.failed
        self.indeterminate += other.indeterminate
        self.skipped += other.skipped


@dataclass
class Failure:
    """One failed check on the minimal (shrunk) example."""

    check: Check
    diagnosis: str
    candidate: str | None = None
    step: int | None = None
    field: str | None = None


FailureKey = tuple[Check, str | None]
"""What makes a failure new to a run: its check, and for ``step_metadata`` its field."""


def failure_key(check: Check, field: str | None) -> FailureKey:
    """The :data:`FailureKey` of a failure of ``check`` at ``field``: a later example fails
    anew only by failing a check, or a ``step_metadata`` field, not failed before."""
    return (check, field if check is Check.STEP_METADATA else None)


@dataclass
class Finding:
    """One failure the search found (``speccheck verify`` keeps searching after the first,
    unless ``--fail-fast``): the failed checks of its minimal (shrunk) example that no
    earlier finding had failed, the example, and its own reproduce command."""

    failures: list[Failure]
    example: dict[str, Any]
    """The minimal example (:func:`~speccheck.checks.verify.examples.example_json`)."""
    found_at: int = 1
    """The example of the run (1-based) whose failure was shrunk to :attr:`example`."""
    reproduce: str | None = None
    reproduced: bool | None = None
    """Whether ``reproduce``, run in a fresh worker, failed these checks again (``None``:
    not checked)."""

    @property
    def keys(self) -> set[FailureKey]:
        """The :func:`failure_key` of each of its failures."""
        return {failure_key(f.check, f.field) for f in self.failures}

    @property
    def checks(self) -> list[Check]:
        """The checks this finding failed, each once, in report order."""
        failed = {failure.check for failure in self.failures}
        return [check for check in Check if check in failed]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Finding:
        return cls(**{**data, "failures": [_failure_from_json(f) for f in data["failures"]]})


@dataclass
class ClaimAudit:
    """``--audit-claims``: the fused path run although the matrix does not allow it under
    the config, to learn whether the claim is too strict or confirmed."""

    status: Status
    """``passed``: the claim is too strict; ``failed``: confirmed; ``skipped``/``crashed``:
    no answer (``detail`` says why)."""
    examples: int = 0
    failures: list[Failure] = field(default_factory=list)
    detail: str = ""

    @property
    def verdict(self) -> str:
        """One line for the summary and the docs."""
        if self.status is Status.PASSED:
            return f"claim too strict: the fused path passed {self.examples} examples"
        if self.status is Status.FAILED and self.failures:
            first = self.failures[0]
            return f"claim confirmed: the fused path fails ({first.check}: {first.diagnosis})"
        return f"claim not audited: {self.status.value}: {self.detail}"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClaimAudit:
        return cls(Status(data["status"]), data["examples"],
                   [_failure_from_json(f) for f in data["failures"]], data["detail"])


@dataclass
class CellReport:
    """One configuration cell of a backend's run
    (:class:`~speccheck.checks.verify.cells.Cell`): its verdict, examples and how it ran
    (``detail``), or, not run (``run`` false, status ``skipped``), why."""

    name: str
    """The cell in words (:attr:`~speccheck.checks.verify.cells.Cell.name`)."""
    status: Status
    run: bool = True
    examples: int = 0
    detail: str = ""
    reproduce: str | None = None
    """The cell's failure's reproduce command, where it failed."""

    @property
    def verdict(self) -> str:
        """The cell's verdict in words: its status, or ``not run`` and why."""
        return self.status.value if self.run else f"not run: {self.detail}"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CellReport:
        return cls(**{**data, "status": Status(data["status"])})


def _failure_from_json(data: dict[str, Any]) -> Failure:
    return Failure(**{**data, "check": Check.parse(data["check"])})


@dataclass
class BackendReport:
    backend: str
    tier: Tier
    status: Status
    fused_allowed: bool = False
    fused_reason: str = ""
    candidates: list[str] = field(default_factory=list)
    examples: int = 0
    checks: dict[Check, CheckTally] = field(default_factory=lambda: {c: CheckTally() for c in Check})
    failures: list[Failure] = field(default_factory=list)
    """Every failure: those of each of :attr:`findings`, in order (or of a DP or DCP run,
    or a claims audit, which record no findings)."""
    minimal_example: dict[str, Any] | None = None
    """The first finding's minimal example (a DP or DCP run's failing example)."""
    reproduce: str | None = None
    """The first finding's reproduce command (a crash's: the example it died in)."""
    reproduced: bool | None = None
    """Whether every reproduce command, run in a fresh worker, failed the same way
    (``None``: not checked)."""
    findings: list[Finding] = field(default_factory=list)
    """Each failure the search found, with its own minimal example and reproduce command
    (:mod:`~speccheck.checks.verify.search`)."""
    examples_asked: int = 0
    """How many examples the run was given (:attr:`examples`: how many it ran)."""
    stopped_at: int | None = None
    """``--fail-fast``: the example at which the run stopped, short of
    :attr:`examples_asked` (``None``: it ran them all, or stopped on its last)."""
    detail: str = ""
    raised_at: str = ""
    """A crash by a raise in the worker: where it was raised
    (:func:`~speccheck.checks.verify.raise_site.raised_at`, also at the end of
    :attr:`detail`), for tools that tell crashes apart (``speccheck mutate``); ``""``
    otherwise."""
    hang_seconds: float | None = None
    """A crash by hang: the seconds without progress after which the worker was killed
    (:class:`~speccheck.checks.verify.hang.HangClock`); the reproduce check holds its
    example to the same bound. ``None``: no hang."""
    capture_seconds: float = 0.0
    seconds: float = 0.0
    device: str = ""
    runtime_config: dict[str, Any] = field(default_factory=dict)
    claim_audit: ClaimAudit | None = None
    breakpoints: dict[str, Any] | None = None
    """Where the backend's derived metadata changes with one request's length
    (:meth:`~speccheck.checks.verify.breakpoints.Breakpoints.to_json`)."""
    data_parallel: dict[str, Any] | None = None
    """For a ``--dp-size N`` run: ``{"dp_size": N, "collectives": the ranks' process-group
    backend ("gloo" or "cpu:gloo,cuda:nccl"), "devices": rank r's device at index r}``."""
    latent_fields: list[str] = field(default_factory=list)
    """Declared refreshed fields whose perturbation changed no output
    (:mod:`~speccheck.checks.verify.latent_fields`), as ``backend.metadata.field``."""
    worker_task: dict[str, Any] | None = None
    """The :class:`~speccheck.checks.verify.run.WorkerTask` the worker process that wrote
    this report was given, as it read it (``model_dump(mode="json")``: the run unchanged,
    the backend, the worker's examples and seed); after a merge of shards, the first
    worker's. ``None`` for a report not written by a worker process (DP and DCP ranks)."""
    cells: list[CellReport] = field(default_factory=list)
    """The configuration cells verified, each with its own verdict, base first (empty:
    one configuration, the run's)."""

    @property
    def stop_note(self) -> str | None:
        """Why checks that did not fail ran on fewer examples than asked, as a clause (``the
        run stopped at example 2 of 20 (--fail-fast)``); ``None`` when none did."""
        if self.stopped_at is None:
            return None
        return (f"the run stopped at example {self.stopped_at} of {self.examples_asked} "
                "(--fail-fast)")

    def reproduce_of(self, check: Check) -> str | None:
        """The reproduce command of the first finding that failed ``check`` (else the
        report's own)."""
        for finding in self.findings:
            if check in finding.checks:
                return finding.reproduce
        return self.reproduce

    def tally(self, outcomes: Any) -> None:
        """Count every outcome (anything with ``check`` and ``result``) in its check."""
        for outcome in outcomes:
            self.checks[outcome.check].add(outcome.result)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BackendReport:
        data = dict(data)
        data["tier"], data["status"] = Tier(data["tier"]), Status(data["status"])
        data["checks"] = {Check.parse(k): CheckTally(**v) for k, v in data["checks"].items()}
        data["failures"] = [_failure_from_json(f) for f in data["failures"]]
        data["findings"] = [Finding.from_json(f) for f in data.get("findings", [])]
        if data.get("claim_audit") is not None:
            data["claim_audit"] = ClaimAudit.from_json(data["claim_audit"])
        data["cells"] = [CellReport.from_json(c) for c in data.get("cells", [])]
        return cls(**data)


SEVERITY = (Status.CRASHED, Status.FAILED, Status.PASSED, Status.SKIPPED)
"""Statuses from worst to best: a backend verified by several workers ends with the worst."""


def merge_shards(shards: Sequence[BackendReport], seconds: float) -> BackendReport:
    """One report for a backend verified by several workers, each on its share of the
    examples from a seed of its own (``speccheck verify --jobs``): examples, check tallies
    and capture time summed over them, ``seconds`` the wall time of them all, the worst of
    their statuses (:data:`SEVERITY`) with the first such worker's minimal example,
    reproduce command and detail; every worker's findings in worker order, less those that
    failed nothing an earlier one had not (:attr:`Finding.keys`), and their failures; it
    stopped short (``--fail-fast``) when a worker did; everything a worker reports about
    the backend rather than its examples (device, config, candidates, breakpoints) from
    the first."""
    if not shards:
        raise ValueError("merge_shards needs at least one report")
    worst = min(shards, key=lambda report: SEVERITY.index(report.status))
    checks = {check: CheckTally() for check in Check}
    for report in shards:
        for check, tally in report.checks.items():
            checks[check].include(tally)
    findings: list[Finding] = []
    for report in shards:
        for finding in report.findings:
            if finding.keys - {key for f in findings for key in f.keys}:
                findings.append(finding)
    failures = ([f for finding in findings for f in finding.failures] if findings
                else list(worst.failures))
    examples = sum(report.examples for report in shards)
    stopped = any(report.stopped_at is not None for report in shards)
    return replace(
        shards[0], status=worst.status, examples=examples,
        examples_asked=sum(report.examples_asked for report in shards),
        stopped_at=examples if stopped else None,
        checks=checks, failures=failures, findings=findings,
        minimal_example=findings[0].example if findings else worst.minimal_example,
        reproduce=findings[0].reproduce if findings else worst.reproduce, reproduced=None,
        detail=worst.detail, raised_at=worst.raised_at, hang_seconds=worst.hang_seconds,
        capture_seconds=sum(report.capture_seconds for report in shards), seconds=seconds)


def json_report(reports: list[BackendReport], meta: dict[str, Any]) -> str:
    """The JSON report: ``meta``'s keys, then ``backends``, one object per report."""
    payload = {**meta, "backends": [r.to_json() for r in reports]}
    return json.dumps(payload, indent=2, sort_keys=False) + "\n"


def write_junit(reports: list[BackendReport], path: Path, source: str = "matrix.yaml") -> None:
    """One test suite per backend, one test case per check (``CHECK[TIER]``) and one per
    configuration cell (``cell[NAME][TIER]``, skipped where not run); a skipped
    or crashed backend is one case, skipped or in error. Suites carry ``tests``,
    ``failures``, ``errors``, ``skipped`` and ``time``; cases carry ``file`` (``source``,
    the matrix the backend was declared in) and ``time``."""
    suites = ElementTree.Element("testsuites", name="speccheck verify")
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for report in reports:
        suite = ElementTree.SubElement(suites, "testsuite", name=f"speccheck.{report.backend}")
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}

        def case(name: str, seconds: float = 0.0) -> ElementTree.Element:
            counts["tests"] += 1
            return ElementTree.SubElement(suite, "testcase", classname=report.backend,
                                          name=name, file=source, time=f"{seconds:.3f}")

        if report.status in (Status.SKIPPED, Status.CRASHED):
            element = case("verify", report.seconds)
            if report.status is Status.SKIPPED:
                counts["skipped"] += 1
                ElementTree.SubElement(element, "skipped", message=report.detail)
            else:
                counts["errors"] += 1
                error = ElementTree.SubElement(element, "error", message=report.detail)
                error.text = f"reproduce: {report.reproduce}" if report.reproduce else None
        else:
            for check, tally in report.checks.items():
                element = case(f"{check.value}[{report.tier.value}]")
                failed = [f for f in report.failures if f.check == check]
                reproduce = report.reproduce_of(check)
                if failed:
                    counts["failures"] += 1
                    failure = ElementTree.SubElement(element, "failure",
                                                     message=failed[0].diagnosis)
                    failure.text = "\n".join(f.diagnosis for f in failed) + (
                        f"\nreproduce: {reproduce}" if reproduce else "")
                elif report.stop_note is not None:
                    counts["skipped"] += 1
                    ElementTree.SubElement(element, "skipped",
                                           message=cut_short(report, tally))
                elif tally.passed == 0 and tally.indeterminate == 0:
                    counts["skipped"] += 1
                    ElementTree.SubElement(element, "skipped", message="not applicable")
            for cell in report.cells:
                element = case(f"cell[{cell.name}][{report.tier.value}]")
                if not cell.run or cell.status is Status.SKIPPED:
                    counts["skipped"] += 1
                    ElementTree.SubElement(element, "skipped", message=cell.verdict)
                elif cell.status in (Status.FAILED, Status.CRASHED):
                    counts["failures"] += 1
                    failure = ElementTree.SubElement(element, "failure", message=cell.detail
                                                     or cell.status.value)
                    failure.text = f"reproduce: {cell.reproduce}" if cell.reproduce else None
        for key, value in counts.items():
            suite.set(key, str(value))
            totals[key] += value
        suite.set("time", f"{report.seconds:.3f}")
    for key, value in totals.items():
        suites.set(key, str(value))
    suites.set("time", f"{sum(r.seconds for r in reports):.3f}")
    ElementTree.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)


def cut_short(report: BackendReport, tally: CheckTally) -> str:
    """Why a check that did not fail is no pass: the run stopped short of its examples
    (:attr:`BackendReport.stop_note`), with what the check saw before it did."""
    if tally.passed == 0 and tally.indeterminate == 0:
        return f"not reached: {report.stop_note}"
    return (f"cut short: {report.stop_note}; before that: {tally.passed} passed, "
            f"{tally.indeterminate} indeterminate")


def misfit_line(misfit: ExampleDoesNotFit) -> str:
    """Why a ``--reproduce`` example does not fit the run, as one line that names the limit
    it crosses and the option that raises that limit (where one does)."""
    from speccheck.checks.verify import input_fit as fit

    match misfit:
        case fit.TooManyRequests(requests, most):
            return (f"--reproduce: the example has {requests} requests, more than the {most} "
                    "this run serves (its largest capture size); raise it with --capture-sizes")
        case fit.TooManyPrefillTokens(tokens, most, per_request):
            return (f"--reproduce: the example has {tokens} prefill tokens, more than the "
                    f"{most} this run's drafter holds ({per_request} per request of its "
                    "largest capture size); raise it with --max-new-tokens or --capture-sizes")
        case fit.PastMaxModelLen(request, context, new_tokens, max_model_len):
            return (f"--reproduce: request {request} reaches length {context + new_tokens} "
                    f"(context {context} + {new_tokens} new tokens), more than "
                    f"--max-model-len {max_model_len}; raise it with --max-model-len")
        case fit.BlockTableTooWide(request, blocks, most, max_model_len, block_size):
            return (f"--reproduce: request {request}'s block table has {blocks} blocks, more "
                    f"than the {most} a request holds at --max-model-len {max_model_len} and "
                    f"--block-size {block_size}; raise it with --max-model-len")
        case fit.BlockPastCache(block, request, live_blocks):
            return (f"--reproduce: block id {block} (request {request}) is past the "
                    f"{live_blocks} live blocks of this run's KV cache; raise them with "
                    "--capture-sizes or --max-model-len")
        case fit.TokenOutsideVocabulary(token, request, vocab_size):
            return (f"--reproduce: token id {token} (request {request}) is outside the "
                    f"drafter's vocabulary of {vocab_size} tokens, which no option changes")
        case fit.LayoutMismatch(block_size, max_model_len, k, reason):
            return (f"--reproduce: the example does not fit --block-size {block_size} "
                    f"--max-model-len {max_model_len} with K = {k}: {reason}")
    raise TypeError(f"no wording for {type(misfit).__name__}")
