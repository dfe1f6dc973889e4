"""The autoregressive speculator: K draft tokens per request, per-step, fused or
host_preplanned.

Draft token 0 comes from an eager prefill-style pass over each request's new tokens
(:mod:`~speccheck.speculator.first_pass`); the other K-1 from decode steps. The first
pass's slot mappings (and, padded, its query offsets) are written with its inputs, and step
1's lanes by the first pass's body, before any metadata is built. Per-step path: before
every decode step, recompute slot mappings (from step 2 on) and rebuild attention metadata
on the host, then run (or replay) one step. Fused path: build metadata once, then run every
decode step in one body that, between steps (never after the last), recomputes slot
mappings and refreshes each attention group's metadata. In FULL mode that body is one
captured graph, replayed once per propose. Where every group's refresh rebuilds its
metadata (:attr:`AutoregressiveSpeculator.refresh_rebuilds_in_graph`), the graphs refresh
instead of the host building, the first pass's and step 1's metadata included, and a
padded first pass and its decode steps are one graph: the host stages the inputs and
launches once. host_preplanned path (the matrix's strategy of that name, for backends such
as FlashInfer whose planning cannot be captured): plan every step's metadata on the host
first (:mod:`~speccheck.speculator.host_preplanned`), then run every step in one body (one
replay) that only recomputes slot mappings between steps.

The device bodies and the one refresh call site are in
:mod:`~speccheck.speculator.decode_steps`, their host loops in
:mod:`~speccheck.speculator.decode_loops`, the graph capture in
:mod:`~speccheck.speculator.graph_capture`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from speccheck.contract.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from speccheck.contract.groups import AttentionGroup
from speccheck.contract.resolution import (
    FusedDecision,
    decide_fused_multi_step,
    graph_capture_shortfall,
)
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.contract.token_count import build_uniform_attention_metadata
from speccheck.speculator.base import DraftModelSpeculator, SpeculatorOptions
from speccheck.speculator.batch import DraftBatch, DraftResult, RequestArrays
from speccheck.speculator.decode_loops import DecodeLoops
from speccheck.speculator.decode_steps import DecodeSteps
from speccheck.speculator.first_pass import FirstPass
from speccheck.speculator.graph_capture import GraphCapture
from speccheck.speculator.host_preplanned import HostPreplanner
from speccheck.speculator.kv_cache import PagedKVCache
from speccheck.speculator.model import DraftModel
from speccheck.speculator.pass_inputs import scatters_by_kernel
from speccheck.speculator.paths import FUSED_PROPOSE, DecodePath, RefreshHook, StepObserver

__all__ = ["AutoregressiveSpeculator", "DecodePath"]

logger = logging.getLogger(__name__)


class AutoregressiveSpeculator(DraftModelSpeculator):
    """Drafts ``config.num_speculative_steps`` tokens per request.

    Two entry points: :meth:`propose` (tokens and logits back on the host) and
    :meth:`launch` (the work queued, the results left on the device)."""

    def __init__(
        self,
        model: DraftModel,
        groups: list[AttentionGroup],
        config: RuntimeConfig,
        device: torch.device,
        options: SpeculatorOptions = SpeculatorOptions(),
        kv_cache: PagedKVCache | None = None,
    ) -> None:
        super().__init__(model, groups, config, device, options, kv_cache=kv_cache)
        self.step_observer: StepObserver | None = None
        self.first_pass_observer: StepObserver | None = None
        """Like :attr:`step_observer`, for a padded first pass (step 0, over ``bucket *
        query_len`` lanes), called on the host before it runs or replays with the metadata
        built for it."""
        self.refresh_hook: RefreshHook | None = None
        """Called instead of each ``group.update_draft_decode_metadata(metadata)`` on every
        path (:meth:`~speccheck.speculator.decode_steps.DecodeSteps.refresh`)."""
        self.fused_decision = self._configure_fused_multi_step_decode()
        supports = {group.backend_name: group.cudagraph_support for group in groups}
        self.first_pass_query_lens = tuple(
            query_len for query_len in sorted(set(options.first_pass_query_lens))
            if query_len >= 1 and self.max_num_reqs * query_len <= self.max_num_tokens
            and graph_capture_shortfall(supports, query_len) is None)
        """The ``options.first_pass_query_lens`` this speculator pads (and captures): those
        its backends can capture and its buffers hold at the largest bucket."""
        self.first_pass = FirstPass(self)
        self.decode_steps = DecodeSteps(self)
        self.decode_loops = DecodeLoops(self)
        self.host_preplanner = HostPreplanner(self)
        self.graph_capture = GraphCapture(self)

    def _configure_fused_multi_step_decode(self) -> FusedDecision:
        decision = decide_fused_multi_step(
            self.config,
            [(g.backend_name, g.supports_draft_decode_metadata_update) for g in self.groups],
        )
        if not decision.enabled and decision.blocking_backends:
            logger.info(decision.reason)
        return decision

    @property
    def use_fused_multi_step_decode(self) -> bool:
        return self.fused_decision.enabled

    @property
    def refresh_rebuilds_in_graph(self) -> bool:
        """The matrix lets this config fuse, and every group's refresh rebuilds its metadata
        from the inputs alone (``refresh_rebuilds``): the graphs then build no metadata on
        the host. The first pass's body refreshes its metadata before the forward (the
        pass's scatter wrote every input it reads), and the fused body refreshes before
        step 1 too (the lanes wrote step 1's)."""
        return self.use_fused_multi_step_decode and all(g.refresh_rebuilds for g in self.groups)

    @property
    def host_preplanned_applies(self) -> bool:
        """Every group either refreshes in-graph or is ``host_preplanned``, and at least one
        is: the host_preplanned path applies."""
        return (
            self.num_steps > 1
            and self.config.advance_draft_positions
            and any(g.host_preplanned for g in self.groups)
            and all(
                g.supports_draft_decode_metadata_update or g.host_preplanned for g in self.groups
            )
        )

    @property
    def auto_path(self) -> DecodePath:
        """The path ``propose(path="auto")`` takes: fused when the matrix allows it, else
        host_preplanned when ``options.host_preplanned`` asks for it and it applies, else
        per-step."""
        if self.use_fused_multi_step_decode:
            return DecodePath.FUSED
        if self.options.host_preplanned and self.host_preplanned_applies:
            return DecodePath.HOST_PREPLANNED
        return DecodePath.PER_STEP

    @property
    def scatters_in_graph(self) -> bool:
        """Whether the whole-propose graph begins with the scatter of the pass's staged
        inputs (:func:`~speccheck.speculator.pass_inputs.scatter_staged_pass_inputs`): where
        the scatter is the one-kernel form, whose launch holds nothing of the batch. A
        replay then needs only the staging copy before it."""
        return scatters_by_kernel(self.index_buffers, self.kernel)

    # ------------------------------------------------------------- metadata
    def decode_descriptor(self, num_reqs: int) -> BatchExecutionDescriptor:
        """FULL over the bucket when graphs (or padded eager runs) are in use: the eager
        loops then compute exactly what the graphs hold, padding lanes included."""
        if not self.pads_to_buckets:
            return BatchExecutionDescriptor(CUDAGraphMode.NONE, num_reqs, None, 1)
        bucket = self.bucket_for(num_reqs)
        return BatchExecutionDescriptor(CUDAGraphMode.FULL, bucket, bucket, 1)

    def build_decode_metadata(
        self,
        desc: BatchExecutionDescriptor,
        num_reqs: int,
        base_seq_lens: np.ndarray,
        step: int,
        for_capture: bool = False,
    ) -> list[Any]:
        """Each group's metadata of decode step ``step`` over ``desc``'s lanes, built on the
        host from the buffers as they are (for a capture with ``for_capture``)."""
        common = build_uniform_attention_metadata(
            buffers=self.buffers,
            batch_desc=desc,
            num_reqs=num_reqs,
            num_query_per_req=1,
            base_seq_lens_np=base_seq_lens,
            step=step,
            max_model_len=self.max_model_len,
        )
        if for_capture:
            return [g.build_for_cudagraph_capture(common) for g in self.groups]
        return [g.build(common) for g in self.groups]

    def first_pass_width(self, batch: DraftBatch) -> int | None:
        """The new tokens per request of ``batch``'s padded first pass, or ``None`` when it
        runs eagerly over the real tokens (:meth:`~speccheck.speculator.first_pass.
        FirstPass.width`)."""
        return self.first_pass.width(batch)

    # --------------------------------------------------------------- capture
    def capture(self) -> None:
        """Capture FULL graphs for every bucket on dummy inputs (:meth:`~speccheck.
        speculator.graph_capture.GraphCapture.capture_all`)."""
        self.graph_capture.capture_all()

    # --------------------------------------------------------------- propose
    def propose(
        self, batch: DraftBatch, path: DecodePath = DecodePath.AUTO, use_graphs: bool = True
    ) -> DraftResult:
        """Draft ``num_speculative_steps`` tokens for every request of ``batch``; tokens and
        logits come back on the host.

        ``path="auto"`` takes :attr:`auto_path`; ``"fused"``, ``"per_step"`` and
        ``"host_preplanned"`` force a path (the verifier runs them all). Forcing ``"fused"``
        on a backend without an in-graph refresh raises the builder's
        ``NotImplementedError``. ``use_graphs=False`` runs the chosen loop eagerly even when
        graphs are captured.
        """
        num_reqs = self._run(batch, path, use_graphs)
        return DraftResult(
            draft_tokens=self.draft_tokens[:num_reqs].cpu().clone(),
            logits=self.draft_logits[:num_reqs].cpu().clone(),
        )

    def launch(self, batch: DraftBatch, path: DecodePath = DecodePath.AUTO) -> int:
        """The serving loop's form of :meth:`propose`: queue its work (graphs where
        captured) and return the number of requests ``R`` without waiting for the device:
        the tokens are in ``draft_tokens[:R]`` and the logits in ``draft_logits[:R]`` once
        the stream has run it. What it costs is the launching thread's host time per
        propose (``speccheck bench`` times it, and lists whatever in it synchronises with
        the device)."""
        return self._run(batch, path, use_graphs=True)

    def _run(self, batch: DraftBatch, path: DecodePath, use_graphs: bool) -> int:
        """Run the first pass and the chosen decode loop; the results are left in
        :attr:`draft_tokens` and :attr:`draft_logits`. Returns the number of requests."""
        arrays = self._validate(batch, extra_positions=self.num_steps - 1)
        path = DecodePath(path)
        chosen = self.auto_path if path is DecodePath.AUTO else path
        num_reqs = batch.num_reqs
        replay = use_graphs and self.graphs is not None
        if chosen is DecodePath.FUSED and replay and self._replay_fused_propose(batch, arrays):
            return num_reqs
        base_seq_lens = arrays.context_lens + arrays.query_lens
        desc = self.decode_descriptor(num_reqs)
        early: list[Any] | None = None
        if self.num_steps > 1 and chosen is DecodePath.FUSED and not replay:
            # The eager fused body runs on the metadata a capture of this bucket builds (dummy
            # lanes, every lane a request: GraphCapture.decode_metadata), as a replay runs on
            # what was captured; a field that build snapshots keeps the capture's values.
            # With rebuild, step 1 then sees only what its refresh recomputes from the lanes;
            # otherwise the loop's build of step 1 only writes the persistent buffers it
            # views, as before a replay.
            with self.capturing():
                early = self.graph_capture.decode_metadata(desc.num_tokens)
        self.first_pass.run(batch, arrays, base_seq_lens, use_graphs, desc.num_tokens,
                            emulate=early is not None and self.refresh_rebuilds_in_graph)
        if self.num_steps > 1:
            if chosen is DecodePath.FUSED:
                self.decode_loops.fused(desc, num_reqs, base_seq_lens, replay, early)
            elif chosen is DecodePath.HOST_PREPLANNED:
                self.decode_loops.host_preplanned(desc, num_reqs, base_seq_lens, replay)
            else:
                self.decode_loops.per_step(desc, num_reqs, base_seq_lens, replay)
        return num_reqs

    def _replay_fused_propose(self, batch: DraftBatch, arrays: RequestArrays) -> bool:
        """The whole fused propose as one replay, where one was captured for ``batch``'s
        bucket and first-pass width: the host stages the pass's inputs (and scatters them,
        unless the graph does: :attr:`scatters_in_graph`) and launches one graph. Returns
        whether it did (it counts as a first-pass and a decode replay)."""
        query_len = self.first_pass.width(batch)
        key = (FUSED_PROPOSE, self.bucket_for(batch.num_reqs), query_len)
        if query_len is None or self.graphs is None or key not in self.graphs:
            return False
        self.write_pass_inputs(arrays, batch.new_tokens, uniform_width=query_len,
                                scatter=not self.scatters_in_graph)
        self.graphs.replay(key)
        self.counters.first_pass_replays += 1
        self.counters.graph_replays += 1
        self.record("slots", 1)
        return True
