"""The autoregressive speculator: K draft tokens per request, per-step or fused.

Draft token 0 comes from an eager prefill-style pass over each request's new tokens; the
other K-1 from decode steps. The first pass's slot mappings (and, padded, its query
offsets) are written with its inputs, and step 1's lanes by the first pass's body, before
any metadata is built. Per-step path: before every decode step, recompute slot mappings
(from step 2 on) and rebuild attention metadata on the host, then run (or replay) one
step. Fused path: build metadata once, then run every decode step in one body that,
between steps (never after the last), recomputes slot mappings and calls each attention
group's ``update_draft_decode_metadata``. In FULL mode that body is one captured graph,
replayed once per propose. Where every group's refresh rebuilds its metadata
(:attr:`AutoregressiveSpeculator.refresh_rebuilds_in_graph`), the graphs refresh instead
of the host building, the first pass's and step 1's metadata included, and a padded first
pass and its decode steps are one graph: the host stages the inputs and launches once.
Preplanned path
(``host_preplanned`` backends such as FlashInfer, whose planning cannot be captured): plan
every step's metadata on the host first, then run every step in one body (one replay) that
only recomputes slot mappings between steps.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from functools import partial
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
from speccheck.contract.metadata import CommonAttentionMetadata
from speccheck.contract.token_count import (
    at_later_draft_step,
    attention_request_count,
    build_uniform_attention_metadata,
    draft_steps_seq_lens_upper_bound,
)
from speccheck.speculator.base import DraftModelSpeculator, SpeculatorOptions
from speccheck.speculator.batch import DraftBatch, DraftResult, RequestArrays
from speccheck.speculator.decode_inputs import DecodeLaneBuffers, prepare_decode_lanes
from speccheck.speculator.kv_cache import PagedKVCache
from speccheck.speculator.model import DraftModel
from speccheck.speculator.pass_inputs import (
    PassInputs,
    scatter_pass_inputs,
    scatter_staged_pass_inputs,
    scatters_by_kernel,
    stage_pass_inputs,
)
from speccheck.speculator.sampling import finish_decode_step, sample_tokens

logger = logging.getLogger(__name__)



class DecodePath(enum.StrEnum):
    """How :meth:`AutoregressiveSpeculator.propose` runs the K - 1 decode steps."""

    AUTO = "auto"
    """The path the matrix allows: :attr:`AutoregressiveSpeculator.auto_path`."""
    FUSED = "fused"
    """Build once, refresh in-graph between steps; one replay in FULL mode."""
    PER_STEP = "per_step"
    """Rebuild metadata on the host before every step (the verifier's oracle)."""
    PREPLANNED = "preplanned"
    """Plan every step on the host first, then one body (``host_preplanned`` backends)."""


RefreshHook = Callable[[AttentionGroup, Any], None]
"""Stands in for ``group.update_draft_decode_metadata(metadata)`` and must call it; the
verifier wraps the call in capture-safety probes."""
StepObserver = Callable[[int, int, Sequence[Any], Sequence[Any] | None], None]
"""Called with (decode lanes, draft step, metadata of every group, the metadata whose host
values the step's launches use when that is another object) right before that step's
forward. The last is the single-step graph's captured metadata before a per-step replay
(the replay re-issues launches recorded with the capture's host values), else ``None``.
In the fused body it runs inside the captured graph, so it may only emit capture-safe
in-place GPU work (the verifier copies metadata into snapshot buffers there)."""


FIRST_PASS = "first_pass"
"""Graph key prefix of the padded first pass: ``(FIRST_PASS, bucket, q)``."""
FUSED_PROPOSE = "fused_propose"
"""Graph key prefix of a whole fused propose, the padded first pass and every decode step:
``(FUSED_PROPOSE, bucket, q)`` (only where :attr:`AutoregressiveSpeculator.
refresh_rebuilds_in_graph`)."""


class AutoregressiveSpeculator(DraftModelSpeculator):
    """Drafts ``config.num_speculative_steps`` tokens per request."""

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
        """Like :attr:`step_observer`, for a padded first pass (step 0, over ``bucket * q``
        lanes), called on the host before it runs or replays with the metadata built for
        it."""
        self.refresh_hook: RefreshHook | None = None
        self._captured_metadata: dict[tuple[str, int], list[Any]] = {}
        self.fused_decision = self._configure_fused_multi_step_decode()
        supports = {g.backend_name: g.cudagraph_support for g in groups}
        self.first_pass_query_lens = tuple(
            q for q in sorted(set(options.first_pass_query_lens))
            if q >= 1 and self.max_num_reqs * q <= self.max_num_tokens
            and graph_capture_shortfall(supports, q) is None)
        """The ``options.first_pass_query_lens`` this speculator pads (and captures): those
        its backends can capture and its buffers hold at the largest bucket."""

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
    def preplanned_capable(self) -> bool:
        """Every group either refreshes in-graph or plans each step ahead, and at least one
        plans ahead: the host_preplanned path applies."""
        return (
            self.num_steps > 1
            and self.config.advance_draft_positions
            and any(g.plans_on_host for g in self.groups)
            and all(
                g.supports_draft_decode_metadata_update or g.plans_on_host for g in self.groups
            )
        )

    @property
    def auto_path(self) -> DecodePath:
        """The path ``propose(path="auto")`` takes: fused when the matrix allows it, else
        preplanned when ``options.host_preplanned`` asks for it and it applies, else
        per-step."""
        if self.use_fused_multi_step_decode:
            return DecodePath.FUSED
        if self.options.host_preplanned and self.preplanned_capable:
            return DecodePath.PREPLANNED
        return DecodePath.PER_STEP

    # ------------------------------------------------------------- metadata
    def decode_descriptor(self, num_reqs: int) -> BatchExecutionDescriptor:
        """FULL over the bucket when graphs (or padded eager runs) are in use: the eager
        loops then compute exactly what the graphs hold, padding lanes included."""
        if not self.pads_to_buckets:
            return BatchExecutionDescriptor(CUDAGraphMode.NONE, num_reqs, None, 1)
        bucket = self.bucket_for(num_reqs)
        return BatchExecutionDescriptor(CUDAGraphMode.FULL, bucket, bucket, 1)

    def _build_decode_metadata(
        self,
        desc: BatchExecutionDescriptor,
        num_reqs: int,
        base_seq_lens: np.ndarray,
        step: int,
        for_capture: bool = False,
    ) -> list[Any]:
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

    # --------------------------------------------------------- device bodies
    def _generate_draft(
        self, n: int, group_metadata: Sequence[Any], step: int, observe: bool = True
    ) -> None:
        """One decode step over ``n`` lanes: forward, sample, store, advance. Capture-safe.
        ``observe=False`` keeps the step observer out of the single-step graph, whose
        replays the per-step path observes from the host instead."""
        if observe and self.step_observer is not None:
            self.step_observer(n, step, group_metadata, None)
        b = self.buffers
        # Real lanes advance one position (clamped); padding lanes (position and length 0)
        # stay.
        finish_decode_step(
            self.model.unprojected_logits(self._run_model(n, group_metadata)),
            self.options.sampling, self.seeds[:n], b.positions[:n], b.seq_lens[:n],
            self.is_real_req[:n], self.current_step, self.draft_tokens[:n],
            self.draft_logits[:n], self.input_ids[:n],
            advance=self.config.advance_draft_positions, max_model_len=self.max_model_len,
            lanes_done=self.lanes_done, kernel=self.kernel)
        if not self._in_capture:
            self.counters.eager_step_calls += 1
        self._record("generate", step)

    def _generate_fused_drafts(self, n: int, group_metadata: Sequence[Any]) -> None:
        """Every decode step in one body, with ``group_metadata`` refreshed in place between
        steps (after the positions advanced and the slots were recomputed), never after the
        last; where :attr:`refresh_rebuilds_in_graph`, before step 1 too, from the lanes
        :meth:`_prepare_decode_inputs` wrote."""
        first = self.refresh_rebuilds_in_graph
        for step in range(1, self.num_steps):
            if step > 1 and self.config.advance_draft_positions:
                self._compute_slot_mappings(n, step)
            if (step == 1 and first) or (step > 1 and self.config.advance_draft_positions):
                self._refresh(group_metadata)
            self._generate_draft(n, group_metadata, step)

    def _refresh(self, group_metadata: Sequence[Any]) -> None:
        """Each group's in-graph refresh of its metadata (through :attr:`refresh_hook`
        where one is set). Capture-safe as the refreshes are."""
        for group, md in zip(self.groups, group_metadata, strict=True):
            if self.refresh_hook is None:
                group.update_draft_decode_metadata(md)
            else:
                self.refresh_hook(group, md)
            self._record("refresh", id(md))

    def _generate_preplanned_drafts(self, n: int, per_step: Sequence[Sequence[Any]]) -> None:
        """Every decode step in one body with metadata planned ahead per step
        (``per_step[i]`` is step ``i + 1``'s): first the device half of the host plans
        (:meth:`~speccheck.contract.builder.AttentionMetadataBuilder.
        finish_draft_step_plans`); between steps only the slot mappings are recomputed, and
        groups that refresh in-graph are refreshed."""
        for index, group in enumerate(self.groups):
            if group.plans_on_host:
                group.finish_draft_step_plans([step_md[index] for step_md in per_step])
        for step in range(1, self.num_steps):
            group_metadata = per_step[step - 1]
            self._generate_draft(n, group_metadata, step)
            if step == self.num_steps - 1:
                continue
            self._compute_slot_mappings(n, step + 1)
            for group, md in zip(self.groups, group_metadata, strict=True):
                if not group.plans_on_host:
                    group.update_draft_decode_metadata(md)
                    self._record("refresh", id(md))

    def _build_preplanned_metadata(
        self, desc: BatchExecutionDescriptor, num_reqs: int, base_seq_lens: np.ndarray,
        for_capture: bool = False,
    ) -> list[list[Any]]:
        """``[step - 1][group]`` metadata: planned per step for ``host_preplanned`` groups,
        built once (step 1) and refreshed in-graph for the others. Host work: one build,
        the later steps' common metadata derived from it. The build launches nothing: the
        query offsets are the decode lanes' (:meth:`_prepare_decode_inputs` wrote them),
        which the per-step path, rebuilding everything as the verifier's oracle, writes
        again before every step."""
        first = self._preplanned_step_one(desc, num_reqs, base_seq_lens)
        commons = [first] + [
            at_later_draft_step(first, base_seq_lens, step) for step in range(2, self.num_steps)
        ]
        per_group: list[list[Any]] = []
        for group in self.groups:
            if group.plans_on_host:
                per_group.append(group.builder.plan_draft_steps(commons))
            else:
                build = group.build_for_cudagraph_capture if for_capture else group.build
                per_group.append([build(commons[0])] * len(commons))
        return [list(step_md) for step_md in zip(*per_group, strict=True)]

    def _preplanned_step_one(
        self, desc: BatchExecutionDescriptor, num_reqs: int, base_seq_lens: np.ndarray
    ) -> CommonAttentionMetadata:
        """Step 1's common metadata on the preplanned path; launches nothing (see
        :meth:`_build_preplanned_metadata`)."""
        return build_uniform_attention_metadata(
            buffers=self.buffers, batch_desc=desc, num_reqs=num_reqs, num_query_per_req=1,
            base_seq_lens_np=base_seq_lens, step=1, max_model_len=self.max_model_len,
            offsets_on_device=True,
        )

    # --------------------------------------------------------------- capture
    def capture(self) -> None:
        """Capture FULL graphs for every bucket on dummy inputs: the padded first pass (per
        first-pass width), one single-step graph, and the fused body when the matrix allows
        it; where :attr:`refresh_rebuilds_in_graph`, also the whole fused propose per
        first-pass width. Index buffers are reset first so a stale index from an earlier
        batch can never point out of bounds during capture."""
        if self.graphs is None or self.num_steps < 2:
            return
        self.graphs.reset()
        self._in_capture = True
        try:
            for n in self.graphs.capture_sizes:
                for q in self.first_pass_query_lens:
                    self._capture_first_pass(n, q)
                self._capture_one(("step", n), partial(self._generate_draft, n, step=0, observe=False))
                if self.use_fused_multi_step_decode:
                    self._capture_one((DecodePath.FUSED, n), partial(self._generate_fused_drafts, n))
                if self.refresh_rebuilds_in_graph:
                    for q in self.first_pass_query_lens:
                        self._capture_fused_propose(n, q)
                if self.preplanned_capable:
                    self._capture_one(
                        (DecodePath.PREPLANNED, n), partial(self._generate_preplanned_drafts, n)
                    )
        finally:
            self._in_capture = False
            self._reset_index_buffers()

    def _capture_one(self, key: tuple[str, int], body: Callable[[list[Any]], None]) -> None:
        """Dummy inputs for ``n`` lanes, all live at position 0 (length 1), every
        block-table entry the sink (so warm-up and capture write only the sink), written as
        a propose writes step 1's lanes (slots included) after a pass of ``n`` requests of
        length 0, then fresh capture metadata, then capture."""
        assert self.graphs is not None
        n = key[1]
        md: list[Any]
        if key[0] == DecodePath.PREPLANNED:
            self._write_dummy_decode_lanes(n)
            md = self._build_preplanned_metadata(
                BatchExecutionDescriptor(CUDAGraphMode.FULL, n, n, 1), n, np.zeros(n, np.int64),
                for_capture=True)
        else:
            md = self._decode_capture_metadata(n)
        self._captured_metadata[key] = md
        self.graphs.capture(key, lambda: body(md))

    def _write_dummy_decode_lanes(self, n: int) -> None:
        """Step 1's lanes of ``n`` requests of length 0 after a pass, on reset buffers."""
        self._reset_index_buffers()
        self.index_buffers.num_reqs.fill_(n)
        self._prepare_decode_inputs(n)

    def _decode_capture_metadata(self, n: int) -> list[Any]:
        """Capture metadata of a decode step over ``n`` lanes, on dummy lanes."""
        self._write_dummy_decode_lanes(n)
        return self._build_decode_metadata(BatchExecutionDescriptor(CUDAGraphMode.FULL, n, n, 1),
                                           n, np.zeros(n, np.int64), 1, for_capture=True)

    def _capture_first_pass(self, n: int, q: int) -> None:
        """The padded first pass of ``n`` requests of ``q`` tokens on dummy inputs (context
        0, every block the sink), with capture metadata."""
        assert self.graphs is not None
        md = self._first_pass_capture_metadata(n, q)
        refresh = self.refresh_rebuilds_in_graph
        self.graphs.capture((FIRST_PASS, n, q), lambda: self._first_pass_body(n, q, md, refresh))

    @property
    def scatters_in_graph(self) -> bool:
        """Whether the whole-propose graph begins with the scatter of the pass's staged
        inputs (:func:`~speccheck.speculator.pass_inputs.scatter_staged_pass_inputs`): where
        the scatter is the one-kernel form, whose launch holds nothing of the batch. A
        replay then needs only the staging copy before it."""
        return scatters_by_kernel(self.index_buffers, self.kernel)

    def _capture_fused_propose(self, n: int, q: int) -> None:
        """A whole fused propose of ``n`` requests of ``q`` tokens in one graph: the scatter
        of the staged pass inputs (where :attr:`scatters_in_graph`; the first pass's dummy
        inputs are the last staged), the first pass's body, then the fused decode body, each
        refreshing capture metadata of its own (the decode's built first: the first pass's
        dummy inputs are the last written, as a propose's pass inputs are)."""
        assert self.graphs is not None
        decode = self._decode_capture_metadata(n)
        first = self._first_pass_capture_metadata(n, q)
        scatter = self.scatters_in_graph

        def body() -> None:
            if scatter:
                scatter_staged_pass_inputs(self.index_buffers, self.staging.device_buffer,
                                           self.block_size)
            self._first_pass_body(n, q, first, refresh=True)
            self._generate_fused_drafts(n, decode)

        self.graphs.capture((FUSED_PROPOSE, n, q), body)

    def _stage_dummy_pass(self, n: int, q: int) -> PassInputs:
        """Capture inputs, staged: ``n`` requests of ``q`` tokens at positions ``0 .. q -
        1`` (length ``q``), no block-table entry (every block the sink), token ids and
        seeds 0."""
        return stage_pass_inputs(
            self.staging, np.zeros((n, 0), np.int64), np.zeros(n, np.int64),
            np.full(n, q, np.int64), np.tile(np.arange(q), n), np.zeros(n * q, np.int64),
            np.repeat(np.arange(n), q), q)

    def _first_pass_capture_metadata(self, n: int, q: int) -> list[Any]:
        """Capture metadata of the padded first pass of ``n`` requests of ``q`` tokens, on
        dummy inputs (:meth:`_stage_dummy_pass`, scattered as a pass's inputs are: every
        other index reset, the sink's slots)."""
        scatter_pass_inputs(self.index_buffers, self._stage_dummy_pass(n, q), self.block_size,
                            kernel=self.kernel)
        return self._first_pass_metadata(n, n, q, np.full(n, q), for_capture=True)

    def _first_pass_body(self, n: int, q: int, group_metadata: Sequence[Any],
                         refresh: bool) -> None:
        """Draft token 0 of ``n`` requests of ``q`` tokens each (lanes ``r*q .. r*q+q-1``
        are request ``r``'s; padding requests' lanes write the sink and their drafts are
        ignored), then, with decode steps to come, the ``n`` decode lanes (no host value
        of the batch needed, so a replay of this body leaves nothing for the host to do
        before the decode steps). With ``refresh``, ``group_metadata`` is first refreshed
        in place from the pass's inputs (a build's stand-in: see
        :attr:`refresh_rebuilds_in_graph`). Capture-safe."""
        if refresh:
            self._refresh(group_metadata)
        if self.first_pass_observer is not None:
            self.first_pass_observer(n * q, 0, group_metadata, None)
        hidden = self._run_model(n * q, group_metadata).view(n, q, -1)[:, -1]
        self._store_draft_zero(hidden, self.buffers.positions[: n * q].view(n, q)[:, -1])
        if self.num_steps > 1:
            self._prepare_decode_inputs(n)

    def _store_draft_zero(self, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """Draft token 0 (and its logits) of the first ``len(hidden)`` requests from the
        hidden state of each one's last new token at ``positions``. Capture-safe."""
        n = hidden.shape[0]
        logits = self.model.compute_logits(hidden)
        self.draft_tokens[:n, 0] = sample_tokens(logits, self.options.sampling, self.seeds[:n],
                                                 positions, kernel=self.kernel)
        self.draft_logits[:n, 0] = logits

    # --------------------------------------------------------------- propose
    def propose(
        self, batch: DraftBatch, path: DecodePath = DecodePath.AUTO, use_graphs: bool = True
    ) -> DraftResult:
        """Draft ``num_speculative_steps`` tokens for every request of ``batch``; tokens and
        logits come back on the host.

        ``path="auto"`` takes :attr:`auto_path`; ``"fused"``, ``"per_step"`` and
        ``"preplanned"`` force a path (the verifier runs them all). Forcing ``"fused"`` on a
        backend without an in-graph refresh raises the builder's ``NotImplementedError``.
        ``use_graphs=False`` runs the chosen loop eagerly even when graphs are captured.
        """
        r = self._draft(batch, path, use_graphs)
        return DraftResult(
            draft_tokens=self.draft_tokens[:r].cpu().clone(),
            logits=self.draft_logits[:r].cpu().clone(),
        )

    def propose_tokens(
        self, batch: DraftBatch, path: DecodePath = DecodePath.AUTO
    ) -> torch.Tensor:
        """The serving loop's form of :meth:`propose`: only the ``[R, K]`` draft tokens come
        back to the host; the logits stay in :attr:`draft_logits` on the device."""
        return self.draft_tokens[: self.launch(batch, path)].cpu()

    def launch(self, batch: DraftBatch, path: DecodePath = DecodePath.AUTO) -> int:
        """Queue the work of :meth:`propose_tokens` (graphs where captured) and return the
        number of requests ``R`` without waiting for the device: the tokens are in
        ``draft_tokens[:R]`` and the logits in ``draft_logits[:R]`` once the stream has run
        it. What it costs is the launching thread's host time per propose (``speccheck
        bench`` times it, and lists whatever in it synchronises with the device)."""
        return self._draft(batch, path, use_graphs=True)

    def _draft(self, batch: DraftBatch, path: DecodePath, use_graphs: bool) -> int:
        """Run the prefill pass and the chosen decode loop; the results are left in
        :attr:`draft_tokens` and :attr:`draft_logits`. Returns the number of requests."""
        arrays = self._validate(batch, extra_positions=self.num_steps - 1)
        path = DecodePath(path)
        chosen = self.auto_path if path is DecodePath.AUTO else path
        r = batch.num_reqs
        replay = use_graphs and self.graphs is not None
        if chosen is DecodePath.FUSED and replay and self._replay_fused_propose(batch, arrays):
            return r
        base = arrays.context_lens + arrays.query_lens
        desc = self.decode_descriptor(r)
        early: list[Any] | None = None
        if (self.num_steps > 1 and chosen is DecodePath.FUSED and not replay
                and self.refresh_rebuilds_in_graph):
            # The eager fused body runs on metadata built before the call's inputs exist,
            # as a replay's was built for capture: step 1 sees only what its refresh
            # recomputes from the lanes.
            early = self._build_decode_metadata(desc, r, base, 1)
        self._prefill(batch, arrays, base, use_graphs, desc.num_tokens,
                      emulate=early is not None)
        if self.num_steps > 1:
            if chosen is DecodePath.FUSED:
                self._fused_multi_step_decode(desc, r, base, replay, early)
            elif chosen is DecodePath.PREPLANNED:
                self._preplanned_multi_step_decode(desc, r, base, replay)
            else:
                self._multi_step_decode(desc, r, base, replay)
        return r

    def _replay_fused_propose(self, batch: DraftBatch, arrays: RequestArrays) -> bool:
        """The whole fused propose as one replay, where one was captured for ``batch``'s
        bucket and first-pass width: the host stages the pass's inputs (and scatters them,
        unless the graph does: :attr:`scatters_in_graph`) and launches one graph. Returns
        whether it did (it counts as a first-pass and a decode replay)."""
        q = self.first_pass_width(batch)
        key = (FUSED_PROPOSE, self.bucket_for(batch.num_reqs), q)
        if q is None or self.graphs is None or key not in self.graphs:
            return False
        self._write_pass_inputs(arrays, batch.new_tokens, uniform_width=q,
                                scatter=not self.scatters_in_graph)
        self.graphs.replay(key)
        self.counters.first_pass_replays += 1
        self.counters.graph_replays += 1
        self._record("slots", 1)
        return True

    def first_pass_width(self, batch: DraftBatch) -> int | None:
        """``q`` when ``batch``'s first pass runs padded over its bucket (padding in use,
        every request brings ``q`` new tokens, ``q`` in :attr:`first_pass_query_lens`),
        else ``None`` (the first pass runs eagerly over the real tokens only)."""
        widths = {len(row) for row in batch.new_tokens}
        if not self.pads_to_buckets or len(widths) != 1:
            return None
        (q,) = widths
        return q if q in self.first_pass_query_lens else None

    def _prefill(self, batch: DraftBatch, arrays: RequestArrays, base: np.ndarray,
                 use_graphs: bool, lanes: int, emulate: bool = False) -> None:
        """Draft token 0: one pass over each request's new tokens: padded over the bucket
        when :meth:`first_pass_width` says so (a graph replay where one was captured), else
        eagerly over the real tokens; then, with decode steps to come, the ``lanes``
        decode lanes (:meth:`_prepare_decode_inputs`: inside the padded pass's body).

        Where :attr:`refresh_rebuilds_in_graph`, a replay follows the pass's inputs
        directly (its body refreshes its metadata); ``emulate`` runs the padded pass
        eagerly as a replay runs it: on metadata built before the call's inputs existed,
        refreshed in the body."""
        r = batch.num_reqs
        q = self.first_pass_width(batch)
        if q is not None:
            n = self.bucket_for(r)
            key = (FIRST_PASS, n, q)
            replay = use_graphs and self.graphs is not None and key in self.graphs
            rebuild = self.refresh_rebuilds_in_graph and (replay or emulate)
            md = self._first_pass_metadata(r, n, q, base) if rebuild and not replay else []
            self._write_pass_inputs(arrays, batch.new_tokens, uniform_width=q)
            if not rebuild:
                md = self._first_pass_metadata(r, n, q, base)
            if replay:
                assert self.graphs is not None
                self.graphs.replay(key)
                self.counters.first_pass_replays += 1
                if self.num_steps > 1:
                    self._record("slots", 1)
            else:
                self._first_pass_body(n, q, md, rebuild)
            return
        last_host = np.cumsum(arrays.query_lens) - 1
        hidden, _, (last,) = self._eager_pass(arrays, batch.new_tokens, [last_host])
        self._store_draft_zero(hidden[last], self.buffers.positions[last])
        if self.num_steps > 1:
            self._prepare_decode_inputs(lanes)

    def _first_pass_metadata(self, r: int, n: int, q: int, base: np.ndarray,
                             for_capture: bool = False) -> list[Any]:
        """Each group's metadata for the first pass of ``r`` requests padded to ``n`` of
        ``q`` tokens each, built on the host from the buffers as they are (for a capture
        with ``for_capture``). Host work."""
        common = build_uniform_attention_metadata(
            buffers=self.buffers,
            batch_desc=BatchExecutionDescriptor(CUDAGraphMode.FULL, n * q, n, q),
            num_reqs=r, num_query_per_req=q, base_seq_lens_np=base, step=0,
            max_model_len=self.max_model_len,
        )
        if for_capture:
            return [g.build_for_cudagraph_capture(common) for g in self.groups]
        return [g.build(common) for g in self.groups]

    def _prepare_decode_inputs(self, n: int) -> None:
        """Lanes ``0..n-1`` for decode: draft token 0 as input, positions, lengths and slots
        for step 1 from the pass's requests and their lengths after it, read on the device
        (clamped at ``max_model_len``); padding lanes have length 0, sink slots; the query
        offsets one token per real request
        (:func:`~speccheck.speculator.decode_inputs.prepare_decode_lanes`). Capture-safe.
        Step 1's slot mapping is final here, before any step-1 metadata is built or
        refreshed; the trace records it as ``("slots", 1)``."""
        b = self.buffers
        lanes = DecodeLaneBuffers(
            positions=b.positions[:n], seq_lens=b.seq_lens[:n], input_ids=self.input_ids[:n],
            token_request=self.token_request[:n], is_real_req=self.is_real_req[:n],
            is_real_token=self.is_real_token[:n], slot_mapping=b.slot_mapping[:n],
            query_start_loc=b.query_start_loc[: n + 1], block_table=b.block_table,
            draft_tokens=self.draft_tokens[:n], current_step=self.current_step,
            num_reqs=self.index_buffers.num_reqs)
        prepare_decode_lanes(lanes, self.max_model_len, self.block_size, kernel=self.kernel)
        self._record("slots", 1)

    def _multi_step_decode(
        self, desc: BatchExecutionDescriptor, r: int, base: np.ndarray, replay: bool
    ) -> None:
        """Per-step path: slots and a metadata rebuild before every step (step 1's slots
        are :meth:`_prepare_decode_inputs`'s). With ``replay``, each step replays the
        single-step graph, which reads the metadata captured for it: the rebuild must land
        in the persistent buffers that metadata views."""
        n = desc.num_tokens
        md: list[Any] = []
        for step in range(1, self.num_steps):
            if step == 1 or self.config.advance_draft_positions:
                if step > 1:
                    self._compute_slot_mappings(n, step)
                md = self._build_decode_metadata(desc, r, base, step)
            if not replay:
                self._generate_draft(n, md, step)
                continue
            if self.step_observer is not None:
                # The rebuild's tensors (written into the buffers the graph reads), and the
                # host values of the capture, which the replayed launches still use.
                self.step_observer(n, step, md, self._captured_metadata[("step", n)])
            assert self.graphs is not None
            self.graphs.replay(("step", n))
            self.counters.graph_replays += 1

    def _fused_multi_step_decode(
        self, desc: BatchExecutionDescriptor, r: int, base: np.ndarray, replay: bool,
        early: list[Any] | None,
    ) -> None:
        """Fused path: one replay of the fused graph, or the same body eagerly.

        Where :attr:`refresh_rebuilds_in_graph`, a replay follows the lanes directly: they
        hold every input step 1 reads, and the graph refreshes each step's metadata in
        place, step 1's included. The eager body then runs on ``early``, metadata built
        before the call's inputs existed (see :meth:`_draft`). Otherwise step 1's metadata
        is built here (this also writes the builders' persistent buffers the graph reads)
        and the body refreshes between steps only."""
        n = desc.num_tokens
        md = early
        if not self.refresh_rebuilds_in_graph:
            md = self._build_decode_metadata(desc, r, base, 1)
        if not replay:
            assert md is not None
            self._generate_fused_drafts(n, md)
            return
        assert self.graphs is not None
        self.graphs.replay((DecodePath.FUSED, n))
        self.counters.graph_replays += 1

    def _preplanned_multi_step_decode(
        self, desc: BatchExecutionDescriptor, r: int, base: np.ndarray, replay: bool
    ) -> None:
        """Preplanned path: plan every step on the host (this writes each step's persistent
        buffers; step 1's slots are :meth:`_prepare_decode_inputs`'s), then one replay of
        the preplanned graph (:meth:`_replan_preplanned`), or the same body eagerly."""
        n = desc.num_tokens
        if not replay:
            self._generate_preplanned_drafts(n, self._build_preplanned_metadata(desc, r, base))
            return
        assert self.graphs is not None
        self._replan_preplanned(desc, r, base)
        self.graphs.replay((DecodePath.PREPLANNED, n))
        self.counters.graph_replays += 1

    def _replan_preplanned(
        self, desc: BatchExecutionDescriptor, num_reqs: int, base_seq_lens: np.ndarray
    ) -> None:
        """What a replay of the preplanned graph needs from the host, and nothing more:
        each ``host_preplanned`` group re-plans the metadata the graph was captured with
        from the steps' host lengths alone (``replan_draft_steps``), and any other group
        builds step 1 (its build writes the persistent buffers the graph reads; the
        graph's refresh does the rest). No metadata object is made for the captured body,
        which would not read it."""
        captured = self._captured_metadata[(DecodePath.PREPLANNED, desc.num_tokens)]
        lengths = draft_steps_seq_lens_upper_bound(
            base_seq_lens, num_reqs, attention_request_count(desc, num_reqs), 1,
            self.num_steps - 1, self.max_model_len)
        first: CommonAttentionMetadata | None = None
        for index, group in enumerate(self.groups):
            if group.plans_on_host:
                group.builder.replan_draft_steps([step_md[index] for step_md in captured],
                                                 lengths)
                continue
            if first is None:
                first = self._preplanned_step_one(desc, num_reqs, base_seq_lens)
            group.build(first)
