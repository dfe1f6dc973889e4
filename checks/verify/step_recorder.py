"""Per-step snapshots of every tensor reachable from the attention metadata.

Installed as a speculator's ``step_observer``. Each call copies the tensors into buffers
the recorder owns, keyed by (lanes, step, path), with ``copy_``: capture-safe, so inside a
captured fused body the copies are recorded into the graph and every replay refreshes the
snapshots. Buffers are allocated on first sight (eagerly, or in the warm-up that precedes a
capture), never during a capture.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from speccheck.checks.verify.state_walk import walk_tensors
from speccheck.contract.groups import AttentionGroup


def metadata_roots(groups: Sequence[AttentionGroup], group_metadata: Sequence[Any]) -> dict[str, object]:
    """Walk roots: each group's metadata and its builder's persistent buffers."""
    roots: dict[str, object] = {}
    for group, md in zip(groups, group_metadata, strict=True):
        roots[f"{group.backend_name}.metadata"] = md
        roots[f"{group.backend_name}.buffers"] = dict(group.builder.persistent_buffers())
    return roots


def reachable_tensors(groups: Sequence[AttentionGroup], group_metadata: Sequence[Any]) -> dict[str, torch.Tensor]:
    """Every tensor reachable from the roots, except the builders' workspace buffers."""
    workspace = {
        t.untyped_storage().data_ptr()
        for g in groups
        for t in g.builder.workspace_buffers().values()
    }
    tensors: dict[str, torch.Tensor] = {}
    for prefix, root in metadata_roots(groups, group_metadata).items():
        for path, t in walk_tensors(root, prefix=prefix).items():
            if t.untyped_storage().data_ptr() not in workspace:
                tensors[path] = t
    return tensors


class StepMetadataRecorder:
    """Records, for each draft step, the metadata the step is about to run with."""

    def __init__(self, groups: Sequence[AttentionGroup]) -> None:
        self.groups = list(groups)
        self._buffers: dict[tuple[int, int, str], torch.Tensor] = {}
        self._seen: dict[int, dict[tuple[int, str], None]] = {}
        self.last_metadata: list[Any] | None = None
        """The group metadata of the latest observed step."""
        self.storage_of: dict[str, int] = {}
        """Storage address of the tensor last seen at each path (to tell views of the
        speculator's input buffers from a builder's derived tensors)."""

    def __call__(self, lanes: int, step: int, group_metadata: Sequence[Any]) -> None:
        self.last_metadata = list(group_metadata)
        for path, tensor in reachable_tensors(self.groups, group_metadata).items():
            key = (lanes, step, path)
            buf = self._buffers.get(key)
            if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
                if _capturing():
                    raise RuntimeError(
                        f"snapshot buffer for {path} (step {step}) first seen during capture"
                    )
                buf = torch.empty_like(tensor, memory_format=torch.contiguous_format)
                self._buffers[key] = buf
            buf.copy_(tensor)
            self.storage_of[path] = tensor.untyped_storage().data_ptr()
            self._seen.setdefault(lanes, {})[(step, path)] = None

    def collect(self, lanes: int) -> dict[int, dict[str, torch.Tensor]]:
        """Host copies of the latest snapshots over ``lanes`` decode lanes:
        ``{step: {path: tensor}}``, steps ascending, paths in walk order (metadata first)."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for step, path in sorted(self._seen.get(lanes, {}), key=lambda key: key[0]):
            out.setdefault(step, {})[path] = self._buffers[(lanes, step, path)].cpu().clone()
        return out


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
