"""Capture-safety probes for ``update_draft_decode_metadata`` (DESIGN.md, checks/ step 5).

The refresh runs between draft steps inside a captured CUDA graph, so it must emit only
capture-safe device work and write its results in place (``contract/builder.py``). These
probes find the ways it can break that contract:

- :class:`HostSyncRecorder` — host synchronisations (``.item()``, ``.tolist()``, ``bool()`` on
  a tensor, ``nonzero``, boolean-mask indexing, host copies, ...), each with its call site.
- :class:`AllocationRecorder` — new tensors created, and existing storage reallocated.
- :class:`IdentityGuard` — metadata tensors replaced by new objects instead of written in place.
- :func:`check_zero_tail` — persistent buffers whose unused tail must stay zero.
- :class:`GuardedBuffer` — poison-filled guard bands around a persistent buffer, to catch
  writes past either end.

The recorders trace with ``TorchFunctionMode`` and ``TorchDispatchMode``, so they work on CPU
tensors: on CPU CI the CPU plays the device, and a call that would synchronise on a GPU is
reported even though on the CPU it is free. Each probe reports :class:`ProbeFinding` records
whose message says what to change.

All probes are verifier-side tools: their own checks synchronise, so use them around an eager
refresh (or a capture), never inside code that is itself being captured.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from speccheck.checks.state_walk import TensorIdentity, tensor_identity, walk_tensors

logger = logging.getLogger(__name__)

HOST_SYNC = "host_sync"
ALLOCATION = "allocation"
REPLACED_TENSOR = "replaced_tensor"
ZERO_TAIL = "zero_tail"
GUARD_BAND = "guard_band"

DEFAULT_GUARD_ELEMENTS = 256


@dataclass(frozen=True)
class ProbeFinding:
    """One capture-safety problem."""

    check: str
    """Which probe found it: ``host_sync``, ``allocation``, ``replaced_tensor``,
    ``zero_tail`` or ``guard_band``."""
    path: str
    """Where: a metadata path (``metadata.scheduler_metadata``), a buffer name, or the
    ``file:line`` call site of the offending call."""
    message: str
    """What is wrong, and what to change."""

    def __str__(self) -> str:
        return f"[{self.check}] {self.path}: {self.message}"


# ---------------------------------------------------------------------------------------------
# Call sites

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _call_site() -> tuple[str, str]:
    """``("file:line", function)`` of the innermost frame outside torch and this module."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename != __file__ and not filename.startswith(_TORCH_DIR):
            return f"{filename}:{frame.f_lineno}", frame.f_code.co_name
        frame = frame.f_back
    return "<unknown>", "<unknown>"


# ---------------------------------------------------------------------------------------------
# Host synchronisation


@dataclass(frozen=True)
class _SyncKind:
    what: str
    fix: str


_SCALAR_READ = _SyncKind(
    "reads a device value into a Python scalar",
    "keep the value on the device (torch.where, clamp_, masked_fill_) or take it from the "
    "host-side metadata in build()",
)
_BRANCH = _SyncKind(
    "decides on the host from device values (truth value, `in`, equal/allclose)",
    "a graph records one outcome for every replay: compute both on the device and select "
    "with torch.where, or decide on the host in build()",
)
_HOST_COPY = _SyncKind(
    "copies device data to the host",
    "keep the data on the device, or prepare it on the host in build(), where synchronising "
    "is allowed",
)
_FORMAT = _SyncKind(
    "formats tensor values as text (print, f-string, logging)",
    "do not print or log tensor values in the refresh",
)
_DATA_SHAPE = _SyncKind(
    "creates a tensor whose shape depends on device values",
    "use a fixed-size form: torch.where(cond, a, b), masked_fill_, "
    "torch.nonzero_static(x, size=N), repeat_interleave(..., output_size=N)",
)
_MASK_INDEX = _SyncKind(
    "indexes with a boolean mask, which is expanded to indices through nonzero on the host",
    "keep shapes fixed: masked_fill_(mask, v), torch.where(mask, new, old, out=...), or "
    "an integer index buffer of fixed size",
)
_UPLOAD = _SyncKind(
    "builds a tensor from host data (on a GPU, a host-to-device copy from pageable memory, "
    "which is illegal during capture)",
    "create the constant once in build() as a persistent device buffer",
)
_H2D = _SyncKind(
    "copies pageable host memory to the device",
    "stage the data in a persistent device buffer in build(), or copy from pinned memory "
    "with non_blocking=True",
)

