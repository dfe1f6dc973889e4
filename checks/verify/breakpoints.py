"""Breakpoint discovery: the sequence lengths at which a backend's derived metadata changes.

A stale refresh between fused draft steps only shows when a derived field would have
changed between two steps. Some fields change only when a length crosses a threshold of the
backend's own (FA3's scheduler metadata: a split count goes 2 -> 1 at one length of one
request, nowhere near a KV-block boundary), so batches drawn without knowing the thresholds
rarely expose the bug. Before examples are drawn, :func:`discover_breakpoints` probes the
builder's eager :meth:`~speccheck.contract.builder.AttentionMetadataBuilder.build` (host
work) on synthetic decode batches and records where each derived field changes as one
request's length ``L`` grows by one token; the batch strategy then places requests so that
their draft steps cross those lengths
(:attr:`speccheck.checks.verify.strategies.BatchLimits.breakpoints`).

What is watched, per build:

- every tensor reachable from the metadata
  (:func:`~speccheck.checks.probes.state_walk.walk_tensors`) that is not a view of the
  probe's own input buffers (lengths, offsets, slots, block table: the speculator advances
  those itself) nor one of the builder's workspace buffers (contents meaningless between
  calls), plus the caller's declared step-dependent fields whatever they view;
- every host value reachable from the metadata
  (:func:`~speccheck.checks.probes.state_walk.walk_host_values`: numbers, strings, ``None``,
  enums, tuples and lists of numbers, numpy arrays).

Entries that simply follow the length are not breakpoints: an element that changes at every
one-token step of a probe window (a copy of ``seq_lens``, ``seq_len + 1``, a host
``max_seq_len``) is masked out of its field, because a stale refresh of it shows at every
draft step anyway. Such fields are listed as :attr:`BatchBreakpoints.tracking`. The mask
applies where the field has the shape it had in the windows; a field whose shape changes
inside a window is compared whole.

The synthetic batch: ``batch_size`` requests, request 0 at length ``L`` (its decode token
at position ``L - 1``), the others at ``companion_len``, each with disjoint block-table
rows, one query token per request, padded as ``descriptor_for`` says (the speculator's
decode descriptor). ``L`` runs over ``1..max_model_len``. Breakpoints found with other
companion lengths may differ (FA3 balances splits over the whole batch); the ones found
here are where the strategy aims, and hypothesis' targeting (see
:func:`~speccheck.checks.verify.strategies.derived_step_changes`) covers the rest.

Cost: at most ``max_builds`` builds in all, shared by the batch sizes. Where a batch size's
share covers every length, the sweep is exhaustive; otherwise lengths are probed on a
coarse grid (half the share) and every grid interval whose endpoints differ is bisected
down to the exact length, narrowest (then lowest) interval first. While the builds left
cover a bisection of every open interval down to one change each, all open intervals are
halved in one round whose builds are read back together; otherwise one at a time. A
change that reverts inside one grid interval is missed
(:attr:`BatchBreakpoints.coarse_step` says how wide they are), and intervals still open
when the builds run out are listed as :attr:`BatchBreakpoints.unresolved`.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from speccheck.checks.probes.state_walk import attribute_storages, walk_state
from speccheck.checks.verify.readback import host_copies
from speccheck.contract.builder import AttentionMetadataBuilder, blocks_for
from speccheck.contract.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from speccheck.contract.metadata import AttentionInputBuffers
from speccheck.contract.token_count import build_uniform_attention_metadata
from speccheck.speculator.kv_cache import compute_slot_mapping

DEFAULT_MAX_BUILDS = 6000
"""Builds one :func:`discover_breakpoints` call may run, over all batch sizes. Measured on
an H200: FA3 (one ``get_scheduler_metadata`` launch and a copy back per build) runs about
1500 builds a second, and at ``max_model_len`` 32768 its scheduler metadata changes at about
75 lengths per batch size (every 176 tokens at first), which this cap resolves completely
for three batch sizes in under 4 s. The reference backend's builds take about 0.2 ms on a
CPU."""

TRACKING_WINDOW = 8
"""One-token steps per probe window: an element that changes at each of them follows the
length and is masked (two windows: at the shortest lengths and mid-range)."""

READBACK_BUILDS = 64
"""Builds whose watched tensors one device-to-host transfer reads back (their copies stay on
the device until then: tens of KiB per build at serving scale)."""

DESCRIBE_LENGTHS = 12
"""Lengths :meth:`Breakpoints.describe` lists per field before it abbreviates."""

Descriptor = Callable[[int], BatchExecutionDescriptor]
"""Real request count -> the descriptor its decode step runs under."""


def eager_decode_descriptor(num_reqs: int) -> BatchExecutionDescriptor:
    """The decode descriptor of an unpadded eager batch: one token per request."""
    return BatchExecutionDescriptor(CUDAGraphMode.NONE, num_reqs, None, 1)


@dataclass(frozen=True)
class BatchBreakpoints:
    """What one batch size's sweep found."""

    batch_size: int
    """Real requests in the probed batch (the swept one and its companions)."""
    lanes: int
    """Requests the metadata covers (the capture bucket when the descriptor pads)."""
    fields: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """Per field that changes somewhere, in walk order: the ascending lengths ``L`` at which
    its value differs from its value at ``L - 1``."""
    tracking: tuple[str, ...] = ()
    """Fields with elements that change at every one-token step; those elements are
    ignored (a field whose every element tracks has no breakpoints)."""
    unresolved: tuple[tuple[int, int], ...] = ()
    """``(a, c)``: some watched field changes somewhere in ``a + 1 .. c``, but the build
    cap ran out before the exact length was found."""
    builds: int = 0
    coarse_step: int = 1
    """Spacing of the first probe grid (1: every length was built)."""
    error: str | None = None
    """Why the builder could not build this synthetic batch (then nothing else is set)."""

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(sorted({length for _, lengths in self.fields for length in lengths}))

    def to_json(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size, "lanes": self.lanes,
            "fields": {name: list(lengths) for name, lengths in self.fields},
            "tracking": list(self.tracking),
            "unresolved": [list(interval) for interval in self.unresolved],
            "builds": self.builds, "coarse_step": self.coarse_step, "error": self.error,
        }


