"""Decode context parallelism (DCP): the KV cache of every request split across ranks.

Contract, with ``N = dcp_world_size``: token position ``p`` of every request lives on rank
``p % N`` at local position ``p // N`` (interleaved shares), so a request of ``L`` tokens
holds ``max(0, ceil((L - rank) / N))`` of them on rank ``rank``. Queries are replicated: every rank
attends them over its own share only and yields a *partial* output, normalised over the keys
it saw, with the natural-log log-sum-exp of those keys' scaled scores (``-inf`` where it saw
none); :func:`merge_partials` combines the ranks' partials into the attention over all keys.

Local lengths are step-dependent metadata: they advance with the global lengths, but only
on the rank that receives the new token, which is why a builder that does not refresh them
between draft steps computes the wrong attention (the reason backends gate fused drafting on
``dcp_world_size == 1``).

Every function is capture-safe: fixed shapes, no host synchronisation, nothing persistent
(:func:`merge_across_ranks` is a collective: capturable where its process group is, i.e.
NCCL). :class:`DcpLocalShare` holds a builder's persistent local lengths and slots.

A rank's local cache (the layout :class:`DcpLocalShare` writes and the backends read):
every rank has a paged KV cache of its own and uses each request's block table as it is.
The ``j``-th position a rank holds of a request (global position ``j * N + rank``) goes to
local position ``j``, i.e. slot ``block_table[r, j // block_size] * block_size + j %
block_size``: the rank's share of a request is dense, in the first ``ceil(local_len /
block_size)`` blocks of the row (vLLM's ``virtual_block_size = block_size * N`` layout at
interleave size 1). A token another rank stores writes the sink slot
(:data:`~speccheck.backends.kv_cache_write.SINK_SLOT`) instead, as padding tokens do.

Where a rank comes from: a backend with real DCP takes a
:class:`~speccheck.contract.dcp.DcpRank` at construction (its builder's keyword ``dcp``,
from whoever constructs the builders; the builder hands it to the impl). Without one, a config's
``dcp_world_size`` is a configuration value only and the backend attends its whole cache.
The one collective, :func:`merge_across_ranks`, takes the process group from it explicitly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

import torch
import torch.distributed as dist

from speccheck.backends.batch_layout import token_request_index
from speccheck.backends.kv_cache_write import SINK_SLOT
from speccheck.contract.builder import AttentionMetadataBuilder, BuilderLimits
from speccheck.contract.dcp import DcpRank
from speccheck.contract.metadata import CommonAttentionMetadata


def dcp_local_length_table(seq_lens: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's local lengths at once: ``[num_reqs, world]``, column ``r`` rank ``r``'s
    (``max(0, ceil((L - r) / world))``; rank 0 holds ``ceil(L / world)``), for a process that
    simulates all the ranks (``triton_mla``)."""
    ranks = torch.arange(world, device=seq_lens.device, dtype=seq_lens.dtype)
    return ((seq_lens[:, None] - ranks[None, :] + world - 1) // world).clamp(min=0)


def merge_partials(outputs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """The attention over all ranks' keys from each rank's partial: ``outputs`` ``[N, T, H, D]``
    and ``lses`` ``[N, T, H]``, fp32, rank ``k``'s output normalised over its own keys and
    ``lses[k]`` their log-sum-exp.

    ``lse = logsumexp_k lses[k]`` and ``out = sum_k exp(lses[k] - lse) * outputs[k]``. A rank
    whose ``lse`` is ``-inf`` (it saw no key) contributes nothing whatever its output holds;
    rows that no rank saw give zeros, never NaN (their weights are NaN, and all masked).
    Returns ``[T, H, D]`` fp32.
    """
    weights = torch.exp(lses - torch.logsumexp(lses, dim=0))[..., None]
    return torch.where(torch.isneginf(lses)[..., None], 0.0, weights * outputs).sum(dim=0)


def merge_across_ranks(out: torch.Tensor, lse: torch.Tensor, dcp: DcpRank) -> torch.Tensor:
    """The attention over every rank's keys from this rank's partial: ``out`` ``[T, H, D]``
    (normalised over this rank's keys) and ``lse`` ``[T, H]`` (their log-sum-exp, ``-inf``
    where it saw none), both fp32, as every rank of ``dcp.group`` calls it with its own.

    One ``all_gather`` over ``dcp.group`` of both packed together, then
    :func:`merge_partials`; every rank returns the same ``[T, H, D]`` fp32 (zeros for rows no
    rank saw). A collective: every rank calls it with the same ``T``. Capture-safe with a
    group that can be captured (NCCL): fixed shapes, no host synchronisation; the gathered
    copies are temporaries.
    """
    if dcp.world_size == 1:
        return merge_partials(out.float()[None], lse.float()[None])
    packed = torch.cat([out.float(), lse.float()[..., None]], dim=-1).contiguous()
    gathered = packed.new_empty((dcp.world_size, *packed.shape))
    dist.all_gather(list(gathered.unbind(0)), packed, group=dcp.group)
    return merge_partials(gathered[..., :-1], gathered[..., -1])


def group_capturable(group: dist.ProcessGroup | None) -> bool:
    """Whether a CUDA graph can capture :func:`merge_across_ranks` over ``group``: true
    when CUDA is available and the group runs collectives on CUDA tensors through NCCL
    (``"nccl"``, or a ``"cpu:gloo,cuda:nccl"`` style group), and for ``None`` (a single
    rank gathers nothing). Gloo collectives cannot be captured, and a process group shared
    by several ranks on one GPU cannot be NCCL (NCCL refuses duplicate devices), so both
    give false: such ranks run the fused refresh eagerly. Host call, no communication."""
    if group is None:
        return True
    if not torch.cuda.is_available():
        return False
    return _cuda_backend(dist.get_backend_config(group)) == "nccl"


def _cuda_backend(config: str) -> str | None:
    """The backend of CUDA tensors in a process group's backend config: ``"nccl"`` for
    ``"cpu:gloo,cuda:nccl"``; a config naming one backend without devices (``"gloo"``)
    uses it for every device."""
    mapping = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
    if not mapping:
        return config.strip() or None
    return mapping.get("cuda")


def write_dcp_local_lengths(
    seq_lens: torch.Tensor, rank: int, world: int, out: torch.Tensor
) -> None:
    """How many of each request's positions ``< seq_lens`` rank ``rank`` of ``world`` holds,
    written into ``out`` (same shape, integer dtype), in place and without temporaries:
    ``(L - rank + world - 1) // world`` (never negative for ``L >= 0``). Capture-safe."""
    torch.sub(seq_lens, rank - world + 1, out=out)
    out.floor_divide_(world)
    out.clamp_(min=0)


def write_dcp_slot_mapping(
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    rank: int,
    world: int,
    out: torch.Tensor,
) -> None:
    """Where each of the ``out.shape[0]`` tokens writes its KV on rank ``rank`` of
    ``world`` (the module's local layout), into ``out`` (int64) in place: a real token at a
    global position ``p`` with ``p % world == rank`` writes local position ``p // world`` of
    its request's block-table row; padding tokens (past ``query_start_loc[-1]``) and tokens
    of other ranks write :data:`~speccheck.backends.kv_cache_write.SINK_SLOT`.

    ``positions`` are the tokens' global positions (the speculator's, advanced in place by
    draft steps), ``query_start_loc`` ``[num_reqs + 1]`` and ``block_table`` ``[num_reqs,
    *]`` the batch's. Capture-safe: gathers and one in-place copy (the intermediates are
    temporaries), no host values but shapes.
    """
    num_tokens, num_reqs = out.shape[0], block_table.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        out.fill_(SINK_SLOT)
        return
    req = token_request_index(query_start_loc, num_tokens)
    real = req < num_reqs
    req = req.clamp(max=num_reqs - 1).long()
    pos = positions[:num_tokens]
    local = torch.div(pos, world, rounding_mode="floor")
    block = block_table[req, torch.div(local, block_size, rounding_mode="floor")].long()
    slot = block * block_size + local % block_size
    out.copy_(torch.where(real & (pos % world == rank), slot, SINK_SLOT))


class DcpLocalShare:
    """A DCP rank's step-dependent view of each batch, in two persistent buffers that its
    builder allocates once (through
    :meth:`~speccheck.contract.builder.AttentionMetadataBuilder.allocate_persistent`, so
    they are guarded) and whose tails past the batch stay zero:

    - ``dcp_local_seq_lens`` ``[max_num_reqs]`` int32: positions each request holds on this
      rank (:func:`write_dcp_local_lengths` of the global ``seq_lens``);
    - ``dcp_slot_mapping`` ``[max_num_tokens]`` int64: where each token writes its KV in
      this rank's cache (:func:`write_dcp_slot_mapping`; the sink, slot 0, in the tail).

    :meth:`bind` writes both for a batch and returns the views the metadata holds;
    :meth:`refresh_lengths` and :meth:`refresh_slots` recompute them in place from the
    speculator's advanced ``seq_lens`` and ``positions``, tails included, so a refresh
    leaves what :meth:`bind` would (capture-safe, so a builder calls them from
    ``update_draft_decode_metadata``, before the first draft step too).
    """

    LENGTHS = "dcp_local_seq_lens"
    SLOTS = "dcp_slot_mapping"

    def __init__(
        self,
        dcp: DcpRank,
        allocate: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor],
        limits: BuilderLimits,
        block_size: int,
    ) -> None:
        self.dcp = dcp
        self.block_size = block_size
        self.local_seq_lens = allocate(self.LENGTHS, (limits.max_num_reqs,), torch.int32)
        self.slot_mapping = allocate(self.SLOTS, (limits.max_num_tokens,), torch.int64)

    @classmethod
    def for_builder(
        cls, builder: AttentionMetadataBuilder[Any], dcp: DcpRank | None
    ) -> DcpLocalShare | None:
        """The share of ``builder`` (allocated through it) when ``dcp`` spans more than one
        rank, else ``None``. Raises ``ValueError`` when ``dcp`` disagrees with the builder's
        ``config.dcp_world_size`` or with its process group."""
        if dcp is None:
            return None
        if dcp.world_size != builder.config.dcp_world_size:
            raise ValueError(f"DCP rank of a world of {dcp.world_size} for a config with "
                             f"dcp_world_size={builder.config.dcp_world_size}")
        if dcp.world_size == 1:
            return None
        dcp.check_group()
        return cls(dcp, builder.allocate_persistent, builder.limits, builder.layer.block_size)

    def bind(self, common: CommonAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dcp_local_seq_lens, slot_mapping)`` for ``common``: the first ``num_reqs`` and
        ``num_actual_tokens`` rows of the buffers, written for ``common``'s step; the rows
        past them are zeroed. Host work (build time)."""
        n, t = common.num_reqs, common.num_actual_tokens
        lens, slots = self.local_seq_lens[:n], self.slot_mapping[:t]
        self.refresh_lengths(common.seq_lens, lens)
        self.refresh_slots(common.positions, common.query_start_loc, common.block_table, slots)
        return lens, slots

    def refresh_lengths(self, seq_lens: torch.Tensor, local_seq_lens: torch.Tensor) -> None:
        """Recompute ``local_seq_lens`` (a view :meth:`bind` returned) from the global
        ``seq_lens`` in place, without temporaries, and zero the buffer past it.
        Capture-safe."""
        write_dcp_local_lengths(seq_lens, self.dcp.rank, self.dcp.world_size, local_seq_lens)
        self.local_seq_lens[local_seq_lens.shape[0]:].zero_()

    def refresh_slots(
        self, positions: torch.Tensor, query_start_loc: torch.Tensor, block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Recompute ``slot_mapping`` (a view :meth:`bind` returned) from the tokens' global
        ``positions`` in place, and set the buffer past it to the sink. Capture-safe."""
        write_dcp_slot_mapping(positions, query_start_loc, block_table, self.block_size,
                               self.dcp.rank, self.dcp.world_size, slot_mapping)
        self.slot_mapping[slot_mapping.shape[0]:].fill_(SINK_SLOT)

    def extents(self, local_seq_lens: torch.Tensor, slot_mapping: torch.Tensor) -> dict[str, int]:
        """Rows of each buffer a metadata object uses (its views' lengths); the tail past
        them is zero (``SINK_SLOT`` is slot 0)."""
        return {self.LENGTHS: local_seq_lens.shape[0], self.SLOTS: slot_mapping.shape[0]}


class DcpShareMetadata(Protocol):
    """What the metadata of a builder holding a DCP share carries (read-only here)."""

    @property
    def positions(self) -> torch.Tensor | None: ...
    @property
    def query_start_loc(self) -> torch.Tensor: ...
    @property
    def block_table(self) -> torch.Tensor: ...
    @property
    def slot_mapping(self) -> torch.Tensor: ...
    @property
    def seq_lens(self) -> torch.Tensor: ...
    @property
    def dcp_local_seq_lens(self) -> torch.Tensor | None: ...


ShareMetadataT = TypeVar("ShareMetadataT", bound=DcpShareMetadata)


class HoldsDcpShare(Generic[ShareMetadataT]):
    """The refresh of a builder whose metadata (:class:`DcpShareMetadata`) views a
    :class:`DcpLocalShare` (``dcp_share``, ``None`` without DCP). Without DCP the refresh has
    nothing to do: lengths, slots and offsets are views of persistent buffers the speculator
    advances in place, read by the kernels at run time. Under DCP the local slots and lengths
    are recomputed in place (:meth:`refresh_dcp_slots`, :meth:`refresh_dcp_lengths`).
    Capture-safe."""

    dcp_share: DcpLocalShare | None

    def update_draft_decode_metadata(self, metadata: ShareMetadataT) -> None:
        self.refresh_dcp_slots(metadata)
        self.refresh_dcp_lengths(metadata)

    def refresh_dcp_slots(self, metadata: ShareMetadataT) -> None:
        """Under DCP: ``slot_mapping`` recomputed in place from ``positions``."""
        if self.dcp_share is not None:
            assert metadata.positions is not None
            self.dcp_share.refresh_slots(metadata.positions, metadata.query_start_loc,
                                         metadata.block_table, metadata.slot_mapping)

    def refresh_dcp_lengths(self, metadata: ShareMetadataT) -> None:
        """Under DCP: ``dcp_local_seq_lens`` recomputed in place from ``seq_lens``."""
        if self.dcp_share is not None:
            assert metadata.dcp_local_seq_lens is not None
            self.dcp_share.refresh_lengths(metadata.seq_lens, metadata.dcp_local_seq_lens)

    def persistent_buffer_extents(self, metadata: ShareMetadataT) -> Mapping[str, int]:
        """Under DCP: the rows of the local lengths and slots the batch uses."""
        if self.dcp_share is None or metadata.dcp_local_seq_lens is None:
            return {}
        return self.dcp_share.extents(metadata.dcp_local_seq_lens, metadata.slot_mapping)
