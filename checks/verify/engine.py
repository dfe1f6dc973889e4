"""One backend, one runtime config, in this process: draw batches, run the oracle (eager
per-step, metadata rebuilt before every step) and the candidates (fused FULL-graph replay
on a GPU, and the eager fused loop) from identical state, and compare.

:class:`BackendVerifier` coordinates: the harnesses it runs on
(:mod:`~speccheck.checks.verify.harness`), whether an example fits them
(:mod:`~speccheck.checks.verify.input_fit`), the check units it hands each run's recorded
steps to (:mod:`~speccheck.checks.verify.comparisons`, :mod:`~speccheck.checks.verify.
declared_fields`, :mod:`~speccheck.checks.verify.zero_tails`, :mod:`~speccheck.checks.
verify.guard_bands`, :mod:`~speccheck.checks.verify.refresh_probe`, :mod:`~speccheck.
checks.verify.field_meanings`, :mod:`~speccheck.checks.verify.latent_fields`), the search for a
failing example (:mod:`~speccheck.checks.verify.search`) and the localisation of a
divergence from the fp32 reference (:mod:`~speccheck.checks.verify.localise`).

Run it through :mod:`speccheck.checks.verify.runner`, which gives each backend a process
of its own: an illegal memory access breaks a CUDA context for good.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st

from speccheck.checks.verify.breakpoints import Breakpoints, discover_breakpoints
from speccheck.checks.verify.cells import BatchClass
from speccheck.checks.verify.comparisons import (
    FirstPassSnapshot,
    KVSnapshot,
    Outcome,
    compare_drafts,
    compare_steps,
    expected_slots,
    first_divergence,
    first_pass_metadata,
    kv_matches,
    kv_untouched,
)
from speccheck.checks.verify.context import MatrixContext
from speccheck.checks.verify.declared_fields import declared_fields, input_storages
from speccheck.checks.verify.examples import Example
from speccheck.checks.verify.field_meanings import DeclaredMeanings
from speccheck.checks.verify.forward_probe import ForwardProbe
from speccheck.checks.verify.guard_bands import guard_bands
from speccheck.checks.verify.harness import Harness, HarnessSet
from speccheck.checks.verify.input_fit import ExampleDoesNotFit, check_fits
from speccheck.checks.verify.kv_share import WHOLE_CACHE, KvShare, whole_cache_start
from speccheck.checks.verify.latent_fields import LatentFields
from speccheck.checks.verify.localise import FirstRunTokens, localise_reference_divergence
from speccheck.checks.verify.refresh_probe import RefreshProbe, RefreshRaised
from speccheck.checks.verify.report import BackendReport, FailureKey, misfit_line
from speccheck.checks.verify.run import WorkerTask
from speccheck.checks.verify.scale import (
    DEFAULT_CAPTURE_SIZES,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_SHRINK_SECONDS,
    DEFAULT_STEPS,
)
from speccheck.checks.verify.search import (
    Coverage,
    ExampleRun,
    SearchBudget,
    record_failure,
    search_all,
)
from speccheck.checks.verify.side_lane import SideLane, SideRun
from speccheck.checks.verify.step_guard import GuardedRun, StepCheckFailed
from speccheck.checks.verify.strategies import (
    BatchLimits,
    derived_step_changes,
    draft_batches,
    draft_step_counts,
    of_shape,
)
from speccheck.checks.verify.vocabulary import Candidate, Check, Result, Tier
from speccheck.checks.verify.zero_tails import zero_tails
from speccheck.contract.builder import AttentionMetadataBuilder
from speccheck.contract.dcp import DcpRank
from speccheck.contract.matrix_model import KvLayout
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.attention_setup import machine_platform
from speccheck.speculator.autoregressive import DecodePath
from speccheck.speculator.batch import DraftBatch, DraftResult
from speccheck.speculator.kv_cache import SINK_BLOCK
from speccheck.speculator.model import DrafterConfig

logger = logging.getLogger(__name__)

TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 6e-2}
"""Absolute logit / KV tolerance per dtype; a top-2 logit gap below twice this makes the
oracle's token choice indeterminate."""

