"""The verifier's vocabulary, as records: every check (the registry the docs' check table and
the reports are generated from), the result of one check, a backend's status, the tier, and
the candidates compared with the oracle.

Members are ``StrEnum``s, so reports serialise them as their plain values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

if TYPE_CHECKING:  # imports torch; this module is imported by torch-free commands
    from speccheck.speculator.autoregressive import DecodePath


class Check(enum.StrEnum):
    """Every check the verifier runs, in report order; each carries what must hold.

    Declared as ``NAME = ("value", "what must hold")``. Adding a member adds a row to the
    generated docs (``docs/checks.md``), a tally to every report and a JUnit test case.
    """

    description: str

    def __new__(cls, value: str, description: str) -> Self:
        member = str.__new__(cls, value)
        member._value_ = value
        member.description = description
        return member

    @classmethod
    def parse(cls, value: str) -> Check:
        """The check whose value is ``value`` (reports store checks by value)."""
        return cls._value2member_map_[value]  # type: ignore[return-value]

    CAPTURE = (
        "capture",
        "(GPU) capturing the draft-decode graphs succeeds; a host sync or pageable copy inside "
        "the captured refresh makes it fail",
    )
    DRAFT_TOKENS = (
        "draft_tokens",
        "candidate tokens equal the oracle's exactly; where the oracle's top-2 logits are within "
        "2× the dtype tolerance and the tokens differ, the position is *indeterminate* (counted, "
        "never passed), and the request's later steps are not compared",
    )
    LOGITS = (
        "logits",
        "within the dtype tolerance (fp32 1e-4, fp16 2e-2, bf16 6e-2, scaled for large logits) "
        "up to each request's first divergence",
    )
    KV_CACHE = (
        "kv_cache",
        "the expected slots hold the oracle's values; nothing else changed, except the sink "
        "block (so no padding lane and no stale slot mapping wrote a live slot); every padding "
        "lane's slot mapping points at the sink (a stray write names the slot and the lane)",
    )
    PADDING_ROWS = (
        "padding_rows",
        "the attention output rows of padding tokens (past `query_start_loc[num_reqs]` of a "
        "padded pass or step), which arrive zero, are left zero by every layer's `forward()` "
        "in the oracle and every candidate, and in the padded pass of every `--dp-size N` "
        "rank (counted on the device, inside captured graphs too): no draft token, logit or "
        "KV slot depends on them, so no other check sees a write there",
    )
    STEP_METADATA = (
        "step_metadata",
        "before every draft step, every tensor reachable from the metadata and the builder's "
        "persistent buffers equals the oracle's fresh eager build for that step (snapshotted "
        "with in-place copies inside the captured graph; at a padded first pass, the tensors "
        "reached from its metadata), and so does every host value reachable from the "
        "metadata (a graph's are those it was captured with)",
    )
    FIELD_MEANINGS = (
        "field_meanings",
        "before every draft step of the oracle and of every candidate, each field the matrix "
        "entry gives a meaning (`draft_decode.field_meanings`: lengths, positions, query "
        "offsets, slots, block table, DCP local lengths, windows) equals that meaning's value "
        "computed from the batch itself, not from the builder or its helpers, and a split-KV "
        "schedule obeys its rule (every tile of every token run once, partials numbered in "
        "order); a mismatch names the field, the step, the request (or part) and both values",
    )
    DECLARED_FIELDS = (
        "declared_fields",
        "claims audit: a derived tensor that changes between the oracle's steps must be listed "
        "in the matrix entry's `draft_decode.refreshed_fields` (or `invalidated_caches`), and "
        "every listed field must exist in the metadata (views of the speculator's input buffers "
        "are not derived)",
    )
    VS_FP32_REFERENCE = (
        "vs_fp32_reference",
        "the oracle agrees with the fp32 reference: the drafter in fp32 on the tensor-op "
        "form of every layer, sampling and index-buffer update, over an attention of its own "
        "(`checks/verify/oracle`: its own KV write, dense masked softmax over each request's "
        "keys and values gathered from the cache) that shares no code with `backends/`, so "
        "it runs for `reference` too (graph and eager can agree and both be wrong; they also "
        "share the drafter's Triton kernels)",
    )
    LATENT_FIELDS = (
        "latent_fields",
        "(informational) on the run's first clean examples, each declared refreshed field is "
        "put back to its value before every refresh of the eager fused candidate (stale, as a "
        "forgotten refresh leaves it); a field whose stale value changes no draft token and "
        "no logit is listed as latent in the report (`latent_fields`): its value is checked by "
        "`field_meanings` only; never a failure",
    )
    REFRESH_ERROR = (
        "refresh_error",
        "the refresh (`update_draft_decode_metadata`, run eagerly in the fused loop) raises "
        "nothing; an exception is reported once, with the last frames of its traceback",
    )
    HOST_SYNC = (
        "host_sync",
        "the refresh makes no host synchronisation (`.item()`, `.tolist()`, `nonzero`, "
        "`bool(t)`, device-to-host copies, …; traced in the eager fused loop with torch "
        "dispatch and function modes, and CUDA sync-debug mode on a GPU), nor does the "
        "attention call (`forward()`, traced on the CPU tier on the path a graph records; "
        "a GPU captures it for real); a finding names the file and line",
    )
    IN_PLACE = (
        "in_place",
        "the refresh rebinds no metadata or builder tensor to a new object or address",
    )
    ZERO_TAILS = (
        "zero_tails",
        "rows of a persistent buffer past what the metadata uses are zero (builders declare "
        "the extents); every example starts with those buffers poisoned, so a stale tail fails "
        "in a fresh worker too",
    )
    GUARD_BANDS = (
        "guard_bands",
        "nothing was written into the poisoned bands the verifier places around every "
        "persistent buffer (builders allocate them through `allocate_persistent`)",
    )
    DP_TOKEN_COUNT = (
        "dp_token_count",
        "(`--dp-size N`) on every rank, the attention metadata covers the token count the "
        "seed-004 rule gives: FULL, the padded count; eager, the real `query_start_loc[-1]`",
    )
    DP_MATCHES_SINGLE_RANK = (
        "dp_matches_single_rank",
        "(`--dp-size N`) on every rank, the drafts of the padded pass equal a single-rank run "
        "of the same requests (a difference at a near-tie is indeterminate)",
    )
    DP_VS_FP32_REFERENCE = (
        "dp_vs_fp32_reference",
        "(`--dp-size N`) on every rank, the single-rank run's drafts agree with the same "
        "DFlash drafter in fp32 over the oracle's attention (`checks/verify/oracle`: dense "
        "masked softmax, non-causal within each block, sharing no code with `backends/`): "
        "the padded pass can equal the single-rank run and both be wrong",
    )
    DCP_BLOCKS_VS_FP32_REFERENCE = (
        "dcp_blocks_vs_fp32_reference",
        "(`--dcp-world-size N --drafter dflash`) on every rank of a real DCP group, each "
        "holding its interleaved share of the KV cache and attending the DFlash drafter's "
        "blocks non-causally over it, the drafts agree with the same drafter in fp32 over "
        "the oracle's attention run by one process holding the whole cache the ranks hold "
        "together: no causal bound clips a rank's share here, so a local length or mask one "
        "position too wide shows",
    )


class Result(enum.StrEnum):
    """The result of one check on one example."""

    PASSED = "passed"
    FAILED = "failed"
    INDETERMINATE = "indeterminate"
    """Could not be decided (a near-tie of the oracle's logits): counted, never passed."""
    SKIPPED = "skipped"


class Status(enum.StrEnum):
    """A backend's verdict in a verify run."""

    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"
    """Nothing ran: no adapter, another platform, or a missing kernel package."""
    CRASHED = "crashed"
    """The worker died or hung; the report names the last example it started."""


class Tier(enum.StrEnum):
    """What a verify run could exercise on this machine."""

    GPU = "gpu"
    """Real CUDA graphs."""
    CPU = "cpu"
    """Eager loops, probes by tracing; no graph result is claimed."""
    NONE = "none"
    """Nothing ran."""


@dataclass(frozen=True)
class Candidate:
    """A draft path compared with the eager per-step oracle, replayed from captured graphs
    or run eagerly."""

    path: DecodePath
    graphs: bool

    @property
    def name(self) -> str:
        """``fused_graph``, ``host_preplanned_eager``, ``per_step_graph``, …"""
        return f"{self.path.value}_{'graph' if self.graphs else 'eager'}"

    def __str__(self) -> str:
        return self.name
