"""Comparisons of a candidate run with the oracle run, as check outcomes.

Pure functions over host copies: draft tokens and logits, KV-cache writes, and per-step
metadata snapshots (tensors and host values). Each returns :class:`Outcome` records with
one-line diagnoses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from speccheck.checks.verify.kv_share import WHOLE_CACHE, KVSnapshot, KvShare
from speccheck.checks.probes.state_walk import describe_host_value, same_host_value, same_value
from speccheck.checks.verify.step_recorder import StepSnapshots, reached_from_metadata
from speccheck.checks.verify.vocabulary import Check, Result
from speccheck.contract.host_copy import int64_on
from speccheck.speculator.batch import DraftBatch, DraftResult
from speccheck.speculator.kv_cache import SINK_BLOCK

V = TypeVar("V")

SLOT_MAPPING_SUFFIX = ".metadata.slot_mapping"
"""Snapshot paths that end so hold the slot each lane's new key and value are written to
(every adapter's metadata names it ``slot_mapping``: one entry per token)."""


@dataclass(frozen=True)
class FirstPassSnapshot:
    """The metadata a padded first pass ran with (``snapshots[0]``), ``query_len`` new
    tokens per request."""

    snapshots: StepSnapshots
    query_len: int


@dataclass
class Outcome:
    """One check on one example. ``candidate`` names the candidate compared (``None`` for
    the oracle's own checks); ``step`` and ``field`` point at where it diverged."""

    check: Check
    result: Result
    diagnosis: str = ""
    candidate: str | None = None
    step: int | None = None
    field: str | None = None


def compare_drafts(
    oracle: DraftResult, cand: DraftResult, name: str, tol: float,
    *, token_check: Check = Check.DRAFT_TOKENS, logit_check: Check = Check.LOGITS,
) -> list[Outcome]:
    """Per request, step by step until the first divergence (later steps ran on different
    inputs): the logits must agree within ``tol`` (scaled for large logits), and the tokens
    exactly. Different tokens with agreeing logits and an oracle top-2 gap below ``2 * tol``
    are a near tie: indeterminate, never counted as agreement. ``cand``'s tensors have the
    shapes of the oracle's (``ValueError`` otherwise)."""
    shapes = [(tuple(d.draft_tokens.shape), tuple(d.logits.shape)) for d in (oracle, cand)]
    if shapes[0] != shapes[1]:
        raise ValueError(f"{name}: draft tokens and logits of shapes {shapes[1]}, the "
                         f"oracle's {shapes[0]}")
    # Per (request, step) figures as Python numbers, each in one host read.
    top2 = oracle.logits.topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1]).tolist()
    diffs = (oracle.logits - cand.logits).abs().amax(dim=-1).tolist()
    scales = oracle.logits.abs().amax(dim=-1).tolist()
    oracle_tokens, cand_tokens = oracle.draft_tokens.tolist(), cand.draft_tokens.tolist()
    out: list[Outcome] = []
    for r in range(oracle.draft_tokens.shape[0]):
        for step in range(oracle.draft_tokens.shape[1]):
            o_tok, c_tok = oracle_tokens[r][step], cand_tokens[r][step]
            diff = diffs[r][step]
            bound = tol * max(1.0, scales[r][step] / 10)
            if diff > bound:
                out.append(Outcome(logit_check, Result.FAILED,
                                   f"{name}: request {r} step {step}: logits differ by {diff:.3g} "
                                   f"(tolerance {bound:.3g})", name, step))
                break
            out.append(Outcome(logit_check, Result.PASSED, candidate=name))
            if o_tok == c_tok:
                out.append(Outcome(token_check, Result.PASSED, candidate=name))
                continue
            if gaps[r][step] < 2 * tol:
                out.append(Outcome(token_check, Result.INDETERMINATE, candidate=name, step=step))
            else:
                out.append(Outcome(token_check, Result.FAILED,
                                   f"{name}: request {r} step {step}: draft token {c_tok}, oracle "
                                   f"{o_tok} (oracle top-2 gap {gaps[r][step]:.3g})", name, step))
            break
    return out


