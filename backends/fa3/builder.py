"""FlashAttention-3 through the ``fa3-fwd`` wheel: metadata builder and impl.

What this build of FA3 can do, and what follows from it. The configuration rules (bf16
only, head sizes a multiple of 8 up to 256, ``block_size == max_model_len``, KV cache in the
query dtype, sm90) are stated once, as the ``fa3`` entry's constraints in ``matrix.yaml``,
and enforced from there before the builder is constructed
(:func:`speccheck.contract.constraints.enforce_constraints`); the builder does not re-check
them.

- **bf16 only.** ``fa3-fwd`` 0.0.3 is compiled with ``FLASHATTENTION_DISABLE_FP16``.
- **No paged KV.** ``FLASHATTENTION_DISABLE_PAGEDKV`` is set, so ``page_table`` cannot be
  used. The layer's KV cache ``[num_blocks, block_size, num_kv_heads, head_size]`` is used
  with ``block_size == max_model_len``: every block is one request's whole cache row, the
  block table has one column, and ``flash_attn_with_kvcache`` addresses the row through
  ``cache_batch_idx = block_table[:, 0]`` with ``cache_seqlens = seq_lens``.
- **Ahead-of-time scheduler metadata.** ``get_scheduler_metadata`` runs FA3's
  ``prepare_varlen_num_blocks`` kernel and returns an int32 vector (per-request split
  counts, m-block counts, the sorted batch order, the head-swizzle vector, one tile
  semaphore). The builder copies it into one persistent buffer, zeroes the unused tail, and
  hands the kernel the ``[:n]`` view; FA3 checks that the view has exactly the size it
  expects for the batch. ``update_draft_decode_metadata`` recomputes it from the
  metadata's own persistent ``seq_lens``/``query_start_loc`` views and writes it into the
  same buffer, which is capture-safe (measured on an H200: ``get_scheduler_metadata`` can be
  captured and gives correct results at replay).
- **Pinned split count under CUDA graphs.** ``num_splits`` sizes FA3's split-KV
  accumulators at capture; it is pinned to :attr:`FA3MetadataBuilder.max_num_splits_for_cuda_graph`
  whenever graphs are in use, and passed identically to ``get_scheduler_metadata`` and to
  the attention call, so both derive the same metadata layout and split bound. The key
  length bound ``max_seqlen_k`` is the cache row length (``block_size == max_model_len``),
  a host constant, which is also what the attention call derives from ``k_cache.shape[1]``.
- **Never cascade.** Every call is one varlen call over ``cu_seqlens_q = query_start_loc``.

Stale scheduler metadata gives the *same outputs* as refreshed metadata in every mix that
was measured, so comparing outputs cannot catch a missing refresh: the verifier must compare
``scheduler_metadata`` itself (the matrix's ``refreshed_fields``) with a fresh build.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar

import torch

from speccheck.backends.availability import require_module
from speccheck.backends.kv_cache_write import write_kv_cache
from speccheck.contract.builder import (
    AttentionImpl,
    AttentionMetadataBuilder,
)
from speccheck.contract.metadata import CommonAttentionMetadata

FA3_IMPORT_NAME = "fa3_fwd_interface"
FA3_PACKAGE = "fa3-fwd"
FA3_INSTALL_HINT = "pip install 'speccheck[fa3]' (fa3-fwd, CUDA, sm90)"


def fa3_interface() -> ModuleType:
    """The ``fa3_fwd_interface`` module, or :class:`BackendUnavailable` with the install
    hint. Imported lazily: this module must import on machines without the wheel."""
    return require_module(FA3_IMPORT_NAME, FA3_PACKAGE, FA3_INSTALL_HINT)


def scheduler_metadata_size_bound(num_reqs: int) -> int:
    """Upper bound of the length of FA3's scheduler metadata for ``num_reqs`` requests:
    one tile semaphore plus at most four per-request vectors, each rounded up to a multiple
    of 4 (``flash_api``: num_splits_dynamic, num_m_blocks, varlen_batch_idx,
    num_nheads_in_l2)."""
    return 1 + 4 * (-(-max(num_reqs, 1) // 4) * 4)


@dataclass
class FA3Metadata:
    """Metadata of one FA3 attention call.

    Every tensor except ``scheduler_metadata`` is a view of the speculator's persistent
    input buffers; ``scheduler_metadata`` is a ``[:n]`` view of the builder's persistent
    buffer (``None`` when the schedule is not computed ahead of time, in which case FA3
    computes it inside the attention call).
    """

    query_start_loc: torch.Tensor
    """``[num_reqs + 1]`` int32: FA3's ``cu_seqlens_q``."""
    seq_lens: torch.Tensor
    """``[num_reqs]`` int32: FA3's ``cache_seqlens`` (KV length including this step)."""
    block_table: torch.Tensor
    """``[num_reqs, 1]`` int32: the cache row of each request."""
    cache_batch_idx: torch.Tensor
    """``[num_reqs]`` int32 view ``block_table[:, 0]``: FA3's ``cache_batch_idx``."""
    slot_mapping: torch.Tensor
    """``[num_actual_tokens]`` int64: where this step's keys and values are written."""
    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    """FA3's ``max_seqlen_q``; part of the captured shape (uniform count in FULL mode)."""
    max_seqlen_k: int
    """Static key-length bound: the cache row length (``block_size == max_model_len``)."""
    causal: bool
    num_splits: int
    """Split-KV bound passed to both ``get_scheduler_metadata`` and the attention call."""
    scheduler_metadata: torch.Tensor | None
    """``[n]`` int32 view of the builder's persistent ``"scheduler_metadata"`` buffer."""