_FUNCTION_SYNCS: dict[str, _SyncKind] = {
    "item": _SCALAR_READ,
    "__int__": _SCALAR_READ,
    "__float__": _SCALAR_READ,
    "__complex__": _SCALAR_READ,
    "__index__": _SCALAR_READ,
    "__bool__": _BRANCH,
    "__contains__": _BRANCH,
    "equal": _BRANCH,
    "allclose": _BRANCH,
    "is_nonzero": _BRANCH,
    "tolist": _HOST_COPY,
    "numpy": _HOST_COPY,
    "__array__": _HOST_COPY,
    "cpu": _HOST_COPY,
    "__repr__": _FORMAT,
    "__str__": _FORMAT,
    "__format__": _FORMAT,
}
"""Python-level calls that synchronise; several (``tolist``, ``numpy``, ``cpu``, printing)
are invisible to a dispatch mode."""

_aten = torch.ops.aten
_SCALAR_OPS = frozenset({_aten._local_scalar_dense})
_BOOL_OPS = frozenset({_aten.equal, _aten.is_nonzero})
_DATA_SHAPE_OPS = frozenset(
    {
        _aten.nonzero,
        _aten.masked_select,
        _aten._unique,
        _aten._unique2,
        _aten.unique_dim,
        _aten.unique_consecutive,
        _aten.unique_dim_consecutive,
        _aten.bincount,
    }
)
_MASK_INDEX_OPS = frozenset(
    {_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_}
)
_REPEAT_INTERLEAVE_TENSOR = frozenset(
    {_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor}
)


