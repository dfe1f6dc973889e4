"""What a speculator is asked to draft for, and what it returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from speccheck.contract.builder import blocks_for


@dataclass(frozen=True)
class DraftBatch:
    """One propose call.

    Request ``r`` already has ``context_lens[r]`` tokens in the drafter's KV cache; the
    prefill-style pass runs its ``new_tokens[r]`` (the tokens the target just accepted, at
    least one) and samples draft token 0 from the last of them. Its KV lives in the physical
    blocks ``block_table[r]`` (block 0 is the sink and is never live). ``seeds[r]`` keys the
    Gumbel noise of seeded sampling.
    """

    context_lens: tuple[int, ...]
    new_tokens: tuple[tuple[int, ...], ...]
    block_table: tuple[tuple[int, ...], ...]
    seeds: tuple[int, ...]

    @property
    def num_reqs(self) -> int:
        return len(self.context_lens)

    def validate(
        self,
        *,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        extra_positions: int,
        max_num_reqs: int,
    ) -> RequestArrays:
        """The batch's :class:`RequestArrays`, or ``ValueError`` naming the request and
        field that cannot be served.

        ``extra_positions``: positions the drafter writes past the new tokens (K - 1 decode
        steps for an autoregressive drafter, K for a DFlash block); the block-table rows
        must cover them up to the ``max_model_len`` clamp.

        Every propose call pays for this on the host: the whole batch is checked with a
        few array operations, and only a batch that fails them is walked request by
        request for the message; the arrays it builds for the checks are the ones the
        call stages."""
        n = self.num_reqs
        if not 1 <= n <= max_num_reqs:
            raise ValueError(f"batch has {n} requests; this speculator serves 1..{max_num_reqs}")
        for name in ("new_tokens", "block_table", "seeds"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} rows, expected {n}")
        q, ctx = row_lengths(self.new_tokens), np.array(self.context_lens, dtype=np.int64)
        lengths = row_lengths(self.block_table)
        needed = np.minimum(ctx + q - 1 + extra_positions, max_model_len - 1) // block_size + 1
        flat = flattened(self.block_table, lengths)
        blocks = np.sort(flat)
        if (q.min() < 1 or ctx.min() < 0 or (ctx + q).max() > max_model_len
                or lengths.max() > blocks_for(max_model_len, block_size)
                or (lengths < needed).any()
                or (blocks.size and (blocks[0] < 1 or blocks[-1] >= num_blocks))):
            self._raise_first_problem(max_model_len, block_size, num_blocks, extra_positions)
        if (blocks[1:] == blocks[:-1]).any():
            raise ValueError("block_table rows share physical blocks")
        width = int(lengths.max())
        table = np.zeros((n, width), dtype=np.int64)
        table[np.arange(width) < lengths[:, None]] = flat
        return RequestArrays(ctx, q, table, np.asarray(self.seeds, dtype=np.int64))

    def _raise_first_problem(self, max_model_len: int, block_size: int, num_blocks: int,
                             extra_positions: int) -> None:
        """Walk the requests in order and raise for the first one that cannot be served."""
        max_blocks = blocks_for(max_model_len, block_size)
        for r in range(self.num_reqs):
            q, ctx = len(self.new_tokens[r]), self.context_lens[r]
            if q < 1 or ctx < 0:
                raise ValueError(f"request {r}: needs >= 1 new token and context >= 0")
            if ctx + q > max_model_len:
                raise ValueError(
                    f"request {r}: context {ctx} + new {q} exceeds max_model_len {max_model_len}"
                )
            row = self.block_table[r]
            last_pos = min(ctx + q - 1 + extra_positions, max_model_len - 1)
            needed = last_pos // block_size + 1
            if len(row) > max_blocks or len(row) < needed:
                raise ValueError(
                    f"request {r}: block_table row has {len(row)} blocks, needs {needed}..{max_blocks}"
                )
            if min(row) < 1 or max(row) >= num_blocks:
                raise ValueError(f"request {r}: block ids must lie in 1..{num_blocks - 1}")


@dataclass(frozen=True)
class RequestArrays:
    """A validated batch's per-request host arrays, built once per call by
    :meth:`DraftBatch.validate` and staged from there (every propose pays for them on the
    host)."""

    context_lens: np.ndarray
    """``[R]`` int64."""
    query_lens: np.ndarray
    """``[R]`` int64: new tokens per request."""
    block_table: np.ndarray
    """``[R, longest row]`` int64: each request's block-table row, zero past its end."""
    seeds: np.ndarray
    """``[R]`` int64."""


def row_lengths(rows: Sequence[Sequence[int]]) -> np.ndarray:
    """The lengths of ``rows`` as int64."""
    return np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))


def flattened(rows: Sequence[Sequence[int]], lengths: np.ndarray) -> np.ndarray:
    """``rows`` end to end as int64 (``lengths``: their :func:`row_lengths`)."""
    return np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))


@dataclass(frozen=True)
class DraftResult:
    """``draft_tokens`` ``[R, K]`` int64 and fp32 ``logits`` ``[R, K, vocab]``, on the host."""

    draft_tokens: torch.Tensor
    logits: torch.Tensor
