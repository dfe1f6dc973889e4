"""Hypothesis strategies for draft batches that differ from what graphs were captured on,
and the target that steers the search towards batches whose derived metadata changes
between draft steps."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings, target
from hypothesis import strategies as st

from speccheck.checks.probes.state_walk import same_value
from speccheck.checks.verify.cells import INT16_MAX, BatchClass
from speccheck.contract.builder import blocks_for
from speccheck.speculator.batch import DraftBatch


@dataclass(frozen=True)
class BatchLimits:
    """What a drafter can hold: the bounds every drawn batch respects."""

    max_num_reqs: int
    block_size: int
    max_model_len: int
    num_blocks: int
    extra_positions: int
    """Positions written past the new tokens (K-1 autoregressive, K for a DFlash block)."""
    vocab_size: int
    max_new_tokens: int = 3
    room_for_block: bool = False
    """Require ``context + new + extra_positions <= max_model_len`` (DFlash blocks)."""
    breakpoints: tuple[int, ...] = ()
    """Ascending sequence lengths at which the backend's derived metadata changes
    (:attr:`speccheck.checks.verify.breakpoints.Breakpoints.lengths`): requests of the
    :attr:`ContextKind.BREAKPOINT` kind are placed so that their draft steps cross one.
    Empty: no such kind is drawn."""
    batch_classes: tuple[BatchClass, ...] = (BatchClass.MIXED,)
    """The shapes drawn (:func:`~speccheck.checks.verify.cells.claimed_batch_classes` of the
    entry's CUDA-graph claim), each batch one of them."""
    capture_sizes: tuple[int, ...] = ()
    """The padded request counts (buckets): a ``uniform_padded`` batch has a request count
    below its bucket, so that padding lanes run beside it."""
    padded_widths: tuple[int, ...] = ()
    """Query widths whose uniform first pass runs padded over its bucket (the harness's
    ``first_pass_query_lens``): a ``uniform_padded`` draw has one of them
    (:attr:`padded_widths_drawn`), a batch of that class one of two tokens or more
    (:attr:`uniform_widths`)."""

    def __post_init__(self) -> None:
        ascending = list(self.breakpoints) == sorted(set(self.breakpoints))
        if not ascending or any(b < 1 for b in self.breakpoints):
            raise ValueError(
                f"breakpoints must be ascending positive lengths, got {self.breakpoints}"
            )
        if not self.batch_classes:
            raise ValueError("at least one batch class must be drawn")

    @property
    def padded_widths_drawn(self) -> tuple[int, ...]:
        """The query widths a ``uniform_padded`` draw picks from: the :attr:`padded_widths`
        up to ``max_new_tokens``, every width up to it where none is given or fits."""
        fit = [w for w in self.padded_widths if w <= self.max_new_tokens]
        return tuple(fit or range(1, self.max_new_tokens + 1))

    @property
    def uniform_widths(self) -> tuple[int, ...]:
        """The query widths of a batch of the ``uniform_padded`` class (:func:`has_shape`):
        those of :attr:`padded_widths_drawn` of two tokens or more (one token each is the
        single-token decode class), all of them where none is."""
        drawn = self.padded_widths_drawn
        return tuple(w for w in drawn if w >= 2) or drawn

    @property
    def padded_counts(self) -> tuple[int, ...]:
        """Request counts of two or more that run with padding lanes (not a capture size
        themselves); all of ``2..max_num_reqs`` where no capture size is known or none
        pads, ``(1,)`` where a batch holds one request."""
        counts = range(2, self.max_num_reqs + 1)
        padded = tuple(n for n in counts if self.capture_sizes and n not in self.capture_sizes)
        return padded or tuple(counts) or (1,)


class ContextKind(enum.StrEnum):
    """Where a request's context length is placed, every kind drawn for every backend
    (:attr:`BREAKPOINT` where the limits carry breakpoints); Hypothesis shrinks towards the
    first."""

    ANYWHERE = "anywhere"
    """Any length that fits."""
    BOUNDARY = "boundary"
    """Just before a block boundary, so the draft steps cross it."""
    CLAMP = "clamp"
    """Near the top, so the draft steps hit the ``max_model_len`` clamp."""
    BREAKPOINT = "breakpoint"
    """Just below a breakpoint, so the refreshes between draft steps cross it
    (:func:`_below_breakpoint`)."""
    EMPTY = "empty"
    """None: the prompt is all new tokens (with one new token, a first pass of length 1,
    whose only visible position is its own)."""


def _context_len(
    draw: st.DrawFn, limits: BatchLimits, q: int, room: int, first: bool = False
) -> int | None:
    """A context length of a drawn :class:`ContextKind`; every position the request writes
    stays below ``room`` (the positions its share of the live blocks holds), ``None`` where
    none fits. Where the top reaches past :data:`~speccheck.checks.verify.cells.INT16_MAX`
    (the long cell), the ``first`` request of every batch starts past it (a length an int16
    cannot hold)."""
    top = limits.max_model_len - q - (limits.extra_positions if limits.room_for_block else 0)
    if room < limits.max_model_len:
        top = min(top, room - q - limits.extra_positions)
    if top < 0:
        return None
    if first and top > INT16_MAX:
        return draw(st.integers(INT16_MAX + 1 - q, top))
    kind = draw(st.sampled_from(
        [kind for kind in ContextKind if limits.breakpoints or kind is not ContextKind.BREAKPOINT]))
    if kind is ContextKind.BREAKPOINT:
        return _below_breakpoint(draw, limits, q, top)
    if kind is ContextKind.ANYWHERE:
        return draw(st.integers(0, top))
    if kind is ContextKind.EMPTY:
        return 0
    if kind is ContextKind.CLAMP:
        return max(0, top - draw(st.integers(0, 2)))
    bs = limits.block_size
    boundary = draw(st.integers(1, max(1, top // bs))) * bs
    return int(np.clip(boundary - q - draw(st.integers(0, 1)), 0, top))


def _below_breakpoint(draw: st.DrawFn, limits: BatchLimits, q: int, top: int) -> int:
    """A context ``ctx`` in ``0..top`` whose draft steps cross a breakpoint ``b``.

    The arithmetic of the autoregressive speculator: with ``q`` new tokens, the prefill
    pass runs at length ``ctx + q`` and decode step ``s`` (``1..K-1``) at ``ctx + q + s``
    (clamped at ``max_model_len``, which no breakpoint exceeds); metadata is built for step
    1 and refreshed before steps ``2..K-1``. A refresh that should change a field at ``b``
    is exercised when ``ctx + q + 1 < b <= ctx + q + K - 1``, i.e. ``ctx = b - q - d`` with
    ``2 <= d <= K - 1 = extra_positions``. ``d`` shrinks towards 2 (step 1 runs at
    ``b - 1``, step 2 at ``b``) and ``b`` towards the first breakpoint this ``q`` and
    ``top`` can reach. With ``K <= 2`` there is no refresh, and ``d = 2`` puts step 1 just
    below ``b``. Where no breakpoint can be reached, the context is drawn anywhere.
    """
    most = max(2, limits.extra_positions)
    reachable = [b for b in limits.breakpoints if max(2, b - q - top) <= min(most, b - q)]
    if not reachable:
        return draw(st.integers(0, top))
    b = draw(st.sampled_from(reachable))
    return b - q - draw(st.integers(max(2, b - q - top), min(most, b - q)))


@st.composite
def draft_batches(draw: st.DrawFn, limits: BatchLimits) -> DraftBatch:
    """A batch of 1..``max_num_reqs`` requests of one of ``limits.batch_classes``, whose
    block tables are a shuffled, disjoint draw from the live blocks: mixed widths (each
    request's drawn on its own), single-token decode (one new token each), uniform with
    padding (:attr:`BatchLimits.padded_counts` requests of one of
    :attr:`BatchLimits.padded_widths_drawn`), or full
    (``max_num_reqs`` requests of ``max_new_tokens`` each). Each request leaves every later
    one the live blocks it needs with no context (:func:`reserved_blocks`, at the batch's
    widest width); a batch ends early only where even those run out.

    Shrinks towards the first class, one request, short contexts, one new token, token 0,
    seed 0.
    """
    bs = limits.block_size
    max_blocks = blocks_for(limits.max_model_len, bs)
    budget = limits.num_blocks - 1
    if budget < max_blocks:
        raise ValueError(f"num_blocks={limits.num_blocks} cannot hold one full request row")
    shape = draw(st.sampled_from(limits.batch_classes))
    if shape is BatchClass.UNIFORM_PADDED:
        n = draw(st.sampled_from(limits.padded_counts))
        width: int | None = draw(st.sampled_from(limits.padded_widths_drawn))
    elif shape is BatchClass.FULL:
        n, width = limits.max_num_reqs, limits.max_new_tokens
    else:
        n = draw(st.integers(1, limits.max_num_reqs))
        width = 1 if shape is BatchClass.SINGLE_TOKEN_DECODE else None
    reserve = reserved_blocks(limits, width or limits.max_new_tokens)
    contexts: list[int] = []
    news: list[tuple[int, ...]] = []
    rows_needed: list[int] = []
    for i in range(n):
        q = width if width is not None else draw(st.integers(1, limits.max_new_tokens))
        room = budget - sum(rows_needed) - (n - 1 - i) * reserve
        ctx = _context_len(draw, limits, q, room * bs, first=i == 0)
        if ctx is None:
            break
        last = min(ctx + q - 1 + limits.extra_positions, limits.max_model_len - 1)
        needed = last // bs + 1
        contexts.append(ctx)
        news.append(_tokens(draw, limits.vocab_size, q))
        rows_needed.append(draw(st.integers(needed, max(needed, min(max_blocks, room)))))
    layout = np.random.default_rng(draw(st.integers(0, 2**16))).permutation(
        np.arange(1, limits.num_blocks))
    rows, start = [], 0
    for count in rows_needed:
        rows.append(tuple(layout[start : start + count].tolist()))
        start += count
    seeds = tuple(draw(st.integers(0, 2**31 - 1)) for _ in contexts)
    return DraftBatch(tuple(contexts), tuple(news), tuple(rows), seeds)


def of_shape(limits: BatchLimits, shape: BatchClass | None) -> BatchLimits:
    """``limits`` drawing ``shape`` only (all its classes where ``None``)."""
    return limits if shape is None else dataclasses.replace(limits, batch_classes=(shape,))


def has_shape(shape: BatchClass, batch: DraftBatch, limits: BatchLimits) -> bool:
    """Whether ``batch`` is of ``shape`` within ``limits`` (a batch may be of several):
    requests of two widths or more (mixed), one new token each, one of the uniform widths
    over a request count that runs padding lanes, or the largest bucket's requests each of the
    most new tokens (full)."""
    widths = {len(tokens) for tokens in batch.new_tokens}
    if shape is BatchClass.MIXED:
        return len(widths) >= 2
    if shape is BatchClass.SINGLE_TOKEN_DECODE:
        return widths == {1}
    if shape is BatchClass.FULL:
        return batch.num_reqs == limits.max_num_reqs and widths == {limits.max_new_tokens}
    return (batch.num_reqs in limits.padded_counts and len(widths) == 1
            and widths <= set(limits.uniform_widths))


def reserved_blocks(limits: BatchLimits, q: int) -> int:
    """The blocks a request of ``q`` new tokens and no context needs: what each request of
    a batch leaves for each one after it."""
    return min(q - 1 + limits.extra_positions, limits.max_model_len - 1) // limits.block_size + 1


def _tokens(draw: st.DrawFn, vocab_size: int, count: int) -> tuple[int, ...]:
    """``count`` token ids from one drawn seed: a request's tokens cost hypothesis one
    choice, not ``count`` (64 requests of 16 tokens stay well inside its per-example
    budget). Seed 0 gives all-zero tokens, where shrinking ends."""
    token_seed = draw(st.integers(0, 2**32 - 1))
    if token_seed == 0:
        return (0,) * count
    return tuple(np.random.default_rng(token_seed).integers(0, vocab_size, count).tolist())


DECODE_K_WEIGHT = 2
"""How many times each K >= 2 is listed against K = 1's once (:func:`draft_step_counts`)."""

FIRST_REFRESHED_K = 3
"""The smallest K whose draft decode runs a refresh between two of its steps (K = 2 runs
one decode step, on built metadata)."""


def draft_step_counts(steps: Sequence[int]) -> st.SearchStrategy[int]:
    """A K from ``steps``: each K >= 2 (the examples that run draft decode steps)
    :data:`DECODE_K_WEIGHT` times as likely as K = 1 (no decode step: the first pass's
    control, about one example in fifteen of the default 1..8). The Ks that refresh
    (>= :data:`FIRST_REFRESHED_K`) are listed first, then K = 2, then K = 1, so that
    hypothesis' preference for early choices (its first examples, shrinking) falls on the
    smallest K that refreshes: a cell given one or two examples still runs a refresh."""
    refreshed = sorted(k for k in set(steps) if k >= FIRST_REFRESHED_K)
    decode = refreshed + sorted(k for k in set(steps) if 2 <= k < FIRST_REFRESHED_K)
    control = [1] if 1 in steps else []
    return st.sampled_from(decode * (DECODE_K_WEIGHT if decode else 1) + control)


TARGET_LABEL = "derived elements changed between draft steps"


def derived_step_changes(
    steps: Mapping[int, Mapping[str, torch.Tensor]],
    storage_of: Mapping[str, int],
    input_storages: Collection[int],
) -> int:
    """How many derived elements change between consecutive draft steps of one run,
    summed over the step pairs: the quantity a stale refresh would get wrong.

    ``steps`` is ``{step: {path: tensor}}`` as :meth:`StepMetadataRecorder.collect
    <speccheck.checks.verify.step_recorder.StepMetadataRecorder.collect>` returns it (the
    oracle's), ``storage_of`` the recorder's path -> storage address, ``input_storages``
    the storages of the speculator's input buffers, whose views are not derived (the
    speculator advances them). Each storage counts once, under its first path in walk order
    (a metadata field before the persistent buffer behind it). A tensor whose shape changes
    counts every element of the larger one.
    """
    ordered = [steps[s] for s in sorted(steps)]
    if len(ordered) < 2:
        return 0
    counted: set[int] = set(input_storages)
    paths: list[str] = []
    for path in ordered[0]:
        storage = storage_of.get(path)
        if storage is not None and storage not in counted:
            counted.add(storage)
            paths.append(path)
    total = 0
    for before, after in zip(ordered, ordered[1:]):
        for path in paths:
            a, b = before.get(path), after.get(path)
            if a is None or b is None or same_value(a, b):
                continue
            total += max(a.numel(), b.numel()) if a.shape != b.shape else int((a != b).sum())
    return total


def target_derived_changes(count: int) -> None:
    """Steer hypothesis towards examples where more derived elements change between
    draft steps (where a stale refresh shows). Call it from inside the ``@given`` test
    function, once per example, with :func:`derived_step_changes`; targeting runs only
    when ``Phase.target`` is among the settings' phases."""
    target(float(count), label=TARGET_LABEL)


T = TypeVar("T")


def draw_values(strategy: st.SearchStrategy[T], count: int, seed_value: int) -> list[T]:
    """``count`` values of ``strategy`` drawn by hypothesis from ``seed_value`` (generation
    only: no shrinking, no database), deterministic in the seed. For runs whose examples are
    drawn once, in one process, and handed to several (DP and DCP ranks), where a search
    running in each could go different ways."""
    drawn: list[T] = []

    @seed(seed_value)
    @settings(max_examples=count, database=None, deadline=None, derandomize=False,
              phases=(Phase.generate,), suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(value: T) -> None:
        drawn.append(value)

    collect()
    return drawn
