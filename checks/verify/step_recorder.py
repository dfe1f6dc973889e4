"""Per-step snapshots of every tensor and host value reachable from the attention metadata.

Installed as a speculator's ``step_observer``, which the speculator calls right before each
draft step's forward, with the metadata that step runs with.

Tensors: each call copies them into buffers the recorder owns, keyed by (lanes, step,
path, shape, dtype), with ``copy_``: capture-safe, so inside a captured fused body the copies
are recorded into the graph and every replay refreshes the snapshots. Buffers are allocated
on first sight (eagerly, or in the warm-up that precedes a capture), never during a capture.
A buffer a capture wrote into is never freed: the graph writes into it on every replay, so
a buffer dropped when the field comes with another shape under the same (lanes, step,
path) (padded first passes of 32 requests of 2 tokens and of 64 of 1 both run 64 lanes)
would be memory the allocator hands to someone else while replays still write it. Any
other buffer is dropped when its field comes with another shape (eager runs size some
fields by the batch). :meth:`StepMetadataRecorder.collect` reads, per step, the paths
last observed over those lanes and each one's buffer of the shape it then had: the oracle's
eager run of the example, which precedes its candidates' replays of the same geometry. A
path that run did not have is not reported, though an earlier geometry over the same lanes
had it (FlashInfer's first passes: 4 requests of 2 tokens plan a prefill wrapper with query
offsets, 8 requests of 1 token a decode wrapper without; a stale path's buffer holds the
earlier example's values, which the oracle's snapshot reported beside the candidate's
fresh step, where the path is missing).

Host values (:func:`~speccheck.checks.probes.state_walk.walk_host_values`) cannot be
recorded into a graph: a replay runs no Python, and the kernels it replays were launched,
at capture, with the host values of that moment. So each call also reads the host values,
on the host, and keeps them per (lanes, step) in one of two places:

- outside a capture (eager runs, and the host side of per-step replays): as the values of
  the run in progress;
- during a capture: as the values the captured body runs with at that step, in every
  replay. A fused body is captured once per bucket with metadata built for capture, and
  its refresh runs, on the host, only at capture: whatever host values the captured
  metadata object holds then (as the refreshes of the capture left them, step by step) are
  what every replay's kernels see, whatever batch is replayed. The first capture of a
  (lanes, step) is kept: the speculator captures the fused body before the host_preplanned one,
  and capture metadata comes from fixed dummy inputs, so capturing again records the same
  values.

:meth:`StepMetadataRecorder.collect` ends a run: a step observed outside a capture since the
previous collect ran eagerly, and reports the host values observed; a step not observed ran
inside a replay of a captured body, and reports the host values recorded at its capture.

Per-step graph replays are observed from the host, before each replay: the tensors of the
fresh build (what it wrote into the persistent buffers the graph reads), and the host values
of the metadata the single-step graph was captured with, which the replayed launches still
use (the speculator passes both). A host value a kernel reads therefore shows as a
step_metadata difference against the eager oracle there too. Not covered: a builder whose
build binds fresh tensors instead of writing the buffers the graph reads; the per-step graph
candidate's outputs show that.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from speccheck.checks.probes.state_walk import walk_state
from speccheck.checks.verify.readback import HostCopyPlan
from speccheck.contract.groups import AttentionGroup


class StepSnapshots(dict[int, dict[str, torch.Tensor]]):
    """What one run's metadata held before each draft step.

    As a dict: ``{step: {path: tensor}}``, steps ascending, paths in walk order (metadata
    first), host copies; callers that read tensors only use it as such. :attr:`host`:
    ``{step: {path: host value}}`` (:func:`~speccheck.checks.probes.state_walk.
    walk_host_values` values) for the same steps.
    """

    def __init__(
        self,
        tensors: Mapping[int, dict[str, torch.Tensor]] | None = None,
        host: Mapping[int, dict[str, np.ndarray]] | None = None,
    ) -> None:
        super().__init__(tensors or {})
        self.host: dict[int, dict[str, np.ndarray]] = dict(host or {})

    def of_metadata(self) -> StepSnapshots:
        """These snapshots without the tensors reached only from the builders' persistent
        buffers (:func:`reached_from_metadata`); the host values all kept."""
        return StepSnapshots(
            {step: {path: t for path, t in tensors.items() if reached_from_metadata(path)}
             for step, tensors in self.items()}, self.host)


METADATA_ROOT = "metadata"
"""The second part of every path reached from a group's metadata."""


