"""Every failure is shown (issue 43 item 2): the search goes on after the first failure,
each failure gets its own minimal example, ``fail_fast`` stops at the first and says so,
and a check that a stopped run cut short never reads as passed."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from xml.etree import ElementTree

import pytest
from hypothesis import strategies as st

from speccheck.checks.api import VerifyReport, _verdict
from speccheck.checks.verify.comparisons import Outcome
from speccheck.checks.verify.examples import Example, encode_example
from speccheck.checks.verify.report import (
    BackendReport,
    Failure,
    Finding,
    merge_shards,
    write_junit,
)
from speccheck.checks.verify.search import (
    ExampleRaised,
    ExampleRun,
    SearchBudget,
    record_failure,
    search_all,
)
from speccheck.checks.verify.vocabulary import Check, Result, Status, Tier
from speccheck.checks.cli.verify import reproduced_example_line
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.batch import DraftBatch

EXAMPLES = 50


def _example(context: int) -> Example:
    return 2, DraftBatch((context,), ((0,),), ((1,),), (0,))


def _run(example: Example) -> ExampleRun:
    """Two independent faults: ``step_metadata`` fails from context 10 on, the fp32
    reference at every context of 5 mod 7 (5, 12, 19, ...: 12 fails both)."""
    context = example[1].context_lens[0]
    metadata = Result.FAILED if context >= 10 else Result.PASSED
    reference = Result.FAILED if context % 7 == 5 else Result.PASSED
    return ExampleRun([
        Outcome(Check.STEP_METADATA, metadata, f"stale at {context}", "fused_eager", 2, "f"),
        Outcome(Check.VS_FP32_REFERENCE, reference, f"off at {context}"),
        Outcome(Check.LOGITS, Result.PASSED, candidate="fused_eager"),
    ], 0)


def _search(fail_fast: bool) -> BackendReport:
    report = BackendReport("b", Tier.CPU, Status.PASSED)
    search_all(st.integers(0, 60).map(_example), SearchBudget(EXAMPLES, 0, 30.0, fail_fast),
               _run, report, lambda index, example: None,
               lambda r, example, outcomes, found_at, known: record_failure(
                   r, example, outcomes, lambda e: "localised", found_at, known))
    return report


def test_the_search_goes_on_and_each_failure_gets_its_own_minimal_example() -> None:
    report = _search(fail_fast=False)
    found = {(tuple(f.checks), f.example["context_lens"][0]) for f in report.findings}
    assert found == {((Check.STEP_METADATA,), 10), ((Check.VS_FP32_REFERENCE,), 5)}
    assert report.examples == report.examples_asked == EXAMPLES
    assert report.stopped_at is None and report.status is Status.FAILED
    assert {f.check for f in report.failures} == {Check.STEP_METADATA, Check.VS_FP32_REFERENCE}
    assert report.minimal_example == report.findings[0].example


def test_fail_fast_stops_at_the_first_failure_and_says_where() -> None:
    report = _search(fail_fast=True)
    assert len(report.findings) == 1
    assert report.stopped_at == report.examples == report.findings[0].found_at < EXAMPLES
    assert report.stop_note == (f"the run stopped at example {report.stopped_at} of "
                                f"{EXAMPLES} (--fail-fast)")
    failed = report.findings[0].checks[0]
    other = ({Check.STEP_METADATA, Check.VS_FP32_REFERENCE} - {failed}).pop()
    # the other fault's check is not passed: the run cut it short
    verdict = _verdict(report, other)
    assert verdict.status is Status.SKIPPED
    assert verdict.message.startswith(("cut short: the run stopped at example",
                                       "not reached: the run stopped at example"))
    assert _verdict(report, Check.LOGITS).status is Status.SKIPPED


def _stopped_report() -> BackendReport:
    report = BackendReport("b", Tier.CPU, Status.FAILED, examples=2, examples_asked=20,
                           stopped_at=2)
    report.checks[Check.LOGITS].passed = 3
    failure = Failure(Check.STEP_METADATA, "stale", "fused_eager", 2, "f")
    report.failures = [failure]
    report.findings = [Finding([failure], {"num_speculative_steps": 2}, 2, "speccheck verify x")]
    return report


def test_a_check_cut_short_is_no_pass_in_the_verdicts_junit_and_summary(tmp_path: Path) -> None:
    report = _stopped_report()
    verdict = _verdict(report, Check.LOGITS)
    assert (verdict.status, verdict.message) == (
        Status.SKIPPED, "cut short: the run stopped at example 2 of 20 (--fail-fast); before "
        "that: 3 passed, 0 indeterminate")
    assert _verdict(report, Check.ZERO_TAILS).message == (
        "not reached: the run stopped at example 2 of 20 (--fail-fast)")
    # what the run could never have exercised says so, stopped or not
    assert _verdict(report, Check.CAPTURE).message.startswith(
        "needs CUDA graphs: this run is on the CPU tier")
    path = tmp_path / "junit.xml"
    write_junit([report], path)
    cases = {case.get("name"): case for case in ElementTree.parse(path).iter("testcase")}
    skipped = cases["logits[cpu]"].find("skipped")
    assert skipped is not None and skipped.get("message", "").startswith("cut short: the run")
    summary = VerifyReport((report,), Tier.CPU, "CPU", RuntimeConfig(), None).summary_lines()
    assert ("b: the run stopped at example 2 of 20 (--fail-fast): checks that did not fail "
            "ran on 2 of 20 examples, not all") in summary
    assert BackendReport.from_json(report.to_json()) == report


def test_skip_reasons_say_what_the_check_needs() -> None:
    report = BackendReport("b", Tier.CPU, Status.PASSED, examples=20, examples_asked=20,
                           candidates=["fused_eager"])
    assert _verdict(report, Check.CAPTURE).message.startswith(
        "needs CUDA graphs: this run is on the CPU tier")
    assert _verdict(report, Check.DP_TOKEN_COUNT).message.startswith(
        "needs a data-parallel run (--dp-size 2 or more)")
    assert _verdict(report, Check.ZERO_TAILS).message.startswith(
        "no example of this run exercised it (20 examples on the CPU tier, candidates: "
        "fused_eager)")


def test_each_finding_in_the_summary_has_its_own_example_and_command() -> None:
    report = BackendReport("b", Tier.CPU, Status.FAILED, fused_allowed=True, examples=20,
                           examples_asked=20)
    for number, check in enumerate((Check.STEP_METADATA, Check.VS_FP32_REFERENCE)):
        failure = Failure(check, f"bug {number}")
        report.failures.append(failure)
        report.findings.append(Finding([failure], {"n": number}, number + 1, f"cmd {number}",
                                       reproduced=True))
    lines = VerifyReport((report,), Tier.CPU, "CPU", RuntimeConfig(), None).summary_lines()
    assert lines == [
        "FAIL b step_metadata: bug 0", 'minimal example: {"n": 0}',
        "reproduce (checked: fails the same way in a fresh worker): cmd 0",
        "FAIL b vs_fp32_reference: bug 1", 'minimal example: {"n": 1}',
        "reproduce (checked: fails the same way in a fresh worker): cmd 1",
    ]
    assert "cmd 1" in _verdict(report, Check.VS_FP32_REFERENCE).message
    assert "cmd 0" not in _verdict(report, Check.VS_FP32_REFERENCE).message


def test_shards_merge_their_findings_less_repeats() -> None:
    def shard(*checks: Check) -> BackendReport:
        report = BackendReport("b", Tier.CPU, Status.FAILED, examples=10, examples_asked=10)
        for check in checks:
            failure = Failure(check, check.value)
            report.failures.append(failure)
            report.findings.append(Finding([failure], {"check": check.value}))
        return report

    merged = merge_shards([shard(Check.LOGITS), shard(Check.LOGITS, Check.ZERO_TAILS)], 1.0)
    assert [f.checks for f in merged.findings] == [[Check.LOGITS], [Check.ZERO_TAILS]]
    assert [f.check for f in merged.failures] == [Check.LOGITS, Check.ZERO_TAILS]
    assert merged.examples_asked == 20 and merged.stopped_at is None


def test_a_reproduce_run_names_its_own_example() -> None:
    blob = encode_example((3, DraftBatch((5, 17), ((1,), (2, 3)), ((1, 2), (3, 4, 5, 6, 7)),
                                         (0, 1))))
    assert reproduced_example_line(blob) == (
        "reproducing one example: K = 3, 2 request(s), new tokens 1,2, context lengths 5,17")


class _Held:
    """Stands in for what an example's frames hold (a serving-scale KV snapshot)."""