def expected_slots(
    batch: DraftBatch, k: int, block_size: int, max_model_len: int, upto: Sequence[int] | None = None,
    share: KvShare = WHOLE_CACHE,
) -> set[int]:
    """Slots each real request writes: its new tokens, then one per decode step (clamped at
    ``max_model_len``); ``upto[r]`` limits request ``r`` to its first ``upto[r]`` steps.
    A position that a step after those writes again is left out: at the clamp every later
    step rewrites the last position, with inputs that followed the divergence.
    ``share``: the positions this process's cache holds (a DCP rank writes only its own)."""
    slots: set[int] = set()
    for r, (ctx, new, row) in enumerate(zip(batch.context_lens, batch.new_tokens, batch.block_table)):
        steps = k - 1 if upto is None else upto[r]
        base = ctx + len(new)
        decoded = [min(base + s, max_model_len - 1) for s in range(k - 1)]
        rewritten = set(decoded[steps:])
        positions = [pos for pos in (*range(ctx, base), *decoded[:steps]) if pos not in rewritten]
        held = (share.slot(row, pos, block_size) for pos in positions)
        slots.update(slot for slot in held if slot is not None)
    return slots


def kv_untouched(
    batch: DraftBatch, expected: set[int], block_size: int, start: KVSnapshot, after: KVSnapshot,
    name: str, steps: StepSnapshots | None = None, first_pass: FirstPassSnapshot | None = None,
    share: KvShare = WHOLE_CACHE,
) -> list[Outcome]:
    """Padding lanes write only the sink block, and nothing outside ``expected`` and the
    sink block changed: no padding lane and no stale slot mapping writes a live slot.

    With ``steps`` (the run's per-decode-step snapshots, one token per lane, lanes from
    ``batch.num_reqs`` on padding): first, every padding lane's entry in each slot mapping
    must be a sink slot. That catches a padding lane sent to a slot the batch writes itself,
    which the KV comparisons cannot see (the slot is expected, and an oracle with the same
    fault wrote it the same way); the diagnosis names the step, the lane, the slot, and the
    request and position the slot belongs to. Then a changed slot outside ``expected`` is
    attributed to the lanes whose slot mapping points at it, or to none (the write ignores
    the slot mapping).

    With ``first_pass`` (the padded first pass's snapshot, step 0, ``q`` tokens per
    request: lanes from ``batch.num_reqs * q`` on are padding) the same holds there first.
    ``share`` names positions in diagnoses (a DCP rank's cache holds only its own).
    """
    bs = block_size
    padding = [] if first_pass is None else _padding_writes(
        batch, first_pass.snapshots, bs, first_pass.query_len)
    if steps is not None:
        padding += _padding_writes(batch, steps, bs)
    if padding:
        step, path, lane, slot = padding[0]
        when = "in the padded first pass" if step == 0 else f"before draft step {step}"
        return [Outcome(Check.KV_CACHE, Result.FAILED,
                        f"{name}: {when}, padding lane {lane} (token {lane}) "
                        f"writes {describe_slot(batch, bs, expected, slot, share)} instead of the sink "
                        f"block ({path})", name, step, path)]
    # each tensor on its own: an MLA layer's second tensor is empty
    changed = [changed_slots(k0, k1) | changed_slots(v0, v1)
               for (k0, v0), (k1, v1) in zip(start, after)]
    stray = _stray_slots(changed, expected, bs)
    # one read-back for every layer; the slots themselves only when there is one to name
    if stray is None or not bool(stray.any()):
        return [Outcome(Check.KV_CACHE, Result.PASSED, candidate=name)]
    layer = next(i for i, layer_stray in enumerate(stray) if bool(layer_stray.any()))
    slots = torch.nonzero(stray[layer]).flatten().tolist()
    where = ", ".join(
        describe_slot(batch, bs, expected, s, share)
        + ("" if steps is None and first_pass is None
           else f", {_mapped_by(batch, s, steps, first_pass)}")
        for s in slots[:4]
    )
    return [Outcome(Check.KV_CACHE, Result.FAILED,
                    f"{name}: layer {layer} wrote {len(slots)} slot(s) outside the expected "
                    f"ones: {where} — a padding lane or a stale slot mapping writes a live block",
                    name)]


def _stray_slots(changed: list[torch.Tensor], expected: set[int],
                 block_size: int) -> torch.Tensor | None:
    """``[layers, slots]`` bool: the layers' ``changed`` masks (:func:`changed_slots`) less
    the ``expected`` slots and the sink block; ``None`` without layers."""
    if not changed:
        return None
    stray = torch.stack(changed)
    stray[:, SINK_BLOCK * block_size : (SINK_BLOCK + 1) * block_size] = False
    if expected:
        stray[:, int64_on(sorted(expected), stray.device)] = False
    return stray