class FA3AttentionImpl(AttentionImpl[FA3Metadata]):
    """Writes the new keys/values with :func:`write_kv_cache`, then one FA3 varlen call
    without ``k``/``v`` (nothing appended inside the kernel) over the per-request cache rows,
    its result written straight into ``output``. FA3 writes only the requests' rows, so
    padding rows stay as the caller cleared them."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: FA3Metadata,
        output: torch.Tensor,
    ) -> None:
        fa3 = fa3_interface()
        n = metadata.num_actual_tokens
        write_kv_cache(key[:n], value[:n], key_cache, value_cache, metadata.slot_mapping)
        if metadata.num_reqs == 0:
            return  # every token is padding: its rows arrive zero
        dst = output[:n]
        # FA3 writes its result into ``dst`` (its main kernel, or the split combine), so no
        # copy of a returned tensor follows. ``flash_attn_with_kvcache`` has no ``out``
        # argument, and the Python custom op under it refuses an output that aliases an
        # input, so this calls the compiled op that both wrap, with the arguments
        # ``flash_attn_with_kvcache`` passes (its ``cache_seqlens`` is ``seqused_k``, its
        # ``cache_batch_idx`` is ``kv_batch_idx``).
        fa3.fa3_fwd_cuda.fwd(
            query[:n], key_cache, value_cache,
            None, None, None,  # k_new, v_new, qv: nothing appended inside the kernel
            dst,  # out_
            metadata.query_start_loc,  # cu_seqlens_q
            None, None, None,  # cu_seqlens_k, cu_seqlens_k_new, seqused_q
            metadata.seq_lens,  # seqused_k
            metadata.max_query_len,  # max_seqlen_q
            None, None,  # max_seqlen_k (from the cache's shape), page_table
            metadata.cache_batch_idx,  # kv_batch_idx
            None, None, None, None,  # leftpad_k, rotary_cos, rotary_sin, seqlens_rotary
            None, None, None,  # q_descale, k_descale, v_descale
            self.scale, metadata.causal,
            -1, -1, 0, 0.0,  # window left and right, attention_chunk, softcap
            True,  # rotary_interleaved (no rotary here)
            metadata.scheduler_metadata, metadata.num_splits,
            None, 0,  # pack_gqa (FA3's heuristic), sm_margin
        )


class FA3MetadataBuilder(AttentionMetadataBuilder[FA3Metadata]):
    """Refresh strategy ``in_graph``: the only step-dependent derived state is the AOT
    scheduler metadata, recomputed in place by :meth:`update_draft_decode_metadata`.

    Constraints on the layer and config (dtype, head size, ``block_size == max_model_len``,
    KV-cache dtype, platform, compute capability) are enforced from the ``fa3`` matrix entry
    before construction; :meth:`setup` checks only that the package and a CUDA device are
    there."""

    backend_name = "fa3"
    impl_cls = FA3AttentionImpl

    max_num_splits_for_cuda_graph: ClassVar[int] = 32
    """Split-KV bound pinned while CUDA graphs are in use (vLLM's default): it sizes the
    split accumulators at capture, so it must not follow a per-batch heuristic."""
    scheduler_metadata_margin: ClassVar[int] = 2
    """The persistent buffer holds this many times the largest size ever needed."""

    def setup(self) -> None:
        layer, config, device = self.layer, self.config, self.device
        fa3_interface()  # BackendUnavailable with the install hint, before any device work
        if torch.device(device).type != "cuda":
            raise ValueError(f"fa3 backend runs on CUDA devices only, got device={device}")
        self.aot_schedule = True
        """Compute the scheduler metadata ahead of time (False: FA3 computes it inside the
        attention call, and there is nothing for the refresh to do)."""
        self.max_seqlen_k = layer.block_size
        self.num_splits = (
            self.max_num_splits_for_cuda_graph if config.cudagraph_mode != "none" else 0
        )
        self._scheduler_metadata_buffer = self.allocate_persistent(
            "scheduler_metadata", (self._scheduler_metadata_capacity(),), torch.int32
        )
        self._kept_entries_by_shape: dict[tuple[int, int], torch.Tensor] = {}
        """:meth:`_kept_entries` by ``(num_reqs, n)``."""

    # -- scheduler metadata -------------------------------------------------------------

    def _scheduler_metadata_capacity(self) -> int:
        """Size of the persistent buffer: the margin times the larger of the documented
        bound and what ``get_scheduler_metadata`` returns for the largest batch (computed
        once, on the device, with a query length > 1 so causal batches keep their
        head-swizzle vector, which is the larger layout)."""
        max_reqs = max(self.limits.max_num_reqs, 1)
        seq_lens = torch.zeros(max_reqs, dtype=torch.int32, device=self.device)
        query_start_loc = torch.arange(max_reqs + 1, dtype=torch.int32, device=self.device) * 2
        probe = self._compute_scheduler_metadata(
            num_reqs=max_reqs,
            max_query_len=2,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            causal=True,
            num_splits=self.num_splits,
        )
        needed = max(scheduler_metadata_size_bound(max_reqs), int(probe.numel()))
        return self.scheduler_metadata_margin * needed

    def _compute_scheduler_metadata(
        self,
        *,
        num_reqs: int,
        max_query_len: int,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        causal: bool,
        num_splits: int,
    ) -> torch.Tensor:
        """FA3's AOT schedule for one varlen call. Every argument that FA3's attention call
        derives on its own (``max_seqlen_k`` from ``k_cache.shape[1]``, no page size, no
        appended KV, no window, no softcap, ``pack_gqa`` by its heuristic) is passed so that
        both sides compute the same layout. Capture-safe: only host ints and device
        tensors that outlive the call."""
        fa3 = fa3_interface()
        return fa3.get_scheduler_metadata(
            num_reqs,
            max_query_len,
            self.max_seqlen_k,
            self.layer.num_heads,
            self.layer.num_kv_heads,
            self.layer.head_size,
            seq_lens,
            qkv_dtype=torch.bfloat16,
            cu_seqlens_q=query_start_loc,
            causal=causal,
            num_splits=num_splits,
        )

    def _kept_entries(self, num_reqs: int, n: int) -> torch.Tensor:
        """``[n]`` int32: 0 at the padding entries of an ``n``-entry schedule for
        ``num_reqs`` requests, 1 elsewhere. FA3 lays the schedule out as per-request vectors
        of ``round_up(num_reqs, 4)`` entries (then the tile semaphore) but allocates it
        uninitialised and writes only the first ``num_reqs`` entries of each vector.

        Made once per shape, by :meth:`build` (outside any graph), and kept: a refresh
        under capture only reads it."""
        key = (num_reqs, n)
        kept = self._kept_entries_by_shape.get(key)
        if kept is None:
            rounded = -(-num_reqs // 4) * 4
            index = torch.arange(n, device=self.device)
            padding = (index % rounded >= num_reqs) & (index < n // rounded * rounded)
            kept = (~padding).to(torch.int32)
            self._kept_entries_by_shape[key] = kept
        return kept

    def _store_scheduler_metadata(self, fresh: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """Write ``fresh`` into the head of the persistent buffer with its padding entries
        zeroed (``kept``: :meth:`_kept_entries`), zero the tail (stale entries there could
        be read by thread blocks of a larger captured schedule), and return the ``[:n]``
        view. In place: the buffer's address never changes. With the padding zeroed the
        stored schedule is a function of the batch alone, so a fresh build can be compared
        with a refreshed one entry for entry. Capture-safe: two kernels over tensors that
        outlive the graph."""
        buffer = self._scheduler_metadata_buffer
        n = int(fresh.numel())
        if n > buffer.numel():
            raise RuntimeError(
                f"fa3 scheduler metadata needs {n} entries but the persistent buffer holds "
                f"{buffer.numel()}; raise BuilderLimits.max_num_reqs (now "
                f"{self.limits.max_num_reqs}) or FA3MetadataBuilder.scheduler_metadata_margin"
            )
        torch.mul(fresh.view(-1), kept, out=buffer[:n])
        buffer[n:].zero_()
        return buffer[:n]

    # -- protocol -----------------------------------------------------------------------

    def build(self, common: CommonAttentionMetadata) -> FA3Metadata:
        if common.num_reqs > self.limits.max_num_reqs:
            raise ValueError(
                f"fa3 backend: num_reqs={common.num_reqs} exceeds BuilderLimits.max_num_reqs="
                f"{self.limits.max_num_reqs}"
            )
        if common.block_table.shape[-1] < 1:
            raise ValueError("fa3 backend: the block table needs one column (the cache row)")
        scheduler_metadata = None
        if self.aot_schedule and common.num_reqs > 0 and common.max_query_len > 0:
            fresh = self._compute_scheduler_metadata(
                num_reqs=common.num_reqs,
                max_query_len=common.max_query_len,
                seq_lens=common.seq_lens,
                query_start_loc=common.query_start_loc,
                causal=common.causal,
                num_splits=self.num_splits,
            )
            kept = self._kept_entries(common.num_reqs, int(fresh.numel()))
            scheduler_metadata = self._store_scheduler_metadata(fresh, kept)
        return FA3Metadata(
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            cache_batch_idx=common.block_table[:, 0],
            slot_mapping=common.slot_mapping,
            num_actual_tokens=common.num_actual_tokens,
            num_reqs=common.num_reqs,
            max_query_len=common.max_query_len,
            max_seqlen_k=self.max_seqlen_k,
            causal=common.causal,
            num_splits=self.num_splits,
            scheduler_metadata=scheduler_metadata,
        )

    def update_draft_decode_metadata(self, metadata: FA3Metadata) -> None:
        """Recompute the AOT schedule for the lengths the speculator has just advanced in
        place, and write it into the same persistent buffer (zero tail kept).

        Capture-safe: the inputs are the metadata's persistent device views and host ints
        fixed at build time; the only host decisions compare shapes, never values. Without
        AOT metadata (``scheduler_metadata is None``) FA3 recomputes its schedule inside
        the attention call from the live ``seq_lens``, so there is nothing to do.
        """
        current = metadata.scheduler_metadata
        if current is None:
            return
        buffer = self._scheduler_metadata_buffer
        if current.data_ptr() != buffer.data_ptr():
            raise RuntimeError(
                "fa3 refresh: metadata.scheduler_metadata is not a view of this builder's "
                "persistent buffer (metadata built by another builder, or the field was "
                "rebound); a replay would not see the refresh"
            )
        fresh = self._compute_scheduler_metadata(
            num_reqs=metadata.num_reqs,
            max_query_len=metadata.max_query_len,
            seq_lens=metadata.seq_lens,
            query_start_loc=metadata.query_start_loc,
            causal=metadata.causal,
            num_splits=metadata.num_splits,
        )
        if fresh.numel() != current.numel():
            raise RuntimeError(
                f"fa3 refresh: the recomputed scheduler metadata has {fresh.numel()} entries, "
                f"the captured view {current.numel()}; the batch shape changed between build "
                "and refresh"
            )
        kept = self._kept_entries_by_shape.get((metadata.num_reqs, current.numel()))
        if kept is None:
            raise RuntimeError(
                "fa3 refresh: no padding mask for this batch shape; the metadata was not "
                "built by this builder's build()"
            )
        self._store_scheduler_metadata(fresh, kept)

    def persistent_buffer_extents(self, metadata: FA3Metadata) -> dict[str, int]:
        if metadata.scheduler_metadata is None:
            return {"scheduler_metadata": 0}
        return {"scheduler_metadata": metadata.scheduler_metadata.numel()}
