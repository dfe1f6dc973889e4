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
max_model_len - 1)`` (``s`` stays 1 for drafts that do not advance).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from speccheck.checks.verify.comparisons import Outcome
from speccheck.checks.verify.kv_share import KvShare
from speccheck.checks.verify.step_recorder import StepSnapshots
from speccheck.checks.verify.vocabulary import Check, Result
from speccheck.contract.groups import AttentionGroup
from speccheck.contract.matrix_model import FieldMeaning, Matrix
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.batch import DraftBatch
from speccheck.speculator.kv_cache import PAD_SLOT, SINK_BLOCK


@dataclass(frozen=True)
class DecodeStep:
    """One draft step of one batch, as the meanings see it: ``seq_lens[r]`` and
    ``positions[r]`` of each real request ``r`` (host integers)."""

    batch: DraftBatch
    step: int
    seq_lens: tuple[int, ...]
    positions: tuple[int, ...]

    @classmethod
    def of(cls, batch: DraftBatch, step: int, *, max_model_len: int, advance: bool) -> DecodeStep:
        """Draft step ``step`` (1-based) of ``batch``: see the module docstring."""
        grown = step if advance else 1
        ends = [ctx + len(new) + grown for ctx, new in zip(batch.context_lens, batch.new_tokens)]
        return cls(batch, step, tuple(min(end, max_model_len) for end in ends),
                   tuple(min(end - 1, max_model_len - 1) for end in ends))


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


def _lanes(shape: torch.Size, num_reqs: int, extra: int = 0) -> int | None:
    """The lane count a field of ``shape`` covers (its first dimension less ``extra``), or
    ``None`` when that cannot hold ``num_reqs`` requests."""
    if len(shape) == 0 or shape[0] - extra < num_reqs:
        return None
    return shape[0] - extra


def _per_lane(values: Sequence[int], n: int, pad: int = 0) -> torch.Tensor:
    return torch.tensor([*values, *[pad] * (n - len(values))], dtype=torch.int64)


def _query_start_loc(d: DecodeStep, g: MeaningGeometry, shape: torch.Size) -> torch.Tensor | None:
    n = _lanes(shape, d.batch.num_reqs, extra=1)
    if n is None or len(shape) != 1:
        return None
    return torch.tensor([min(i, d.batch.num_reqs) for i in range(n + 1)], dtype=torch.int64)


def _seq_lens(d: DecodeStep, g: MeaningGeometry, shape: torch.Size) -> torch.Tensor | None:
    n = _lanes(shape, d.batch.num_reqs)
    return None if n is None or len(shape) != 1 else _per_lane(d.seq_lens, n)


def _positions(d: DecodeStep, g: MeaningGeometry, shape: torch.Size) -> torch.Tensor | None:
    n = _lanes(shape, d.batch.num_reqs)
    return None if n is None or len(shape) != 1 else _per_lane(d.positions, n)


