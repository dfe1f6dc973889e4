"""FlashInfer adapter: paged decode/prefill wrappers in CUDA-graph mode, planned on the
host (no in-graph refresh; ``plan_draft_steps`` pre-plans every draft step). The kernel
package is imported lazily, so this package imports on machines without it."""

from speccheck.backends.flashinfer.builder import (
    FlashInferAttentionImpl,
    FlashInferMetadata,
    FlashInferMetadataBuilder,
    paged_kv_layout,
)

__all__ = [
    "FlashInferAttentionImpl",
    "FlashInferMetadata",
    "FlashInferMetadataBuilder",
    "paged_kv_layout",
]