def changed_slots(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """``[blocks * block_size]`` bool: whether any bit of each slot's entry differs between
    two snapshots of one cache tensor (``[blocks, block_size, ...]``). Entries are compared
    as the widest integer words their bytes divide into: an exact test of "untouched" (NaNs
    and signed zeros by their bits) over a few times fewer elements than an element-wise
    one, which matters for a cache of gigabytes compared several times per example."""
    slots = before.shape[0] * before.shape[1]
    if before.numel() == 0:
        return torch.zeros(slots, dtype=torch.bool, device=before.device)
    a, b = before.reshape(slots, -1), after.reshape(slots, -1)
    if a.stride(-1) != 1 or b.stride(-1) != 1:  # an entry's bytes must be contiguous
        a, b = a.contiguous(), b.contiguous()
    # bytes an entry spans and where each tensor starts: a word must divide all three
    spans = [a.shape[1] * a.element_size()] + [
        t.storage_offset() * t.element_size() for t in (a, b)]
    word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8)
                if all(span % w.itemsize == 0 for span in spans))
    differ = a.view(word) != b.view(word)
    # on a CPU, a bool any() over the inner dimension runs about three times slower than
    # a count of differing words
    return differ.any(-1) if differ.is_cuda else differ.sum(-1) > 0


def describe_slot(
    batch: DraftBatch, block_size: int, expected: set[int], slot: int,
    share: KvShare = WHOLE_CACHE,
) -> str:
    """``slot`` as a diagnosis names it: its block, the request whose block table holds the
    block and the position it is there (the position ``share`` keeps there), and whether
    the batch writes it (``expected``) and when: ``slot 37 (block 9, request 1 position 13,
    which request 1 writes itself at draft step 2)``."""
    block = slot // block_size
    if block == SINK_BLOCK:
        return f"slot {slot} (the sink block)"
    owners = [r for r, row in enumerate(batch.block_table) if block in row]
    if not owners:
        return f"slot {slot} (block {block}, owned by no request of the batch)"
    r = owners[0]
    position = share.position(batch.block_table[r].index(block) * block_size + slot % block_size)
    base = batch.context_lens[r] + len(batch.new_tokens[r])
    if slot not in expected:
        written = "which the batch does not write"
    elif position < base:
        written = f"which request {r} writes itself in its prefill pass"
    else:
        written = f"which request {r} writes itself at draft step {position - base + 1}"
    return f"slot {slot} (block {block}, request {r} position {position}, {written})"


def _slot_mappings(steps: StepSnapshots) -> list[tuple[int, str, list[int]]]:
    """``(step, path, slot of each token)`` for every slot mapping of every step."""
    return [(step, path, tensor.reshape(-1).tolist())
            for step in sorted(steps)
            for path, tensor in steps[step].items() if path.endswith(SLOT_MAPPING_SUFFIX)]