FP32_REFERENCE_TOLERANCE_FACTOR = 4
"""The tolerance against the fp32 reference, in multiples of the run's dtype's
(:data:`TOLERANCE`): the run's dtype rounds where the reference does not."""


@dataclass(frozen=True)
class VerifySettings:
    backend: str
    config: RuntimeConfig
    examples: int = 50
    seed: int = 0
    steps: tuple[int, ...] = DEFAULT_STEPS
    capture_sizes: tuple[int, ...] = DEFAULT_CAPTURE_SIZES
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    vocab_size: int = 256
    num_layers: int = 2
    builder_overrides: tuple[tuple[str, type[AttentionMetadataBuilder[Any]]], ...] = ()
    """(backend name, builder class) swaps: tests use them to plant known-bad builders."""
    shrink_seconds: float = DEFAULT_SHRINK_SECONDS
    """Time budget for shrinking a failure; past it the smallest failure so far is kept."""
    claim_fused: bool = False
    """Run the fused candidate even where the matrix forbids it (``--audit-claims``)."""
    fail_fast: bool = False
    """End the search at the first failure (``--fail-fast``)."""
    kv_layout: KvLayout | None = None
    """The drafter's layer kind (a cell's); ``None``: the entry's (``--kv-layout``)."""
    matrices: MatrixContext = field(kw_only=True)
    """The matrix under verification, and the shipped one for the fp32 reference."""

    @classmethod
    def for_task(cls, task: WorkerTask, tier: Tier, matrices: MatrixContext) -> VerifySettings:
        """The engine's view of ``task`` on ``tier`` (``matrices``: its run's): the only
        place a worker's settings are derived from what it was given."""
        scale = task.run.scale(tier)
        return cls(task.backend, task.config_for(tier, matrices.matrix, machine_platform()),
                   examples=task.examples, seed=task.seed, steps=task.run.draft_steps,
                   capture_sizes=scale.capture_sizes, max_new_tokens=scale.max_new_tokens,
                   shrink_seconds=task.run.shrink_seconds, claim_fused=task.claim_fused,
                   fail_fast=task.run.fail_fast, kv_layout=task.drafter_layout,
                   matrices=matrices)


def candidates_for(multi_step: DecodePath | None, gpu: bool) -> list[Candidate]:
    """The candidates of one example, in the order they run after the oracle.

    ``multi_step`` is ``FUSED`` when the speculator fuses, ``HOST_PREPLANNED`` when the
    host_preplanned strategy applies, else ``None``. The multi-step body runs as a graph
    replay on the GPU and eagerly everywhere. On the GPU, when fused decoding is not
    allowed, the per-step graph replays the speculator falls back to are a candidate too,
    and they run first: their step comparison covers every persistent buffer, and a
    host_preplanned candidate rewrites its per-step buffers, which the oracle saw holding the
    previous example's plans.

    The fused body runs eagerly before its graph replay: both run the same refresh, and
    the eager run's step guard stops before a forward whose metadata is wrong
    (:mod:`~speccheck.checks.verify.step_guard`), where a replay would run into it (FA3
    without its schedule refresh faulted the device in the replay, before any check, on
    H100 and H200). The host_preplanned body's eager loop plans through another hook than
    its replay (``plan_draft_steps``, ``replan_draft_steps``), so its graph keeps going
    first.
    """
    fallback = ([Candidate(DecodePath.PER_STEP, graphs=True)]
                if gpu and multi_step is not DecodePath.FUSED else [])
    if multi_step is None:
        return fallback
    eager = Candidate(multi_step, graphs=False)
    if not gpu:
        return fallback + [eager]
    graph = Candidate(multi_step, graphs=True)
    return fallback + ([eager, graph] if multi_step is DecodePath.FUSED else [graph, eager])


PROBED_CANDIDATE = Candidate(DecodePath.FUSED, graphs=False)
"""The candidate whose refreshes run traced (:class:`~speccheck.checks.verify.refresh_probe.
RefreshProbe`): the eager fused loop, where every refresh call runs on the host's watch."""


