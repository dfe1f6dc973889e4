"""Host synchronisations made by a refresh or an attention call (``.item()``, ``.tolist()``,
``bool(t)``, ``nonzero``, boolean-mask indexing, host copies, ...), each with its call
site."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from speccheck.checks.probes.findings import (
    HOST_SYNC,
    ProbeFinding,
    call_site,
)
from speccheck.checks.probes.tracing import HookDispatchMode, ModeRecorder

logger = logging.getLogger(__name__)


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


class HostSyncRecorder(ModeRecorder):
    """Records host synchronisations made while the context is active.

    Usage::

        with HostSyncRecorder() as syncs:
            builder.update_draft_decode_metadata(metadata)
        problems = syncs.findings()

    ``subject`` names what was traced in the findings (``refresh``, ``attention forward``).

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
    - ``device_only=True`` records only calls that touch a tensor off the CPU (or build one
      there): what synchronises on this machine, rather than what would on a GPU. The
      bench uses it to name the real waits in a launch.
    - Events accumulate in :attr:`events` in call order, also over several ``with`` blocks
      of one recorder (one per call of the traced function, say); use a fresh recorder per
      traced run.
    """

    def __init__(self, *, cuda_sync_debug: bool = False, device_only: bool = False,
                 subject: str = "refresh") -> None:
        super().__init__()
        self.subject = subject
        self.cuda_sync_debug = cuda_sync_debug
        self.device_only = device_only
        self.events: list[HostSyncEvent] = []
        self._suppress = 0

    def __enter__(self) -> HostSyncRecorder:
        if self.cuda_sync_debug:
            if torch.cuda.is_available():
                previous = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
                self._stack.callback(torch.cuda.set_sync_debug_mode, previous)
            else:
                logger.info("cuda_sync_debug requested without CUDA; tracing only")
        self._stack.enter_context(HookDispatchMode(self._dispatch))
        self._stack.enter_context(_SyncFunctionMode(self))
        return self

    def _dispatch(
        self, func: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> Any:
        """Runs the aten op; records it first if it synchronises, unless it runs inside a
        recorded Python-level call (or, with ``device_only``, touches no device tensor)."""
        if not self._suppress and (not self.device_only or _touches_device(args, kwargs)):
            kind = _dispatch_sync(func, args, kwargs)
            if kind is not None:
                self._record(str(func), kind)
        return func(*args, **kwargs)

    def _record(self, op: str, kind: _SyncKind) -> None:
        site, function = call_site()
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
                f"{self.subject} calls {event.op} in {event.function}() ({counts[key]}x), which "
                f"{event.what}: a host synchronisation cannot be captured in a CUDA graph; "
                f"{event.fix}",
            )
            for key, event in first.items()
        ]


def _touches_device(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """A tensor among ``args`` (or in a list or tuple there) or ``kwargs`` lives off the
    CPU, or ``kwargs`` name a device off the CPU."""
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "cpu":
        return True
    values = [*args, *kwargs.values()]
    values += [item for value in values if isinstance(value, list | tuple) for item in value]
    return any(isinstance(value, torch.Tensor) and value.device.type != "cpu"
               for value in values)


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
        if kind is None or (self._recorder.device_only and not _touches_device(args, kwargs)):
            return func(*args, **kwargs)
        self._recorder._record(_function_label(func), kind)
        self._recorder._suppress += 1
        try:
            return func(*args, **kwargs)
        finally:
            self._recorder._suppress -= 1


# ---------------------------------------------------------------------------------------------
# Allocations
