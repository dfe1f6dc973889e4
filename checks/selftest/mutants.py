"""Known-bad builders that re-create historical bugs of this class, and the self-test that
proves the verifier catches each one with the check meant for it.

Every mutant is the reference backend plus one derived, step-dependent field
(``kv_lens_plus_one``, kept in a persistent buffer and refreshed in-graph) with exactly one
thing done wrong, verified against a matrix whose ``reference`` entry declares what the
mutant's adapter would declare (:func:`declaring_matrix`). :class:`DerivedBuilder` does it
right and must pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speccheck.backends.reference.builder import (
    ReferenceAttentionImpl,
    ReferenceMetadata,
    ReferenceMetadataBuilder,
)
from speccheck.checks.verify.vocabulary import Check
from speccheck.contract.matrix_model import DraftDecode, Matrix, RefreshStrategy
from speccheck.contract.metadata import CommonAttentionMetadata

DERIVED_FIELD = "kv_lens_plus_one"


@dataclass
class DerivedMetadata(ReferenceMetadata):
    kv_lens_plus_one: torch.Tensor | None = None


class DerivedBuilder(ReferenceMetadataBuilder):
    """Derives ``kv_lens_plus_one`` from ``seq_lens`` into a persistent buffer whose tail is
    zeroed and recomputes it in place between draft steps (its matrix entry declares it)."""

    def setup(self) -> None:
        self.derived = self.allocate_persistent("derived", (self.limits.max_num_reqs,), torch.int32)

    def build(self, common: CommonAttentionMetadata) -> DerivedMetadata:
        base = super().build(common)
        n = common.num_reqs
        self.derived[:n].copy_(common.seq_lens + 1)
        self.derived[n:].zero_()
        return DerivedMetadata(**vars(base), kv_lens_plus_one=self.derived[:n])

    def update_draft_decode_metadata(self, metadata: ReferenceMetadata) -> None:
        torch.add(metadata.seq_lens, 1, out=_derived(metadata))

    def persistent_buffer_extents(self, metadata: ReferenceMetadata) -> dict[str, int]:
        return {"derived": _derived(metadata).shape[0]}


def _derived(metadata: ReferenceMetadata) -> torch.Tensor:
    """The derived field of a :class:`DerivedBuilder`'s metadata."""
    assert isinstance(metadata, DerivedMetadata) and metadata.kv_lens_plus_one is not None
    return metadata.kv_lens_plus_one


class StaleRefresh(DerivedBuilder):
    def update_draft_decode_metadata(self, metadata: ReferenceMetadata) -> None:
        """Forgets to recompute the derived lengths."""


class AllocatingRefresh(DerivedBuilder):
    def update_draft_decode_metadata(self, metadata: ReferenceMetadata) -> None:
        """Rebinds the field to a new tensor instead of writing the persistent one."""
        assert isinstance(metadata, DerivedMetadata)
        metadata.kv_lens_plus_one = metadata.seq_lens + 1


class SyncingRefresh(DerivedBuilder):
    def update_draft_decode_metadata(self, metadata: ReferenceMetadata) -> None:
        """Decides on the host from a device value."""
        if int(metadata.seq_lens.max().item()) > 0:
            torch.add(metadata.seq_lens, 1, out=_derived(metadata))


class DirtyTail(DerivedBuilder):
    def build(self, common: CommonAttentionMetadata) -> DerivedMetadata:
        """Leaves stale entries past the live rows (as if from an earlier, larger batch)."""
        md = super().build(common)
        self.derived[common.num_reqs :].fill_(7)
        return md


class Overrun(DerivedBuilder):
    def update_draft_decode_metadata(self, metadata: ReferenceMetadata) -> None:
        """Writes one element past the end of its persistent buffer (a wrong bound)."""
        super().update_draft_decode_metadata(metadata)
        n = self.derived.shape[0]
        torch.as_strided(self.derived, (n + 1,), (1,))[n:].fill_(1)


