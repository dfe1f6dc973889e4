"""The padding-rows check: every attention call leaves the output rows of padding tokens
zero, as :meth:`~speccheck.contract.builder.AttentionImpl.forward` requires (they arrive
zero; the drafter's next layers read them as they are).

A padding row is a token past ``query_start_loc[num_reqs]`` of a padded pass or step: the
speculator's ``is_real_token`` is ``False`` there (real tokens are a prefix of the lanes).
No draft token, logit or KV slot of a real request depends on such a row, so the other
checks cannot see an impl that writes into it: a kernel that merges split partials into a
row it never attended, a tile loop that overruns the last real token. In an engine that
row is a real buffer's row: a NaN there reaches whatever later reduces over the rows.
"""

from __future__ import annotations

from typing import Any

import torch

from speccheck.checks.verify.comparisons import Outcome
from speccheck.checks.verify.vocabulary import Check, Result
from speccheck.contract.builder import AttentionImpl
from speccheck.speculator.base import DraftModelSpeculator


class _CountingImpl(AttentionImpl[Any]):
    """One layer's impl with, after its ``forward``, a count of the output rows of padding
    tokens that are not zero (a NaN is not zero) added to ``counts[layer]``.

    Capture-safe: tensor ops on persistent buffers only, so a captured graph counts on
    every replay; the count is read by the host after the run, never inside it."""

    def __init__(self, impl: AttentionImpl[Any], layer: int, counts: torch.Tensor,
                 is_real_token: torch.Tensor) -> None:
        super().__init__(impl.layer, impl.scale)
        self.impl = impl
        self.index = layer
        self.counts = counts
        self.is_real_token = is_real_token

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: Any,
                output: torch.Tensor) -> None:
        self.impl.forward(query, key, value, key_cache, value_cache, metadata, output)
        rows = output.shape[0]
        written = output.reshape(rows, -1).ne(0).any(dim=1)
        padding = torch.logical_not(self.is_real_token[:rows])
        self.counts[self.index].add_(torch.logical_and(written, padding).sum())


class PaddingRowsCheck:
    """The padding-row counts of every layer of ``speculator``, for every run after
    installation (graph replays included: install before capturing).

    Contract: construction wraps each layer's impl in ``speculator.layer_impls`` for good
    (probes installed later wrap these wrappers); :meth:`reset` before a run,
    :meth:`outcomes` after it (one host read)."""

    def __init__(self, speculator: DraftModelSpeculator) -> None:
        impls = speculator.layer_impls
        self.counts = torch.zeros(len(impls), dtype=torch.int64,
                                  device=speculator.is_real_token.device)
        impls[:] = [_CountingImpl(impl, layer, self.counts, speculator.is_real_token)
                    for layer, impl in enumerate(impls)]

    def reset(self) -> None:
        """Zero the counts (before a run)."""
        self.counts.zero_()

    def outcomes(self, candidate: str) -> list[Outcome]:
        """``padding_rows`` of the run since :meth:`reset`, by ``candidate``: failed with
        each layer that wrote a padding row and how many times, else passed."""
        counts = self.counts.tolist()
        written = [(layer, n) for layer, n in enumerate(counts) if n]
        if not written:
            return [Outcome(Check.PADDING_ROWS, Result.PASSED, candidate=candidate)]
        where = ", ".join(f"layer {layer}: {n}" for layer, n in written)
        return [Outcome(
            Check.PADDING_ROWS, Result.FAILED,
            f"{candidate}: the attention output of padding tokens (rows past "
            f"query_start_loc[num_reqs], which arrive zero) was written non-zero ({where} "
            "rows summed over the run's passes and steps); forward() must leave them zero",
            candidate)]
