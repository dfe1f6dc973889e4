"""FlashInfer with plans that do not depend on the KV lengths: in-graph refresh.

FlashInfer's FA2 scheduler (``PrefillSplitQOKVIndptr``, which the tensor-core decode
wrapper runs too) reads the KV lengths for one decision only: how to split each request's
KV over several CTAs. With ``disable_split_kv=True`` every request is one KV chunk, and the
plan (the work-tile lists in the wrapper's int workspace and the plan info baked into the
launches) is a function of the batch size, the query layout and the wrapper's frozen row
bound alone; the kernels take the lengths and pages from the fixed page-table buffers when
they run. Evidence run 46 (docs/notes/flashinfer-fixed-plan.md) checked it on the H200: plans
for KV lengths of 1 to 3000 at batch 64 are byte-identical, and one plan run on another
length set's page tables gives the fresh plan's outputs bit for bit; with split KV, or the
CUDA-core decode, it does not.

So this builder plans each graph-mode wrapper once per query layout, on the host, and
refreshes everything that depends on the lengths on the device, in place and capture-safe
(:meth:`FlashInferFixedPlanMetadataBuilder.update_draft_decode_metadata`): the page table
(``paged_kv_indptr``, ``paged_kv_indices``, ``paged_kv_last_page_len``) from the device
``seq_lens`` and block table, in one launch
(:func:`~speccheck.backends.flashinfer.page_indices.write_paged_kv_table`), and, for the
prefill wrapper, ``qo_indptr`` from the device ``query_start_loc``. :meth:`build` is that
refresh after the plan where one is due; the refresh alone rebuilds any batch of the
metadata's layout, so the whole propose (first pass and draft steps) runs in one graph.

The query layouts:

- decode steps run the tensor-core decode wrapper (one query row per lane, its own fixed
  ``qo_indptr``): one plan per padded batch size, ever;
- a uniform batch (every lane's share of the padded tokens is ``max_query_len``: the
  padded first pass, DFlash blocks) is planned as ``max_query_len`` rows for *every* lane,
  padding lanes included. The device ``qo_indptr`` then gives padding lanes no rows, so
  their work tiles find nothing to do: a plan for more rows per request covers fewer,
  because without split KV a tile's rows and KV range are read from the buffers at run
  time. One plan per (batch size, query length);
- any other batch (eager passes over the real tokens) is planned for its own layout,
  re-planned when the layout changes.

The price is the split: a long request at a small batch runs on one CTA per KV head and
query tile where FlashInfer would spread it over the GPU. The prefill wrapper is pinned to
FlashInfer's FA2 kernels: its SM90 (FA3) scheduler balances by KV length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import numpy as np
import torch

from speccheck.backends.flashinfer.builder import (
    FlashInferMetadata,
    FlashInferMetadataBuilder,
    WrapperKind,
    _is_decode,
    wrapper_buffer_name,
    wrapper_kind,
)
from speccheck.backends.flashinfer.page_indices import paged_kv_lengths, write_paged_kv_table
from speccheck.contract.metadata import CommonAttentionMetadata

PlanKey = tuple[float, bool, tuple[int, ...] | None]
"""What a wrapper's plan was made for: softmax scale, causal mask, and the host query
offsets it was given (``None`` for the decode wrapper, whose layout is fixed)."""


class FlashInferFixedPlanMetadataBuilder(FlashInferMetadataBuilder):
    """Refresh strategy ``in_graph``, with ``refresh_rebuilds``: FlashInfer's wrappers with
    split KV disabled, planned once per query layout, their page tables refreshed on the
    device (see the module docstring)."""

    backend_name = "flashinfer_fixed_plan"
    split_kv: ClassVar[bool] = False
    decode_tensor_cores: ClassVar[bool] = True
    """Tensor cores: the CUDA-core decode plan depends on the lengths even without split
    KV (run 46)."""
    kernel_backend: ClassVar[str] = "fa2"
    """FA2 for both wrappers, as the base builder has it, but here a requirement, not a
    speed-up: the SM90 (FA3) prefill scheduler balances by KV length, so its plan would
    not outlive a change of lengths."""

    def setup(self) -> None:
        super().setup()
        self._plan_keys: dict[tuple[WrapperKind, int], PlanKey] = {}

    def build(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        """Plan the wrapper on the host where its query layout, scale or mask changed since
        its last plan, then :meth:`update_draft_decode_metadata`. Host work only when a
        plan is due; the page table always comes from the device lengths."""
        num_reqs = common.num_reqs
        self._check_batch_size(num_reqs)
        if num_reqs == 0:
            return self._empty_metadata(common, draft_step=None)
        use_decode = _is_decode(common)
        kind = wrapper_kind(use_decode)
        graph_wrapper = self._wrapper(kind, num_reqs)
        qo_indptr = None if use_decode else _planned_query_offsets(common)
        key: PlanKey = (
            self.sm_scale, common.causal, None if qo_indptr is None else tuple(qo_indptr.tolist())
        )
        if self._plan_keys.get((kind, num_reqs)) != key:
            seq_lens = common.seq_lens_cpu_upper_bound[:num_reqs]
            lengths = paged_kv_lengths(
                seq_lens, self.layer.block_size, common.block_table.shape[1]
            )
            self._upload_plan(
                graph_wrapper, seq_lens, lengths,
                None if qo_indptr is None else torch.from_numpy(qo_indptr),
                causal=common.causal,
            )
            self._plan_keys[(kind, num_reqs)] = key
        metadata = self._metadata(
            common,
            graph_wrapper.wrapper.run,
            use_decode=use_decode,
            paged_kv_indptr=graph_wrapper.paged_kv_indptr,
            paged_kv_indices=graph_wrapper.paged_kv_indices,
            paged_kv_last_page_len=graph_wrapper.paged_kv_last_page_len,
            qo_indptr=graph_wrapper.qo_indptr,
            draft_step=None,
        )
        self._write_page_table(metadata)
        return metadata

    def update_draft_decode_metadata(self, metadata: FlashInferMetadata) -> None:
        """The device half of :meth:`build` (:meth:`_write_page_table`); the plan stays: it
        does not depend on what changed."""
        self._write_page_table(metadata)

    def _write_page_table(self, metadata: FlashInferMetadata) -> None:
        """Rebuild the wrapper's page table from ``metadata.seq_lens`` and its block table
        (the whole indices buffer, its tail zeroed), and the prefill wrapper's ``qo_indptr``
        from ``metadata.query_start_loc``: device work only, in place, into the fixed
        buffers the wrapper's captured kernels read; two launches at most. Capture-safe."""
        if metadata.run is None:
            return
        num_reqs = metadata.num_reqs
        if metadata.qo_indptr is not None:
            metadata.qo_indptr.copy_(metadata.query_start_loc[: num_reqs + 1])
        write_paged_kv_table(
            metadata.seq_lens,
            metadata.block_table,
            self.layer.block_size,
            indptr=metadata.paged_kv_indptr,
            last_page_len=metadata.paged_kv_last_page_len,
            indices=metadata.paged_kv_indices,
            num_reqs=num_reqs,
        )

    def persistent_buffer_extents(self, metadata: FlashInferMetadata) -> Mapping[str, int]:
        """The used head of the metadata's wrapper's indices buffer, whose tail the refresh
        zeroes. Reads ``indptr[num_reqs]`` back from the device: for checks after a run,
        never inside one."""
        if metadata.run is None:
            return {}
        kind = wrapper_kind(metadata.use_decode)
        used = int(metadata.paged_kv_indptr[metadata.num_reqs])
        return {wrapper_buffer_name(kind, metadata.num_reqs, "paged_kv_indices"): used}

    def plan_draft_steps(
        self, common_per_step: Sequence[CommonAttentionMetadata]
    ) -> list[FlashInferMetadata]:
        """Not offered: this builder refreshes in the graph (the protocol's
        ``NotImplementedError``)."""
        raise NotImplementedError(
            f"{type(self).__name__} refreshes in-graph and has no host_preplanned strategy"
        )


def _planned_query_offsets(common: CommonAttentionMetadata) -> np.ndarray:
    """The host query offsets a prefill plan is made for: ``max_query_len`` rows for every
    lane when the padded tokens are exactly that many per lane (a uniform batch; padding
    lanes included, see the module docstring), else the batch's own offsets."""
    num_reqs, rows = common.num_reqs, common.max_query_len
    if rows > 0 and common.num_actual_tokens == num_reqs * rows:
        return np.arange(num_reqs + 1, dtype=np.int32) * np.int32(rows)
    return common.query_start_loc_cpu[: num_reqs + 1].numpy().astype(np.int32)
