"""Where the oracle leaves the fp32 reference (``vs_fp32_reference``), and why.

:func:`localise` names the request and draft step of the first divergence, then looks at
the KV-cache slots that request reads at that step: a slot whose keys or values differ from
the reference's and that another lane wrote (a padding lane, a stale slot mapping) is the
cause, named with its block, position and the lane that wrote it; a slot the request's own
lane wrote with different layer-0 values points at the cache write; anything else means
only the attention output differs (later layers' keys and values follow from it).

Both speculators are re-run eagerly on the per-step path from the example's start state:
once plainly, to find the first divergence, then traced (:func:`trace_run`), copying the
KV cache at the slots of interest before every decode step and after the last, and the
slot mapping every decode step ran with. Host work, after a failure: never captured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from speccheck.checks.verify.comparisons import (
    KVSnapshot,
    compare_drafts,
    describe_slot,
    expected_slots,
)
from speccheck.checks.verify.vocabulary import Result
from speccheck.speculator.autoregressive import AutoregressiveSpeculator, DecodePath
from speccheck.speculator.batch import DraftBatch, DraftResult
from speccheck.speculator.kv_cache import SINK_BLOCK

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, (keys, values) at the traced slots: ``[slots, kv_heads, head_size]``."""

SLOT_MAPPING = "the slot mapping"
"""The speculator's slot mapping, by which every lane's key and value should be written."""


@dataclass(frozen=True)
class RunTrace:
    """One eager per-step run, observed at a fixed set of slots."""

    slots: list[int]
    """The traced slots, ascending."""
    kv: list[LayerKV]
    """``kv[0]``: the start state; ``kv[s + 1]``: the state after draft step ``s`` (0 is the
    prefill pass). Host copies in the cache's dtype."""
    slot_mappings: dict[int, dict[str, list[int]]]
    """Decode step -> the slot of every lane by :data:`SLOT_MAPPING` and by each group's
    metadata ``slot_mapping`` that differs from it (``"the GROUP metadata's slot_mapping"``):
    a backend may write the cache through a mapping of its own."""


def _kv_at(spec: AutoregressiveSpeculator, index: torch.Tensor) -> LayerKV:
    return [(k.flatten(0, 1)[index.to(k.device)].cpu(), v.flatten(0, 1)[index.to(v.device)].cpu())
            for k, v in spec.kv_cache.layers]


def trace_run(
    spec: AutoregressiveSpeculator, batch: DraftBatch, start: KVSnapshot, slots: list[int]
) -> RunTrace:
    """Run ``batch`` eagerly on the per-step path from the KV state ``start``, copying the
    cache at ``slots`` before the run, before every decode step and after the last, and
    the slot mappings of every decode step. The speculator's own step observer is set aside
    for the run and put back after it."""
    index = torch.tensor(slots, dtype=torch.long)
    spec.kv_cache.restore(start)
    kv = [_kv_at(spec, index)]
    mappings: dict[int, dict[str, list[int]]] = {}

    def observe(lanes: int, step: int, group_metadata: Sequence[Any],
                launched_with: Sequence[Any] | None) -> None:
        del launched_with  # an eager run: the metadata is what the step runs with
        kv.append(_kv_at(spec, index))
        lane_slots = spec.buffers.slot_mapping[:lanes].tolist()
        mappings[step] = {SLOT_MAPPING: lane_slots}
        for group, md in zip(spec.groups, group_metadata, strict=True):
            own = getattr(md, "slot_mapping", None)
            if isinstance(own, torch.Tensor) and own.dim() == 1:
                own_slots = own[:lanes].tolist()
                if own_slots != lane_slots:
                    mappings[step][f"the {group.backend_name} metadata's slot_mapping"] = own_slots

    saved = spec.step_observer
    spec.step_observer = observe
    try:
        spec.propose(batch, DecodePath.PER_STEP, use_graphs=False)
    finally:
        spec.step_observer = saved
    kv.append(_kv_at(spec, index))
    return RunTrace(slots, kv, mappings)


def earliest_divergence(
    expected: DraftResult, got: DraftResult, tol: float
) -> tuple[int, int] | None:
    """``(request, step)`` of the earliest draft step at which ``got`` leaves ``expected``
    (as :func:`~speccheck.checks.verify.comparisons.compare_drafts` judges it: logits
    beyond ``tol`` or a token that is not a near tie), the lowest request at that step;
    ``None`` when they agree."""
    found = []
    for r in range(expected.draft_tokens.shape[0]):
        row = slice(r, r + 1)
        outcomes = compare_drafts(DraftResult(expected.draft_tokens[row], expected.logits[row]),
                                  DraftResult(got.draft_tokens[row], got.logits[row]), "", tol)
        steps = [o.step for o in outcomes if o.result is Result.FAILED and o.step is not None]
        if steps:
            found.append((steps[0], r))
    if not found:
        return None
    step, request = min(found)
    return request, step


