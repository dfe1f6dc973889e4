"""Schema of ``matrix.yaml``: strict, frozen pydantic models and nothing else.

The file is a mapping ``{version: 1, backends: [entry, ...]}``; each entry declares what one
attention backend can do and under which runtime conditions fused multi-step draft decoding
(all draft steps inside one CUDA graph) is allowed. Loading a file with line numbers lives in
:mod:`speccheck.contract.matrix_loader`; turning an entry plus a runtime configuration into a
decision lives in :mod:`speccheck.contract.resolution`.

Conventions: every model forbids unknown fields and is immutable; scalars are strict (no
``"90"`` for ``90``, no ``1`` for ``true``); every field has a description, which feeds the
exported JSON Schema and the generated capability docs. Cross-field rules reject
contradictions with the reason spelled out; a model reports all of its violations at once,
each tagged with the path of the field to change (see :func:`consistency_violations`).
"""

from __future__ import annotations

import enum
import functools
import json
from collections import Counter
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    GetJsonSchemaHandler,
    StrictBool,
    StrictInt,
    StrictStr,
    StringConstraints,
    Tag,
    ValidationError,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError

from speccheck.contract.conditions import ConditionError, parse_condition
from speccheck.contract.runtime_config import (
    DtypeName,
    KvCacheDtypeName,
    Platform,
    RuntimeConfig,
)

MATRIX_VERSION = 1
"""The ``version`` this schema reads."""

CONSISTENCY_ERROR_TYPE = "matrix_consistency"
"""Error type of cross-field violations; their ``ctx["violations"]`` holds
``((relative_loc, message), ...)`` pairs, one per field to change."""

Loc = tuple[str | int, ...]


class _DescribedEnum(enum.Enum):
    """String-valued enum whose members each carry a one-paragraph ``description``.

    Members are declared as ``NAME = ("value", "description")``; the YAML spelling is the
    value. The descriptions also appear in the JSON Schema (``markdownEnumDescriptions``).
    """

    description: str

    def __new__(cls, value: str, description: str) -> Self:
        member = object.__new__(cls)
        member._value_ = value
        member.description = description
        member.__doc__ = description
        return member

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        schema = handler.resolve_ref_schema(handler(core_schema))
        schema["markdownEnumDescriptions"] = [member.description for member in cls]
        return schema


@functools.total_ordering
class CudaGraphSupport(_DescribedEnum):
    """How much of a backend's attention can be captured in a CUDA graph, weakest first.

    Members are ordered: ``never < uniform_single_token_decode < uniform_batch < always``.
    """

    NEVER = (
        "never",
        "No CUDA graphs at all: the backend must run eagerly (or piecewise, with attention "
        "outside the graph).",
    )
    UNIFORM_SINGLE_TOKEN_DECODE = (
        "uniform_single_token_decode",
        "Only pure decode batches with exactly one query token per request can be captured.",
    )
    UNIFORM_BATCH = (
        "uniform_batch",
        "Batches where every request has the same query length can be captured; this covers "
        "speculative-decoding batches of 1 + k tokens per request and every draft step.",
    )
    ALWAYS = (
        "always",
        "Any batch can be captured, including mixed prefill and decode batches.",
    )

    @property
    def rank(self) -> int:
        """Position in the order ``never`` (0) .. ``always`` (3)."""
        return list(type(self)).index(self)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, CudaGraphSupport):
            return NotImplemented
        return self.rank < other.rank

    @classmethod
    def needed_for(cls, tokens_per_req: int) -> CudaGraphSupport:
        """The least support that captures uniform batches of ``tokens_per_req`` query
        tokens per request: single-token decode steps, or blocks such as DFlash's 1 + K."""
        return cls.UNIFORM_SINGLE_TOKEN_DECODE if tokens_per_req == 1 else cls.UNIFORM_BATCH


