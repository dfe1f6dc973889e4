"""Known-bad builders of the latent-cache (MLA) backends.

:class:`StaleDcpLocalLens` is the ``triton_mla`` builder with vLLM's Triton MLA refresh:
``update_draft_decode_metadata`` does nothing, whatever the DCP size. Under decode context
parallelism the DCP-local lengths it derived at build time then stay at draft step 1's
values, so from step 2 on each rank bounds its share of the context by a stale length and
the newest token drops out of the attention. :func:`claiming_matrix` is the matrix its
author would ship: fused draft decode at every DCP size, ``dcp_local_seq_lens`` declared as
refreshed in-graph. Verified under it at ``dcp_world_size == 2``, ``step_metadata`` must
name ``dcp_local_seq_lens``.
"""

from __future__ import annotations

from speccheck.backends.triton_mla.builder import TritonMLAMetadata, TritonMLAMetadataBuilder
from speccheck.checks.selftest.mutants import declaring_matrix, naming_matrix
from speccheck.contract.matrix_model import Matrix

DCP_LOCAL_FIELD = "dcp_local_seq_lens"


class StaleDcpLocalLens(TritonMLAMetadataBuilder):
    """Caches the DCP-local lengths at build and never refreshes them."""

    def update_draft_decode_metadata(self, metadata: TritonMLAMetadata) -> None:
        """Does nothing, also under DCP (the shipped builder refuses there)."""


def claiming_matrix(shipped: Matrix) -> Matrix:
    """``shipped`` with a ``triton_mla`` entry that names :class:`StaleDcpLocalLens` and
    claims fused draft decode at every DCP size, refreshing ``dcp_local_seq_lens``."""
    declared = declaring_matrix(shipped, (DCP_LOCAL_FIELD,), backend="triton_mla")
    return naming_matrix(declared, StaleDcpLocalLens)
