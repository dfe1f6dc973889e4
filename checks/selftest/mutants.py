"""Known-bad builders that re-create historical bugs of this class, and the self-test that
proves the verifier catches each one with the check meant for it.

Most mutants are the reference backend plus one derived, step-dependent field
(``kv_lens_plus_one``, kept in a persistent buffer and refreshed in-graph) with exactly one
thing done wrong; the others are the reference backend with one fault of their own (a host
bound, a slot mapping of its own, an impl that ignores the slot mapping). Each is verified
against a matrix whose ``reference`` entry declares what the mutant's adapter would declare
(:func:`declaring_matrix`). :class:`DerivedBuilder` does it right and must pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from speccheck.backends.batch_layout import padding_tokens
from speccheck.backends.reference.builder import (
    ReferenceAttentionImpl,
    ReferenceMetadata,
    ReferenceMetadataBuilder,
)
from speccheck.checks.verify.vocabulary import Check
from speccheck.contract.adapter_status import implementation_path
from speccheck.contract.builder import AttentionMetadataBuilder
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


class ShortOnlyRefresh(DerivedBuilder):
    refreshed_below: ClassVar[int] = 16
    """Requests this long or longer are left stale (the self-test's lengths run to 32)."""

    def update_draft_decode_metadata(self, metadata: ReferenceMetadata) -> None:
        """Recomputes the derived lengths only of requests shorter than
        :attr:`refreshed_below` (a fast path, or a table sized for short sequences); longer
        ones keep the previous step's."""
        derived = _derived(metadata)
        fresh = metadata.seq_lens + 1
        derived.copy_(torch.where(metadata.seq_lens < self.refreshed_below, fresh, derived))


class FirstRequestRefresh(DerivedBuilder):
    def update_draft_decode_metadata(self, metadata: ReferenceMetadata) -> None:
        """Recomputes the derived lengths of the first request only (a grid of one block, a
        ``[:1]`` slice): single-request batches pass."""
        torch.add(metadata.seq_lens[:1], 1, out=_derived(metadata)[:1])


@dataclass
class BoundedMetadata(DerivedMetadata):
    max_seq_len: int = 0
    """Host bound on every request's length, from the common metadata at build time."""


class _BoundedImpl(ReferenceAttentionImpl):
    """Attends over at most ``metadata.max_seq_len`` keys per request: a host bound passed
    to the kernel as a launch argument, as FlashAttention's ``max_seqlen_k`` is."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: ReferenceMetadata,
        output: torch.Tensor,
    ) -> None:
        assert isinstance(metadata, BoundedMetadata)
        bounded = metadata.seq_lens.clamp(max=metadata.max_seq_len)
        super().forward(query, key, value, key_cache, value_cache,
                        dataclasses.replace(metadata, seq_lens=bounded), output)


class BakedMaxSeqLen(DerivedBuilder):
    """Refreshes its derived lengths correctly, but its impl bounds the keys it attends to
    by a host ``max_seq_len`` set at build time, which no in-graph refresh can update: from
    the second draft step on the longest request loses its newest key (and a replayed graph
    keeps the bound of the dummy batch it was captured on)."""

    impl_cls = _BoundedImpl

    def build(self, common: CommonAttentionMetadata) -> BoundedMetadata:
        return BoundedMetadata(**vars(super().build(common)), max_seq_len=common.max_seq_len)


@dataclass
class QueryLensMetadata(DerivedMetadata):
    query_lens: torch.Tensor | None = None


class BuildOnlyQueryLens(DerivedBuilder):
    """Declares that its refresh rebuilds the metadata (``refresh_rebuilds``) and
    recomputes its derived lengths whole, tail included, but also keeps each request's
    query length (from the query offsets) in a persistent buffer that only the build
    writes. The field never changes between draft steps, so it needs no declaration and
    the per-step contract holds; graphs that refresh instead of building keep whatever an
    earlier build left there (a decode step, the first pass's query lengths)."""

    def setup(self) -> None:
        super().setup()
        self.query_lens = self.allocate_persistent(
            "query_lens", (self.limits.max_num_reqs,), torch.int32)

    def build(self, common: CommonAttentionMetadata) -> QueryLensMetadata:
        n = common.num_reqs
        offsets = common.query_start_loc
        torch.sub(offsets[1 : n + 1], offsets[:n], out=self.query_lens[:n])
        self.query_lens[n:].zero_()
        return QueryLensMetadata(**vars(super().build(common)), query_lens=self.query_lens[:n])

    def update_draft_decode_metadata(self, metadata: ReferenceMetadata) -> None:
        super().update_draft_decode_metadata(metadata)
        self.derived[_derived(metadata).shape[0]:].zero_()

    def persistent_buffer_extents(self, metadata: ReferenceMetadata) -> dict[str, int]:
        assert isinstance(metadata, QueryLensMetadata) and metadata.query_lens is not None
        return {**super().persistent_buffer_extents(metadata),
                "query_lens": metadata.query_lens.shape[0]}


@dataclass
class OwnSlotsMetadata(ReferenceMetadata):
    token_slots: torch.Tensor | None = None
    """The speculator's slot mapping (advanced in place), which the refresh copies from."""


class PaddingSharesSlot(ReferenceMetadataBuilder):
    """Keeps its own slot mapping in a persistent buffer, rebuilt from the speculator's at
    build time and in the refresh, but pads it by repeating the first token's slot instead
    of the sink's: every padding lane writes its key and value into the slot request 0
    writes in the same pass. Per-step and fused runs agree, so only the slot mapping shows
    it."""

    def setup(self) -> None:
        self.slots = self.allocate_persistent("slots", (self.limits.max_num_tokens,), torch.int64)

    def build(self, common: CommonAttentionMetadata) -> OwnSlotsMetadata:
        base = super().build(common)
        n = common.num_actual_tokens
        fields = {**vars(base), "slot_mapping": self.slots[:n]}
        metadata = OwnSlotsMetadata(**fields, token_slots=common.slot_mapping[:n])
        self.update_draft_decode_metadata(metadata)
        return metadata

    def update_draft_decode_metadata(self, metadata: ReferenceMetadata) -> None:
        """Real tokens (those before ``query_start_loc[-1]``) keep their slot; the others
        get token 0's."""
        assert isinstance(metadata, OwnSlotsMetadata) and metadata.token_slots is not None
        source = metadata.token_slots
        padding = padding_tokens(metadata.query_start_loc, source.shape[0])
        metadata.slot_mapping.copy_(torch.where(padding, source[:1].expand_as(source), source))


class _PaddingWritesLiveImpl(ReferenceAttentionImpl):
    """Sends padding tokens' KV to the first request's next slot instead of the sink."""

    def forward(self, query, key, value, key_cache, value_cache, metadata, output) -> None:  # type: ignore[no-untyped-def]
        slots = metadata.slot_mapping
        padding = padding_tokens(metadata.query_start_loc, slots.shape[0])
        patched = torch.where(padding, slots[0].expand_as(slots) + 1, slots)
        metadata = ReferenceMetadata(**{**vars(metadata), "slot_mapping": patched})
        super().forward(query, key, value, key_cache, value_cache, metadata, output)


class PaddingWritesLive(ReferenceMetadataBuilder):
    impl_cls = _PaddingWritesLiveImpl


class _PaddingRowsWrittenImpl(ReferenceAttentionImpl):
    """Copies the last real token's attention output into every padding row (as a kernel
    whose last tile runs past the batch's last real token does). Capture-safe."""

    def forward(self, query, key, value, key_cache, value_cache, metadata, output) -> None:  # type: ignore[no-untyped-def]
        super().forward(query, key, value, key_cache, value_cache, metadata, output)
        real = metadata.query_start_loc[-1]
        last = output.index_select(0, (real - 1).clamp(min=0).view(1))
        padding = padding_tokens(metadata.query_start_loc, output.shape[0])
        output.copy_(torch.where(padding.view(-1, 1, 1), last, output))


class PaddingRowsWritten(ReferenceMetadataBuilder):
    impl_cls = _PaddingRowsWrittenImpl


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
    refresh already breaks the capture; a field against its meaning stops the run before
    its kernels: :mod:`~speccheck.checks.verify.step_guard`)."""
    gpu_diagnosis: str | None = None
    declares: tuple[str, ...] = (DERIVED_FIELD,)
    """The step-dependent fields the mutant's matrix entry declares."""
    rebuilds: bool = False
    """What the mutant's matrix entry declares as ``refresh_rebuilds``."""

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
    Mutant("padding_rows_written", PaddingRowsWritten, Check.PADDING_ROWS,
           "the attention output of padding tokens",
           "an attention kernel writing the output rows of padding tokens (a split-KV merge or "
           "a last tile past the last real token): no draft token changes, but the rows are a "
           "real buffer's in an engine", declares=()),
    Mutant("dirty_tail", DirtyTail, Check.ZERO_TAILS, "unused tail",
           "stale entries of an earlier, larger batch past the live rows (SGLang #22958)"),
    Mutant("overrun", Overrun, Check.GUARD_BANDS, "derived",
           "a kernel writing past its index row into neighbouring graph memory (SGLang #27338)"),
    Mutant("short_only_refresh", ShortOnlyRefresh, Check.STEP_METADATA,
           "kv_lens_plus_one differs from a fresh eager build",
           "a refresh correct only below some length: tests with short sequences pass"),
    Mutant("baked_max_seq_len", BakedMaxSeqLen, Check.STEP_METADATA,
           "host value reference.metadata.max_seq_len is",
           "a host max_seq_len fixed at build (or capture) time that the kernel bounds its keys "
           "by: no in-graph refresh can update a host value"),
    Mutant("first_request_refresh", FirstRequestRefresh, Check.STEP_METADATA,
           "kv_lens_plus_one differs from a fresh eager build",
           "a refresh that updates only the first request: single-request tests pass"),
    Mutant("padding_shares_slot", PaddingSharesSlot, Check.KV_CACHE, "padding lane",
           "padding lanes writing a slot the batch itself writes in the same pass: the slot is "
           "expected and the oracle does the same, so only the slot mapping shows it",
           gpu_check=Check.FIELD_MEANINGS, gpu_diagnosis="reference.metadata.slot_mapping",
           declares=("slot_mapping",)),
    Mutant("build_only_field", BuildOnlyQueryLens, Check.STEP_METADATA,
           "query_lens differs from a fresh eager build",
           "a field only the build writes, under a matrix entry that says the refresh "
           "rebuilds the metadata: graphs that refresh instead of building keep an earlier "
           "build's values", rebuilds=True),
)


