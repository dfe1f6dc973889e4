"""Builder of the ``rocm_sparse_swa`` backend: refuses to be built, with its reason.

vLLM's ROCm builder of DeepSeek sparse SWA (``DeepseekV4ROCMAiterSparseSWAMetadataBuilder``)
hands AITER's kernels ragged window indices with indptrs instead of the padded ``[tokens,
W]`` rows of :mod:`speccheck.backends.sparse_swa`, has no tile scheduler, and is not adapted
to in-graph refresh between draft steps. speccheck ships no adapter over those kernels, so
this class exists to say so: the matrix names it, ``speccheck verify`` reports the backend
skipped (with the platform reason off ROCm, with :data:`REFUSAL` on ROCm), and nothing
ever runs the CUDA kernels under the ROCm entry's name.
"""

from __future__ import annotations

from speccheck.backends.availability import BackendUnavailable
from speccheck.backends.sparse_swa.builder import SparseSWAMetadataBuilder

REFUSAL = (
    "speccheck ships no ROCm sparse sliding-window kernels: the ROCm ragged SWA indices and "
    "indptrs (AITER) are not adapted, so there is nothing to run or verify; use sparse_swa "
    "on CUDA or CPU"
)


class RocmSparseSWANotAdapted(BackendUnavailable):
    """Raised by every construction of :class:`RocmSparseSWAMetadataBuilder`: reported as
    the backend being unavailable (``speccheck verify`` skips it), with :data:`REFUSAL` as
    its message."""

    def __init__(self) -> None:
        super().__init__("amd-aiter", "no adapter over AITER's ragged sparse SWA kernels",
                         reason=REFUSAL)

    def __str__(self) -> str:
        return f"rocm_sparse_swa: {REFUSAL}"


class RocmSparseSWAMetadataBuilder(SparseSWAMetadataBuilder):
    """The ``rocm_sparse_swa`` entry's builder: construction raises
    :class:`RocmSparseSWANotAdapted` before any buffer is allocated."""

    backend_name = "rocm_sparse_swa"

    def setup(self) -> None:
        raise RocmSparseSWANotAdapted()
