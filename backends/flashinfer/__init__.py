"""FlashInfer adapters: paged decode/prefill wrappers in CUDA-graph mode.

- ``flashinfer`` (:mod:`.builder`): planned on the host from host lengths while the page
  indices are gathered on the device (no device-to-host copy per plan; no in-graph
  refresh; ``plan_draft_steps`` pre-plans every draft step);
- ``flashinfer_fixed_plan`` (:mod:`.fixed_plan`): split KV disabled, so a plan ignores the
  lengths; planned once per query layout, its page tables refreshed in the graph.

The kernel package is imported lazily, so this package imports on machines without it."""

from speccheck.backends.flashinfer.builder import (
    FlashInferAttentionImpl,
    FlashInferMetadata,
    FlashInferMetadataBuilder,
)
from speccheck.backends.flashinfer.fixed_plan import FlashInferFixedPlanMetadataBuilder
from speccheck.backends.flashinfer.page_indices import paged_kv_layout, write_paged_kv_indices

__all__ = [
    "FlashInferAttentionImpl",
    "FlashInferMetadata",
    "FlashInferFixedPlanMetadataBuilder",
    "FlashInferMetadataBuilder",
    "paged_kv_layout",
    "write_paged_kv_indices",
]