def metadata_path(backend_name: str, field: str) -> str:
    """The path ``field`` of ``backend_name``'s metadata is recorded under (the field
    meanings, claims and latent-field probes name fields by it)."""
    return f"{backend_name}.{METADATA_ROOT}.{field}"


def reached_from_metadata(path: str) -> bool:
    """Whether ``path`` (a :func:`reachable_state` path) was reached from a group's metadata,
    not from its builder's persistent buffers (:func:`metadata_roots`)."""
    return path.split(".", 1)[-1].startswith(METADATA_ROOT)


def metadata_roots(groups: Sequence[AttentionGroup], group_metadata: Sequence[Any]) -> dict[str, object]:
    """Walk roots: each group's metadata and its builder's persistent buffers."""
    roots: dict[str, object] = {}
    for group, md in zip(groups, group_metadata, strict=True):
        roots[f"{group.backend_name}.{METADATA_ROOT}"] = md
        roots[f"{group.backend_name}.buffers"] = dict(group.builder.persistent_buffers())
    return roots


def reachable_state(
    groups: Sequence[AttentionGroup], group_metadata: Sequence[Any]
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """Every tensor reachable from the roots, except the builders' workspace buffers, and
    every host value reachable from them, with the same paths (one
    :func:`~speccheck.checks.probes.state_walk.walk_state` per root)."""
    workspace = {
        t.untyped_storage().data_ptr()
        for g in groups
        for t in g.builder.workspace_buffers().values()
    }
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, np.ndarray] = {}
    for prefix, root in metadata_roots(groups, group_metadata).items():
        found, host = walk_state(root, prefix=prefix)
        for path, t in found.items():
            if t.untyped_storage().data_ptr() not in workspace:
                tensors[path] = t
        values.update(host)
    return tensors, values


