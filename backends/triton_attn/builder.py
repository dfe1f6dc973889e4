"""Metadata builder and impl of the ``triton_attn`` backend.

Refresh strategy ``none_needed``: the metadata holds only views of the speculator's
persistent input buffers and of this builder's persistent split-KV scratch, and the kernels
read lengths, offsets and block ids from those buffers at run time with value-independent
grids. A draft step that advances ``seq_lens`` / ``slot_mapping`` in place is therefore
seen by the next replay without any refresh work.

Under decode context parallelism (a builder given a
:class:`~speccheck.contract.dcp.DcpRank` of more than one rank) this process is one DCP
rank: its cache holds the rank's interleaved share, the split kernel attends that share
(bounded by the step-dependent ``dcp_local_seq_lens``), the reduction also emits the
log-sum-exp, and the impl merges every rank's partials. The local lengths and KV slots live
in the builder's :class:`~speccheck.backends.dcp.DcpLocalShare` and the refresh recomputes
them in place (``in_graph``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
import triton

from speccheck.backends.dcp import DcpLocalShare, HoldsDcpShare, merge_across_ranks
from speccheck.backends.kv_cache_write import write_kv_cache
from speccheck.backends.triton_attn.kernels import (
    LOG2E,
    paged_attention_reduce_kernel,
    paged_attention_split_kernel,
)
from speccheck.contract.builder import (
    AttentionImpl,
    AttentionLayerSpec,
    AttentionMetadataBuilder,
    BufferAllocator,
    BuilderLimits,
    zeros_allocator,
)
from speccheck.contract.dcp import DcpRank
from speccheck.contract.dependent_launch import dependent_launch
from speccheck.contract.metadata import CommonAttentionMetadata
from speccheck.contract.runtime_config import RuntimeConfig

MIN_KV_PER_SPLIT = 512
"""Fewest KV positions per split at ``max_model_len``: shorter splits cost more in the
reduction than they win in parallelism."""
MAX_KV_SPLITS = 16
SCRATCH_BUDGET_BYTES = 256 * 2**20
"""Upper bound on the split-KV scratch; fewer splits are used when it would be exceeded."""
KV_TILE = 32
"""KV positions per inner-loop tile (``BLOCK_N``); at least 16, as ``tl.dot`` requires."""


def default_num_kv_splits(
    layer: AttentionLayerSpec, limits: BuilderLimits, width: int | None = None
) -> int:
    """Splits per query block: enough that a ``max_model_len`` sequence is cut into runs of
    at least :data:`MIN_KV_PER_SPLIT` positions, at most :data:`MAX_KV_SPLITS`, and few
    enough that the scratch for ``limits.max_num_tokens`` fits :data:`SCRATCH_BUDGET_BYTES`.
    ``width`` is the accumulator's last dimension (``head_size`` unless given; an MLA
    kernel accumulates ``kv_lora_rank`` channels)."""
    width = layer.head_size if width is None else width
    by_length = min(MAX_KV_SPLITS, triton.cdiv(layer.max_model_len, MIN_KV_PER_SPLIT))
    bytes_per_split = max(1, limits.max_num_tokens) * layer.num_heads * (width + 2) * 4
    return max(1, min(by_length, SCRATCH_BUDGET_BYTES // bytes_per_split))


@dataclass(frozen=True)
class SplitKVScratch:
    """The builder's persistent split-KV workspace (fp32, allocated once, never resized).

    - ``part_max``: ``[max_num_tokens, num_heads, num_splits]``, running maximum of the
      scaled scores, log2 domain.
    - ``part_sum``: same shape, softmax denominator relative to ``part_max``.
    - ``part_acc``: ``[max_num_tokens, num_heads, num_splits, width]``, value sum relative
      to ``part_max`` (``width`` is ``head_size``; the ``triton_mla`` backend, which shares
      this scratch and the reduction kernel, accumulates ``kv_lora_rank`` channels).

    Contents are transient: every forward writes all partials of its real tokens before the
    reduction reads them, and never reads rows of padding tokens, so stale or unzeroed
    contents (tails included) cannot reach the output.
    """

    part_max: torch.Tensor
    part_sum: torch.Tensor
    part_acc: torch.Tensor

    @classmethod
    def allocate(
        cls, num_tokens: int, num_heads: int, num_splits: int, width: int, device: torch.device
    ) -> SplitKVScratch:
        """Zeroed partials for ``num_tokens`` tokens of ``num_heads`` heads, each
        accumulating ``width`` channels (``head_size`` here; ``kv_lora_rank`` for MLA)."""
        rows = (num_tokens, num_heads, num_splits)
        return cls(
            part_max=torch.zeros(rows, dtype=torch.float32, device=device),
            part_sum=torch.zeros(rows, dtype=torch.float32, device=device),
            part_acc=torch.zeros(*rows, width, dtype=torch.float32, device=device),
        )

    def as_workspace(self) -> dict[str, torch.Tensor]:
        """The three partial buffers by name (what ``workspace_buffers`` reports)."""
        return {"part_max": self.part_max, "part_sum": self.part_sum, "part_acc": self.part_acc}

    @property
    def num_splits(self) -> int:
        return self.part_max.shape[2]

    @property
    def max_num_tokens(self) -> int:
        return self.part_max.shape[0]

    def reduce_into(
        self, output: torch.Tensor, query_start_loc: torch.Tensor, num_reqs: int,
        num_tokens: int, lse: torch.Tensor | None = None,
    ) -> None:
        """Merge every split's partials of the first ``num_tokens`` rows into ``output``
        (``[T, heads, width]``, last dimension contiguous), zeros for padding tokens (those
        at or past ``query_start_loc[num_reqs]``): one capture-safe launch whose grid
        depends on shapes only. With ``lse`` (fp32 ``[T, heads]``) also each row's
        natural-log log-sum-exp, ``-inf`` where it saw no key."""
        num_heads, width = output.shape[1], output.shape[2]
        paged_attention_reduce_kernel[(num_tokens, num_heads)](
            output,
            self.part_max,
            self.part_sum,
            self.part_acc,
            output if lse is None else lse,
            query_start_loc,
            num_reqs,
            output.stride(0),
            output.stride(1),
            0 if lse is None else lse.stride(0),
            0 if lse is None else lse.stride(1),
            NUM_HEADS=num_heads,
            HEAD_SIZE=width,
            NUM_SPLITS=self.num_splits,
            SPLITS_P=triton.next_power_of_2(self.num_splits),
            WRITE_LSE=lse is not None,
        )


@dataclass
class TritonAttnMetadata:
    """Views of the speculator's persistent buffers plus the builder's scratch; without
    decode context parallelism nothing is derived from tensor values, so nothing is step
    dependent.

    ``max_query_len`` only picks the query-block size (a performance choice): any value
    gives correct results for any query lengths the buffers hold at replay time.

    Under DCP ``slot_mapping`` and ``dcp_local_seq_lens`` are views of the builder's
    :class:`~speccheck.backends.dcp.DcpLocalShare`: this rank's local KV slots and local
    lengths, step dependent, recomputed by the refresh from ``seq_lens`` and ``positions``.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    """Where each token writes its KV in the cache this process holds."""
    num_actual_tokens: int
    max_query_len: int
    causal: bool
    scratch: SplitKVScratch
    positions: torch.Tensor | None = None
    """The tokens' global positions (a view of the speculator's buffer)."""
    dcp_local_seq_lens: torch.Tensor | None = None
    """``[num_reqs]`` int32: positions of each request this rank's cache holds; without DCP
    ``seq_lens`` itself (the same tensor). ``None`` reads as ``seq_lens``."""
    split_arrivals: torch.Tensor | None = None
    """int32, one counter per (program slot, KV head) of the split kernel, zero between
    launches (persistent): how many splits of a query block have stored their partials,
    so that the last one merges them (without DCP). ``None``: a separate reduction."""


