"""Known-bad builders that re-create historical bugs of this class, and the self-test that
proves the verifier catches each one with the check meant for it.

Every mutant is the reference backend plus one derived, step-dependent field
(``kv_lens_plus_one``, kept in a persistent buffer and refreshed in-graph) with exactly one
thing done wrong. :class:`DerivedBuilder` does it right and must pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from speccheck.backends.reference.builder import (
    ReferenceAttentionImpl,
    ReferenceMetadata,
    ReferenceMetadataBuilder,
)
from speccheck.contract.metadata import CommonAttentionMetadata


@dataclass
class DerivedMetadata(ReferenceMetadata):
    kv_lens_plus_one: torch.Tensor | None = None


class DerivedBuilder(ReferenceMetadataBuilder):
    """Derives ``kv_lens_plus_one`` from ``seq_lens`` into a persistent buffer whose tail is
    zeroed, declares it, and recomputes it in place between draft steps."""

    step_dependent_fields: ClassVar[tuple[str, ...]] = ("kv_lens_plus_one",)

    def setup(self) -> None:
        self.derived = self.allocate_persistent("derived", (self.limits.max_num_reqs,), torch.int32)

    def build(self, common: CommonAttentionMetadata) -> DerivedMetadata:
        base = super().build(common)
        n = common.num_reqs
        self.derived[:n].copy_(common.seq_lens + 1)
        self.derived[n:].zero_()
        return DerivedMetadata(**vars(base), kv_lens_plus_one=self.derived[:n])

    def update_draft_decode_metadata(self, metadata: DerivedMetadata) -> None:
        torch.add(metadata.seq_lens, 1, out=metadata.kv_lens_plus_one)

    def persistent_buffer_extents(self, metadata: DerivedMetadata) -> dict[str, int]:
        assert metadata.kv_lens_plus_one is not None
        return {"derived": metadata.kv_lens_plus_one.shape[0]}


class StaleRefresh(DerivedBuilder):
    def update_draft_decode_metadata(self, metadata: DerivedMetadata) -> None:
        """Forgets to recompute the derived lengths."""


class UndeclaredField(DerivedBuilder):
    step_dependent_fields = ()


class AllocatingRefresh(DerivedBuilder):
    def update_draft_decode_metadata(self, metadata: DerivedMetadata) -> None:
        """Rebinds the field to a new tensor instead of writing the persistent one."""
        metadata.kv_lens_plus_one = metadata.seq_lens + 1


class SyncingRefresh(DerivedBuilder):
    def update_draft_decode_metadata(self, metadata: DerivedMetadata) -> None:
        """Decides on the host from a device value."""
        if int(metadata.seq_lens.max().item()) > 0:
            torch.add(metadata.seq_lens, 1, out=metadata.kv_lens_plus_one)


class DirtyTail(DerivedBuilder):
    def build(self, common: CommonAttentionMetadata) -> DerivedMetadata:
        """Leaves stale entries past the live rows (as if from an earlier, larger batch)."""
        md = super().build(common)
        self.derived[common.num_reqs :].fill_(7)
        return md


class Overrun(DerivedBuilder):
    def update_draft_decode_metadata(self, metadata: DerivedMetadata) -> None:
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
    check: str
    diagnosis: str
    """A phrase the catching check's diagnosis must contain."""
    recreates: str
    gpu_check: str | None = None
    """The catching check on the GPU tier, where it differs (a host sync inside a captured
    refresh already breaks the capture)."""
    gpu_diagnosis: str | None = None

    def expected(self, gpu: bool) -> tuple[str, str]:
        if gpu and self.gpu_check is not None:
            return self.gpu_check, self.gpu_diagnosis or ""
        return self.check, self.diagnosis


MUTANTS: tuple[Mutant, ...] = (
    Mutant("stale_refresh", StaleRefresh, "step_metadata",
           "kv_lens_plus_one differs from a fresh eager build",
           "a derived field not refreshed between fused draft steps (FA3 AOT schedule, vLLM "
           "stale draft metadata): outputs may even stay right"),
    Mutant("undeclared_field", UndeclaredField, "declared_fields", "does not declare it",
           "a step-dependent field missing from the builder's declaration"),
    Mutant("allocating_refresh", AllocatingRefresh, "in_place", "kv_lens_plus_one",
           "a refresh that rebinds a metadata tensor: replays keep reading the old address"),
    Mutant("syncing_refresh", SyncingRefresh, "host_sync", "item",
           "host-side decisions in captured code freeze dummy-batch values (TRT-LLM #17110)",
           gpu_check="capture", gpu_diagnosis="capturing the draft-decode graphs failed"),
    Mutant("padding_writes_live", PaddingWritesLive, "kv_cache", "outside the expected",
           "padding lanes with stale indices writing live KV slots (SGLang #10892, #25529)"),
    Mutant("dirty_tail", DirtyTail, "zero_tails", "unused tail",
           "stale entries of an earlier, larger batch past the live rows (SGLang #22958)"),
    Mutant("overrun", Overrun, "guard_bands", "derived",
           "a kernel writing past its index row into neighbouring graph memory (SGLang #27338)"),
)