def _function_sync(
    func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> _SyncKind | None:
    name = getattr(func, "__name__", "")
    kind = _FUNCTION_SYNCS.get(name)
    if kind is not None:
        return kind
    if name == "to" and args and isinstance(args[0], torch.Tensor):
        # ``t.to(other)`` follows other's device: only an explicit device is a host copy
        # request here; a real device-to-host copy is also seen at dispatch as _to_copy.
        if len(args) > 1 and isinstance(args[1], torch.Tensor):
            return None
        device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
        return _HOST_COPY if device is not None and device.type == "cpu" else None
    if name in ("tensor", "as_tensor") and func in (torch.tensor, torch.as_tensor):
        data = args[0] if args else kwargs.get("data")
        return None if isinstance(data, torch.Tensor) else _UPLOAD
    return None


def _cross_device_copy(src: torch.Tensor, dst_device: torch.device) -> _SyncKind | None:
    if src.device == dst_device:
        return None
    if dst_device.type == "cpu":
        return _HOST_COPY
    if src.device.type == "cpu":
        return None if src.is_pinned() else _H2D
    return None  # device to device: asynchronous


def _dispatch_sync(
    func: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> _SyncKind | None:
    packet = func.overloadpacket
    if packet in _SCALAR_OPS:
        return _SCALAR_READ
    if packet in _BOOL_OPS:
        return _BRANCH
    if packet in _DATA_SHAPE_OPS:
        return _DATA_SHAPE
    if func in _REPEAT_INTERLEAVE_TENSOR:
        return _DATA_SHAPE if kwargs.get("output_size") is None else None
    if packet in _MASK_INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        masked = any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
        )
        return _MASK_INDEX if masked else None
    if func is _aten._to_copy.default and kwargs.get("device") is not None:
        return _cross_device_copy(args[0], torch.device(kwargs["device"]))
    if packet is _aten.copy_:
        dst, src = args[0], args[1]
        # A 0-dim host tensor (``t[i] = 5``) is passed by value: not a copy from host memory.
        if src.device.type == "cpu" and src.dim() == 0:
            return None
        return _cross_device_copy(src, dst.device)
    return None


def _function_label(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", repr(func))
    if getattr(torch, name, None) is func:
        return f"torch.{name}"
    if getattr(torch.Tensor, name, None) is func:
        return f"Tensor.{name}"
    return getattr(func, "__qualname__", name)


@dataclass(frozen=True)
class HostSyncEvent:
    """One host synchronisation seen by :class:`HostSyncRecorder`."""

    op: str
    """``Tensor.item``, ``torch.tensor``, ``aten.nonzero.default``, ..."""
    site: str
    """``file:line`` of the innermost frame outside torch (the offending line)."""
    function: str
    """Name of the function containing ``site``."""
    what: str
    """What the call does that a captured graph cannot."""
    fix: str
    """How to make it capture-safe."""


class HostSyncRecorder:
    """Records host synchronisations made while the context is active.

    Usage::

        with HostSyncRecorder() as syncs:
            builder.update_draft_decode_metadata(metadata)
        problems = syncs.findings()

    Contract:

    - Sees Python-level calls through a ``TorchFunctionMode`` (``item``, ``tolist``,
      ``numpy``, ``bool``/``int``/``float``/``__index__`` on a tensor, ``x in t``,
      ``equal``/``allclose``, printing, ``.cpu()``, ``.to("cpu")`` with an explicit device,
      ``torch.tensor``/``as_tensor`` from host data) and aten ops through a
      ``TorchDispatchMode`` (``_local_scalar_dense``, ``nonzero``, ``masked_select``,
      ``_unique2`` and the other ``unique`` ops, ``bincount``, ``repeat_interleave`` without
      ``output_size``, ``index``/``index_put_`` with a boolean or uint8 mask, device-to-host
      copies and host-to-device copies from pageable memory). An aten op issued inside a
      recorded Python-level call is not recorded again, so each offending line counts once
      per execution.
    - On CPU tensors the CPU is taken to be the device: ``.cpu()`` and ``.to("cpu")`` are
      reported even when they are no-ops there, because on a GPU they are host copies.
    - ``cuda_sync_debug=True`` additionally sets ``torch.cuda.set_sync_debug_mode("error")``
      for the duration when CUDA is available, so that a real synchronisation raises at
      once (the event is recorded before it raises); the previous mode is restored on exit.
      Without CUDA the flag is ignored (logged).
    - Events accumulate in :attr:`events` in call order; use a fresh recorder per refresh.
    """

    def __init__(self, *, cuda_sync_debug: bool = False) -> None:
        self.cuda_sync_debug = cuda_sync_debug
        self.events: list[HostSyncEvent] = []
        self._suppress = 0
        self._stack = ExitStack()

    def __enter__(self) -> HostSyncRecorder:
        if self.cuda_sync_debug:
            if torch.cuda.is_available():
                previous = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
                self._stack.callback(torch.cuda.set_sync_debug_mode, previous)
            else:
                logger.info("cuda_sync_debug requested without CUDA; tracing only")
        self._stack.enter_context(_SyncDispatchMode(self))
        self._stack.enter_context(_SyncFunctionMode(self))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stack.close()

    def _record(self, op: str, kind: _SyncKind) -> None:
        site, function = _call_site()
        logger.debug("host sync %s at %s (%s)", op, site, function)
        self.events.append(HostSyncEvent(op, site, function, kind.what, kind.fix))

    def findings(self) -> list[ProbeFinding]:
        """One finding per distinct (op, call site), in first-seen order, with a count."""
        counts: dict[tuple[str, str], int] = {}
        first: dict[tuple[str, str], HostSyncEvent] = {}
        for event in self.events:
            key = (event.op, event.site)
            counts[key] = counts.get(key, 0) + 1
            first.setdefault(key, event)
        return [
            ProbeFinding(
                HOST_SYNC,
                event.site,
                f"refresh calls {event.op} in {event.function}() ({counts[key]}x), which "
                f"{event.what}: a host synchronisation cannot be captured in a CUDA graph; "
                f"{event.fix}",
            )
            for key, event in first.items()
        ]


class _SyncFunctionMode(TorchFunctionMode):
    def __init__(self, recorder: HostSyncRecorder) -> None:
        super().__init__()
        self._recorder = recorder

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        kind = _function_sync(func, args, kwargs)
        if kind is None:
            return func(*args, **kwargs)
        self._recorder._record(_function_label(func), kind)
        self._recorder._suppress += 1
        try:
            return func(*args, **kwargs)
        finally:
            self._recorder._suppress -= 1


class _SyncDispatchMode(TorchDispatchMode):
    def __init__(self, recorder: HostSyncRecorder) -> None:
        super().__init__()
        self._recorder = recorder

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if not self._recorder._suppress:
            kind = _dispatch_sync(func, args, kwargs)
            if kind is not None:
                self._recorder._record(str(func), kind)
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Allocations


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


class AllocationRecorder:
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
        self.events: list[AllocationEvent] = []
        self._stack = ExitStack()

    def __enter__(self) -> AllocationRecorder:
        self._stack.enter_context(_AllocationDispatchMode(self))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stack.close()

    def _record(self, op: str, kind: Literal["new", "moved"], t: torch.Tensor) -> None:
        site, function = _call_site()
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


class _AllocationDispatchMode(TorchDispatchMode):
    def __init__(self, recorder: AllocationRecorder) -> None:
        super().__init__()
        self._recorder = recorder

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
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
                self._recorder._record(op, "moved", t)
        returns = func._schema.returns
        values = (out,) if len(returns) == 1 else tuple(out or ())
        for ret, value in zip(returns, values, strict=True):
            for t in _tensors_in(value):
                fresh = func is _aten.lift_fresh.default and t.dim() > 0
                if ret.alias_info is None or fresh:
                    self._recorder._record(op, "new", t)
        return out


# ---------------------------------------------------------------------------------------------
# Identity of metadata tensors


class IdentityGuard:
    """Checks that a refresh keeps every reachable tensor the same object at the same address.

    Usage::

        with IdentityGuard({"metadata": metadata, "builder": builder}) as g:
            builder.update_draft_decode_metadata(metadata)
        problems = g.findings()

    Contract:

    - On entry, walks each root with :func:`~speccheck.checks.state_walk.walk_tensors` under
      its name as prefix and records every tensor and its
      :class:`~speccheck.checks.state_walk.TensorIdentity`, holding a reference to each so
      that neither its ``id`` nor its address can be reused before the comparison.
    - On exit (also when the body raised), walks the same root objects again and reports, per
      path: a different tensor object (replaced: the captured graph keeps the old address, or,
      for a new view over the same memory, code outside the graph sees the wrong object); the
      same object with moved storage (``resize_``/``set_``/mis-sized ``out=``); the same object
      with a new offset, shape or stride; a tensor that disappeared; and a new tensor path.
    - Roots are walked live, twice: pass the objects that own the tensors (the builder, not
      a dict returned by its ``persistent_buffers()``, which would not see a rebinding).
    - ``findings()`` before the context has exited raises ``RuntimeError``.
    """

    def __init__(self, roots: Mapping[str, object]) -> None:
        if not isinstance(roots, Mapping):
            raise TypeError(
                f"IdentityGuard takes a mapping of root names to objects, e.g. "
                f"{{'metadata': metadata}}; got {type(roots).__name__}"
            )
        self.roots = dict(roots)
        self._before: dict[str, tuple[torch.Tensor, TensorIdentity]] = {}
        self._findings: list[ProbeFinding] | None = None

    def _walk(self) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        for name, root in self.roots.items():
            tensors.update(walk_tensors(root, prefix=name))
        return tensors

    def __enter__(self) -> IdentityGuard:
        self._before = {path: (t, tensor_identity(t)) for path, t in self._walk().items()}
        self._findings = None
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        after = self._walk()
        findings = [
            ProbeFinding(REPLACED_TENSOR, path, message)
            for path, (old, identity) in self._before.items()
            if (message := _identity_problem(path, old, identity, after.get(path))) is not None
        ]
        findings += [
            ProbeFinding(
                REPLACED_TENSOR,
                path,
                f"refresh bound a new tensor at {path}; allocate it once in build() as a "
                "persistent buffer and write into it in place in the refresh",
            )
            for path in after
            if path not in self._before
        ]
        self._findings = findings
        self._before = {}

    def findings(self) -> list[ProbeFinding]:
        """Findings of the last completed ``with`` block."""
        if self._findings is None:
            raise RuntimeError("IdentityGuard.findings() called before the with-block ended")
        return list(self._findings)


def _identity_problem(
    path: str, old: torch.Tensor, identity: TensorIdentity, new: torch.Tensor | None
) -> str | None:
    if new is None:
        return (
            f"refresh removed the tensor at {path}; keep it bound and write the new values "
            "into it in place"
        )
    now = tensor_identity(new)
    if new is not old:
        if now.data_ptr != identity.data_ptr:
            return (
                f"refresh replaced {path} with a new tensor (address {identity.data_ptr:#x} -> "
                f"{now.data_ptr:#x}); a graph replay keeps reading the old address, so write "
                f"into the persistent buffer with copy_() (or an op's out=) instead"
            )
        return (
            f"refresh rebound {path} to a new tensor object over the same memory "
            f"({_layout(identity)} -> {_layout(now)}); a replay does not repeat the rebinding, "
            "so code outside the graph sees the last captured object: keep the original "
            "tensor and write into it in place"
        )
    if now.data_ptr != identity.data_ptr:
        return (
            f"refresh moved the storage of {path} (address {identity.data_ptr:#x} -> "
            f"{now.data_ptr:#x}) through resize_(), set_() or a mis-sized out=; a replay keeps "
            "reading the old address: keep the buffer's size fixed and write into a slice"
        )
    if now != identity:
        return (
            f"refresh changed the layout of {path} in place ({_layout(identity)} -> "
            f"{_layout(now)}); kernels captured earlier keep the old layout: keep shape and "
            "stride fixed and write values only"
        )
    return None


def _layout(identity: TensorIdentity) -> str:
    return (
        f"shape={list(identity.shape)} stride={list(identity.stride)} "
        f"offset={identity.storage_offset}"
    )


# ---------------------------------------------------------------------------------------------
# Persistent-buffer tails and guard bands


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


class GuardedBuffer:
    """A persistent buffer with a poison-filled guard band before and after it.

    ``tensor`` is the buffer to hand to the code under test: a contiguous view of
    ``guard`` + ``numel`` + ``guard`` elements of backing storage. The bands are filled with a
    sentinel — NaN for floating and complex dtypes, the byte pattern ``0xA5`` for integer and
    bool dtypes (int32 ``-0x5A5A5A5B``, int64 ``-0x5A5A5A5A5A5A5A5B``), or ``sentinel`` when
    given — so that an over-read poisons results and an over-write is detectable.
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
            if sentinel is not None:
                band.fill_(sentinel)
            elif dtype.is_floating_point or dtype.is_complex:
                band.fill_(math.nan)
            else:
                band.view(torch.uint8).fill_(0xA5)
        self._initial = tuple(band.view(torch.uint8).clone() for band in self._bands)

    @classmethod
    def like(
        cls, t: torch.Tensor, *, name: str = "buffer", guard: int = DEFAULT_GUARD_ELEMENTS
    ) -> GuardedBuffer:
        """A guarded buffer with ``t``'s shape, dtype, device and values."""
        guarded = cls(t.shape, t.dtype, t.device, name=name, guard=guard)
        guarded.tensor.copy_(t)
        return guarded

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
