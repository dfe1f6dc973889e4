"""``speccheck selftest``: the verifier must catch every mutant with the check meant for it,
and must pass the correct control builder."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer
from rich.console import Console
from rich.table import Table

from speccheck.checks.selftest.mutants import MUTANTS, DerivedBuilder
from speccheck.checks.verify.engine import BackendVerifier, VerifySettings
from speccheck.checks.verify.report import BackendReport
from speccheck.contract.builder import AttentionMetadataBuilder
from speccheck.contract.runtime_config import RuntimeConfig

CPU_CONFIG = RuntimeConfig(platform="cpu", cudagraph_mode="none", block_size=4, max_model_len=32,
                           dtype="float32", head_size=16, num_heads=2, num_kv_heads=1)


@dataclass
class SelftestResult:
    name: str
    expected_check: str
    caught: bool
    detail: str
    recreates: str


def verify_builder(
    builder: type[AttentionMetadataBuilder],  # type: ignore[type-arg]
    device: torch.device,
    examples: int = 12,
    shrink_seconds: float = 120.0,
) -> BackendReport:
    """Verify the reference backend with ``builder`` swapped in (small drafter, K = 4)."""
    gpu = device.type == "cuda"
    config = CPU_CONFIG.model_copy(
        update={"platform": "cuda", "cudagraph_mode": "full"} if gpu else {}
    )
    settings = VerifySettings("reference", config, examples=examples, steps=(4,), capture_sizes=(2, 4),
                              vocab_size=64, builder_overrides=(("reference", builder),),
                              shrink_seconds=shrink_seconds)
    report = BackendReport("reference", "gpu" if gpu else "cpu", "passed")
    BackendVerifier(settings, device).run(report, lambda i, e: None)
    return report


def run_selftest(device: torch.device) -> list[SelftestResult]:
    gpu = device.type == "cuda"
    control = verify_builder(DerivedBuilder, device)
    results = [SelftestResult(
        "control (correct builder)", "-", control.status == "passed",
        "passed" if control.status == "passed" else f"{control.failures[0].check}: {control.failures[0].diagnosis}",
        "none: must pass",
    )]
    for mutant in MUTANTS:
        check, phrase = mutant.expected(gpu)
        report = verify_builder(mutant.builder, device)
        hits = [f for f in report.failures if f.check == check and phrase in f.diagnosis]
        detail = hits[0].diagnosis if hits else (
            "not caught" if not report.failures else
            f"caught by {report.failures[0].check} instead: {report.failures[0].diagnosis}")
        results.append(SelftestResult(mutant.name, check, bool(hits), detail, mutant.recreates))
    return results


def selftest_command(
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the results here.")] = None,
) -> None:
    """Prove the verifier catches every known-bad builder (exit 1 if one slips through)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    console = Console(highlight=False)
    results = run_selftest(device)
    table = Table(title=f"speccheck selftest ({'GPU, real graphs' if device.type == 'cuda' else 'CPU tier'})")
    for column in ("mutant", "must be caught by", "result", "re-creates"):
        table.add_column(column)
    for r in results:
        table.add_row(r.name, r.expected_check, "ok" if r.caught else "MISSED", r.recreates)
    console.print(table)
    for r in results:
        if not r.caught:
            console.print(f"MISSED {r.name}: {r.detail}", markup=False)
    if json_path:
        json_path.write_text(json.dumps([asdict(r) for r in results], indent=2))
    if not all(r.caught for r in results):
        raise typer.Exit(1)
