"""The probed attention call: on the CPU tier, while the probed candidate runs, every
layer's attention ``forward()`` runs under an emulated capture
(:func:`~speccheck.contract.capture_state.emulated_capture`: the path a graph would
record), traced for host synchronisations, so that a CPU-only run catches what a capture
would reject, with the offending file and line.

The GPU tier does not install it: there the graph candidates capture every call for real,
the stronger check, and a third-party kernel may pick an eager path (legitimately
synchronising) from the real capture state, which an emulation cannot set."""

from __future__ import annotations

from typing import Any

import torch

from speccheck.checks.probes import HostSyncRecorder
from speccheck.checks.verify.comparisons import Outcome
from speccheck.checks.verify.vocabulary import Check, Result
from speccheck.contract.builder import AttentionImpl
from speccheck.contract.capture_state import emulated_capture
from speccheck.speculator.base import DraftModelSpeculator

SUBJECT = "attention forward"
"""What the findings say made the call."""


class _TracedImpl(AttentionImpl[Any]):
    """Stands in for one layer's impl while it is probed: the same layer and scale, its
    ``forward`` the impl's own under an emulated capture, recorded by ``syncs``."""

    def __init__(self, impl: AttentionImpl[Any], syncs: HostSyncRecorder) -> None:
        super().__init__(impl.layer, impl.scale)
        self.impl = impl
        self.syncs = syncs

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: Any,
                output: torch.Tensor) -> None:
        with emulated_capture(), self.syncs:
            self.impl.forward(query, key, value, key_cache, value_cache, metadata, output)


class ForwardProbe:
    """The traced attention calls of one candidate run (``candidate`` names it in the
    outcomes) on ``speculator``.

    Contract: construction installs the tracing in place of each layer's impl in
    ``speculator.layer_impls``; :meth:`uninstall` puts the impls back (call it in a
    ``finally``: the speculator's next run must see its own impls). One recorder per
    backend collects every call's host synchronisations; :meth:`outcomes` turns them into
    one ``host_sync`` outcome per backend, read once.
    """

    def __init__(self, candidate: str, speculator: DraftModelSpeculator) -> None:
        self.candidate = candidate
        self._impls = speculator.layer_impls
        self._originals = list(self._impls)
        self._syncs: dict[str, HostSyncRecorder] | None = {}
        for group in speculator.groups:
            syncs = self._syncs.setdefault(group.backend_name,
                                           HostSyncRecorder(subject=SUBJECT))
            for layer in group.layer_indices:
                self._impls[layer] = _TracedImpl(self._originals[layer], syncs)

    def uninstall(self) -> None:
        """Every layer's own impl back in ``speculator.layer_impls``."""
        self._impls[:] = self._originals

    def outcomes(self) -> list[Outcome]:
        """Per backend, ``host_sync`` failed with the first call site found (file, line and
        the remedy), else passed. Read once (``RuntimeError`` on a second read)."""
        if self._syncs is None:
            raise RuntimeError("this probe's outcomes were read already")
        syncs, self._syncs = self._syncs, None
        outcomes = []
        for backend, recorder in syncs.items():
            findings = recorder.findings()
            if findings:
                outcomes.append(Outcome(Check.HOST_SYNC, Result.FAILED,
                                        f"{backend}: {findings[0]}", self.candidate))
            else:
                outcomes.append(Outcome(Check.HOST_SYNC, Result.PASSED,
                                        candidate=self.candidate))
        return outcomes
