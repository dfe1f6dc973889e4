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
    minimal_example: dict[str, Any] | None = None
    reproduce: str | None = None
    reproduced: bool | None = None
    """Whether ``reproduce``, run in a fresh worker, failed the same way (``None``: not
    checked)."""
    detail: str = ""
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
    worker_task: dict[str, Any] | None = None
    """The :class:`~speccheck.checks.verify.run.WorkerTask` the worker process that wrote
    this report was given, as it read it (``model_dump(mode="json")``: the run unchanged,
    the backend, the worker's examples and seed); after a merge of shards, the first
    worker's. ``None`` for a report not written by a worker process (DP and DCP ranks)."""

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
        if data.get("claim_audit") is not None:
            data["claim_audit"] = ClaimAudit.from_json(data["claim_audit"])
        return cls(**data)


SEVERITY = (Status.CRASHED, Status.FAILED, Status.PASSED, Status.SKIPPED)
"""Statuses from worst to best: a backend verified by several workers ends with the worst."""


def merge_shards(shards: Sequence[BackendReport], seconds: float) -> BackendReport:
    """One report for a backend verified by several workers, each on its share of the
    examples from a seed of its own (``speccheck verify --jobs``): examples, check tallies
    and capture time summed over them, ``seconds`` the wall time of them all, the worst of
    their statuses (:data:`SEVERITY`) with the first such worker's failures, minimal
    example, reproduce command and detail; everything a worker reports about the backend
    rather than its examples (device, config, candidates, breakpoints) from the first."""
    if not shards:
        raise ValueError("merge_shards needs at least one report")
    worst = min(shards, key=lambda report: SEVERITY.index(report.status))
    checks = {check: CheckTally() for check in Check}
    for report in shards:
        for check, tally in report.checks.items():
            checks[check].include(tally)
    return replace(
        shards[0], status=worst.status, examples=sum(report.examples for report in shards),
        checks=checks, failures=list(worst.failures), minimal_example=worst.minimal_example,
        reproduce=worst.reproduce, reproduced=None, detail=worst.detail,
        capture_seconds=sum(report.capture_seconds for report in shards), seconds=seconds)


def json_report(reports: list[BackendReport], meta: dict[str, Any]) -> str:
    """The JSON report: ``meta``'s keys, then ``backends``, one object per report."""
    payload = {**meta, "backends": [r.to_json() for r in reports]}
    return json.dumps(payload, indent=2, sort_keys=False) + "\n"


def write_junit(reports: list[BackendReport], path: Path, source: str = "matrix.yaml") -> None:
    """One test suite per backend and one test case per check (``CHECK[TIER]``); a skipped
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
                if failed:
                    counts["failures"] += 1
                    failure = ElementTree.SubElement(element, "failure",
                                                     message=failed[0].diagnosis)
                    failure.text = "\n".join(f.diagnosis for f in failed) + (
                        f"\nreproduce: {report.reproduce}" if report.reproduce else "")
                elif tally.passed == 0 and tally.indeterminate == 0:
                    counts["skipped"] += 1
                    ElementTree.SubElement(element, "skipped", message="not applicable")
        for key, value in counts.items():
            suite.set(key, str(value))
            totals[key] += value
        suite.set("time", f"{report.seconds:.3f}")
    for key, value in totals.items():
        suites.set(key, str(value))
    suites.set("time", f"{sum(r.seconds for r in reports):.3f}")
    ElementTree.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)


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