def declaring_matrix(shipped: Matrix, fields: tuple[str, ...], backend: str = "reference", *,
                     rebuilds: bool = False) -> Matrix:
    """``shipped`` with ``backend``'s draft-decode declaration replaced by one that lists
    ``fields`` as refreshed in-graph (``none_needed`` when there are none), and
    ``refresh_rebuilds`` as given, as the adapter of a mutant would declare
    them."""
    strategy = RefreshStrategy.IN_GRAPH if fields else RefreshStrategy.NONE_NEEDED
    draft = DraftDecode(supported=True, refresh_strategy=strategy, refreshed_fields=fields,
                        refresh_rebuilds=rebuilds,
                        field_meanings=shipped.backend(backend).draft_decode.field_meanings)
    return shipped.replacing(shipped.backend(backend).model_copy(update={"draft_decode": draft}))


def naming_matrix(shipped: Matrix,
                  builder: type[AttentionMetadataBuilder]) -> Matrix:  # type: ignore[type-arg]
    """``shipped`` with the entry of ``builder.backend_name`` naming ``builder`` as its
    implementation (everything it claims unchanged), as the author of that builder would
    ship it."""
    entry = shipped.backend(builder.backend_name).model_copy(
        update={"implementation": implementation_path(builder)})
    return shipped.replacing(entry)


def mutants_matrix(shipped: Matrix) -> Matrix:
    """A matrix of one entry per mutant, named after it: ``shipped``'s ``reference`` entry
    with the mutant's builder as its implementation and the mutant's declaration, so that
    ``speccheck verify --matrix FILE --backend all`` runs every mutant as a user's adapter
    is run (each in its worker, each failure's reproduce command re-run in a fresh one)."""
    entries = []
    for mutant in MUTANTS:
        declared = declaring_matrix(shipped, mutant.declares, rebuilds=
                                    mutant.rebuilds).backend("reference")
        builder = mutant.builder
        entries.append(declared.model_copy(update={
            "name": mutant.name, "display_name": f"Known-bad builder: {mutant.name}",
            "description": mutant.recreates,
            "implementation": implementation_path(builder),
        }))
    return Matrix(version=shipped.version, backends=tuple(entries))