@dataclass(frozen=True)
class Breakpoints:
    """Where one backend's derived metadata changes with a request's length, per batch
    size. Empty (no lengths) when nothing derived changes or the builder could not be
    probed; :attr:`reason` then says which."""

    backend: str
    max_model_len: int
    batches: tuple[BatchBreakpoints, ...] = ()
    reason: str | None = None

    @property
    def lengths(self) -> tuple[int, ...]:
        """Every breakpoint of every field and batch size, ascending: what the batch
        strategy aims at."""
        return tuple(sorted({length for b in self.batches for length in b.lengths}))

    def field_lengths(self) -> dict[str, tuple[int, ...]]:
        """Per field, its breakpoints over all batch sizes, ascending."""
        merged: dict[str, set[int]] = {}
        for batch in self.batches:
            for name, lengths in batch.fields:
                merged.setdefault(name, set()).update(lengths)
        return {name: tuple(sorted(lengths)) for name, lengths in merged.items()}

    @property
    def complete(self) -> bool:
        """Every batch size was probed and no interval was left unresolved."""
        return all(b.error is None and not b.unresolved for b in self.batches)

    def describe(self) -> str:
        """One line for logs and ``--verbose``, e.g. ``fa3: scheduler_metadata changes at
        lengths 129, 169, 300 (batch sizes 1, 2, 8; 1503 builds)``. A field whose lengths
        differ by batch size gets one list per batch size."""
        if not self.lengths:
            return f"{self.backend}: no breakpoints ({self.reason})"
        parts: list[str] = []
        for name in self.field_lengths():
            per_batch = {
                b.batch_size: dict(b.fields).get(name, ()) for b in self.batches if b.error is None
            }
            if len(set(per_batch.values())) == 1:
                (lengths,) = set(per_batch.values())
                parts.append(f"{name} changes at lengths {_abbreviate(lengths)}")
            else:
                lists = "; ".join(
                    f"{_abbreviate(lengths) or 'none'} with {size} request{'s' * (size > 1)}"
                    for size, lengths in per_batch.items()
                )
                parts.append(f"{name} changes at lengths {lists}")
        sizes = ", ".join(str(b.batch_size) for b in self.batches if b.error is None)
        notes = [f"batch sizes {sizes}", f"{sum(b.builds for b in self.batches)} builds"]
        if not self.complete:
            notes.append("incomplete: see the JSON report")
        return f"{self.backend}: {'; '.join(parts)} ({'; '.join(notes)})"

    def to_json(self) -> dict[str, Any]:
        """JSON-ready: the merged lengths and per-field lengths, and each batch size's
        sweep."""
        return {
            "backend": self.backend, "max_model_len": self.max_model_len,
            "lengths": list(self.lengths),
            "fields": {name: list(lengths) for name, lengths in self.field_lengths().items()},
            "complete": self.complete, "reason": self.reason,
            "batches": [b.to_json() for b in self.batches],
        }


