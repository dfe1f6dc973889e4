"""The common metadata fields checked against their meaning (``field_meanings``): the
matrix entry maps fields to a :class:`~speccheck.contract.matrix_model.FieldMeaning`, and
before every draft step of a run each such field must hold what its meaning gives for the
batch.

The expected values are the verifier's own statement of each meaning, computed on the host
from the :class:`~speccheck.speculator.batch.DraftBatch` alone (its lengths, new tokens and
block table), the draft step, the block size, ``max_model_len``, whether drafts advance, the
DCP share this process holds (:class:`~speccheck.checks.verify.kv_share.KvShare`) and the
padding lanes up to the recorded field's length. Nothing here calls a builder or a backend
helper: the oracle rebuilds every step with the builder's own helpers, so a helper wrong in
both the build and the refresh agrees with itself, and only a definition of its own catches
it (a DCP local length overestimated by one changes no output where the attention clips to
the causal bound).

A decode step runs one query token per lane: lane ``r < num_reqs`` is request ``r``, the
lanes past it are padding. Before step ``s`` (1-based) a request of ``L`` tokens after the
first pass has KV length ``min(L + s, max_model_len)`` and queries position ``min(L + s - 1,
max_model_len - 1)`` (``s`` stays 1 for drafts that do not advance). A padded first pass
(step 0: every request brings ``w`` new tokens, the bucket's padding requests none) runs
``w`` query tokens per request at positions ``ctx .. ctx + w - 1``, with KV length ``ctx +
w`` and query offsets ``min(i, num_reqs) * w``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from speccheck.checks.verify.comparisons import FirstPassSnapshot, Outcome
from speccheck.checks.verify.kv_share import KvShare
from speccheck.checks.verify.split_schedule import (
    SCHEDULE_COLUMNS,
    Coverage,
    expected_schedule,
    read_schedule,
    token_tiles,
)
from speccheck.checks.verify.step_recorder import StepSnapshots, metadata_path
from speccheck.checks.verify.vocabulary import Check, Result
from speccheck.contract.groups import AttentionGroup
from speccheck.contract.matrix_model import SPLIT_MEANINGS, FieldMeaning, Matrix
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.batch import DraftBatch
from speccheck.speculator.kv_cache import PAD_SLOT, SINK_BLOCK


@dataclass(frozen=True)
class PassState:
    """One pass of one batch as the meanings see it: the padded first pass (``step`` 0,
    ``width`` new tokens per request) or draft step ``step`` (one token per request):
    ``seq_lens[r]`` and the query positions ``queries[r]`` of each real request ``r``
    (host integers)."""

    batch: DraftBatch
    step: int
    width: int
    seq_lens: tuple[int, ...]
    queries: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, batch: DraftBatch, step: int, *, max_model_len: int, advance: bool) -> PassState:
        """Step ``step`` of ``batch``: see the module docstring (step 0 only for a padded
        first pass, whose requests bring the same number of new tokens)."""
        if step == 0:
            width = len(batch.new_tokens[0])
            return cls(batch, 0, width,
                       tuple(ctx + width for ctx in batch.context_lens),
                       tuple(tuple(range(ctx, ctx + width)) for ctx in batch.context_lens))
        grown = step if advance else 1
        ends = [ctx + len(new) + grown for ctx, new in zip(batch.context_lens, batch.new_tokens)]
        return cls(batch, step, 1, tuple(min(end, max_model_len) for end in ends),
                   tuple((min(end - 1, max_model_len - 1),) for end in ends))

    @property
    def tokens(self) -> list[tuple[tuple[int, ...], int]]:
        """Each real query token in lane order: its request's block-table row and its
        position."""
        return [(row, position) for row, queries in zip(self.batch.block_table, self.queries)
                for position in queries]


def held_positions(length: int, share: KvShare) -> int:
    """How many of the positions ``0 .. length - 1`` of a request ``share`` holds."""
    return len(range(share.rank, length, share.world))


@dataclass(frozen=True)
class MeaningGeometry:
    """What the expected values depend on besides the batch and the step."""

    block_size: int
    max_model_len: int
    advance: bool
    share: KvShare
    """The cache this process holds (a DCP rank's share, or the whole cache)."""
    dcp_world_size: int
    """The config's DCP world (the width of a per-rank length table)."""
    sliding_window: int
    """The config's sliding window (``0``: none)."""


def _lanes(shape: torch.Size, real: int, extra: int = 0) -> int | None:
    """The rows a field of ``shape`` covers (its first dimension less ``extra``), or
    ``None`` when they cannot hold its ``real`` rows (requests or tokens)."""
    if len(shape) == 0 or shape[0] - extra < real:
        return None
    return shape[0] - extra


def _per_lane(values: Sequence[int], n: int, pad: int = 0) -> torch.Tensor:
    return torch.tensor([*values, *[pad] * (n - len(values))], dtype=torch.int64)


def _query_start_loc(d: PassState, g: MeaningGeometry, shape: torch.Size) -> torch.Tensor | None:
    n = _lanes(shape, d.batch.num_reqs, extra=1)
    if n is None or len(shape) != 1:
        return None
    return torch.tensor([min(i, d.batch.num_reqs) * d.width for i in range(n + 1)],
                        dtype=torch.int64)


def _seq_lens(d: PassState, g: MeaningGeometry, shape: torch.Size) -> torch.Tensor | None:
    n = _lanes(shape, d.batch.num_reqs)
    return None if n is None or len(shape) != 1 else _per_lane(d.seq_lens, n)


def _positions(d: PassState, g: MeaningGeometry, shape: torch.Size) -> torch.Tensor | None:
    tokens = d.tokens
    n = _lanes(shape, len(tokens))
    return None if n is None or len(shape) != 1 else _per_lane([p for _, p in tokens], n)


def _block_table(d: PassState, g: MeaningGeometry, shape: torch.Size) -> torch.Tensor | None:
    n = _lanes(shape, d.batch.num_reqs)
    if n is None or len(shape) != 2 or any(len(row) > shape[1] for row in d.batch.block_table):
        return None
    out = torch.full((n, shape[1]), SINK_BLOCK, dtype=torch.int64)
    for r, row in enumerate(d.batch.block_table):
        out[r, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return out


def _kv_slots(d: PassState, g: MeaningGeometry, shape: torch.Size) -> torch.Tensor | None:
    tokens = d.tokens
    n = _lanes(shape, len(tokens))
    if n is None or len(shape) != 1:
        return None
    slots = [g.share.slot(row, position, g.block_size) for row, position in tokens]
    return _per_lane([PAD_SLOT if slot is None else slot for slot in slots], n, PAD_SLOT)


def _local_seq_lens(d: PassState, g: MeaningGeometry, shape: torch.Size) -> torch.Tensor | None:
    n = _lanes(shape, d.batch.num_reqs)
    if n is None or len(shape) != 1:
        return None
    return _per_lane([held_positions(length, g.share) for length in d.seq_lens], n)


def _local_seq_len_table(
    d: PassState, g: MeaningGeometry, shape: torch.Size
) -> torch.Tensor | None:
    n = _lanes(shape, d.batch.num_reqs)
    world = g.dcp_world_size
    if n is None or tuple(shape[1:]) != (world,):
        return None
    out = torch.zeros((n, world), dtype=torch.int64)
    for r, length in enumerate(d.seq_lens):
        for rank in range(world):
            out[r, rank] = held_positions(length, KvShare(rank, world))
    return out


def _window_length(position: int, window: int) -> int:
    return min(position + 1, window)


def _window_lengths(d: PassState, g: MeaningGeometry, shape: torch.Size) -> torch.Tensor | None:
    tokens = d.tokens
    n = _lanes(shape, len(tokens))
    if n is None or len(shape) != 1 or g.sliding_window <= 0:
        return None
    return _per_lane([_window_length(p, g.sliding_window) for _, p in tokens], n)


def _window_slots(d: PassState, g: MeaningGeometry, shape: torch.Size) -> torch.Tensor | None:
    tokens = d.tokens
    n = _lanes(shape, len(tokens))
    window = g.sliding_window
    if n is None or window <= 0 or tuple(shape[1:]) != (window,):
        return None
    out = torch.full((n, window), -1, dtype=torch.int64)
    for r, (row, position) in enumerate(tokens):
        first = position - _window_length(position, window) + 1
        for i, held in enumerate(range(first, position + 1)):
            slot = g.share.slot(row, held, g.block_size)
            out[r, i] = -1 if slot is None else slot
    return out


Definition = Callable[[PassState, MeaningGeometry, torch.Size], torch.Tensor | None]
"""A meaning's expected value for a field recorded with ``shape`` (int64, on the host), or
``None`` when no field of that shape can hold it."""


@dataclass(frozen=True)
class SplitField:
    """A recorded field of a split-KV schedule meaning, with what its rule reads besides
    the batch: the entry's tile size and the other split fields of the same metadata (by
    meaning)."""

    value: torch.Tensor
    tile: int
    siblings: Mapping[FieldMeaning, torch.Tensor]


def _attended(d: PassState, g: MeaningGeometry) -> list[int]:
    """Each real query token's attended KV positions that this process holds: its window
    (the config's sliding window) or its causal KV (``position + 1``)."""
    out = []
    for _, position in d.tokens:
        length = _window_length(position, g.sliding_window) if g.sliding_window > 0 else (
            position + 1)
        first = position - length + 1
        out.append(held_positions(position + 1, g.share) - held_positions(first, g.share))
    return out


def _coverage(d: PassState, g: MeaningGeometry, schedule: torch.Tensor, tile: int,
              num_tokens: int) -> Coverage | str:
    return read_schedule(schedule, token_tiles(_attended(d, g), tile), num_tokens)


def _split_schedule(d: PassState, g: MeaningGeometry, f: SplitField) -> torch.Tensor | str | None:
    if f.value.dim() != 2 or f.value.shape[1] < len(SCHEDULE_COLUMNS):
        return None
    offsets = f.siblings.get(FieldMeaning.KV_SPLIT_OFFSETS)
    num_tokens = len(d.tokens) if offsets is None else max(offsets.shape[0] - 1, 0)
    coverage = _coverage(d, g, f.value, f.tile, num_tokens)
    return coverage if isinstance(coverage, str) else expected_schedule(f.value, coverage)


def _split_offsets(d: PassState, g: MeaningGeometry, f: SplitField) -> torch.Tensor | str | None:
    if f.value.dim() != 1 or _lanes(f.value.shape, len(d.tokens), extra=1) is None:
        return None
    schedule = f.siblings.get(FieldMeaning.KV_SPLIT_SCHEDULE)
    if schedule is None:
        return "has no kv_split_schedule field in its metadata to count"
    coverage = _coverage(d, g, schedule, f.tile, f.value.shape[0] - 1)
    if isinstance(coverage, str):
        return f"counts an invalid schedule: {coverage}"
    return torch.tensor(coverage.offsets(), dtype=torch.int64)


SplitRule = Callable[[PassState, MeaningGeometry, SplitField], torch.Tensor | str | None]
"""A split-KV meaning's expected value for a recorded field (the field as its rule gives it:
the recorded partition with what follows from it), what breaks the rule, or ``None`` when
no field of that shape can hold it."""

SPLIT_RULES: dict[FieldMeaning, SplitRule] = {
    FieldMeaning.KV_SPLIT_SCHEDULE: _split_schedule,
    FieldMeaning.KV_SPLIT_OFFSETS: _split_offsets,
}

DEFINITIONS: dict[FieldMeaning, Definition] = {
    FieldMeaning.QUERY_START_LOC: _query_start_loc,
    FieldMeaning.SEQ_LENS: _seq_lens,
    FieldMeaning.POSITIONS: _positions,
    FieldMeaning.BLOCK_TABLE: _block_table,
    FieldMeaning.KV_SLOTS: _kv_slots,
    FieldMeaning.LOCAL_SEQ_LENS: _local_seq_lens,
    FieldMeaning.LOCAL_SEQ_LEN_TABLE: _local_seq_len_table,
    FieldMeaning.WINDOW_LENGTHS: _window_lengths,
    FieldMeaning.WINDOW_SLOTS: _window_slots,
}
"""Every meaning's definition but the split-KV ones' (:data:`SPLIT_RULES`; a test holds the
two complete)."""


TOKEN_MEANINGS = frozenset({FieldMeaning.POSITIONS, FieldMeaning.KV_SLOTS,
                            FieldMeaning.WINDOW_LENGTHS, FieldMeaning.WINDOW_SLOTS})
"""Meanings with one row per query token (the others: one per request or lane)."""


def _where(index: tuple[int, ...], meaning: FieldMeaning, d: PassState) -> str:
    """``request r`` (``padding lane i``, ``request r token j``) of a mismatch at ``index``
    of a field of ``meaning``; query offsets name the request an offset starts."""
    row = index[0] if index else 0
    suffix = f", entry {index[1]}" if len(index) > 1 else ""
    num_reqs = d.batch.num_reqs
    if meaning is FieldMeaning.KV_SPLIT_SCHEDULE:
        column = index[1] if len(index) > 1 else 0
        return f"part {row} ({SCHEDULE_COLUMNS[column]})"
    if meaning is FieldMeaning.KV_SPLIT_OFFSETS:
        return f"entry {row} (the partials before token {row})"
    if meaning is FieldMeaning.QUERY_START_LOC and row == num_reqs:
        return "the end of the last request"
    if meaning in TOKEN_MEANINGS and d.width > 1:
        if row < num_reqs * d.width:
            return f"request {row // d.width} token {row % d.width}{suffix}"
        return f"padding token {row}{suffix}"
    if row < num_reqs:
        return f"request {row}{suffix}"
    return f"padding lane {row}{suffix}"


@dataclass(frozen=True)
class DeclaredMeanings:
    """The fields of a run's metadata with a declared meaning (snapshot path -> meaning),
    and what their expected values depend on."""

    fields: Mapping[str, FieldMeaning]
    geometry: MeaningGeometry
    split_tiles: Mapping[str, int] = field(default_factory=dict)
    """The tile size of each split-KV field's entry (snapshot path -> ``kv_split_tile``)."""

    @cached_property
    def _split_siblings(self) -> Mapping[str, tuple[str, ...]]:
        """Each split-KV field's path -> the split-KV fields of the same metadata (itself
        included): what its rule reads beside it. Found once per declaration."""
        split = [path for path, meaning in self.fields.items() if meaning in SPLIT_MEANINGS]
        holder = {path: path.rpartition(".metadata.")[0] for path in split}
        return {path: tuple(o for o in split if holder[o] == holder[path]) for path in split}

    @classmethod
    def of(
        cls, matrix: Matrix, groups: Sequence[AttentionGroup], config: RuntimeConfig,
        share: KvShare,
    ) -> DeclaredMeanings:
        """The meanings ``matrix`` declares for the metadata of ``groups``, keyed by the
        paths :mod:`~speccheck.checks.verify.step_recorder` records them under."""
        fields: dict[str, FieldMeaning] = {}
        split_tiles: dict[str, int] = {}
        for group in groups:
            draft = matrix.backend(group.backend_name).draft_decode
            for name, meaning in draft.field_meanings.items():
                path = metadata_path(group.backend_name, name)
                fields[path] = meaning
                if meaning in SPLIT_MEANINGS and draft.kv_split_tile is not None:
                    split_tiles[path] = draft.kv_split_tile
        geometry = MeaningGeometry(config.block_size, config.max_model_len,
                                   config.advance_draft_positions, share, config.dcp_world_size,
                                   config.sliding_window)
        return cls(fields, geometry, split_tiles)

    def check(
        self, batch: DraftBatch, steps: StepSnapshots, name: str,
        first_pass: FirstPassSnapshot | None = None,
    ) -> list[Outcome]:
        """Before every recorded draft step of run ``name``, and in its padded first pass
        (``first_pass``, step 0) where one ran, every declared field equals its meaning's
        value for ``batch``; the first mismatch (earliest step, declaration order) names
        the field, the step, the request and both values. A declared field the metadata
        does not hold is a mismatch too."""
        if not self.fields:
            return [Outcome(Check.FIELD_MEANINGS, Result.SKIPPED,
                            "the matrix entry declares no field_meanings", name)]
        recorded = dict(steps)
        if first_pass is not None and 0 in first_pass.snapshots:
            recorded[0] = first_pass.snapshots[0]
        if not recorded:
            return [Outcome(Check.FIELD_MEANINGS, Result.SKIPPED,
                            "no metadata recorded (single draft step, unpadded first pass)",
                            name)]
        for step in sorted(recorded):
            failed = self.check_step(batch, step, recorded[step], name)
            if failed is not None:
                return [failed]
        return [Outcome(Check.FIELD_MEANINGS, Result.PASSED, candidate=name)]

    def check_step(
        self, batch: DraftBatch, step: int, snapshot: Mapping[str, torch.Tensor], name: str
    ) -> Outcome | None:
        """The failed outcome of the first declared field (declaration order) that
        ``snapshot``, the metadata of run ``name`` before draft step ``step`` (``0``: its
        padded first pass), holds against its meaning for ``batch``; ``None`` when all
        agree."""
        state = PassState.of(batch, step, max_model_len=self.geometry.max_model_len,
                             advance=self.geometry.advance)
        where = f"before draft step {step}" if step else "in the padded first pass"
        for path, meaning in self.fields.items():
            problem = self._problem(state, path, meaning, snapshot)
            if problem is not None:
                return Outcome(Check.FIELD_MEANINGS, Result.FAILED,
                               f"{name}: {where}, {path} ({meaning.value}) {problem}",
                               name, step, path)
        return None

    def _expected(
        self, state: PassState, path: str, meaning: FieldMeaning, got: torch.Tensor,
        snapshot: Mapping[str, torch.Tensor],
    ) -> torch.Tensor | str | None:
        """``meaning``'s value for the field at ``path`` recorded as ``got``: see
        :data:`DEFINITIONS` and :data:`SPLIT_RULES`."""
        if meaning not in SPLIT_MEANINGS:
            return DEFINITIONS[meaning](state, self.geometry, got.shape)
        siblings = {self.fields[other]: snapshot[other].to(torch.int64)
                    for other in self._split_siblings[path] if other in snapshot}
        recorded = SplitField(got.to(torch.int64), self.split_tiles[path], siblings)
        return SPLIT_RULES[meaning](state, self.geometry, recorded)

    def _problem(
        self, state: PassState, path: str, meaning: FieldMeaning,
        snapshot: Mapping[str, torch.Tensor],
    ) -> str | None:
        """What is wrong with the field at ``path`` of ``snapshot`` as the value of
        ``meaning`` in ``state``, or ``None``."""
        got = snapshot.get(path)
        if got is None:
            return "is not in the metadata (the matrix entry declares its meaning)"
        if got.is_floating_point() or got.is_complex():
            return f"is of dtype {got.dtype}, not an integer tensor"
        expected = self._expected(state, path, meaning, got, snapshot)
        num_reqs = state.batch.num_reqs
        if expected is None:
            return (f"has shape {tuple(got.shape)}, which cannot hold its meaning for "
                    f"{num_reqs} request(s)")
        if isinstance(expected, str):
            return f"breaks its rule: {expected}"
        bad = (got.to(torch.int64) != expected).nonzero()
        if bad.numel() == 0:
            return None
        index = tuple(int(i) for i in bad[0])
        return (f"at {_where(index, meaning, state)} is {int(got[index])}, its meaning "
                f"gives {int(expected[index])}")
