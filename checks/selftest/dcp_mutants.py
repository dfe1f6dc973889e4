"""Known-bad builders of the backends with real decode context parallelism (``reference``
and ``triton_attn`` given a :class:`~speccheck.contract.dcp.DcpRank`).

Each is the shipped builder with the refresh of vLLM's Triton MLA under DCP: between draft
steps it recomputes this rank's KV slots but leaves the DCP-local lengths at the values
:meth:`build` derived for draft step 1. From step 2 on, the rank that holds a request's
newest position bounds its share by a stale length, the newest key drops out of the
attention, and the merged output is wrong. :func:`claiming_matrix` is the matrix its author
would ship: fused draft decode at every DCP size, ``dcp_local_seq_lens`` (and the local
``slot_mapping``) declared as refreshed in-graph. A verifier running two DCP ranks must name
``dcp_local_seq_lens``.
"""

from __future__ import annotations

from typing import Any

from speccheck.backends.dcp import DcpLocalShare
from speccheck.backends.reference.builder import ReferenceMetadata, ReferenceMetadataBuilder
from speccheck.backends.triton_attn.builder import TritonAttnMetadata, TritonAttnMetadataBuilder
from speccheck.checks.selftest.mutants import declaring_matrix, naming_matrix
from speccheck.contract.builder import AttentionMetadataBuilder
from speccheck.contract.matrix_model import Matrix

DCP_LOCAL_FIELD = DcpLocalShare.LENGTHS
"""The metadata field the mutants leave stale (named after its persistent buffer)."""
DCP_REFRESHED_FIELDS = (DCP_LOCAL_FIELD, "slot_mapping")
"""What a correct DCP builder of these backends refreshes in-graph."""


class ReferenceStaleDcpLocalLens(ReferenceMetadataBuilder):
    """The reference builder whose refresh does not advance ``dcp_local_seq_lens``."""

    def update_draft_decode_metadata(self, metadata: ReferenceMetadata) -> None:
        """Recomputes the local slots only."""
        self.refresh_dcp_slots(metadata)


class TritonAttnStaleDcpLocalLens(TritonAttnMetadataBuilder):
    """The ``triton_attn`` builder whose refresh does not advance ``dcp_local_seq_lens``."""

    def update_draft_decode_metadata(self, metadata: TritonAttnMetadata) -> None:
        """Recomputes the local slots only."""
        self.refresh_dcp_slots(metadata)


STALE_DCP_BUILDERS: dict[str, type[AttentionMetadataBuilder[Any]]] = {
    ReferenceMetadataBuilder.backend_name: ReferenceStaleDcpLocalLens,
    TritonAttnMetadataBuilder.backend_name: TritonAttnStaleDcpLocalLens,
}
"""The known-bad builder of each backend, by backend name."""


def claiming_matrix(shipped: Matrix, backend: str) -> Matrix:
    """``shipped`` with a ``backend`` entry that names the backend's stale builder and
    claims fused draft decode at every DCP size, refreshing :data:`DCP_REFRESHED_FIELDS`."""
    declared = declaring_matrix(shipped, DCP_REFRESHED_FIELDS, backend=backend)
    return naming_matrix(declared, STALE_DCP_BUILDERS[backend])
