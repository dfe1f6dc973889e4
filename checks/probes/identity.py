"""Metadata tensors a refresh replaces by new objects instead of writing in place."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType

import torch

from speccheck.checks.probes.findings import (
    REPLACED_TENSOR,
    ProbeFinding,
)
from speccheck.checks.probes.state_walk import TensorIdentity, tensor_identity, walk_tensors


class IdentityGuard:
    """Checks that a refresh keeps every reachable tensor the same object at the same address.

    Usage::

        with IdentityGuard({"metadata": metadata, "builder": builder}) as g:
            builder.update_draft_decode_metadata(metadata)
        problems = g.findings()

    Contract:

    - On entry, walks each root with :func:`~speccheck.checks.probes.state_walk.walk_tensors` under
      its name as prefix and records every tensor and its
      :class:`~speccheck.checks.probes.state_walk.TensorIdentity`, holding a reference to each so
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