class TritonAttnImpl(AttentionImpl[TritonAttnMetadata]):
    """Split-KV paged attention in one Triton launch: each split stores its partials, and
    the last split of a query block to store them (counted in ``split_arrivals``) merges
    them into the output; programs past the last request zero the padding rows. Without
    ``split_arrivals``, or under DCP, the merge is a second launch (the reduction kernel).

    Capture-safe: two in-place cache scatters and one or two kernel launches whose grids
    depend on shapes only; no allocation, no host synchronisation.

    With ``dcp`` (more than one rank) the cache holds this rank's interleaved share: the
    kernels compute its partial attention and log-sum-exp into fp32 temporaries, and the
    impl writes the merge of every rank's partials
    (:func:`~speccheck.backends.dcp.merge_across_ranks`, a collective), so every rank
    returns the attention over the whole context.
    """

    def __init__(self, layer: AttentionLayerSpec, scale: float, dcp: DcpRank | None = None) -> None:
        super().__init__(layer, scale)
        self.dcp = dcp if dcp is not None and dcp.world_size > 1 else None

    max_query_block: int = 16
    """Upper bound on ``BLOCK_M``, the query tokens of one request a program handles."""
    max_rows: int = 64
    """Upper bound on ``BLOCK_M * GROUP_P`` (rows of one program's score tile), unless the
    padded head group alone is larger."""

    def query_block(self, max_query_len: int, group_p: int) -> int:
        """``BLOCK_M``: a power of two covering ``max_query_len`` within the two caps."""
        block = triton.next_power_of_2(max(1, max_query_len))
        return max(1, min(block, self.max_query_block, self.max_rows // group_p))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: TritonAttnMetadata,
        output: torch.Tensor,
    ) -> None:
        n = metadata.num_actual_tokens
        scratch = metadata.scratch
        if n > scratch.max_num_tokens:
            raise ValueError(
                f"{n} tokens exceed the split-KV scratch sized for {scratch.max_num_tokens}"
            )
        if any(t.stride(-1) != 1 for t in (query, output, key_cache, value_cache)):
            raise ValueError("query, output and caches need a contiguous head dimension")
        write_kv_cache(key[:n], value[:n], key_cache, value_cache, metadata.slot_mapping)
        if n == 0:
            return

        num_heads, head_size = query.shape[1:]
        num_kv_heads = key_cache.shape[2]
        group = num_heads // num_kv_heads
        group_p = triton.next_power_of_2(group)
        num_reqs = metadata.seq_lens.shape[0]
        local = metadata.dcp_local_seq_lens
        local = metadata.seq_lens if local is None else local
        rank, world = (0, 1) if self.dcp is None else (self.dcp.rank, self.dcp.world_size)
        arrivals = metadata.split_arrivals if self.dcp is None and num_reqs > 0 else None
        reduce = arrivals is not None
        if num_reqs > 0:
            block_m = self.query_block(metadata.max_query_len, group_p)
            slots = n // block_m + num_reqs + int(reduce)
            if arrivals is not None and slots * num_kv_heads > arrivals.numel():
                raise ValueError(
                    f"{slots} program slots of {num_kv_heads} KV heads exceed the "
                    f"{arrivals.numel()} split counters"
                )
            paged_attention_split_kernel[(slots, num_kv_heads, scratch.num_splits)](
                query,
                key_cache,
                value_cache,
                metadata.block_table,
                metadata.seq_lens,
                local,
                metadata.query_start_loc,
                scratch.part_max,
                scratch.part_sum,
                scratch.part_acc,
                output,
                metadata.seq_lens if arrivals is None else arrivals,
                self.scale * LOG2E,
                num_reqs,
                n,
                rank,
                world,
                query.stride(0),
                query.stride(1),
                key_cache.stride(0),
                key_cache.stride(1),
                key_cache.stride(2),
                value_cache.stride(0),
                value_cache.stride(1),
                value_cache.stride(2),
                metadata.block_table.stride(0),
                output.stride(0),
                output.stride(1),
                NUM_HEADS=num_heads,
                GROUP=group,
                GROUP_P=group_p,
                HEAD_SIZE=head_size,
                BLOCK_SIZE=key_cache.shape[1],
                BLOCK_M=block_m,
                BLOCK_N=KV_TILE,
                NUM_SPLITS=scratch.num_splits,
                CAUSAL=metadata.causal,
                UPCAST=query.device.type != "cuda",
                REDUCE=reduce,
                **dependent_launch(query),
            )
        if reduce:
            return
        if self.dcp is None:
            scratch.reduce_into(output, metadata.query_start_loc, num_reqs, n)
            return
        partial = output.new_empty(output[:n].shape, dtype=torch.float32)
        lse = output.new_empty(output.shape[:2], dtype=torch.float32)[:n]
        scratch.reduce_into(partial, metadata.query_start_loc, num_reqs, n, lse=lse)
        output[:n] = merge_across_ranks(partial, lse, self.dcp).to(output.dtype)


class TritonAttnMetadataBuilder(HoldsDcpShare[TritonAttnMetadata], AttentionMetadataBuilder[TritonAttnMetadata]):
    """Builder of the ``triton_attn`` backend; refresh strategy ``none_needed``.

    Persistent state: the :class:`SplitKVScratch`, allocated here once for
    ``limits.max_num_tokens`` tokens and handed to every metadata object.

    With ``dcp`` (a :class:`~speccheck.contract.dcp.DcpRank` of more than one rank, which
    must match ``config.dcp_world_size``) this process is one DCP rank: the builder also
    owns a :class:`~speccheck.backends.dcp.DcpLocalShare` (persistent
    ``dcp_local_seq_lens`` and ``dcp_slot_mapping``, zeroed tails), written by
    :meth:`build` and recomputed in place by :meth:`update_draft_decode_metadata`
    (``in_graph``). Without ``dcp`` a config's ``dcp_world_size`` is a configuration value
    only: the cache holds every position.

    What the kernels need of the layer and config (power-of-two head sizes from 16 to 256,
    KV cache in the activation dtype) is stated as the ``triton_attn`` matrix entry's
    constraints and enforced from there before construction.
    """

    backend_name = "triton_attn"
    impl_cls: ClassVar[type[TritonAttnImpl]] = TritonAttnImpl

    def __init__(
        self,
        layer: AttentionLayerSpec,
        config: RuntimeConfig,
        device: torch.device,
        limits: BuilderLimits,
        *,
        supports_draft_decode_metadata_update: bool = False,
        buffer_allocator: BufferAllocator = zeros_allocator,
        num_kv_splits: int | None = None,
        dcp: DcpRank | None = None,
    ) -> None:
        """``num_kv_splits`` overrides :func:`default_num_kv_splits` (fixed for the builder's
        lifetime, like the scratch it sizes); ``dcp`` makes this process a DCP rank."""
        super().__init__(
            layer,
            config,
            device,
            limits,
            supports_draft_decode_metadata_update=supports_draft_decode_metadata_update,
            buffer_allocator=buffer_allocator,
        )
        if num_kv_splits is not None and num_kv_splits < 1:
            raise ValueError(f"num_kv_splits={num_kv_splits} must be >= 1")
        splits = num_kv_splits or default_num_kv_splits(layer, limits)
        self.scratch = SplitKVScratch.allocate(
            limits.max_num_tokens, layer.num_heads, splits, layer.head_size, device
        )
        self.dcp_share = DcpLocalShare.for_builder(self, dcp)
        self.split_arrivals = (
            self.allocate_persistent(
                "split_arrivals",
                ((limits.max_num_tokens + limits.max_num_reqs + 1) * layer.num_kv_heads,),
                torch.int32,
            )
            if self.dcp_share is None
            else None
        )
        """The split kernel's arrival counters (see :class:`TritonAttnMetadata`): one per
        (program slot, KV head) of the largest batch; without DCP only."""

    def build(self, common: CommonAttentionMetadata) -> TritonAttnMetadata:
        slots, local = common.slot_mapping, common.seq_lens
        if self.dcp_share is not None:
            local, slots = self.dcp_share.bind(common)
        return TritonAttnMetadata(
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            slot_mapping=slots,
            num_actual_tokens=common.num_actual_tokens,
            max_query_len=common.max_query_len,
            causal=common.causal,
            scratch=self.scratch,
            positions=common.positions,
            dcp_local_seq_lens=local,
            split_arrivals=self.split_arrivals,
        )

    def make_impl(self, scale: float) -> TritonAttnImpl:
        """The impl, given this builder's DCP rank (it all-gathers the partials)."""
        dcp = self.dcp_share.dcp if self.dcp_share is not None else None
        return self.impl_cls(self.layer, scale, dcp)

    def workspace_buffers(self) -> Mapping[str, torch.Tensor]:
        """The split-KV scratch: allocated once, rewritten by every forward."""
        return self.scratch.as_workspace()
