"""Tensors a refresh creates, and existing storage it reallocates."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from speccheck.checks.probes.findings import (
    ALLOCATION,
    ProbeFinding,
    call_site,
)
from speccheck.checks.probes.tracing import HookDispatchMode, ModeRecorder

logger = logging.getLogger(__name__)
_aten = torch.ops.aten


@dataclass(frozen=True)
class AllocationEvent:
    """A tensor created, or an existing tensor's storage moved, by one aten op."""

    op: str
    site: str
    function: str
    kind: Literal["new", "moved"]
    """``new``: the op returned a freshly allocated tensor. ``moved``: the op wrote into an
    existing tensor (in place or ``out=``) and had to reallocate its storage to do so."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int


_NOT_PASSED = object()


def _bound_arguments(
    func: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Iterator[tuple[torch._C.Argument, Any]]:
    """(schema argument, value) for every argument that was passed."""
    positional = iter(args)
    for argument in func._schema.arguments:
        if argument.name in kwargs:
            yield argument, kwargs[argument.name]
        elif not argument.kwarg_only:
            value = next(positional, _NOT_PASSED)
            if value is not _NOT_PASSED:
                yield argument, value


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


class AllocationRecorder(ModeRecorder):
    """Records tensors allocated while the context is active.

    Usage::

        with AllocationRecorder() as allocs:
            builder.update_draft_decode_metadata(metadata)

    Contract:

    - An op's result counts as ``new`` when its schema return carries no alias annotation:
      out-of-place ops and factories (``add``, ``clone``, ``empty``, ``zeros``, ...). Views
      (``view``, ``slice``, ``select``, ``detach``), in-place ops (``add_``, ``copy_``) and
      ``out=`` variants return an alias and do not count. ``torch.tensor(data)`` counts (as
      ``aten.lift_fresh``) unless the result is 0-dimensional: 0-dim host scalars such as
      the ``5`` in ``t[i] = 5`` are passed by value.
    - An in-place or ``out=`` op whose written tensor's storage address changed counts as
      ``moved`` (an ``out=`` tensor of the wrong size is resized; ``resize_``, ``set_``).
    - Allocation is information, not necessarily a bug: a temporary allocated during capture
      comes from the graph's private pool and is reused on every replay. It becomes a bug when
      the result is bound into metadata (see :class:`IdentityGuard`) or a buffer moves.
    - Wrap the refresh call alone, inside the capture if there is one: entering
      ``torch.cuda.graph`` itself allocates (two ``aten.empty`` on torch 2.11).
    - Events accumulate in :attr:`events`; use a fresh recorder per refresh.
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: list[AllocationEvent] = []

    def __enter__(self) -> AllocationRecorder:
        self._stack.enter_context(HookDispatchMode(self._dispatch))
        return self

    def _dispatch(
        self, func: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> Any:
        """Runs the aten op; records the tensors it returns fresh and those it writes whose
        storage moved."""
        written = [
            t
            for argument, value in _bound_arguments(func, args, kwargs)
            if argument.alias_info is not None and argument.alias_info.is_write
            for t in _tensors_in(value)
        ]
        addresses = [t.untyped_storage().data_ptr() for t in written]
        out = func(*args, **kwargs)
        op = str(func)
        for t, address in zip(written, addresses, strict=True):
            if t.untyped_storage().data_ptr() != address:
                self._record(op, "moved", t)
        returns = func._schema.returns
        values = (out,) if len(returns) == 1 else tuple(out or ())
        for ret, value in zip(returns, values, strict=True):
            for t in _tensors_in(value):
                fresh = func is _aten.lift_fresh.default and t.dim() > 0
                if ret.alias_info is None or fresh:
                    self._record(op, "new", t)
        return out

    def _record(self, op: str, kind: Literal["new", "moved"], t: torch.Tensor) -> None:
        site, function = call_site()
        nbytes = t.numel() * t.element_size()
        logger.debug(
            "%s tensor %s %s (%d B) by %s at %s", kind, tuple(t.shape), t.dtype, nbytes, op, site
        )
        self.events.append(
            AllocationEvent(op, site, function, kind, tuple(t.shape), t.dtype, t.device, nbytes)
        )

    def findings(self) -> list[ProbeFinding]:
        """One finding per distinct (call site, kind), in first-seen order."""
        groups: dict[tuple[str, str], list[AllocationEvent]] = {}
        for event in self.events:
            groups.setdefault((event.site, event.kind), []).append(event)
        findings = []
        for (site, kind), events in groups.items():
            ops = ", ".join(dict.fromkeys(e.op for e in events))
            function = events[0].function
            if kind == "new":
                message = (
                    f"refresh allocates {len(events)} new tensor(s), "
                    f"{sum(e.nbytes for e in events)} bytes ({ops}) in {function}(); "
                    "temporaries in a captured graph come from its private pool, but a result "
                    "that the metadata, a later step or the next replay reads must live in a "
                    "persistent buffer: write it with out= or copy_() into a buffer allocated "
                    "in build()"
                )
            else:
                message = (
                    f"refresh reallocated the storage of an existing tensor {len(events)} "
                    f"time(s) ({ops}) in {function}(): an in-place or out= target had the "
                    "wrong size, so the buffer moved and a replay keeps reading the old "
                    "address; size the buffer for the largest bucket and pass a slice of "
                    "the right length"
                )
            findings.append(ProbeFinding(ALLOCATION, site, message))
        return findings


# ---------------------------------------------------------------------------------------------
