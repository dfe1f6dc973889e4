"""What a verification run found: per-check tallies, failures, and their renderings."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

CHECK_NAMES = (
    "capture",
    "draft_tokens",
    "logits",
    "kv_cache",
    "step_metadata",
    "declared_fields",
    "vs_fp32_reference",
    "host_sync",
    "in_place",
    "zero_tails",
    "guard_bands",
    "dp_token_count",
    "dp_matches_single_rank",
)
"""Every check, in report order. See docs/verification.md for what each compares."""


@dataclass
class CheckTally:
    passed: int = 0
    failed: int = 0
    indeterminate: int = 0
    skipped: int = 0


@dataclass
class Failure:
    """One failed check on the minimal (shrunk) example."""

    check: str
    diagnosis: str
    candidate: str | None = None
    step: int | None = None
    field: str | None = None


@dataclass
class BackendReport:
    backend: str
    tier: str
    """``gpu`` (real CUDA graphs), ``cpu`` (eager loops, probes by tracing), or ``none``."""
    status: str
    """``passed``, ``failed``, ``skipped`` or ``crashed``."""
    fused_allowed: bool = False
    fused_reason: str = ""
    candidates: list[str] = field(default_factory=list)
    examples: int = 0
    checks: dict[str, CheckTally] = field(default_factory=lambda: {n: CheckTally() for n in CHECK_NAMES})
    failures: list[Failure] = field(default_factory=list)
    minimal_example: dict[str, Any] | None = None
    reproduce: str | None = None
    detail: str = ""
    capture_seconds: float = 0.0
    seconds: float = 0.0
    device: str = ""
    runtime_config: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BackendReport:
        data = dict(data)
        data["checks"] = {k: CheckTally(**v) for k, v in data["checks"].items()}
        data["failures"] = [Failure(**f) for f in data["failures"]]
        return cls(**data)


def write_json(reports: list[BackendReport], path: Path, meta: dict[str, Any]) -> None:
    payload = {**meta, "backends": [r.to_json() for r in reports]}
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")


def write_junit(reports: list[BackendReport], path: Path) -> None:
    """One test case per (backend, check); a skipped backend is one skipped case."""
    suites = ElementTree.Element("testsuites", name="speccheck verify")
    for report in reports:
        suite = ElementTree.SubElement(suites, "testsuite", name=f"speccheck.{report.backend}")
        cases = 0
        failures = 0
        if report.status in ("skipped", "crashed"):
            case = ElementTree.SubElement(suite, "testcase", classname=report.backend, name="verify")
            tag = "skipped" if report.status == "skipped" else "error"
            ElementTree.SubElement(case, tag, message=report.detail)
            cases, failures = 1, int(report.status == "crashed")
        for name, tally in report.checks.items():
            if report.status in ("skipped", "crashed"):
                break
            cases += 1
            case = ElementTree.SubElement(
                suite, "testcase", classname=report.backend, name=f"{name}[{report.tier}]"
            )
            failed = [f for f in report.failures if f.check == name]
            if failed:
                failures += 1
                el = ElementTree.SubElement(case, "failure", message=failed[0].diagnosis)
                el.text = "\n".join(f.diagnosis for f in failed) + f"\nreproduce: {report.reproduce}"
            elif tally.passed == 0 and tally.indeterminate == 0:
                ElementTree.SubElement(case, "skipped", message="not applicable")
        suite.set("tests", str(cases))
        suite.set("failures", str(failures))
    ElementTree.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)