RESIZED_OUTPUT = r"An output with one or more elements was resized"
"""PyTorch's warning when an ``out=`` tensor of the wrong shape is resized to the result's
(deprecated: a later release raises). In a builder it hides a view sized for another batch:
``torch.sub(lengths, c, out=buffer[:n - 1])`` quietly re-views ``n`` rows, so a wrong
slice bound passes every check; an example that triggers it raises instead."""


class BackendVerifier:
    """Verifies ``settings.backend`` under ``settings.config`` on ``device``.

    With ``dcp`` this process is one rank of a real DCP group
    (:mod:`speccheck.checks.verify.dcp_ranks` runs every rank, in lockstep): the speculator
    under test holds the rank's share of the KV cache (its expected writes are the rank's
    local slots), and the fp32 reference is one process holding the whole cache, started
    from what the ranks hold together (:func:`~speccheck.checks.verify.kv_share.
    whole_cache_start`), so it checks the DCP layout and merge as well. Graph candidates
    run only where the config captures graphs (``cudagraph_mode == "full"`` on CUDA).
    """

    def __init__(
        self, settings: VerifySettings, device: torch.device, dcp: DcpRank | None = None
    ) -> None:
        self.settings = settings
        self.device = device
        self.config = settings.config
        self.gpu = device.type == "cuda"
        self.graphs = self.gpu and self.config.cudagraph_mode == "full"
        """Whether graph candidates run (a DCP rank whose group cannot be captured runs
        with ``cudagraph_mode`` none on CUDA too)."""
        self.share = WHOLE_CACHE if dcp is None else KvShare(dcp.rank, dcp.world_size)
        self.tol = TOLERANCE[self.config.dtype]
        self.reference_tol = FP32_REFERENCE_TOLERANCE_FACTOR * self.tol
        """Tolerance of the oracle against the fp32 reference (a different dtype's rounding)."""
        self.harnesses = HarnessSet(settings, device, dcp)
        self._breakpoints: Breakpoints | None = None
        self.side_lane = SideLane(device)
        """Where each example's fp32 reference runs, beside its oracle and candidates."""
        self.latent_fields = LatentFields()
        """The probe of fields that reach no output, on the run's first clean examples (one
        process only)."""
        self._reference_divergence: tuple[Example, FirstRunTokens] | None = None
        """The last example whose oracle parted from the fp32 reference, with both runs'
        draft tokens: what the localiser's re-run is compared with."""

    # ------------------------------------------------------------ set-up
    @property
    def capture_seconds(self) -> float:
        """Time spent capturing graphs so far."""
        return self.harnesses.capture_seconds

    def drafter(self, dtype: str) -> DrafterConfig:
        """:meth:`HarnessSet.drafter <speccheck.checks.verify.harness.HarnessSet.drafter>`."""
        return self.harnesses.drafter(dtype)

    def reference_drafter(self) -> DrafterConfig:
        """:meth:`HarnessSet.reference_drafter <speccheck.checks.verify.harness.HarnessSet.
        reference_drafter>`."""
        return self.harnesses.reference_drafter()

    def limits(self, k: int) -> BatchLimits:
        """What a batch of ``k`` draft steps may hold in this run's harnesses."""
        return self.harnesses.limits(k)

    @property
    def fused_allowed(self) -> bool:
        """Whether the speculator fuses at the largest K drawn (at K = 1 nothing fuses)."""
        return self.harnesses.harness(max(self.settings.steps)).spec.use_fused_multi_step_decode

    def candidates(self, k: int | None = None) -> list[Candidate]:
        """What is compared with the eager per-step oracle on an example of ``k`` draft
        steps (default: the largest K drawn), in order: see :func:`candidates_for`. K = 1
        has none: no decode step runs, so the example is the control of the first pass
        (its KV writes and its tokens against the fp32 reference)."""
        k = max(self.settings.steps) if k is None else k
        if k == 1:
            return []
        spec = self.harnesses.harness(k).spec
        if spec.use_fused_multi_step_decode:
            return candidates_for(DecodePath.FUSED, self.graphs)
        return candidates_for(DecodePath.HOST_PREPLANNED if spec.host_preplanned_applies else None,
                              self.graphs)

    def check_fits(self, example: Example) -> None:
        """Raise the :class:`~speccheck.checks.verify.input_fit.ExampleDoesNotFit` of the
        first limit of this run's harness ``example`` crosses
        (:func:`~speccheck.checks.verify.input_fit.check_fits`)."""
        check_fits(example, self.harnesses.options(), block_size=self.config.block_size,
                   max_model_len=self.config.max_model_len,
                   vocab_size=self.settings.vocab_size,
                   max_new_tokens=self.settings.max_new_tokens)

    def example_problem(self, example: Example) -> str | None:
        """Why ``example`` cannot run in this harness, as one line that names the limit and
        the option that raises it (:func:`~speccheck.checks.verify.report.misfit_line`);
        ``None`` when it fits."""
        try:
            self.check_fits(example)
        except ExampleDoesNotFit as misfit:
            return misfit_line(misfit)
        return None

    # ------------------------------------------------------------ one example
    def run_example(self, example: Example) -> list[Outcome]:
        """Every check's outcome on ``example`` (:meth:`examine`)."""
        return self.examine(example).outcomes

    def examine(self, example: Example) -> ExampleRun:
        """Run ``example``'s oracle, fp32 reference and candidates from its start state and
        check them. PyTorch's deprecated resize of a mis-sized ``out=`` tensor raises
        (:data:`RESIZED_OUTPUT`)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=RESIZED_OUTPUT, category=UserWarning)
            return self._examine(example)

    def _examine(self, example: Example) -> ExampleRun:
        k, batch = example
        h = self.harnesses.harness(k)
        if h.capture_error is not None:
            return ExampleRun([Outcome(Check.CAPTURE, Result.FAILED, h.capture_error)], 0)
        start = self.harnesses.start_state(h, example)
        reference = self._submit_reference(h, start, batch)
        try:
            return self._run_candidates(h, example, start, reference)
        finally:
            reference.wait()

    def _submit_reference(
        self, h: Harness, start: KVSnapshot, batch: DraftBatch
    ) -> SideRun[tuple[torch.Tensor, torch.Tensor]]:
        """The fp32 reference's run of ``batch`` from ``start``, on the side lane: its draft
        tokens and logits, on the device.
        It reads ``start`` and nothing the oracle or a candidate writes. Only the blocks it
        can read are restored: the batch's and the sink block (what padding lanes and unused
        block-table entries point at)."""
        reference = h.reference
        whole = whole_cache_start(start, batch, self.config.block_size, self.share.world)
        blocks = [SINK_BLOCK, *(block for row in batch.block_table for block in row)]

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            reference.kv_cache.restore(whole, blocks)
            r = reference.launch(batch, DecodePath.PER_STEP)
            # copies: the next example's run reuses the reference's buffers
            return reference.draft_tokens[:r].clone(), reference.draft_logits[:r].clone()

        return self.side_lane.submit(run)

    def _run_candidates(
        self, h: Harness, example: Example, start: KVSnapshot,
        reference: SideRun[tuple[torch.Tensor, torch.Tensor]],
    ) -> ExampleRun:
        """The oracle and the candidates of ``example`` from ``start``, their checks, and
        the oracle against ``reference``."""
        k, batch = example
        spec = h.spec
        lanes = spec.bucket_for(batch.num_reqs)
        query_len = spec.first_pass_width(batch)

        def first_pass() -> FirstPassSnapshot | None:
            if query_len is None:
                return None
            return FirstPassSnapshot(h.first_pass_recorder.collect(lanes * query_len), query_len)

        meanings = DeclaredMeanings.of(self.settings.matrices.matrix, spec.groups, self.config,
                                       self.share)
        h.padding_rows.reset()
        try:
            with h.armed(GuardedRun(batch, "oracle", meanings)):
                oracle = spec.propose(batch, DecodePath.PER_STEP, use_graphs=False)
        except StepCheckFailed as stopped:
            h.discard_run(lanes, query_len)
            return ExampleRun(stopped.outcomes, 0)
        oracle_first_pass = first_pass()
        oracle_steps = h.recorder.collect(lanes)
        oracle_storage = dict(h.recorder.storage_of)
        inputs = input_storages(spec)
        derived_changes = derived_step_changes(oracle_steps, oracle_storage, inputs)
        candidates = self.candidates(k)
        # A KV copy only where a later run overwrites the cache: a candidate restores the
        # start state first. Each candidate's own state is compared in the live cache.
        oracle_kv = spec.kv_cache.snapshot() if candidates else spec.kv_cache.layers
        bs, mml = self.config.block_size, self.config.max_model_len
        written = expected_slots(batch, k, bs, mml, share=self.share)
        outcomes = kv_untouched(batch, written, bs, start, oracle_kv, "oracle", oracle_steps,
                                oracle_first_pass, self.share)
        outcomes += meanings.check(batch, oracle_steps, "oracle", oracle_first_pass)
        outcomes += zero_tails(spec.groups, h.recorder.last_metadata, "oracle")
        outcomes += h.padding_rows.outcomes("oracle")
        if self.graphs:
            outcomes.append(Outcome(Check.CAPTURE, Result.PASSED))

        probe: RefreshProbe | None = None
        forward_probe: ForwardProbe | None = None
        eager_fused_stopped = False
        for candidate in candidates:
            name = candidate.name
            if candidate.graphs and candidate.path is DecodePath.FUSED and eager_fused_stopped:
                continue  # its eager run's refresh was stopped on wrong metadata
            spec.kv_cache.restore(start)
            if candidate == PROBED_CANDIDATE:
                probe = RefreshProbe(
                    name, poison_before_first_refresh=spec.refresh_rebuilds_in_graph,
                    cuda_sync_debug=self.gpu)
                spec.refresh_hook = probe
                forward_probe = None if self.gpu else ForwardProbe(name, spec)
            metadata_only = candidate.path is DecodePath.HOST_PREPLANNED
            h.padding_rows.reset()
            try:
                with h.armed(GuardedRun(
                        batch, name, meanings, oracle_steps, metadata_only,
                        None if oracle_first_pass is None else oracle_first_pass.snapshots)):
                    result = spec.propose(batch, candidate.path, use_graphs=candidate.graphs)
            except RefreshRaised:
                continue  # reported by the probe; nothing else of this candidate to compare
            except StepCheckFailed as failed_step:
                h.discard_run(lanes, query_len)
                outcomes += failed_step.outcomes
                if candidate == PROBED_CANDIDATE:  # the fused replay after it would run
                    eager_fused_stopped = True  # the same metadata
                continue  # it stopped at a failed step: no outputs of it to compare
            finally:
                spec.refresh_hook = None
                if forward_probe is not None:
                    forward_probe.uninstall()
            steps = h.recorder.collect(lanes)
            kv = spec.kv_cache.layers
            candidate_first_pass = first_pass()
            outcomes += compare_drafts(oracle, result, name, self.tol)
            outcomes += kv_untouched(batch, written, bs, start, kv, name, steps,
                                     candidate_first_pass, self.share)
            agreed = expected_slots(batch, k, bs, mml, first_divergence(oracle, result, k),
                                    self.share)
            outcomes += kv_matches(agreed, oracle_kv, kv, self.tol, name)
            if not candidate.graphs:
                outcomes += first_pass_metadata(oracle_first_pass, candidate_first_pass, name,
                                                metadata_only=metadata_only)
            outcomes += compare_steps(oracle_steps, steps, name, metadata_only=metadata_only)
            outcomes += meanings.check(batch, steps, name, candidate_first_pass)
            outcomes += zero_tails(spec.groups, h.recorder.last_metadata, name)
            outcomes += h.padding_rows.outcomes(name)
        outcomes += declared_fields(spec.groups, oracle_steps, oracle_storage, inputs)
        if probe is not None:
            outcomes += probe.outcomes()
        if forward_probe is not None:
            outcomes += forward_probe.outcomes()
        if (PROBED_CANDIDATE in candidates and self.share.world == 1
                and all(o.result is not Result.FAILED for o in outcomes)):
            outcomes += self.latent_fields.probe(
                spec, self.settings.matrices.matrix, batch, k,
                lambda: spec.kv_cache.restore(start), self.tol)
        outcomes += guard_bands(self.harnesses.guards)
        tokens, logits = reference.result()
        expected = DraftResult(tokens.cpu(), logits.cpu())
        versus = compare_drafts(
            expected, oracle, "oracle vs fp32 reference", self.reference_tol,
            token_check=Check.VS_FP32_REFERENCE, logit_check=Check.VS_FP32_REFERENCE,
        )
        if any(o.result is Result.FAILED for o in versus):
            self._reference_divergence = (example, FirstRunTokens(
                oracle.draft_tokens.clone(), expected.draft_tokens.clone()))
        return ExampleRun(outcomes + versus, derived_changes)

    # ------------------------------------------------------------ the run
    @property
    def breakpoints(self) -> Breakpoints:
        """Where the backend's derived metadata changes as one request grows (probed once,
        on the eager build, before any example): the strategy aims draft steps across them."""
        if self._breakpoints is None:
            spec = self.harnesses.harness(self.settings.steps[0]).spec
            group = spec.groups[0]
            self._breakpoints = discover_breakpoints(
                group.builder, group.step_dependent_fields, descriptor_for=spec.decode_descriptor)
            logger.info("%s", self._breakpoints.describe())
        return self._breakpoints

    def example_strategy(self, shape: BatchClass | None = None) -> st.SearchStrategy[Example]:
        """A K from ``settings.steps`` and a batch within :meth:`limits` (of ``shape`` only,
        where given), aimed across the :attr:`breakpoints`."""
        lengths = self.breakpoints.lengths
        return draft_step_counts(self.settings.steps).flatmap(
            lambda k: st.tuples(st.just(k), draft_batches(of_shape(
                dataclasses.replace(self.limits(k), breakpoints=lengths), shape))))

    def coverage(self) -> list[Coverage]:
        """The batch classes every run includes: those the entry's CUDA-graph claim covers
        (:attr:`BatchLimits.batch_classes`)."""
        classes = self.limits(self.settings.steps[0]).batch_classes
        return [Coverage(shape, self.limits, self.example_strategy(shape)) for shape in classes]

    def run(self, report: BackendReport, on_example: Callable[[int, Example], None]) -> None:
        """Draw ``settings.examples`` examples; shrink each failure (within
        ``settings.shrink_seconds``) and record the smallest failing example found, then
        search on for what no finding failed yet, unless ``settings.fail_fast``
        (:func:`~speccheck.checks.verify.search.search_all`).

        ``on_example(index, example)`` is called before every example runs, shrink
        candidates included (same index): a worker killed mid-example names the right one.
        """
        report.breakpoints = self.breakpoints.to_json()
        budget = SearchBudget(self.settings.examples, self.settings.seed,
                              self.settings.shrink_seconds, self.settings.fail_fast)
        search_all(self.example_strategy(), budget, self.examine, report, on_example,
                   self.record_failure, self.coverage())
        report.latent_fields = list(self.latent_fields.latent)

    def record_failure(
        self, report: BackendReport, example: Example, outcomes: list[Outcome],
        found_at: int = 1, known: frozenset[FailureKey] = frozenset(),
    ) -> None:
        """Record ``example`` as a finding of the backend (its failures not ``known``), a
        ``vs_fp32_reference`` failure localised
        (:func:`~speccheck.checks.verify.search.record_failure`)."""
        record_failure(report, example, outcomes, self.localise_reference_divergence,
                       found_at, known)

    def localise_reference_divergence(self, example: Example) -> str:
        """Where and why ``example``'s oracle and fp32 reference part, re-run from its start
        state (:func:`~speccheck.checks.verify.localise.localise_reference_divergence`)."""
        k, batch = example
        h = self.harnesses.harness(k)
        divergence = self._reference_divergence
        first_run = divergence[1] if divergence is not None and divergence[0] == example else None
        return localise_reference_divergence(
            h.spec, h.reference, batch, k, lambda: self.harnesses.start_state(h, example),
            self.config.block_size, self.config.max_model_len, self.reference_tol, first_run)