def _padding_writes(
    batch: DraftBatch, steps: StepSnapshots, block_size: int, query_len: int = 1
) -> list[tuple[int, str, int, int]]:
    """``(step, path, lane, slot)`` for every padding lane (from ``batch.num_reqs *
    query_len`` on) whose slot is not a sink slot."""
    return [(step, path, lane, slot)
            for step, path, slots in _slot_mappings(steps)
            for lane, slot in enumerate(slots)
            if lane >= batch.num_reqs * query_len and slot // block_size != SINK_BLOCK]


def _mapped_by(
    batch: DraftBatch, slot: int, steps: StepSnapshots | None,
    first_pass: FirstPassSnapshot | None,
) -> str:
    """Which lanes' slot mappings point at ``slot`` (the stray write landed there), as a
    clause: each lane with the request it serves (or as padding) and when it wrote, in the
    padded first pass (``first_pass``) or before a draft step (``steps``)."""
    writers: list[str] = []
    if first_pass is not None:
        q = first_pass.query_len
        for _, _, slots in _slot_mappings(first_pass.snapshots):
            writers += [f"lane {lane} ({_lane_owner(batch, lane // q, f'token {lane % q}')}) "
                        "in the padded first pass"
                        for lane, mapped in enumerate(slots) if mapped == slot]
    if steps is not None:
        lanes = sorted({(step, lane) for step, _, slots in _slot_mappings(steps)
                        for lane, mapped in enumerate(slots) if mapped == slot})
        writers += [f"lane {lane} ({_lane_owner(batch, lane, 'its draft token')}) before "
                    f"draft step {step}" for step, lane in lanes]
    if not writers:
        return "where no lane's slot mapping points (the write ignores the slot mapping)"
    return "written there by " + ", ".join(writers[:4])


def _lane_owner(batch: DraftBatch, request: int, token: str) -> str:
    """Whom a lane serves: ``request 1 token 2``, or ``padding``."""
    return f"request {request} {token}" if request < batch.num_reqs else "padding"


def first_divergence(oracle: DraftResult, cand: DraftResult, k: int) -> list[int]:
    """Per request, the decode steps before the first differing draft token (at most K-1)."""
    upto = []
    for row in (oracle.draft_tokens == cand.draft_tokens).tolist():
        upto.append(min([*row, False].index(False), k - 1))
    return upto


def kv_matches(slots: set[int], oracle_kv: KVSnapshot, kv: KVSnapshot, tol: float, name: str) -> list[Outcome]:
    """The ``slots`` hold the oracle's keys and values within ``tol``."""
    index = torch.tensor(sorted(slots), dtype=torch.long)
    for layer, ((ko, vo), (kc, vc)) in enumerate(zip(oracle_kv, kv)):
        for label, a, b in (("keys", ko, kc), ("values", vo, vc)):
            diff = (a.flatten(0, 1)[index].float().cpu() - b.flatten(0, 1)[index].float().cpu()).abs()
            if diff.numel() and float(diff.max()) > tol:
                bad = int(index[diff.flatten(1).amax(1).argmax()])
                return [Outcome(Check.KV_CACHE, Result.FAILED,
                                f"{name}: layer {layer} {label} at slot {bad} differ from the oracle "
                                f"by {float(diff.max()):.3g}", name)]
    return [Outcome(Check.KV_CACHE, Result.PASSED, candidate=name)]


def compare_steps(
    oracle: StepSnapshots, cand: StepSnapshots, name: str, *, metadata_only: bool = False
) -> list[Outcome]:
    """Every tensor and every host value before every draft step equals the oracle's fresh
    eager build; the first difference (earliest step, tensors before host values, walk
    order) is reported with its path as ``field``.

    ``metadata_only`` (a host_preplanned candidate) compares the metadata tensors each step runs
    with, but neither the builders' raw buffers (a host_preplanned run keeps each step in storage
    of its own, by design) nor host values: each step's metadata comes from
    ``plan_draft_steps``, not ``build``, and may carry labels of its own (FlashInfer's
    ``draft_step``).

    A graph candidate's host values are those its captured body was launched with (see
    :mod:`~speccheck.checks.verify.step_recorder`): a host value a fresh build would set
    differently is one the kernels of a replay do not see."""
    if not oracle:
        return [Outcome(Check.STEP_METADATA, Result.SKIPPED, "single draft step", name)]
    for step in sorted(oracle):
        if step not in cand:
            return [Outcome(Check.STEP_METADATA, Result.FAILED,
                            f"{name}: no metadata observed before draft step {step}", name, step)]
        failed = compare_step(oracle, step, cand[step], cand.host.get(step, {}), name,
                              metadata_only=metadata_only)
        if failed is not None:
            return [failed]
    return [Outcome(Check.STEP_METADATA, Result.PASSED, candidate=name)]


def compare_step(
    oracle: StepSnapshots, step: int, tensors: Mapping[str, torch.Tensor],
    host: Mapping[str, np.ndarray], name: str, *, metadata_only: bool = False,
) -> Outcome | None:
    """:func:`compare_steps` for one step of the oracle's (``tensors`` and ``host``: what
    run ``name`` held before draft step ``step``): the failed outcome of the first
    difference, ``None`` when there is none."""
    for path, expected in oracle[step].items():
        if metadata_only and not reached_from_metadata(path):
            continue
        got = tensors.get(path)
        if got is None or not same_value(expected, got):
            detail = "missing" if got is None else describe_difference(expected, got)
            previous = _previous(oracle, step, path)
            return Outcome(Check.STEP_METADATA, Result.FAILED,
                           f"{name}: before draft step {step}, {path} differs from a fresh "
                           f"eager build ({detail}) — "
                           + _staleness(got, previous, same_value), name, step, path)
    if metadata_only:
        return None
    for path, value in oracle.host.get(step, {}).items():
        found = host.get(path)
        if found is None or not same_host_value(value, found):
            shown = "missing" if found is None else describe_host_value(found)
            earlier = _previous(oracle.host, step, path)
            return Outcome(Check.STEP_METADATA, Result.FAILED,
                           f"{name}: before draft step {step}, host value {path} is "
                           f"{shown}, a fresh eager build's is {describe_host_value(value)} "
                           f"— {_staleness(found, earlier, same_host_value)}; host "
                           "values are not refreshed between draft steps (a captured "
                           "graph keeps the ones it was captured with)",
                           name, step, path)
    return None


def compare_first_pass(
    oracle: StepSnapshots, tensors: Mapping[str, torch.Tensor],
    host: Mapping[str, np.ndarray], name: str, *, metadata_only: bool = False,
) -> Outcome | None:
    """:func:`compare_step` for a padded first pass (step 0; ``oracle``: the oracle's) on
    the tensors its metadata reaches (:meth:`~speccheck.checks.verify.step_recorder.
    StepSnapshots.of_metadata`) and the host values. A candidate that builds its step-1
    metadata before the pass from reset index buffers (the emulated fused run) refreshes it
    before step 1, so the builders' other persistent buffers (a decode wrapper's indptr
    under FlashInfer's fixed plan) legitimately differ from the oracle's at the pass."""
    return compare_step(oracle.of_metadata(), 0, tensors, host, name,
                        metadata_only=metadata_only)


def first_pass_metadata(
    oracle: FirstPassSnapshot | None, cand: FirstPassSnapshot | None, name: str, *,
    metadata_only: bool = False,
) -> list[Outcome]:
    """An eagerly run candidate's padded first pass against the oracle's
    (:func:`compare_first_pass`), after the run: a GPU's step guard also compares it before
    the pass's forward, a CPU's only in a run that raised. Nothing where the pass ran
    unpadded. A graph replay's first pass is judged by its outputs (draft token 0, the KV
    it wrote) and its field meanings."""
    if oracle is None or cand is None:
        return []
    failed = compare_first_pass(oracle.snapshots, cand.snapshots.get(0, {}),
                                cand.snapshots.host.get(0, {}), name,
                                metadata_only=metadata_only)
    return [failed or Outcome(Check.STEP_METADATA, Result.PASSED, candidate=name)]


def _previous(steps: Mapping[int, Mapping[str, V]], step: int, path: str) -> V | None:
    """``path``'s value in ``steps`` at the last step before ``step`` (``None``: none)."""
    earlier = [s for s in steps if s < step]
    return steps[max(earlier)].get(path) if earlier else None


def _staleness(got: V | None, previous: V | None, same: Callable[[V, V], bool]) -> str:
    """Whether a step's wrong value ``got`` is the oracle's ``previous`` step's one (stale:
    not recomputed) or neither (wrong: recomputed wrongly), as a clause."""
    if got is None:
        return "the refresh does not recompute it"
    if previous is not None and same(previous, got):
        return "stale (equals the previous step's value): the refresh does not recompute it"
    if previous is None:
        return "wrong (not this step's value; no earlier step to compare with)"
    return "wrong (neither this step's nor the previous): the refresh recomputes it wrongly"


CONSEQUENCES = (Check.DRAFT_TOKENS, Check.LOGITS, Check.KV_CACHE)
"""Checks whose failure a wrong input to the attention call explains."""


def mark_consequences(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """Mark each failed :data:`CONSEQUENCES` outcome of a candidate that also failed
    ``step_metadata`` on the same example as following from it (``... (follows from the
    step_metadata failure at step N, FIELD)``): the output and the cache were computed
    from the wrong metadata, so they are effects to look at after the cause. Returns the
    outcomes marked."""
    causes: dict[str | None, Outcome] = {}
    for outcome in outcomes:
        if outcome.check is Check.STEP_METADATA and outcome.result is Result.FAILED:
            causes.setdefault(outcome.candidate, outcome)
    marked = []
    for outcome in outcomes:
        cause = causes.get(outcome.candidate)
        if cause is not None and outcome.result is Result.FAILED and outcome.check in CONSEQUENCES:
            outcome.diagnosis += (f" (follows from the step_metadata failure at step "
                                  f"{cause.step}, {cause.field})")
            marked.append(outcome)
    return marked


def describe_difference(expected: torch.Tensor, got: torch.Tensor) -> str:
    if expected.shape != got.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    bad = (expected != got).flatten()
    first = int(torch.nonzero(bad).flatten()[0]) if bool(bad.any()) else 0
    return (f"{int(bad.sum())} of {bad.numel()} elements; first at flat index {first}: "
            f"{expected.flatten()[first].item()} expected, {got.flatten()[first].item()} found")