class RefreshStrategy(_DescribedEnum):
    """How a backend's step-dependent attention metadata stays correct across draft steps."""

    IN_GRAPH = (
        "in_graph",
        "`update_draft_decode_metadata` recomputes the listed fields with capture-safe GPU "
        "work, in place, between draft steps inside the captured graph.",
    )
    NONE_NEEDED = (
        "none_needed",
        "Nothing to refresh: every step-dependent field is a view of a persistent buffer that "
        "the speculator advances in place.",
    )
    HOST_PREPLANNED = (
        "host_preplanned",
        "Planning runs on the host, so it cannot happen inside a graph; instead one planned "
        "instance per draft step is prepared before a single replay (as SGLang does for "
        "FlashInfer). In-graph refresh is unavailable.",
    )


class FieldMeaning(_DescribedEnum):
    """What a common metadata field holds, defined by the batch alone: ``speccheck verify``
    computes each declared field's expected value from the draft batch itself (its
    lengths, new tokens and block table, the draft step, the block size, ``max_model_len``,
    the DCP share and the padding lanes up to the bucket), never from the builder, and
    compares it before every draft step."""

    QUERY_START_LOC = (
        "query_start_loc",
        "Query offsets `[lanes + 1]` (or more): entry `i` is the number of query tokens of "
        "requests `0 .. i - 1`, so padding lanes own no token (`min(i, num_reqs)` in a decode "
        "step).",
    )
    SEQ_LENS = (
        "seq_lens",
        "Each request's KV length at the step, `[lanes]`: its context, new tokens and draft "
        "positions so far, clamped at `max_model_len`; 0 for padding lanes.",
    )
    POSITIONS = (
        "positions",
        "Each query token's position, `[tokens]`: its KV length minus one at the step, "
        "clamped at `max_model_len - 1`; 0 for padding lanes.",
    )
    BLOCK_TABLE = (
        "block_table",
        "The batch's block table, `[lanes, width]`: request `r`'s row holds its blocks in "
        "order, the sink block (0) past its end and in padding rows.",
    )
    KV_SLOTS = (
        "kv_slots",
        "Where each query token writes its KV in the cache this process holds, `[tokens]`: "
        "without DCP `block_table[r, p // block_size] * block_size + p % block_size` for "
        "position `p`; as DCP rank `k` of `N` the local slot of `p // N` in the same row "
        "where `p % N == k`, else the sink slot (0); the sink slot for padding lanes.",
    )
    LOCAL_SEQ_LENS = (
        "local_seq_lens",
        "Each request's KV length in the cache this process holds, `[lanes]`: without DCP "
        "its KV length (`seq_lens`); as DCP rank `k` of `N` the number of positions `p < "
        "seq_len` with `p % N == k`; 0 for padding lanes.",
    )
    WINDOW_LENGTHS = (
        "window_lengths",
        "Each query token's sliding-window length, `[tokens]`: the positions it attends, "
        "`min(position + 1, sliding_window)`; 0 for padding lanes.",
    )
    WINDOW_SLOTS = (
        "window_slots",
        "The KV slot of each position of each query token's sliding window, oldest first, "
        "`[tokens, sliding_window]`: the slots of positions `position - length + 1 .. "
        "position` (`length`: its window length), `-1` past them and in padding rows.",
    )
    LOCAL_SEQ_LEN_TABLE = (
        "local_seq_len_table",
        "Each request's KV length on every DCP rank, `[lanes, N]`: column `k` counts the "
        "positions `p < seq_len` with `p % N == k`; 0 for padding lanes.",
    )
    KV_SPLIT_SCHEDULE = (
        "kv_split_schedule",
        "A split-KV tile schedule, `[parts, 5]` rows `(first token, first tile, last token, "
        "end tile, first partial)`: each query token's attended positions (its window, or "
        "its causal KV; under DCP the ones this process holds) cut into tiles of "
        "`kv_split_tile` positions; a row whose last token precedes its first runs nothing, "
        "the others run tiles `first tile ..` of the first token, all tiles of the tokens "
        "between and tiles `.. end tile - 1` of the last; every tile is run by exactly one "
        "row, each token's in row order, and a row's first partial is its first token's "
        "offset plus the earlier rows with tiles of it. A rule, not one value: schedules "
        "that cut the tiles differently are all valid.",
    )
    KV_SPLIT_OFFSETS = (
        "kv_split_offsets",
        "Cumulative partial counts of a split-KV schedule, `[tokens + 1]`: entry `t + 1` "
        "minus entry `t` is the number of rows of the `kv_split_schedule` field with tiles "
        "of token `t` (0 for padding tokens); entry 0 is 0.",
    )