class StepMetadataRecorder:
    """Records, for each draft step, the metadata the step is about to run with (see the
    module docstring for what a graph replay's host values are)."""

    def __init__(self, groups: Sequence[AttentionGroup]) -> None:
        self.groups = list(groups)
        self._buffers: dict[tuple[int, int, str, torch.Size, torch.dtype], torch.Tensor] = {}
        """The snapshot buffers: each one a capture wrote into, and the one of each (lanes,
        step, path) observed last (see the module docstring)."""
        self._captured: set[tuple[int, int, str, torch.Size, torch.dtype]] = set()
        """The keys of the buffers a capture wrote into: never freed."""
        self._seen: dict[int, dict[int, dict[str, tuple[torch.Size, torch.dtype]]]] = {}
        """Per lane count and step, the paths of the last observation (capture included),
        in walk order, with the shape and dtype each had."""
        self._host: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        """Host values last observed outside a capture, per (lanes, step)."""
        self._captured_host: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        """Host values observed during the first capture of each (lanes, step)."""
        self._observed: set[tuple[int, int]] = set()
        """(lanes, step) observed outside a capture since the last :meth:`collect`."""
        self.last_metadata: list[Any] | None = None
        """The group metadata of the latest observed step."""
        self._plans: dict[int, tuple[list[tuple[int, str]], HostCopyPlan]] = {}
        """Per lane count, the snapshot keys in step order and the plan that reads their
        buffers back; dropped when a step of that lane count is observed with other paths,
        shapes or dtypes than the last time."""
        self._latest: tuple[dict[str, torch.Tensor], dict[str, np.ndarray]] = ({}, {})
        """The buffers and host values of the step last observed outside a capture."""
        self.storage_of: dict[str, int] = {}
        """Storage address of the tensor last seen at each path (to tell views of the
        speculator's input buffers from a builder's derived tensors)."""

    def __call__(
        self, lanes: int, step: int, group_metadata: Sequence[Any],
        launched_with: Sequence[Any] | None = None,
    ) -> None:
        """Snapshot the tensors of ``group_metadata`` and the host values of
        ``launched_with`` (the captured metadata a per-step replay's launches were recorded
        with), or of ``group_metadata`` when that is ``None``."""
        self.last_metadata = list(group_metadata)
        in_capture = capturing()
        tensors, host = reachable_state(self.groups, group_metadata)
        host_source = launched_with or group_metadata
        if host_source is not group_metadata:
            host = reachable_state(self.groups, host_source)[1]
        targets = []
        observed = {path: (t.shape, t.dtype) for path, t in tensors.items()}
        previous = self._seen.setdefault(lanes, {}).get(step, {})
        if observed != previous:
            self._seen[lanes][step] = observed
            self._plans.pop(lanes, None)
            for path, signature in previous.items():
                key = (lanes, step, path, *signature)
                if observed.get(path) != signature and key not in self._captured:
                    del self._buffers[key]
        for path, tensor in tensors.items():
            signature = (tensor.shape, tensor.dtype)
            key = (lanes, step, path, *signature)
            buf = self._buffers.get(key)
            if buf is None:
                if in_capture:
                    raise RuntimeError(
                        f"snapshot buffer for {path} (step {step}) first seen during capture"
                    )
                buf = torch.empty_like(tensor, memory_format=torch.contiguous_format)
                self._buffers[key] = buf
            targets.append(buf)
            if in_capture:
                self._captured.add(key)
            self.storage_of[path] = tensor.untyped_storage().data_ptr()
        if targets:
            # one multi-tensor copy, not a launch per field (capturable: device copies only)
            torch._foreach_copy_(targets, list(tensors.values()))
        if in_capture:
            self._captured_host.setdefault((lanes, step), host)
        else:
            self._host[(lanes, step)] = host
            self._observed.add((lanes, step))
            self._latest = (dict(zip(tensors, targets, strict=True)), host)

    def latest(self) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
        """Host copies of the step last observed outside a capture (``{path: tensor}``, in
        walk order) and its host values: what the step is about to run with. Synchronises
        (verifier-side only)."""
        buffers, host = self._latest
        copies = HostCopyPlan(list(buffers.values())).copies() if buffers else []
        return dict(zip(buffers, copies, strict=True)), host

    def collect(self, lanes: int) -> StepSnapshots:
        """Host copies of the latest snapshots over ``lanes`` decode lanes, and the host
        values each step ran with: those observed since the previous ``collect`` where the
        step was observed (an eager run), else those recorded when the step was captured (a
        replay). Ends the run: the next ``collect`` reports only what is observed after
        this one."""
        if lanes not in self._plans:
            seen = self._seen.get(lanes, {})
            keys = [(step, path) for step in sorted(seen) for path in seen[step]]
            buffers = [self._buffers[(lanes, step, path, *seen[step][path])]
                       for step, path in keys]
            self._plans[lanes] = (keys, HostCopyPlan(buffers))
        keys, plan = self._plans[lanes]
        copies = plan.copies()
        tensors: dict[int, dict[str, torch.Tensor]] = {}
        for (step, path), copy in zip(keys, copies, strict=True):
            tensors.setdefault(step, {})[path] = copy
        host: dict[int, dict[str, np.ndarray]] = {}
        for step in tensors:
            key = (lanes, step)
            eager = key in self._observed or key not in self._captured_host
            host[step] = self._host.get(key, {}) if eager else self._captured_host[key]
        self._observed.clear()
        return StepSnapshots(tensors, host)


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
