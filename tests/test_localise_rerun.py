"""A divergence from the fp32 reference that a re-run from the same start state does not
repeat says which side drafted otherwise the first time."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from speccheck.checks.verify.localise import FirstRunTokens, localise_reference_divergence
from speccheck.speculator.batch import DraftBatch, DraftResult

BATCH = DraftBatch((0, 0), ((0,), (0,)), ((1,), (2,)), (0, 0))
TOKENS = torch.tensor([[3, 4], [3, 4]])
LOGITS = torch.zeros(2, 2, 8)


class _Replay:
    """A speculator whose every propose drafts ``TOKENS`` (what the re-run sees)."""

    kv_cache = SimpleNamespace(restore=lambda start: None)

    def propose(self, batch: DraftBatch, *args: Any, **kwargs: Any) -> DraftResult:
        return DraftResult(TOKENS.clone(), LOGITS.clone())


def _localised(first_run: FirstRunTokens | None) -> str:
    return localise_reference_divergence(
        _Replay(), _Replay(), BATCH, 2, lambda: None,  # type: ignore[arg-type]
        block_size=4, max_model_len=64, tol=1e-4, first_run=first_run)


def test_the_side_whose_first_run_drafted_otherwise_is_named() -> None:
    odd = TOKENS.clone()
    odd[:, 0] = 88
    assert _localised(FirstRunTokens(odd, TOKENS.clone())).endswith(
        "; the first run differs from the re-run in the oracle's (2 of 4 tokens) draft tokens")
    assert _localised(FirstRunTokens(TOKENS.clone(), odd)).endswith(
        "in the fp32 reference's (2 of 4 tokens) draft tokens")
    assert _localised(FirstRunTokens(TOKENS.clone(), TOKENS.clone())).endswith(
        "each re-run drafted the tokens of its first run (they parted in the logits)")
    assert _localised(None).endswith("(the divergence depends on state the start state "
                                     "does not set)")