def _abbreviate(lengths: Sequence[int]) -> str:
    shown = ", ".join(str(length) for length in lengths[:DESCRIBE_LENGTHS])
    if len(lengths) > DESCRIBE_LENGTHS:
        shown += f", ... ({len(lengths)} in all)"
    return shown


def discover_breakpoints(
    builder: AttentionMetadataBuilder[Any],
    declared_fields: Sequence[str] = (),
    *,
    batch_sizes: Sequence[int] | None = None,
    descriptor_for: Descriptor = eager_decode_descriptor,
    companion_len: int = 1,
    max_builds: int = DEFAULT_MAX_BUILDS,
) -> Breakpoints:
    """Where ``builder``'s derived metadata changes as one request's length grows through
    ``1..builder.layer.max_model_len`` (see the module docstring for what is watched and how
    lengths are searched).

    ``builder`` is used as it is: the probe builds write its persistent buffers, which the
    next real build rewrites. ``declared_fields`` are the backend's declared step-dependent
    fields (dotted paths into the metadata), watched even where they view an input.
    ``batch_sizes`` defaults to 1, 2 and ``builder.limits.max_num_reqs``; sizes outside
    ``1..max_num_reqs`` are skipped. ``descriptor_for`` maps a real request count to its
    decode descriptor (pass the speculator's, so that padding lanes are probed as they
    run). ``max_builds`` caps the builds over all batch sizes; each batch size gets an equal
    share of what the earlier ones left (at least what its probe windows need).

    Never raises for a builder that cannot build a synthetic batch: that batch size records
    the error, and :attr:`Breakpoints.reason` says why the result is empty.
    """
    backend = type(builder).backend_name
    max_model_len = builder.layer.max_model_len
    limit = builder.limits.max_num_reqs
    requested = (1, 2, limit) if batch_sizes is None else tuple(batch_sizes)
    sizes = sorted({size for size in requested if 1 <= size <= limit})
    if not sizes:
        return Breakpoints(backend, max_model_len,
                           reason=f"no batch size in {list(requested)} fits 1..{limit} requests")
    if max_model_len < 2:
        return Breakpoints(backend, max_model_len, reason="max_model_len < 2: no length to cross")
    batches: list[BatchBreakpoints] = []
    used = 0
    for i, size in enumerate(sizes):
        share = (max_builds - used) // (len(sizes) - i)
        probe = _Probe(builder, declared_fields, size, descriptor_for(size), companion_len)
        result = probe.sweep(share)
        batches.append(result)
        used += result.builds
    reason = None
    if all(b.error is not None for b in batches):
        reason = f"the builder cannot build a synthetic decode batch: {batches[0].error}"
    elif not any(b.fields for b in batches):
        reason = "no derived field changes with the length"
    return Breakpoints(backend, max_model_len, tuple(batches), reason)


Values = dict[str, np.ndarray]
"""Watched field -> its value at one length, as a host array (host scalars and strings are
0-d arrays)."""

Queued = tuple[int, list[str], list[torch.Tensor], Values]
"""A build not read back yet: its length, watched paths, device copies of their tensors (in
that order) and its host values."""