class _PaddingWritesLiveImpl(ReferenceAttentionImpl):
    """Sends padding tokens' KV to the first request's next slot instead of the sink."""

    def forward(self, query, key, value, key_cache, value_cache, metadata, output) -> None:  # type: ignore[no-untyped-def]
        slots = metadata.slot_mapping
        real = metadata.query_start_loc[-1]
        lanes = torch.arange(slots.shape[0], device=slots.device)
        patched = torch.where(lanes >= real, slots[0].expand_as(slots) + 1, slots)
        metadata = ReferenceMetadata(**{**vars(metadata), "slot_mapping": patched})
        super().forward(query, key, value, key_cache, value_cache, metadata, output)


class PaddingWritesLive(ReferenceMetadataBuilder):
    impl_cls = _PaddingWritesLiveImpl


@dataclass(frozen=True)
class Mutant:
    """A known-bad builder, the check that must catch it, and the bug it re-creates."""

    name: str
    builder: type[ReferenceMetadataBuilder]
    check: Check
    diagnosis: str
    """A phrase the catching check's diagnosis must contain."""
    recreates: str
    gpu_check: Check | None = None
    """The catching check on the GPU tier, where it differs (a host sync inside a captured
    refresh already breaks the capture)."""
    gpu_diagnosis: str | None = None
    declares: tuple[str, ...] = (DERIVED_FIELD,)
    """The step-dependent fields the mutant's matrix entry declares."""

    def expected(self, gpu: bool) -> tuple[Check, str]:
        if gpu and self.gpu_check is not None:
            return self.gpu_check, self.gpu_diagnosis or ""
        return self.check, self.diagnosis


MUTANTS: tuple[Mutant, ...] = (
    Mutant("stale_refresh", StaleRefresh, Check.STEP_METADATA,
           "kv_lens_plus_one differs from a fresh eager build",
           "a derived field not refreshed between fused draft steps (FA3 AOT schedule, vLLM "
           "stale draft metadata): outputs may even stay right"),
    Mutant("undeclared_field", DerivedBuilder, Check.DECLARED_FIELDS, "does not declare it",
           "a step-dependent field missing from the matrix's declaration", declares=()),
    Mutant("allocating_refresh", AllocatingRefresh, Check.IN_PLACE, "kv_lens_plus_one",
           "a refresh that rebinds a metadata tensor: replays keep reading the old address"),
    Mutant("syncing_refresh", SyncingRefresh, Check.HOST_SYNC, "item",
           "host-side decisions in captured code freeze dummy-batch values (TRT-LLM #17110)",
           gpu_check=Check.CAPTURE, gpu_diagnosis="capturing the draft-decode graphs failed"),
    Mutant("padding_writes_live", PaddingWritesLive, Check.KV_CACHE, "outside the expected",
           "padding lanes with stale indices writing live KV slots (SGLang #10892, #25529)",
           declares=()),
    Mutant("dirty_tail", DirtyTail, Check.ZERO_TAILS, "unused tail",
           "stale entries of an earlier, larger batch past the live rows (SGLang #22958)"),
    Mutant("overrun", Overrun, Check.GUARD_BANDS, "derived",
           "a kernel writing past its index row into neighbouring graph memory (SGLang #27338)"),
)


def declaring_matrix(shipped: Matrix, fields: tuple[str, ...], backend: str = "reference") -> Matrix:
    """``shipped`` with ``backend``'s draft-decode declaration replaced by one that lists
    ``fields`` as refreshed in-graph (``none_needed`` when there are none), as the adapter
    of a mutant would declare them."""
    strategy = RefreshStrategy.IN_GRAPH if fields else RefreshStrategy.NONE_NEEDED
    draft = DraftDecode(supported=True, refresh_strategy=strategy, refreshed_fields=fields)
    return shipped.replacing(shipped.backend(backend).model_copy(update={"draft_decode": draft}))