def _block_table(d: DecodeStep, g: MeaningGeometry, shape: torch.Size) -> torch.Tensor | None:
    n = _lanes(shape, d.batch.num_reqs)
    if n is None or len(shape) != 2 or any(len(row) > shape[1] for row in d.batch.block_table):
        return None
    out = torch.full((n, shape[1]), SINK_BLOCK, dtype=torch.int64)
    for r, row in enumerate(d.batch.block_table):
        out[r, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return out


def _kv_slots(d: DecodeStep, g: MeaningGeometry, shape: torch.Size) -> torch.Tensor | None:
    n = _lanes(shape, d.batch.num_reqs)
    if n is None or len(shape) != 1:
        return None
    slots = [g.share.slot(row, position, g.block_size)
             for row, position in zip(d.batch.block_table, d.positions)]
    return _per_lane([PAD_SLOT if slot is None else slot for slot in slots], n, PAD_SLOT)


def _local_seq_lens(d: DecodeStep, g: MeaningGeometry, shape: torch.Size) -> torch.Tensor | None:
    n = _lanes(shape, d.batch.num_reqs)
    if n is None or len(shape) != 1:
        return None
    return _per_lane([held_positions(length, g.share) for length in d.seq_lens], n)


def _local_seq_len_table(
    d: DecodeStep, g: MeaningGeometry, shape: torch.Size
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


Definition = Callable[[DecodeStep, MeaningGeometry, torch.Size], torch.Tensor | None]
"""A meaning's expected value for a field recorded with ``shape`` (int64, on the host), or
``None`` when no field of that shape can hold it."""

DEFINITIONS: dict[FieldMeaning, Definition] = {
    FieldMeaning.QUERY_START_LOC: _query_start_loc,
    FieldMeaning.SEQ_LENS: _seq_lens,
    FieldMeaning.POSITIONS: _positions,
    FieldMeaning.BLOCK_TABLE: _block_table,
    FieldMeaning.KV_SLOTS: _kv_slots,
    FieldMeaning.LOCAL_SEQ_LENS: _local_seq_lens,
    FieldMeaning.LOCAL_SEQ_LEN_TABLE: _local_seq_len_table,
}
"""Every meaning's definition (a test holds it complete)."""


def _where(index: tuple[int, ...], meaning: FieldMeaning, num_reqs: int) -> str:
    """``request r`` (or ``padding lane i``) of a mismatch at ``index`` of a field of
    ``meaning``; query offsets name the request an offset starts."""
    lane = index[0] if index else 0
    suffix = f", entry {index[1]}" if len(index) > 1 else ""
    if meaning is FieldMeaning.QUERY_START_LOC and lane == num_reqs:
        return "the end of the last request"
    if lane < num_reqs:
        return f"request {lane}{suffix}"
    return f"padding lane {lane}{suffix}"


@dataclass(frozen=True)
class DeclaredMeanings:
    """The fields of a run's metadata with a declared meaning (snapshot path -> meaning),
    and what their expected values depend on."""

    fields: Mapping[str, FieldMeaning]
    geometry: MeaningGeometry

    @classmethod
    def of(
        cls, matrix: Matrix, groups: Sequence[AttentionGroup], config: RuntimeConfig,
        share: KvShare,
    ) -> DeclaredMeanings:
        """The meanings ``matrix`` declares for the metadata of ``groups``, keyed by the
        paths :mod:`~speccheck.checks.verify.step_recorder` records them under."""
        fields = {
            f"{group.backend_name}.metadata.{name}": meaning
            for group in groups
            for name, meaning in matrix.backend(group.backend_name).draft_decode.field_meanings.items()
        }
        geometry = MeaningGeometry(config.block_size, config.max_model_len,
                                   config.advance_draft_positions, share, config.dcp_world_size)
        return cls(fields, geometry)

    def check(self, batch: DraftBatch, steps: StepSnapshots, name: str) -> list[Outcome]:
        """Before every recorded draft step of run ``name``, every declared field equals its
        meaning's value for ``batch``; the first mismatch (earliest step, declaration
        order) names the field, the step, the request and both values. A declared field
        the metadata does not hold is a mismatch too."""
        if not self.fields:
            return [Outcome(Check.FIELD_MEANINGS, Result.SKIPPED,
                            "the matrix entry declares no field_meanings", name)]
        if not steps:
            return [Outcome(Check.FIELD_MEANINGS, Result.SKIPPED, "single draft step", name)]
        for step in sorted(steps):
            decode = DecodeStep.of(batch, step, max_model_len=self.geometry.max_model_len,
                                   advance=self.geometry.advance)
            for path, meaning in self.fields.items():
                problem = self._problem(decode, path, meaning, steps[step].get(path))
                if problem is not None:
                    return [Outcome(Check.FIELD_MEANINGS, Result.FAILED,
                                    f"{name}: before draft step {step}, {path} ({meaning.value}) "
                                    f"{problem}", name, step, path)]
        return [Outcome(Check.FIELD_MEANINGS, Result.PASSED, candidate=name)]

    def _problem(
        self, decode: DecodeStep, path: str, meaning: FieldMeaning, got: torch.Tensor | None
    ) -> str | None:
        """What is wrong with ``got`` as the value of ``meaning`` at ``decode``, or
        ``None``."""
        if got is None:
            return "is not in the metadata (the matrix entry declares its meaning)"
        expected = DEFINITIONS[meaning](decode, self.geometry, got.shape)
        num_reqs = decode.batch.num_reqs
        if expected is None:
            return (f"has shape {tuple(got.shape)}, which cannot hold its meaning for "
                    f"{num_reqs} request(s)")
        if got.is_floating_point() or got.is_complex():
            return f"is of dtype {got.dtype}, not an integer tensor"
        bad = (got.to(torch.int64) != expected).nonzero()
        if bad.numel() == 0:
            return None
        index = tuple(int(i) for i in bad[0])
        return (f"at {_where(index, meaning, num_reqs)} is {int(got[index])}, its meaning "
                f"gives {int(expected[index])}")