class _Probe:
    """Builds the synthetic decode batch of one batch size at any length and reads the
    watched fields; :meth:`sweep` searches the lengths."""

    def __init__(
        self,
        builder: AttentionMetadataBuilder[Any],
        declared_fields: Sequence[str],
        batch_size: int,
        descriptor: BatchExecutionDescriptor,
        companion_len: int,
    ) -> None:
        self.builder = builder
        self.declared = set(declared_fields)
        self.batch_size = batch_size
        self.descriptor = descriptor
        self.lanes = descriptor.num_reqs if descriptor.num_reqs is not None else batch_size
        self.block_size = builder.layer.block_size
        self.max_model_len = builder.layer.max_model_len
        self.companion_len = min(max(companion_len, 1), self.max_model_len)
        self.builds = 0
        self._buffers: AttentionInputBuffers | None = None
        self._order: dict[str, None] = {}
        """Every field seen, in walk order of first sight."""
        self._pending: dict[int, Values] = {}
        """Values read before the masks were known (the probe windows)."""
        self._masks: dict[str, np.ndarray] = {}
        self._keys: dict[int, dict[str, Hashable]] = {}

    def sweep(self, cap: int) -> BatchBreakpoints:
        """At most ``max(cap, builds the probe windows need)`` builds."""
        lo, hi = 1, self.max_model_len
        try:
            with torch.no_grad():
                self._learn_masks(lo, hi)
                step = 1 if hi - lo + 1 <= cap else -(-(hi - lo) // max(1, cap // 2))
                grid = sorted({*range(lo, hi + 1, step), hi})
                changes, unresolved = self._bisect(grid, cap)
        except Exception as exc:  # whatever the builder raises: this batch cannot be probed
            return BatchBreakpoints(self.batch_size, self.lanes, builds=self.builds,
                                    error=f"{type(exc).__name__}: {exc}")
        fields = tuple(
            (name, tuple(sorted(changes[name]))) for name in self._order if name in changes
        )
        tracking = tuple(
            name for name in self._order if name in self._masks and self._masks[name].any()
        )
        return BatchBreakpoints(self.batch_size, self.lanes, fields, tracking, tuple(unresolved),
                                self.builds, step)

    # -- search -------------------------------------------------------------------------

    def _learn_masks(self, lo: int, hi: int) -> None:
        """Mask, per field, the elements that change at every step of a probe window. A
        field whose shape varies inside a window gets no mask from it; where the windows
        see two shapes, the first window's mask is kept."""
        mid = max(lo, (lo + hi) // 2 - TRACKING_WINDOW // 2)
        windows = sorted({(start, min(hi, start + TRACKING_WINDOW)) for start in (lo, mid)})
        self._read_all(sorted({length for start, stop in windows
                               for length in range(start, stop + 1)}))
        for start, stop in windows:
            values = [self._pending[length] for length in range(start, stop + 1)]
            for name in self._order:
                series = [v[name] for v in values if name in v]
                if len(series) < max(2, len(values)) or len({a.shape for a in series}) != 1:
                    continue
                steps = [np.asarray(a != b) for a, b in zip(series, series[1:])]
                every = np.logical_and.reduce(steps)
                known = self._masks.setdefault(name, every)
                if known.shape == every.shape:
                    self._masks[name] = known | every

    def _bisect(
        self, grid: list[int], cap: int
    ) -> tuple[dict[str, set[int]], list[tuple[int, int]]]:
        """Exact change lengths inside every grid interval whose endpoints differ,
        narrowest (then lowest) interval first, while builds stay within ``cap``."""
        changes: dict[str, set[int]] = {}
        unresolved: list[tuple[int, int]] = []
        self._read_all(grid)
        heap = [(c - a, a, c) for a, c in zip(grid, grid[1:]) if self._key(a) != self._key(c)]
        heapq.heapify(heap)
        while heap:
            # One interval at a time while the builds left might not resolve every open
            # interval: then narrowest-first decides which breakpoints stay exact.
            ample = cap - self.builds >= sum((width - 1).bit_length() for width, _, _ in heap)
            batch = len(heap) if ample else 1
            split: list[tuple[int, int, int]] = []
            to_build = 0
            while heap and len(split) < batch:
                width, a, c = heapq.heappop(heap)
                if width == 1:
                    before, after = self._key(a), self._key(c)
                    for name in before.keys() | after.keys():
                        if before.get(name) != after.get(name):
                            changes.setdefault(name, set()).add(c)
                    continue
                m = (a + c) // 2
                if self._built(m) or self.builds + to_build < cap:
                    to_build += not self._built(m)
                    split.append((a, m, c))
                else:
                    unresolved.append((a, c))
            self._read_all([m for _, m, _ in split])
            for a, m, c in split:
                for left, right in ((a, m), (m, c)):
                    if self._key(left) != self._key(right):
                        heapq.heappush(heap, (right - left, left, right))
        return changes, sorted(unresolved)

    def _key(self, length: int) -> dict[str, Hashable]:
        """Masked digest of every watched field at ``length`` (cached)."""
        if length not in self._keys:
            self._read_all([length])
            values = self._pending.pop(length)
            self._keys[length] = {name: self._digest(name, a) for name, a in values.items()}
        return self._keys[length]

    def _built(self, length: int) -> bool:
        return length in self._keys or length in self._pending

    def _digest(self, name: str, a: np.ndarray) -> Hashable:
        mask = self._masks.get(name)
        if mask is not None and mask.shape == a.shape:
            if mask.all():
                return "follows the length"
            a = np.where(mask, np.zeros_like(a), a)
        return (a.shape, a.dtype.str, hashlib.blake2b(np.ascontiguousarray(a).tobytes()).digest())

    # -- one build ----------------------------------------------------------------------

    def _read_all(self, lengths: Sequence[int]) -> None:
        """Build at each of ``lengths`` not built yet and read every watched field into
        :attr:`_pending`. Each build's watched tensors are copied on their device as soon as
        it returns (the next build rewrites the builder's buffers) and read back together,
        :data:`READBACK_BUILDS` builds per transfer: a read-back of its own per build
        waited for the device every time."""
        queued: list[Queued] = []
        for length in dict.fromkeys(lengths):
            if self._built(length):
                continue
            queued.append(self._queue(length))
            if len(queued) == READBACK_BUILDS:
                self._collect(queued)
                queued = []
        self._collect(queued)

    def _queue(self, length: int) -> Queued:
        """Build at ``length`` and copy its watched tensors on their device."""
        self.builds += 1
        metadata, inputs = self._build(length)
        workspace = {
            t.untyped_storage().data_ptr() for t in self.builder.workspace_buffers().values()
        }
        tensors, host = walk_state(metadata)
        underived = inputs | workspace
        watched = [
            path for path, tensor in tensors.items()
            if path in self.declared or tensor.untyped_storage().data_ptr() not in underived
        ]
        copies = [tensors[path].detach().clone(memory_format=torch.contiguous_format)
                  for path in watched]
        return length, watched, copies, host

    def _collect(self, queued: list[Queued]) -> None:
        """Read the queued builds' copies back in one transfer per dtype."""
        if not queued:
            return
        host_tensors = iter(host_copies([t for _, _, copies, _ in queued for t in copies]))
        for length, watched, _, host in queued:
            values: Values = {path: _host_array(next(host_tensors)) for path in watched}
            values.update(host)
            self._order.update(dict.fromkeys(values))
            self._pending[length] = values

    def _input_buffers(self) -> AttentionInputBuffers:
        """The probe's own input buffers (allocated once): disjoint block-table rows for
        the real requests, the sink block for padding lanes."""
        if self._buffers is None:
            lanes, real = self.lanes, self.batch_size
            max_blocks = blocks_for(self.max_model_len, self.block_size)
            buffers = AttentionInputBuffers.allocate(lanes, lanes, max_blocks, self.builder.device)
            rows = 1 + torch.arange(real * max_blocks, dtype=torch.int32).view(real, max_blocks)
            buffers.block_table[:real].copy_(rows)
            self._buffers = buffers
        return self._buffers

    def _build(self, length: int) -> tuple[Any, set[int]]:
        """The builder's metadata for the batch at ``length`` (request 0 at ``length``, the
        others at ``companion_len``), and the storages of the input buffers."""
        buffers = self._input_buffers()
        lanes, real = self.lanes, self.batch_size
        lens = np.full(real, self.companion_len, dtype=np.int64)
        lens[0] = length
        padded = np.zeros(lanes, dtype=np.int64)
        padded[:real] = lens
        buffers.seq_lens.copy_(torch.from_numpy(padded))
        buffers.positions.copy_(torch.from_numpy(np.maximum(padded - 1, 0)))
        lane = torch.arange(lanes, device=buffers.positions.device)
        compute_slot_mapping(buffers.positions, lane, buffers.block_table, lane < real,
                             self.block_size, out=buffers.slot_mapping)
        common = build_uniform_attention_metadata(
            buffers=buffers, batch_desc=self.descriptor, num_reqs=real, num_query_per_req=1,
            base_seq_lens_np=lens, step=0, max_model_len=self.max_model_len,
        )
        inputs = attribute_storages(buffers)
        return self.builder.build(common), inputs


def _host_array(tensor: torch.Tensor) -> np.ndarray:
    """``tensor`` (on the host) as a numpy array of its own (dtypes numpy lacks, such as
    bfloat16, as float32)."""
    if tensor.dtype == torch.bfloat16 or (tensor.dtype.is_floating_point
                                          and tensor.dtype.itemsize == 1):
        tensor = tensor.float()
    return np.array(tensor.numpy(), copy=True)
