"""Persistent buffers: unused tails that must stay zero, and poisoned guard bands that
catch writes past either end."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from speccheck.checks.probes.findings import (
    GUARD_BAND,
    ProbeFinding,
)

DEFAULT_GUARD_ELEMENTS = 256


def check_zero_tail(buffer: torch.Tensor, used: int, *, name: str = "buffer") -> str | None:
    """Diagnose a persistent buffer whose unused tail is not all zero.

    ``buffer`` is live in rows ``[0, used)`` of its first dimension; rows ``[used, len)``
    must be zero (NaN counts as non-zero, ``-0.0`` as zero). Returns ``None`` when they are,
    else a message naming the buffer, the first offending row and value, and the fix.
    Raises ``ValueError`` for a 0-dim buffer or ``used`` outside ``0..len(buffer)``.
    Synchronises: verifier-side only. A caller collecting findings wraps a diagnosis as
    ``ProbeFinding(ZERO_TAIL, name, diagnosis)``.
    """
    if buffer.dim() == 0:
        raise ValueError(f"check_zero_tail needs a first dimension; buffer {name!r} is 0-dim")
    rows = buffer.shape[0]
    if not 0 <= used <= rows:
        raise ValueError(f"used={used} is outside 0..{rows} for buffer {name!r}")
    tail = buffer[used:].reshape(rows - used, math.prod(buffer.shape[1:]))
    nonzero = tail != 0
    if not bool(nonzero.any()):
        return None
    bad_rows = nonzero.any(dim=1).nonzero().flatten()
    first = int(bad_rows[0])
    value = tail[first][nonzero[first]][0].item()
    return (
        f"persistent buffer {name!r} is live in its first {used} of {rows} rows, but its unused "
        f"tail holds {int(nonzero.sum())} non-zero element(s) in {bad_rows.numel()} row(s), "
        f"the first at row {used + first} (value {value}); a kernel that reads the whole "
        f"buffer sees stale entries from an earlier, larger batch — zero the tail whenever the "
        f"live length changes: {name}[{used}:].zero_()"
    )


POISON_BYTE = 0xA5
"""The byte :func:`poison_` fills integer and bool tensors with by default."""


def poison_(tensor: torch.Tensor, sentinel: float | None = None,
            byte: int = POISON_BYTE) -> None:
    """Fill ``tensor`` in place with a poison value: ``sentinel`` when given, else NaN for
    floating and complex dtypes and the byte pattern ``byte`` for integer and bool dtypes
    (by default ``0xA5``: int32 ``-0x5A5A5A5B``, int64 ``-0x5A5A5A5A5A5A5A5B``). The poison
    is non-zero for :func:`check_zero_tail`; with a byte of ``0x80`` or more it is negative
    in int32 and int64, no valid index or length, and NaN spoils any arithmetic it enters,
    so a read of it shows. Another ``byte`` tells apart integer rows poisoned at two
    moments. ``tensor`` must be contiguous when it has an integer or bool dtype (its bytes
    are written through a ``uint8`` view)."""
    if sentinel is not None:
        tensor.fill_(sentinel)
    elif tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        tensor.fill_(math.nan)
    else:
        tensor.view(torch.uint8).fill_(byte)


class GuardedBuffer:
    """A persistent buffer with a poison-filled guard band before and after it.

    ``tensor`` is the buffer to hand to the code under test: a contiguous view of
    ``guard`` + ``numel`` + ``guard`` elements of backing storage. The bands are filled with
    :func:`poison_`'s sentinel (``sentinel`` when given), so that an over-read poisons results
    and an over-write is detectable.
    :meth:`violations` compares the bands bytewise with their initial contents, so a write is
    caught unless it stores the very sentinel bit pattern.

    Contract: ``guard >= 1``; the bands are never handed to the code under test (only to a
    :class:`GuardedBufferSet`, through :attr:`bands`); ``violations()`` and
    ``findings()`` synchronise (verifier-side only) and may be called any number of times.
    """

    def __init__(
        self,
        shape: int | Sequence[int],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        *,
        name: str = "buffer",
        guard: int = DEFAULT_GUARD_ELEMENTS,
        sentinel: float | None = None,
        fill: float = 0,
    ) -> None:
        if guard < 1:
            raise ValueError(f"guard={guard} must be at least 1 element")
        self.name = name
        self.guard = guard
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.numel = math.prod(shape)
        self._backing = torch.empty(guard + self.numel + guard, dtype=dtype, device=device)
        self.tensor = self._backing[guard : guard + self.numel].view(shape)
        self.tensor.fill_(fill)
        self._bands = (self._backing[:guard], self._backing[guard + self.numel :])
        for band in self._bands:
            poison_(band, sentinel)
        self._initial = tuple(band.view(torch.uint8).clone() for band in self._bands)

    @classmethod
    def like(
        cls, t: torch.Tensor, *, name: str = "buffer", guard: int = DEFAULT_GUARD_ELEMENTS
    ) -> GuardedBuffer:
        """A guarded buffer with ``t``'s shape, dtype, device and values."""
        guarded = cls(t.shape, t.dtype, t.device, name=name, guard=guard)
        guarded.tensor.copy_(t)
        return guarded

    @property
    def bands(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """``(live, initial)`` bytes (``uint8``) of the band before and of the band after
        the buffer: :class:`GuardedBufferSet` compares many buffers' bands at once."""
        return tuple((band.view(torch.uint8), initial)
                     for band, initial in zip(self._bands, self._initial, strict=True))

    def violations(self) -> list[str]:
        """One message per overwritten band, naming the element offsets written, relative to
        element 0 of :attr:`tensor` (negative before it, ``>= numel`` after it)."""
        messages = []
        itemsize = self._backing.element_size()
        for band, initial, base in zip(
            self._bands, self._initial, (-self.guard, self.numel), strict=True
        ):
            written = (band.view(torch.uint8) != initial).view(-1, itemsize).any(dim=1)
            if not bool(written.any()):
                continue
            offsets = [base + int(i) for i in written.nonzero().flatten()]
            if base < 0:
                messages.append(
                    f"guard band before {self.name!r} overwritten at element offset(s) "
                    f"{_format_offsets(offsets)}: something writes below the start of the "
                    "buffer — look for a negative index or an offset of -1 in the refresh or "
                    "a kernel"
                )
            else:
                messages.append(
                    f"guard band after {self.name!r} overwritten at element offset(s) "
                    f"{_format_offsets(offsets)} (the buffer has {self.numel} elements): the "
                    "refresh or a kernel writes past the end — size the buffer for the largest "
                    "bucket or bound the write by the live length"
                )
        return messages

    def findings(self) -> list[ProbeFinding]:
        """:meth:`violations` as findings with ``path`` = the buffer's name."""
        return [ProbeFinding(GUARD_BAND, self.name, message) for message in self.violations()]


class GuardedBufferSet:
    """Many guarded buffers (a backend may hold hundreds, one set per wrapper and batch
    size), rearmed and checked together: one multi-tensor copy rearms every band, and one
    concatenation, one comparison and one read-back tell which buffers were written, instead
    of a few launches per buffer. Synchronises (verifier-side only)."""

    def __init__(self) -> None:
        self.buffers: list[GuardedBuffer] = []
        self._plans: dict[torch.device, _BandPlan] = {}
        self._planned = 0
        """How many of :attr:`buffers` the plans cover."""

    def add(self, buffer: GuardedBuffer) -> None:
        self.buffers.append(buffer)

    def rearm(self) -> None:
        """Restore every band to its initial contents, so that :meth:`violations` reports
        only writes made after this call (the verifier rearms before every example: a
        failure then belongs to the example that caused it)."""
        for plan in self._current_plans():
            torch._foreach_copy_(plan.live, plan.initials)

    def written(self) -> list[bool]:
        """Per buffer, in :attr:`buffers` order, whether either band differs from its
        initial contents."""
        hit = [False] * len(self.buffers)
        for plan in self._current_plans():
            differ = torch.ne(torch.cat(plan.live), plan.initial).cumsum(0)[plan.ends]
            per_band = torch.diff(differ, prepend=differ.new_zeros(1)) > 0
            for owner, band_hit in zip(plan.owners, per_band.tolist(), strict=True):
                hit[owner] = hit[owner] or band_hit
        return hit

    def violations(self) -> list[str]:
        """:meth:`GuardedBuffer.violations` of every buffer :meth:`written` names."""
        return [message for buffer, hit in zip(self.buffers, self.written(), strict=True)
                if hit for message in buffer.violations()]

    def _current_plans(self) -> list[_BandPlan]:
        if self._planned != len(self.buffers):
            grouped: dict[torch.device, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
            for owner, buffer in enumerate(self.buffers):
                for live, initial in buffer.bands:
                    grouped.setdefault(live.device, []).append((owner, live, initial))
            self._plans = {device: _BandPlan(bands) for device, bands in grouped.items()}
            self._planned = len(self.buffers)
        return list(self._plans.values())


class _BandPlan:
    """The bands of one device's buffers, from ``(owner, live, initial)`` triples: their live
    bytes, their initial bytes (apart and concatenated), the index of each band's last byte
    in the concatenation, and the buffer each belongs to."""

    def __init__(self, bands: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        self.owners = [owner for owner, _, _ in bands]
        self.live = [live for _, live, _ in bands]
        self.initials = [initial for _, _, initial in bands]
        self.initial = torch.cat(self.initials)
        sizes = torch.tensor([band.numel() for band in self.live], dtype=torch.int64)
        self.ends = (sizes.cumsum(0) - 1).to(self.initial.device)


def _format_offsets(offsets: Sequence[int], limit: int = 6) -> str:
    """``[3, 4, 5, 9]`` -> ``"3..5, 9"``; more than ``limit`` runs are elided."""
    runs: list[tuple[int, int]] = []
    for offset in offsets:
        if runs and offset == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], offset)
        else:
            runs.append((offset, offset))
    text = ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs[:limit])
    if len(runs) > limit:
        text += f", ... ({len(offsets)} elements in all)"
    return text