@dataclass(frozen=True)
class _Geometry:
    """Where the requests of a batch write and read, and which lane writes what."""

    batch: DraftBatch
    block_size: int
    max_model_len: int

    def slot(self, request: int, position: int) -> int:
        row = self.batch.block_table[request]
        return row[position // self.block_size] * self.block_size + position % self.block_size

    def base(self, request: int) -> int:
        return self.batch.context_lens[request] + len(self.batch.new_tokens[request])

    def decode_position(self, request: int, step: int) -> int:
        return min(self.base(request) + step - 1, self.max_model_len - 1)

    def reads(self, request: int, step: int) -> range:
        """Positions ``request`` attends over at draft step ``step`` (0: the prefill pass)."""
        return range(min(self.base(request) + step, self.max_model_len))

    def writes(self, request: int, k: int) -> dict[int, tuple[int, ...]]:
        """Position -> the draft steps at which ``request`` writes it."""
        steps: dict[int, tuple[int, ...]] = {
            p: (0,) for p in range(self.batch.context_lens[request], self.base(request))}
        for s in range(1, k):
            position = self.decode_position(request, s)
            steps[position] = (*steps.get(position, ()), s)
        return steps

    def lane(self, request: int, position: int, step: int) -> int:
        """The lane by which ``request`` writes ``position`` at ``step``: its prefill token's
        index at step 0, else its request index."""
        if step:
            return request
        before = sum(len(t) for t in self.batch.new_tokens[:request])
        return before + position - self.batch.context_lens[request]

    def mappings(self, trace: RunTrace, step: int) -> dict[str, list[int]]:
        """The slot of every lane at ``step``: the prefill tokens' from the batch (the eager
        prefill pass has no padding), a decode step's as ``trace`` recorded them."""
        if step:
            return trace.slot_mappings[step]
        return {SLOT_MAPPING: [self.slot(r, p) for r in range(self.batch.num_reqs)
                               for p in range(self.batch.context_lens[r], self.base(r))]}

    def describe_slots(self, slots: set[int], k: int) -> str:
        """The slots as diagnoses name them
        (:func:`~speccheck.checks.verify.comparisons.describe_slot`)."""
        written = expected_slots(self.batch, k, self.block_size, self.max_model_len)
        return ", ".join(describe_slot(self.batch, self.block_size, written, slot)
                         for slot in sorted(slots))

    def describe_lanes(self, step: int, lanes: Sequence[int]) -> str:
        return ", ".join(self._describe_lane(step, lane) for lane in lanes)

    def _describe_lane(self, step: int, lane: int) -> str:
        if step == 0:
            request = int(np.searchsorted(
                np.cumsum([len(t) for t in self.batch.new_tokens]), lane, side="right"))
            return f"prefill token {lane} (request {request})"
        if lane < self.batch.num_reqs:
            return f"lane {lane} (request {lane})"
        return f"lane {lane} (a padding lane)"


@dataclass(frozen=True)
class _SlotDiff:
    """A slot the diverging request reads whose keys or values differ from the reference's,
    and who wrote it in the oracle run."""

    layer: int
    kind: str
    slot: int
    position: int
    written: int | None
    """The last step at or before the divergence that changed the slot (``None``: none)."""
    own: bool
    """The request's own lane wrote it then, at a step where it writes this position."""
    others: dict[str, list[int]]
    """Mapping name -> the other lanes it sends to the slot at ``written``."""
    silent: list[int]
    """Lanes whose write at ``written`` did not land where :data:`SLOT_MAPPING` sends them."""

    @property
    def foreign(self) -> bool:
        """Another lane wrote the slot, or the request's own lane did not."""
        return bool(self.others) or not self.own

    @property
    def order(self) -> tuple[int, int, int]:
        return self.written or 0, self.layer, self.position


def traced_slots(batch: DraftBatch, request: int, step: int, k: int, block_size: int,
                 max_model_len: int) -> list[int]:
    """The slots :func:`localise` needs: what ``request`` reads at ``step``, every slot the
    batch writes, and the sink block (where padding lanes are sent)."""
    geo = _Geometry(batch, block_size, max_model_len)
    slots = {geo.slot(request, p) for p in geo.reads(request, step)}
    slots.update(expected_slots(batch, k, block_size, max_model_len))
    slots.update(range(SINK_BLOCK * block_size, (SINK_BLOCK + 1) * block_size))
    return sorted(slots)


def localise(
    batch: DraftBatch, k: int, block_size: int, max_model_len: int, divergence: tuple[int, int],
    oracle: RunTrace, reference: RunTrace, tol: float,
) -> str:
    """One clause for the ``vs_fp32_reference`` diagnosis: where the oracle first leaves
    the reference (``divergence``: request, step, from :func:`earliest_divergence`) and
    whether a KV-cache slot that request reads differs (the slot, and the lane that wrote
    it) or only the attention output does. ``oracle`` and ``reference`` trace the same
    slots (:func:`traced_slots`); KV values differing by more than ``tol`` differ. A slot
    another lane wrote is named before one the request's own lane wrote, the earliest
    write first."""
    request, step = divergence
    geo = _Geometry(batch, block_size, max_model_len)
    head = f"localised: request {request} first leaves the fp32 reference at draft step {step}"
    diffs = _differing_slots(geo, request, step, k, oracle, reference, tol)
    foreign = sorted((d for d in diffs if d.foreign), key=lambda d: d.order)
    if foreign:
        d = foreign[0]
        return (f"{head}; {len({x.slot for x in diffs})} slot(s) it reads hold keys or values "
                f"unlike the reference's, first layer {d.layer} {d.kind} at "
                f"{geo.describe_slots({d.slot}, k)}: {_foreign_write(geo, oracle, d, request, k)}")
    own = sorted(diffs, key=lambda d: d.order)
    if own and own[0].layer == 0:
        d = own[0]
        assert d.written is not None
        lane = geo.describe_lanes(d.written, [geo.lane(request, d.position, d.written)])
        suspects = (f"; {geo.describe_lanes(d.written, d.silent)} wrote nowhere the slot mapping "
                    "sends them, so may have written here too" if d.silent else "")
        return (f"{head}; layer 0 {d.kind} at {geo.describe_slots({d.slot}, k)}, written by its "
                f"own {lane} at draft step {d.written}, differ from the reference's: the cache "
                f"write or the key/value projection{suspects}")
    if own:
        d = own[0]
        return (f"{head}; no KV-cache slot it reads was written by another lane, and its own "
                f"layer-0 keys and values match: only the attention output differs (layer "
                f"{d.layer - 1} at draft step {d.written}, whose output changes the layer "
                f"{d.layer} {d.kind} written there)")
    return (f"{head}; every KV-cache slot it reads matches the reference's: only the attention "
            f"output differs (at draft step {step})")


@dataclass(frozen=True)
class FirstRunTokens:
    """The draft tokens of the run whose oracle parted from the fp32 reference (host)."""

    oracle: torch.Tensor
    reference: torch.Tensor


def localise_reference_divergence(
    spec: AutoregressiveSpeculator, reference: AutoregressiveSpeculator, batch: DraftBatch,
    k: int, start_state: Callable[[], KVSnapshot], block_size: int, max_model_len: int,
    tol: float, first_run: FirstRunTokens | None = None,
) -> str:
    """Re-run ``batch`` (of ``k`` draft steps) on the oracle ``spec`` and the fp32
    ``reference`` from its start state and say where and why they part (:func:`localise`).
    ``start_state()`` puts ``spec`` in the example's start state and returns its KV
    snapshot; it is called once per re-run. Where the re-runs agree, ``first_run`` (the
    failing run's tokens) tells which side drafted otherwise the first time."""
    start = start_state()
    oracle = spec.propose(batch, DecodePath.PER_STEP, use_graphs=False)
    reference.kv_cache.restore(start)
    expected = reference.propose(batch, DecodePath.PER_STEP)
    divergence = earliest_divergence(expected, oracle, tol)
    if divergence is None:
        return ("not localised: re-run from the same start state, the oracle agrees with "
                "the fp32 reference (the divergence depends on state the start state does "
                f"not set){_which_run_changed(first_run, oracle, expected)}")
    slots = traced_slots(batch, *divergence, k, block_size, max_model_len)
    start = start_state()
    oracle_trace = trace_run(spec, batch, start, slots)
    reference_trace = trace_run(reference, batch, start, slots)
    return localise(batch, k, block_size, max_model_len, divergence, oracle_trace,
                    reference_trace, tol)


def _which_run_changed(first_run: FirstRunTokens | None, oracle: DraftResult,
                       expected: DraftResult) -> str:
    """Which side's re-run drafted otherwise than its failing run: that side's first run
    was the odd one."""
    if first_run is None:
        return ""
    changed = [f"{name}'s ({int((then != now).sum())} of {now.numel()} tokens)"
               for name, then, now in (("the oracle", first_run.oracle, oracle.draft_tokens),
                                       ("the fp32 reference", first_run.reference,
                                        expected.draft_tokens))
               if then.shape != now.shape or bool((then != now).any())]
    if not changed:
        return "; each re-run drafted the tokens of its first run (they parted in the logits)"
    return f"; the first run differs from the re-run in {' and '.join(changed)} draft tokens"


def _differing_slots(
    geo: _Geometry, request: int, step: int, k: int, oracle: RunTrace, reference: RunTrace,
    tol: float,
) -> list[_SlotDiff]:
    """The slots ``request`` reads at ``step`` whose keys or values (per layer) differ from
    the reference's after that step, with who wrote them in the oracle run."""
    at = {slot: i for i, slot in enumerate(oracle.slots)}
    writes = geo.writes(request, k)
    diffs = []
    for position in geo.reads(request, step):
        slot = geo.slot(request, position)
        for layer, kind, mine, theirs in _layer_kinds(oracle.kv[step + 1], reference.kv[step + 1]):
            if float((mine[at[slot]].float() - theirs[at[slot]].float()).abs().max()) <= tol:
                continue
            written = _last_change(oracle, at[slot], layer, kind, step)
            if written is None:
                diffs.append(_SlotDiff(layer, kind, slot, position, None, False, {}, []))
                continue
            own_lane = geo.lane(request, position, written)
            mappings = geo.mappings(oracle, written)
            own = (written in writes.get(position, ())
                   and mappings[SLOT_MAPPING][own_lane] == slot)
            others = {name: lanes for name, mapping in mappings.items()
                      if (lanes := [lane for lane, mapped in enumerate(mapping)
                                    if mapped == slot and not (own and lane == own_lane)])}
            silent = [lane for lane, mapped in enumerate(mappings[SLOT_MAPPING])
                      if mapped in at and not _changed(oracle, at[mapped], layer, kind, written)]
            diffs.append(_SlotDiff(layer, kind, slot, position, written, own, others, silent))
    return diffs


def _layer_kinds(
    mine: LayerKV, theirs: LayerKV
) -> list[tuple[int, str, torch.Tensor, torch.Tensor]]:
    """``(layer, "keys"|"values", mine, theirs)`` per layer and cache tensor, leaving out
    empty ones (an MLA layer's second tensor holds nothing)."""
    return [(layer, kind, a, b)
            for layer, (pair, other) in enumerate(zip(mine, theirs, strict=True))
            for kind, a, b in (("keys", pair[0], other[0]), ("values", pair[1], other[1]))
            if a.numel()]


def _changed(trace: RunTrace, index: int, layer: int, kind: str, step: int) -> bool:
    """Whether draft step ``step`` changed the traced slot ``index`` in ``layer``."""
    which = 0 if kind == "keys" else 1
    before, after = trace.kv[step][layer][which][index], trace.kv[step + 1][layer][which][index]
    return not torch.equal(before, after)


def _last_change(trace: RunTrace, index: int, layer: int, kind: str, upto: int) -> int | None:
    for step in range(upto, -1, -1):
        if _changed(trace, index, layer, kind, step):
            return step
    return None


def _foreign_write(geo: _Geometry, trace: RunTrace, d: _SlotDiff, request: int, k: int) -> str:
    """Who wrote ``d.slot`` at ``d.written`` besides, or instead of, ``request``'s own lane."""
    step = d.written
    if step is None:
        return "no lane of the oracle run wrote it, yet it differs from the reference's"
    if d.own:
        lane = geo.describe_lanes(step, [geo.lane(request, d.position, step)])
        verb = f"written at draft step {step} by its own {lane} and by"
    else:
        verb = f"overwritten at draft step {step} by"
    spec_slots = geo.mappings(trace, step)[SLOT_MAPPING]
    if d.others:
        name, lanes = next(iter(d.others.items()))
        if name == SLOT_MAPPING:
            return (f"{verb} {geo.describe_lanes(step, lanes)}, which the slot mapping sends "
                    "there (a stale slot mapping)")
        where = geo.describe_slots({spec_slots[lane] for lane in lanes}, k)
        return (f"{verb} {geo.describe_lanes(step, lanes)}, which {name} sends there while "
                f"the slot mapping sends {'it' if len(lanes) == 1 else 'them'} to {where}")
    if d.silent:
        where = geo.describe_slots({spec_slots[lane] for lane in d.silent}, k)
        return (f"{verb} {geo.describe_lanes(step, d.silent)}, which the slot mapping sends to "
                f"{where}, where nothing was written: the write ignores the slot mapping")
    return f"{verb} a write that no lane's slot mapping points at"
