"""The probed refresh: a :class:`RefreshProbe` records each refresh call's findings, hands
them back once as a value, and turns a raising refresh into a finding that ends the run."""

from __future__ import annotations

import pytest
import torch

from speccheck.backends.reference.builder import ReferenceMetadata
from speccheck.checks.selftest.mutants import DerivedBuilder, declaring_matrix
from speccheck.checks.verify.context import MatrixContext
from speccheck.checks.verify.engine import VerifySettings
from speccheck.checks.verify.harness import HarnessSet
from speccheck.checks.verify.refresh_probe import RefreshProbe, RefreshRaised
from speccheck.checks.verify.vocabulary import Check, Result
from speccheck.contract.builder import AttentionMetadataBuilder
from speccheck.contract.matrix_loader import load_matrix
from speccheck.speculator.autoregressive import AutoregressiveSpeculator, DecodePath
from speccheck.speculator.batch import DraftBatch
from tests.fixtures.configs import CPU_CONFIG

K = 4
BATCH = DraftBatch((5, 2), ((1, 2), (3,)), ((1, 2, 3), (4, 5, 6)), (0, 0))
"""Two requests whose lengths cross a block boundary during the draft steps."""


class RaisingRefresh(DerivedBuilder):
    def update_draft_decode_metadata(self, metadata: ReferenceMetadata) -> None:
        raise ValueError("no refresh today")


def _speculator(builder: type[AttentionMetadataBuilder]) -> AutoregressiveSpeculator:  # type: ignore[type-arg]
    shipped = load_matrix(None)
    matrices = MatrixContext(declaring_matrix(shipped, ("kv_lens_plus_one",)), None, shipped)
    settings = VerifySettings("reference", CPU_CONFIG, steps=(K,), capture_sizes=(2, 4),
                              vocab_size=64, builder_overrides=(("reference", builder),),
                              matrices=matrices)
    spec = HarnessSet(settings, torch.device("cpu")).harness(K).spec
    assert spec.use_fused_multi_step_decode
    return spec


def test_a_probe_returns_each_refresh_calls_findings_once() -> None:
    spec = _speculator(DerivedBuilder)
    probe = RefreshProbe("fused_eager", poison_before_first_refresh=False,
                         cuda_sync_debug=False)
    spec.refresh_hook = probe
    spec.propose(BATCH, DecodePath.FUSED, use_graphs=False)
    outcomes = probe.outcomes()
    refreshes = (K - 2) * len(spec.groups)  # between decode steps 1..K-1, per group
    assert [o.check for o in outcomes] == [Check.REFRESH_ERROR, Check.HOST_SYNC,
                                           Check.IN_PLACE] * refreshes
    assert {(o.result, o.candidate) for o in outcomes} == {(Result.PASSED, "fused_eager")}
    with pytest.raises(RuntimeError, match="read already"):
        probe.outcomes()
    with pytest.raises(RuntimeError, match="create a probe per run"):
        spec.propose(BATCH, DecodePath.FUSED, use_graphs=False)


def test_a_raising_refresh_is_a_finding_that_ends_the_run() -> None:
    spec = _speculator(RaisingRefresh)
    probe = RefreshProbe("fused_eager", poison_before_first_refresh=False,
                         cuda_sync_debug=False)
    spec.refresh_hook = probe
    with pytest.raises(RefreshRaised):
        spec.propose(BATCH, DecodePath.FUSED, use_graphs=False)
    [outcome] = probe.outcomes()
    assert (outcome.check, outcome.result) == (Check.REFRESH_ERROR, Result.FAILED)
    assert "the refresh raised ValueError: no refresh today" in outcome.diagnosis
