"""The host side of the autoregressive speculator's three decode paths, after the first
pass has written step 1's lanes: per-step rebuilds, fused, and host_preplanned. Each runs
its body (:mod:`~speccheck.speculator.decode_steps`) eagerly or replays its captured graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from speccheck.contract.cudagraph import BatchExecutionDescriptor
from speccheck.speculator.paths import SINGLE_STEP, DecodePath

if TYPE_CHECKING:
    from speccheck.speculator.autoregressive import AutoregressiveSpeculator


class DecodeLoops:
    """Runs the decode steps of one speculator on the path it is asked for."""

    def __init__(self, speculator: AutoregressiveSpeculator) -> None:
        self._spec = speculator

    def per_step(
        self, desc: BatchExecutionDescriptor, num_reqs: int, base_seq_lens: np.ndarray,
        replay: bool,
    ) -> None:
        """Per-step path: slots and a metadata rebuild before every step (step 1's slots
        are the first pass's). With ``replay``, each step replays the single-step graph,
        which reads the metadata captured for it: the rebuild must land in the persistent
        buffers that metadata views."""
        spec = self._spec
        num_lanes = desc.num_tokens
        group_metadata: list[Any] = []
        for step in range(1, spec.num_steps):
            if step == 1 or spec.config.advance_draft_positions:
                if step > 1:
                    spec.compute_slot_mappings(num_lanes, step)
                group_metadata = spec.build_decode_metadata(desc, num_reqs, base_seq_lens, step)
            if not replay:
                spec.decode_steps.one_step(num_lanes, group_metadata, step)
                continue
            key = (SINGLE_STEP, num_lanes)
            if spec.step_observer is not None:
                # The rebuild's tensors (written into the buffers the graph reads), and the
                # host values of the capture, which the replayed launches still use.
                spec.step_observer(num_lanes, step, group_metadata,
                                   spec.graph_capture.metadata[key])
            assert spec.graphs is not None
            spec.graphs.replay(key)
            spec.counters.graph_replays += 1

    def fused(
        self, desc: BatchExecutionDescriptor, num_reqs: int, base_seq_lens: np.ndarray,
        replay: bool, early: list[Any] | None,
    ) -> None:
        """Fused path: one replay of the fused graph, or the same body eagerly.

        Where the speculator's ``refresh_rebuilds_in_graph``, a replay follows the lanes
        directly: they hold every input step 1 reads, and the graph refreshes each step's
        metadata in place, step 1's included. Otherwise step 1's metadata is built here
        (this writes the builders' persistent buffers the graph reads) and the body
        refreshes between steps only. The eager body runs on ``early`` where given:
        metadata built before the call's inputs existed (for capture, without rebuild), as
        a replay's was; else on the build here."""
        spec = self._spec
        num_lanes = desc.num_tokens
        group_metadata = early
        if not spec.refresh_rebuilds_in_graph:
            built = spec.build_decode_metadata(desc, num_reqs, base_seq_lens, 1)
            group_metadata = built if group_metadata is None else group_metadata
        if not replay:
            assert group_metadata is not None
            spec.decode_steps.fused(num_lanes, group_metadata)
            return
        assert spec.graphs is not None
        spec.graphs.replay((DecodePath.FUSED, num_lanes))
        spec.counters.graph_replays += 1

    def host_preplanned(
        self, desc: BatchExecutionDescriptor, num_reqs: int, base_seq_lens: np.ndarray,
        replay: bool,
    ) -> None:
        """host_preplanned path: plan every step on the host (this writes each step's
        persistent buffers; step 1's slots are the first pass's), then one replay of the
        host_preplanned graph after a re-plan of what it was captured with, or the same
        body eagerly."""
        spec = self._spec
        num_lanes = desc.num_tokens
        if not replay:
            spec.decode_steps.host_preplanned(
                num_lanes, spec.host_preplanner.plan(desc, num_reqs, base_seq_lens))
            return
        assert spec.graphs is not None
        key = (DecodePath.HOST_PREPLANNED, num_lanes)
        spec.host_preplanner.replan(desc, num_reqs, base_seq_lens,
                                    spec.graph_capture.metadata[key])
        spec.graphs.replay(key)
        spec.counters.graph_replays += 1