SPLIT_MEANINGS = frozenset({FieldMeaning.KV_SPLIT_SCHEDULE, FieldMeaning.KV_SPLIT_OFFSETS})
"""Meanings stated in tiles of ``draft_decode.kv_split_tile`` positions."""


class KvLayout(_DescribedEnum):
    """Memory layout of the KV cache a backend reads. A property of the model's layers, not
    of the runtime configuration: resolution cannot judge it, and building a backend for a
    layer of another layout is refused."""

    NHD = (
        "NHD",
        "Keys and values as `[num_blocks, block_size, num_kv_heads, head_size]`.",
    )
    HND = (
        "HND",
        "Keys and values as `[num_blocks, num_kv_heads, block_size, head_size]`.",
    )
    LATENT = (
        "latent",
        "One latent entry per token (MLA): `[num_blocks, block_size, 1, kv_lora_rank + "
        "qk_rope_head_dim]`, the compressed KV followed by the rope key.",
    )


class StrictModel(BaseModel):
    """Base of every matrix model: unknown fields are errors and instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_condition(source: str) -> str:
    try:
        parse_condition(source)
    except ConditionError as exc:
        raise PydanticCustomError("condition", "{message}", {"message": str(exc)}) from None
    return source


def _reject(violations: Sequence[tuple[Loc, str]]) -> None:
    """Raise one validation error carrying every violation (see ``CONSISTENCY_ERROR_TYPE``)."""
    if violations:
        summary = "; ".join(
            f"{'.'.join(str(part) for part in loc)}: {message}" for loc, message in violations
        )
        raise PydanticCustomError(
            CONSISTENCY_ERROR_TYPE,
            "{summary}",
            {"summary": summary, "violations": tuple(violations)},
        )


def _duplicates(values: Sequence[object]) -> list[object]:
    return [value for value, count in Counter(values).items() if count > 1]


def _size_kind(value: Any) -> str | None:
    if isinstance(value, (list, tuple)):
        return "size-list"
    if isinstance(value, (dict, MultipleOf)):
        return "size-multiple-of"
    return None


def _supported_kind(value: Any) -> str | None:
    if isinstance(value, bool):
        return "supported-bool"
    if isinstance(value, str):
        return "supported-condition"
    return None


NonEmptyText = Annotated[StrictStr, StringConstraints(pattern=r"\S")]
BackendName = Annotated[StrictStr, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,63}$")]
DottedName = Annotated[
    StrictStr, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
]
_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
ImportPath = Annotated[
    StrictStr,
    StringConstraints(pattern=rf"^{_IDENTIFIER}(\.{_IDENTIFIER})*:{_IDENTIFIER}$"),
]
DistributionName = Annotated[
    StrictStr, StringConstraints(pattern=r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
]
PositiveInt = Annotated[StrictInt, Field(ge=1)]
ConditionText = Annotated[
    StrictStr,
    AfterValidator(_check_condition),
    Field(
        description="A condition over runtime-config fields, e.g. `dcp_world_size == 1` "
        "(comparisons, `in` a list literal, `and`/`or`/`not`, int/str/bool literals).",
        examples=["dcp_world_size == 1", "block_size == max_model_len"],
    ),
]
Supported = Annotated[
    Annotated[StrictBool, Tag("supported-bool")]
    | Annotated[ConditionText, Tag("supported-condition")],
    Discriminator(
        _supported_kind,
        custom_error_type="bool_or_condition",
        custom_error_message="expected true, false or a condition string such as "
        "'dcp_world_size == 1'",
    ),
]


class MultipleOf(StrictModel):
    """Any positive multiple of a base size, optionally capped."""

    multiple_of: PositiveInt = Field(description="Every allowed size is a multiple of this.")
    max: PositiveInt | None = Field(
        None, description="Largest allowed size; leave out for no upper bound."
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        violations: list[tuple[Loc, str]] = []
        if self.max is not None and self.max < self.multiple_of:
            violations.append(
                (("max",), f"is {self.max}, below multiple_of ({self.multiple_of}), so no size "
                 "is allowed; raise max or remove it")
            )
        _reject(violations)
        return self


SizeSpec = Annotated[
    Annotated[tuple[PositiveInt, ...], Tag("size-list")]
    | Annotated[MultipleOf, Tag("size-multiple-of")],
    Discriminator(
        _size_kind,
        custom_error_type="size_spec",
        custom_error_message="expected a list of sizes such as [16, 32] or a mapping such as "
        "{multiple_of: 16}",
    ),
]


class PythonPackage(StrictModel):
    """The Python distribution that provides a backend's kernels."""

    distribution: DistributionName = Field(
        description="Name to install from the package index, e.g. `fa3-fwd`."
    )
    import_name: DottedName = Field(
        description="Module to import to use it, e.g. `fa3_fwd_interface`."
    )
    extra: BackendName | None = Field(
        None,
        description="speccheck extra that installs it (`pip install \"speccheck[EXTRA]\"`); "
        "leave out when it is a core dependency.",
    )