def test_an_example_that_raises_is_shrunk_to_the_smallest_and_keeps_none_of_its_frames() -> None:
    """The measured bug: FlashInfer rejected the padded first pass of some batches, and every
    candidate hypothesis shrank kept its frames (a 1 GiB KV snapshot each) until the H200 ran
    out of memory, so the worker reported running out of memory instead of the error. Now the
    search ends with :class:`ExampleRaised` naming the error, on the smallest raising
    example (the last one ``on_example`` saw), and no example's locals outlive it."""
    held: list[weakref.ref[_Held]] = []
    alive: list[int] = []
    seen: list[Example] = []

    def run(example: Example) -> ExampleRun:
        gc.collect()
        alive.append(sum(ref() is not None for ref in held))  # earlier examples' locals
        snapshot = _Held()  # noqa: F841 - a local of the raising frame
        held.append(weakref.ref(snapshot))
        context = example[1].context_lens[0]
        if context >= 20:
            raise ValueError(f"q.shape[0] ({context}) does not match qo_indptr[-1]\nmore")
        return _run(_example(0))

    report = BackendReport("b", Tier.CPU, Status.PASSED)
    with pytest.raises(ExampleRaised) as info:
        search_all(st.integers(0, 60).map(_example), SearchBudget(EXAMPLES, 0, 30.0), run,
                   report, lambda index, example: seen.append(example),
                   lambda *args: pytest.fail("nothing failed a check"))
    raise_line = run.__code__.co_firstlineno + 7
    assert info.value.raised.summary.startswith(
        "builtins.ValueError: q.shape[0] (20) does not match qo_indptr[-1] (at ")
    assert info.value.raised.summary.endswith(f"{Path(__file__).name}:{raise_line})"), info.value.raised.summary
    assert "Traceback" in str(info.value) and seen[-1] == _example(20)
    assert report.examples <= EXAMPLES  # shrink candidates are no examples of the run
    assert len(held) > 2 and not any(alive), alive
