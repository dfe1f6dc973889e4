"""The torch-mode plumbing the recording probes share (:class:`~speccheck.checks.probes.
allocation.AllocationRecorder`, :class:`~speccheck.checks.probes.host_sync.HostSyncRecorder`):
a dispatch mode that hands every aten op to a recorder's hook, and the base that leaves a
recorder's modes when its ``with`` block ends."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DispatchHook = Callable[[torch._ops.OpOverload, Sequence[Any], Mapping[str, Any]], Any]
"""``hook(func, args, kwargs)``: runs the aten op ``func`` on ``args`` and ``kwargs``, records
what it looks for around the call, and returns the op's result."""


class HookDispatchMode(TorchDispatchMode):
    """Hands every aten op dispatched while the mode is active to its hook (``kwargs`` empty
    when the op got none) and returns what the hook returns. Torch leaves the mode while the
    hook runs, so the op the hook calls dispatches past it."""

    def __init__(self, hook: DispatchHook) -> None:
        super().__init__()
        self._hook = hook

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Torch wraps a dispatch mode's ``__torch_dispatch__`` in ``torch._disable_dynamo``
        unless this says no. The recorders never run under ``torch.compile``, and the wrapper
        costs a ``torch._dynamo`` import (about 2 s in each worker process) and a frame per
        aten op (about 15 % of a CPU-tier run)."""
        return False

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        return self._hook(func, args, kwargs or {})


class ModeRecorder:
    """Base of a recorder that traces the body of its ``with`` block through torch modes.

    Contract: a subclass's ``__enter__`` enters its modes, and registers whatever else it
    must undo, on :attr:`_stack`; leaving the block, also when the body raised, undoes all of
    it in reverse order."""

    def __init__(self) -> None:
        self._stack = ExitStack()

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
