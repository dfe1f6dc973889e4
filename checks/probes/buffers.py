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


def poison_(tensor: torch.Tensor, sentinel: float | None = None) -> None:
    """Fill ``tensor`` in place with a poison value: ``sentinel`` when given, else NaN for
    floating and complex dtypes and the byte pattern ``0xA5`` for integer and bool dtypes
    (int32 ``-0x5A5A5A5B``, int64 ``-0x5A5A5A5A5A5A5A5B``). The default poison is non-zero
    for :func:`check_zero_tail`; in int32 and int64 it is negative, no valid index or
    length, and NaN spoils any arithmetic it enters, so a read of it shows.
    ``tensor`` must be contiguous when it has an integer or bool dtype (its bytes are
    written through a ``uint8`` view)."""
    if sentinel is not None:
        tensor.fill_(sentinel)
    elif tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        tensor.fill_(math.nan)
    else:
        tensor.view(torch.uint8).fill_(0xA5)


class GuardedBuffer:
    """A persistent buffer with a poison-filled guard band before and after it.

    ``tensor`` is the buffer to hand to the code under test: a contiguous view of
    ``guard`` + ``numel`` + ``guard`` elements of backing storage. The bands are filled with
    :func:`poison_`'s sentinel (``sentinel`` when given), so that an over-read poisons results
    and an over-write is detectable.
    :meth:`violations` compares the bands bytewise with their initial contents, so a write is
    caught unless it stores the very sentinel bit pattern.

    Contract: ``guard >= 1``; the bands are never handed out; ``violations()`` and
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

    def rearm(self) -> None:
        """Restore both bands to their initial contents, so that :meth:`violations` reports
        only writes made after this call (the verifier rearms before every example: a
        failure then belongs to the example that caused it)."""
        for band, initial in zip(self._bands, self._initial, strict=True):
            band.view(torch.uint8).copy_(initial)

    def written(self) -> torch.Tensor:
        """A bool scalar on the buffer's device: whether either band differs from its
        initial contents. Queues the comparison without synchronising, so a caller holding
        many buffers reads all their answers back at once (:meth:`violations` then names
        the offsets of the few that were written)."""
        return torch.stack([
            torch.ne(band.view(torch.uint8), initial).any()
            for band, initial in zip(self._bands, self._initial, strict=True)
        ]).any()

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