class DraftDecode(StrictModel):
    """Whether, and how, the backend refreshes its metadata between fused draft steps."""

    supported: Supported = Field(
        description="Whether the backend supports draft-decode metadata update, i.e. fused "
        "multi-step draft decoding: `true`, `false`, or a condition over the runtime config.",
        examples=[True, False, "dcp_world_size == 1"],
    )
    reason: NonEmptyText | None = Field(
        None,
        description="Why fused draft decode is (or can be) unavailable; required whenever "
        "`supported` is false or a condition, and forbidden when it is true.",
    )
    refresh_strategy: RefreshStrategy = Field(
        strict=False, description="How step-dependent metadata is kept correct across steps."
    )
    refreshed_fields: tuple[DottedName, ...] = Field(
        (),
        description="Metadata fields (attribute names or dotted paths) that depend on the "
        "draft step: recomputed between draft steps (`in_graph`) or planned per step "
        "(`host_preplanned`). This is the only declaration of them: builders do not repeat "
        "it, and `speccheck verify` fails a backend whose metadata changes anything else "
        "derived between steps. Must be empty for `none_needed`.",
    )
    invalidated_caches: tuple[DottedName, ...] = Field(
        (),
        description="Lazily filled caches that must be cleared between draft steps "
        "(forgetting one reuses the previous step's contents).",
    )
    field_meanings: dict[DottedName, Annotated[FieldMeaning, Field(strict=False)]] = Field(
        default_factory=dict,
        description="Metadata fields (attribute names or dotted paths) whose meaning is "
        "known, each with its meaning: `speccheck verify` computes each one's expected value "
        "from the batch itself, not from the builder or its helpers, before every draft "
        "step of the oracle and of every candidate, so a wrong helper that the build and "
        "the refresh share cannot agree with itself. A field whose value reaches no output "
        "is checked by its meaning only; declare every common field the metadata holds.",
    )
    kv_split_tile: PositiveInt | None = Field(
        None,
        description="KV positions per tile of the split-KV schedule whose fields "
        "`field_meanings` declares (`kv_split_schedule`, `kv_split_offsets`); required "
        "with them, forbidden without.",
    )
    refresh_rebuilds: StrictBool = Field(
        False,
        description="Whether the in-graph refresh rebuilds the metadata: recomputes, from "
        "the speculator's inputs alone (lengths, positions, slot mapping, query offsets, "
        "block table) and the host values the metadata was built with, everything a build "
        "writes, tails included, for a pass of any layout (a padded first pass, a decode "
        "step). Then, where the config may fuse, the graphs build no metadata on the host: "
        "the first pass's graph refreshes before its forward and the fused graph before "
        "step 1 too, and a whole fused propose is one graph (its host work: staging its "
        "inputs and one replay). "
        "`speccheck verify` holds a backend to it: its eager fused candidate builds each "
        "metadata object before the call's inputs exist and poisons the zero-tail buffers "
        "before refreshing it, so a refresh that advances fields instead of recomputing "
        "them, or a build that writes what the refresh does not, fails. Only with "
        "`supported` not false and `refresh_strategy` in_graph or none_needed.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        violations: list[tuple[Loc, str]] = []
        if self.supported is True and self.reason is not None:
            violations.append(
                (("reason",), "must not be set when supported is true: a reason explains why "
                 "fused draft decode can be unavailable; remove it")
            )
        if self.supported is not True and self.reason is None:
            why = (
                "supported is false"
                if self.supported is False
                else f"supported is the condition {self.supported!r}, which can be false"
            )
            violations.append((("reason",), f"is required because {why}; say why"))
        strategy = self.refresh_strategy
        if strategy is RefreshStrategy.NONE_NEEDED:
            for name in ("refreshed_fields", "invalidated_caches"):
                if getattr(self, name):
                    violations.append(
                        ((name,), "must be empty when refresh_strategy is none_needed (every "
                         "step-dependent field is a view of a persistent buffer); use in_graph "
                         "if something is recomputed or cleared")
                    )
        if (
            strategy is RefreshStrategy.IN_GRAPH
            and not self.refreshed_fields
            and not self.invalidated_caches
        ):
            violations.append(
                (("refreshed_fields",), "must name at least one field (or invalidated_caches "
                 "one cache) when refresh_strategy is in_graph; use none_needed if nothing "
                 "changes between draft steps")
            )
        if self.refresh_rebuilds and (
            self.supported is False or strategy is RefreshStrategy.HOST_PREPLANNED
        ):
            violations.append(
                (("refresh_rebuilds",), "must be false when supported is false or "
                 "refresh_strategy is host_preplanned: only a fused graph refreshes in place")
            )
        if strategy is RefreshStrategy.HOST_PREPLANNED and self.supported is not False:
            violations.append(
                (("supported",), "must be false when refresh_strategy is host_preplanned: "
                 "host-side planning cannot run inside a captured graph")
            )
        violations.extend(self._split_violations())
        for name in ("refreshed_fields", "invalidated_caches"):
            for value in _duplicates(getattr(self, name)):
                violations.append(((name,), f"lists {value!r} more than once"))
        for value in sorted(set(self.refreshed_fields) & set(self.invalidated_caches)):
            violations.append(
                (("invalidated_caches",), f"lists {value!r}, which is also a refreshed field; "
                 "name it in one list only")
            )
        _reject(violations)
        return self

    def _split_violations(self) -> list[tuple[Loc, str]]:
        """A split-KV schedule's meanings need its tile size, and the offsets their
        schedule."""
        meanings = set(self.field_meanings.values())
        if meanings & SPLIT_MEANINGS and self.kv_split_tile is None:
            return [(("kv_split_tile",), "is required when field_meanings declares a split-KV "
                     "schedule (kv_split_schedule or kv_split_offsets): say how many KV "
                     "positions a tile holds")]
        if not meanings & SPLIT_MEANINGS and self.kv_split_tile is not None:
            return [(("kv_split_tile",), "must not be set when field_meanings declares no "
                     "split-KV schedule; remove it")]
        if FieldMeaning.KV_SPLIT_OFFSETS in meanings and (
            FieldMeaning.KV_SPLIT_SCHEDULE not in meanings
        ):
            return [(("field_meanings",), "declares kv_split_offsets without a "
                     "kv_split_schedule field: the offsets are defined by the schedule")]
        return []

    @property
    def step_dependent_fields(self) -> tuple[str, ...]:
        """The one declaration of the backend's step-dependent state: the refreshed fields,
        then the invalidated caches (paths into the metadata). The verifier snapshots them
        after every draft step and audits that nothing else derived changes."""
        return (*self.refreshed_fields, *self.invalidated_caches)


class ConditionConstraint(StrictModel):
    """A free-form constraint: a condition that must hold, and why."""

    condition: ConditionText
    reason: NonEmptyText = Field(description="Why the backend needs the condition to hold.")


class ConstraintReasons(StrictModel):
    """Why the backend needs each structured constraint, keyed by the constraint's name.

    A reason may only explain a constraint that is set. It is rendered with the constraint
    in the docs and appended, in parentheses, to every refusal the constraint causes.
    """

    dtypes: NonEmptyText | None = Field(
        None, description="Why only the listed `dtypes` are accepted."
    )
    kv_cache_dtypes: NonEmptyText | None = Field(
        None, description="Why only the listed `kv_cache_dtypes` are accepted."
    )
    head_sizes: NonEmptyText | None = Field(
        None, description="Why only the `head_sizes` given are accepted."
    )
    block_sizes: NonEmptyText | None = Field(
        None, description="Why only the `block_sizes` given are accepted."
    )
    kv_layout: NonEmptyText | None = Field(
        None, description="Why the KV cache must have this `kv_layout`."
    )
    causal_only: NonEmptyText | None = Field(
        None, description="Why the backend serves causal attention only."
    )


STRUCTURED_CONSTRAINTS: tuple[str, ...] = tuple(ConstraintReasons.model_fields)
"""The fields of :class:`Constraints` that :class:`ConstraintReasons` can explain, in
declaration order: ``dtypes``, ``kv_cache_dtypes``, ``head_sizes``, ``block_sizes``,
``kv_layout``, ``causal_only``."""


class Constraints(StrictModel):
    """Runtime configurations the backend can serve at all. Each restriction that is left
    out allows every value; a violated constraint disables the backend (so also fused draft
    decode) for that configuration, and building the backend for it is refused with the
    constraint and its reason (:mod:`speccheck.contract.constraints`)."""

    dtypes: tuple[DtypeName, ...] | None = Field(
        None, description="Activation dtypes the backend accepts."
    )
    kv_cache_dtypes: tuple[KvCacheDtypeName, ...] | None = Field(
        None, description="KV-cache storage dtypes the backend accepts."
    )
    head_sizes: SizeSpec | None = Field(
        None, description="Head sizes: a list, or `{multiple_of: N, max: M}`."
    )
    block_sizes: SizeSpec | None = Field(
        None, description="KV-cache block (page) sizes: a list, or `{multiple_of: N, max: M}`."
    )
    kv_layout: KvLayout | None = Field(
        None, strict=False,
        description="The KV-cache layout the backend reads; building it for a layer of "
        "another layout is refused. Leave out when it reads every layout.",
    )
    causal_only: StrictBool = Field(
        False,
        description="The backend serves causal attention only (each token sees positions up "
        "to its own): building it for a drafter with non-causal passes (a DFlash drafter's "
        "blocks) is refused. Leave out when it serves both.",
    )
    conditions: tuple[ConditionConstraint, ...] = Field(
        (), description="Further conditions over the runtime config, each with a reason."
    )
    reasons: ConstraintReasons = Field(
        default_factory=ConstraintReasons,
        description="Why the backend needs each structured constraint above, keyed by its "
        "name (e.g. `head_sizes: FA3 runs the next compiled size ...`); each key must name "
        "a constraint that is set. Conditions carry their own reason.",
    )

    def reason_for(self, name: str) -> str | None:
        """The matrix's reason for the structured constraint ``name`` (one of
        :data:`STRUCTURED_CONSTRAINTS`), or ``None`` when none is written."""
        if name not in STRUCTURED_CONSTRAINTS:
            raise KeyError(
                f"{name!r} is not a structured constraint; valid: "
                f"{', '.join(STRUCTURED_CONSTRAINTS)}"
            )
        reason: str | None = getattr(self.reasons, name)
        return reason

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        violations: list[tuple[Loc, str]] = []
        for name in ("dtypes", "kv_cache_dtypes", "head_sizes", "block_sizes"):
            values = getattr(self, name)
            if not isinstance(values, tuple):
                continue
            if not values:
                violations.append(
                    ((name,), "is an empty list, which allows nothing; list the allowed values "
                     "or leave the field out to allow every value")
                )
            for value in _duplicates(values):
                violations.append(((name,), f"lists {value!r} more than once"))
        for name in STRUCTURED_CONSTRAINTS:
            if getattr(self.reasons, name) is not None and getattr(self, name) in (None, False):
                violations.append(
                    (("reasons", name), f"explains {name}, which is not set; set {name} or "
                     "remove this reason")
                )
        _reject(violations)
        return self


MACHINE_FIELDS = ("platform", "compute_capability", "cudagraph_mode")
"""Runtime fields that describe the machine a verification runs on, not the configuration
it verifies."""

VERIFIABLE_FIELDS = tuple(name for name in RuntimeConfig.model_fields
                          if name not in (*MACHINE_FIELDS, "advance_draft_positions"))
"""The runtime fields a verification takes (its options, and what ``verify_defaults`` may
set): not the machine's, and not ``advance_draft_positions`` (the drafter verified always
advances its positions)."""


VerifyDefaults = dict[str, StrictInt | StrictStr | StrictBool]
"""Runtime field -> value; checked against :class:`RuntimeConfig` by the entry."""


def _verify_defaults_violations(defaults: VerifyDefaults) -> list[tuple[Loc, str]]:
    """One violation per field of ``verify_defaults`` that is not a runtime field verify can
    set, or whose value :class:`RuntimeConfig` rejects; each tagged with its own key."""
    known = VERIFIABLE_FIELDS
    violations: list[tuple[Loc, str]] = []
    for name, value in defaults.items():
        if name not in known:
            violations.append((("verify_defaults", name), f"{name!r} is not a runtime field "
                               f"verify can set; known fields are: {', '.join(known)}"))
            continue
        try:
            RuntimeConfig(**{name: value})
        except ValidationError as exc:
            message = exc.errors()[0]["msg"].replace("Input should be", "should be", 1)
            violations.append((("verify_defaults", name), f"{message}, got {value!r}"))
    return violations


class BackendEntry(StrictModel):
    """One attention backend's declared capabilities."""

    name: BackendName = Field(
        description="Registry name (lower snake case), used everywhere to refer to the backend."
    )
    display_name: NonEmptyText = Field(description="Human-readable name for docs and reports.")
    description: NonEmptyText = Field(description="One or two sentences on what the backend is.")
    implementation: ImportPath | None = Field(
        description="Import path `module:Class` of the metadata builder; `null` when no "
        "adapter is shipped yet (the backend is declared only)."
    )
    variant_of: BackendName | None = Field(
        None, description="Name of the backend this one is a variant of (must exist)."
    )
    platforms: tuple[Platform, ...] = Field(
        min_length=1, description="Platforms the backend runs on."
    )
    min_compute_capability: PositiveInt | None = Field(
        None,
        description="Lowest CUDA compute capability (major*10+minor, 90 = Hopper); only for "
        "backends that run on cuda. Leave out for no minimum.",
    )
    package: PythonPackage = Field(description="Python package that provides the kernels.")
    cudagraph_support: CudaGraphSupport = Field(
        strict=False, description="Which batches the backend's attention can capture."
    )
    draft_decode: DraftDecode = Field(description="Fused multi-step draft decode support.")
    constraints: Constraints = Field(
        default_factory=Constraints, description="Configurations the backend can serve."
    )
    verify_defaults: VerifyDefaults = Field(
        default_factory=dict,
        description="Runtime fields `speccheck verify` uses for this backend where the user "
        "gives none, over the machine tier's defaults: the configuration the adapter is "
        "verified at by default (e.g. the block size its constraints require). Fields of the "
        "machine (platform, compute capability, graph mode) cannot be set.",
    )
    notes: tuple[NonEmptyText, ...] = Field(
        (), description="Further facts worth knowing, rendered in the docs."
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        violations: list[tuple[Loc, str]] = []
        for platform in _duplicates(self.platforms):
            violations.append((("platforms",), f"lists {platform!r} more than once"))
        if self.min_compute_capability is not None and "cuda" not in self.platforms:
            violations.append(
                (("min_compute_capability",), "only applies to cuda, but platforms are "
                 f"{', '.join(self.platforms)}; remove it")
            )
        if self.variant_of == self.name:
            violations.append((("variant_of",), "names the backend itself; remove it"))
        violations += _verify_defaults_violations(self.verify_defaults)
        _reject(violations)
        return self


class Matrix(StrictModel):
    """The whole capability matrix: a version and one entry per backend."""

    version: Literal[1] = Field(description="Schema version of the file; must be 1.")
    backends: tuple[BackendEntry, ...] = Field(
        min_length=1, description="One entry per attention backend, names unique."
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        violations: list[tuple[Loc, str]] = []
        first_index: dict[str, int] = {}
        for index, entry in enumerate(self.backends):
            if entry.name in first_index:
                violations.append(
                    (("backends", index, "name"), f"{entry.name!r} is already the name of "
                     f"backends[{first_index[entry.name]}]; backend names must be unique")
                )
            first_index.setdefault(entry.name, index)
        by_name = {entry.name: entry for entry in self.backends}
        for index, entry in enumerate(self.backends):
            if entry.variant_of is None or entry.variant_of == entry.name:
                continue
            parent = by_name.get(entry.variant_of)
            if parent is None:
                known = ", ".join(sorted(by_name))
                violations.append(
                    (("backends", index, "variant_of"), f"refers to unknown backend "
                     f"{entry.variant_of!r}; known backends are: {known}")
                )
            elif parent.variant_of is not None:
                violations.append(
                    (("backends", index, "variant_of"), f"refers to {parent.name!r}, which is "
                     f"itself a variant of {parent.variant_of!r}; refer to that one instead")
                )
        _reject(violations)
        return self

    @property
    def names(self) -> tuple[str, ...]:
        """Backend names in file order."""
        return tuple(entry.name for entry in self.backends)

    def replacing(self, entry: BackendEntry) -> Matrix:
        """This matrix with the entry of the same name replaced by ``entry`` (validated like
        any matrix); ``KeyError`` when there is no such entry."""
        self.backend(entry.name)
        backends = tuple(entry if e.name == entry.name else e for e in self.backends)
        return Matrix(version=self.version, backends=backends)

    def backend(self, name: str) -> BackendEntry:
        """The entry called ``name``; ``KeyError`` naming the valid options otherwise."""
        for entry in self.backends:
            if entry.name == name:
                return entry
        raise KeyError(
            f"Unknown attention backend {name!r}. Valid options are: {', '.join(self.names)}"
        )


def render_matrix_json_schema() -> str:
    """The JSON Schema (validation mode) of :class:`Matrix` as text with sorted keys and a
    trailing newline, so that the committed ``matrix.schema.json`` diffs cleanly."""
    schema = Matrix.model_json_schema(mode="validation")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "speccheck capability matrix (matrix.yaml)"
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
