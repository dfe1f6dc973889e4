"""FlashAttention-3 (``fa3-fwd`` wheel) adapter: AOT scheduler metadata in a persistent
buffer, refreshed in place between draft steps. The kernel package is imported lazily, so
this package imports on machines without it."""

from speccheck.backends.fa3.builder import (
    FA3AttentionImpl,
    FA3Metadata,
    FA3MetadataBuilder,
)

__all__ = ["FA3AttentionImpl", "FA3Metadata", "FA3MetadataBuilder"]
