"""Which positions of each request a process's KV cache holds, and where: the verifier's own
host-side statement of the layout, independent of the backends' device code.

Without decode context parallelism (DCP) a process holds every position ``p`` of a request
at ``p`` of its block-table row. As DCP rank ``rank`` of ``world`` (the interleaved layout
of :mod:`speccheck.backends.dcp`) it holds the positions ``p`` with ``p % world == rank``,
densely, at local position ``p // world`` of the same row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speccheck.speculator.batch import DraftBatch

KVSnapshot = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, host or device copies of the key and value caches (``[blocks, block_size,
...]``; an MLA layer's value tensor is empty)."""


@dataclass(frozen=True)
class KvShare:
    """The positions a KV cache holds: DCP rank ``rank`` of ``world`` (``world == 1``: every
    position, :data:`WHOLE_CACHE`)."""

    rank: int = 0
    world: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is not in [0, {self.world})")

    def local(self, position: int) -> int | None:
        """Where this cache holds ``position`` of a request (an index into its block-table
        row), or ``None`` when another rank holds it."""
        if position % self.world != self.rank:
            return None
        return position // self.world

    def position(self, local: int) -> int:
        """The request position held at ``local`` of its row (inverse of :meth:`local`)."""
        return local * self.world + self.rank

    def slot(self, row: tuple[int, ...], position: int, block_size: int) -> int | None:
        """The cache slot of ``position`` of the request whose block-table row is ``row``,
        or ``None`` when another rank holds it."""
        local = self.local(position)
        if local is None:
            return None
        return row[local // block_size] * block_size + local % block_size


WHOLE_CACHE = KvShare()
"""A cache that holds every position (no DCP)."""


def whole_cache_start(
    start: KVSnapshot, batch: DraftBatch, block_size: int, world: int
) -> KVSnapshot:
    """The start state of one process holding every position that ``world`` DCP ranks hold
    together, when every rank's cache starts as ``start`` (the verifier fills each rank's
    cache with the same noise, seeded by the example): each context position ``p`` of each
    request is copied from the local slot its rank keeps it in to its slot in the whole
    cache. Other slots keep ``start``'s values (the run writes the new positions itself).
    Returns new tensors on ``start``'s device; ``world == 1`` returns ``start``."""
    if world == 1:
        return start
    device = start[0][0].device
    whole_slots, local_slots = [], []
    for context, row in zip(batch.context_lens, batch.block_table, strict=True):
        positions = torch.arange(context, device=device)
        blocks = torch.tensor(row, device=device, dtype=torch.long)
        local = positions // world
        whole_slots.append(blocks[positions // block_size] * block_size + positions % block_size)
        local_slots.append(blocks[local // block_size] * block_size + local % block_size)
    to, source = torch.cat(whole_slots), torch.cat(local_slots)
    out: KVSnapshot = []
    for keys, values in start:
        pair = []
        for tensor in (keys, values):
            copy = tensor.clone()
            if tensor.numel():
                copy.flatten(0, 1)[to] = tensor.flatten(0, 1)[source]
            pair.append(copy)
        out.append((pair[0], pair[1]))
    return out
