"""One backend, one runtime config, in this process: draw batches, run the oracle (eager
per-step, metadata rebuilt before every step) and the candidates (fused FULL-graph replay
on a GPU, and the eager fused loop) from identical state, and compare.

Run it through :mod:`speccheck.checks.verify.runner`, which gives each backend a process
of its own: an illegal memory access breaks a CUDA context for good.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky

from speccheck.backends.reference.builder import HostLengthsReferenceBuilder
from speccheck.checks.probes import (
    GuardedBuffer,
    GuardedBufferSet,
    HostSyncRecorder,
    IdentityGuard,
    check_zero_tail,
    poison_,
)
from speccheck.checks.probes.state_walk import attribute_storages, changed_paths
from speccheck.checks.verify.breakpoints import Breakpoints, discover_breakpoints
from speccheck.checks.verify.comparisons import (
    FirstPassSnapshot,
    KVSnapshot,
    Outcome,
    compare_drafts,
    compare_steps,
    expected_slots,
    first_divergence,
    kv_matches,
    kv_untouched,
)
from speccheck.checks.verify.context import MatrixContext
from speccheck.checks.verify.examples import Example, example_digest, example_json
from speccheck.checks.verify.kv_share import WHOLE_CACHE, KvShare, whole_cache_start
from speccheck.checks.verify.localise import earliest_divergence, localise, trace_run, traced_slots
from speccheck.checks.verify.report import BackendReport, Failure
from speccheck.checks.verify.run import WorkerTask
from speccheck.checks.verify.scale import (
    DEFAULT_CAPTURE_SIZES,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_SHRINK_SECONDS,
    DEFAULT_STEPS,
)
from speccheck.checks.verify.side_lane import SideLane, SideRun
from speccheck.checks.verify.step_recorder import StepMetadataRecorder
from speccheck.checks.verify.strategies import (
    BatchLimits,
    derived_step_changes,
    draft_batches,
    target_derived_changes,
)
from speccheck.checks.verify.vocabulary import Candidate, Check, Result, Status, Tier
from speccheck.contract.builder import AttentionMetadataBuilder, blocks_for
from speccheck.contract.dcp import DcpRank
from speccheck.contract.groups import AttentionGroup
from speccheck.contract.matrix_model import KvLayout
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.attention_setup import machine_platform
from speccheck.speculator.autoregressive import AutoregressiveSpeculator, DecodePath
from speccheck.speculator.base import SpeculatorOptions
from speccheck.speculator.batch import DraftBatch, DraftResult
from speccheck.speculator.factory import create_speculator
from speccheck.speculator.kv_cache import SINK_BLOCK, PagedKVCache
from speccheck.speculator.model import DrafterConfig

logger = logging.getLogger(__name__)

FIRST_PASS_QUERY_LENS = (1, 2)
"""Uniform first passes the verified speculators pad and capture (one or two new tokens per
request: a draft fully rejected, or one accepted): a batch of one request, or of requests
that all bring one of these counts, runs its first pass as a graph in the candidates and as
the same padded body in the oracle."""
TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 6e-2}
"""Absolute logit / KV tolerance per dtype; a top-2 logit gap below twice this makes the
oracle's token choice indeterminate."""

KV_CACHE_TOKEN_BUDGET = 1 << 20
"""Most KV-cache positions the harness allocates per layer (past one full request row):
with many requests at a long ``max_model_len`` the cache holds this many, and a drawn batch
takes requests only while their block tables fit (block ids are disjoint)."""


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
    matrices: MatrixContext = field(kw_only=True)
    """The matrix under verification, and the shipped one for the fp32 reference."""

    @classmethod
    def for_task(cls, task: WorkerTask, tier: Tier, matrices: MatrixContext) -> VerifySettings:
        """The engine's view of ``task`` on ``tier`` (``matrices``: its run's): the only
        place a worker's settings are derived from what it was given."""
        scale = task.run.scale(tier)
        return cls(task.backend,
                   task.run.config_for(task.backend, tier, matrices.matrix, machine_platform()),
                   examples=task.examples, seed=task.seed, steps=task.run.draft_steps,
                   capture_sizes=scale.capture_sizes, max_new_tokens=scale.max_new_tokens,
                   shrink_seconds=task.run.shrink_seconds, claim_fused=task.claim_fused,
                   matrices=matrices)


class RefreshRaised(Exception):
    """The traced refresh raised; the probe recorded it as a ``refresh_error`` outcome."""


class ExampleFailed(Exception):
    def __init__(self, example: Example, outcomes: list[Outcome]) -> None:
        super().__init__(f"{sum(o.result == 'failed' for o in outcomes)} checks failed")
        self.example = example
        self.outcomes = outcomes


@dataclass
class _Harness:
    """The speculators for one K: the backend under test and the fp32 reference."""

    spec: AutoregressiveSpeculator
    recorder: StepMetadataRecorder
    first_pass_recorder: StepMetadataRecorder
    """The metadata of the padded first pass (step 0), for the padding-lane check."""
    reference: AutoregressiveSpeculator | None
    capture_error: str | None
    """Why capture failed (a host sync or host copy inside the captured body), if it did."""
    tail_buffers: list[torch.Tensor] | None = None
    """The persistent buffers under the zero-tail rule, once known (:meth:`BackendVerifier.
    _tail_buffers`); every example starts with them poisoned."""


class GuardedAllocator(GuardedBufferSet):
    """A :data:`~speccheck.contract.builder.BufferAllocator` that surrounds every persistent
    buffer with poisoned guard bands and keeps it in this set (checked and rearmed
    together)."""

    def __call__(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        buffer = GuardedBuffer(shape, dtype, device, name=name)
        self.add(buffer)
        return buffer.tensor


def candidates_for(multi_step: DecodePath | None, gpu: bool) -> list[Candidate]:
    """The candidates of one example, in the order they run after the oracle.

    ``multi_step`` is ``FUSED`` when the speculator fuses, ``PREPLANNED`` when the
    host_preplanned strategy applies, else ``None``. The multi-step body runs as a graph
    replay on the GPU and eagerly everywhere. On the GPU, when fused decoding is not
    allowed, the per-step graph replays the speculator falls back to are a candidate too,
    and they run first: their step comparison covers every persistent buffer, and a
    preplanned candidate rewrites its per-step buffers, which the oracle saw holding the
    previous example's plans.
    """
    fallback = ([Candidate(DecodePath.PER_STEP, graphs=True)]
                if gpu and multi_step is not DecodePath.FUSED else [])
    if multi_step is None:
        return fallback
    body = [Candidate(multi_step, graphs=True)] if gpu else []
    return fallback + body + [Candidate(multi_step, graphs=False)]


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
        self.dcp = dcp
        self.share = WHOLE_CACHE if dcp is None else KvShare(dcp.rank, dcp.world_size)
        self.tol = TOLERANCE[self.config.dtype]
        self.reference_tol = 4 * self.tol
        """Tolerance of the oracle against the fp32 reference (a different dtype's rounding)."""
        self._harness: dict[int, _Harness] = {}
        self._kv_cache: PagedKVCache | None = None
        self._reference_kv_cache: PagedKVCache | None = None
        """One KV cache for the speculators of every K, one for their fp32 references:
        examples run one at a time and each starts from its own noise, and at serving
        scale a cache is gigabytes per layer."""
        self.capture_seconds = 0.0
        self._probe_outcomes: list[Outcome] = []
        self._poison_before_refresh = False
        self._refreshed: set[tuple[int, int]] = set()
        """(group, metadata) pairs (by id) the probed run has refreshed so far."""
        self._breakpoints: Breakpoints | None = None
        self.last_derived_changes = 0
        """Derived metadata elements that changed between the last oracle run's steps."""
        self.guards = GuardedAllocator()
        self.side_lane = SideLane(device)
        """Where each example's fp32 reference runs, beside its oracle and candidates."""

    # ------------------------------------------------------------ set-up
    def drafter(self, dtype: str) -> DrafterConfig:
        """The drafter of this run in ``dtype``: its layers are of the kind the backend under
        test reads (GQA for an ``NHD`` cache or an entry that states no layout, MLA for a
        ``latent`` one), and the fp32 reference speculator gets the same kind."""
        layout = self.settings.matrices.matrix.backend(self.settings.backend).constraints.kv_layout
        return DrafterConfig.for_runtime(
            self.config, vocab_size=self.settings.vocab_size,
            num_layers=self.settings.num_layers, seed=self.settings.seed, dtype=dtype,
            kv_layout=layout or KvLayout.NHD,
        )

    def reference_drafter(self) -> DrafterConfig:
        """The fp32 reference's drafter: :meth:`drafter` in fp32 on the tensor-op forms of
        every layer, sampling and index-buffer update (no Triton kernel), so a kernel the
        drafter under test runs in both its oracle and its candidates is still checked
        against an independent computation."""
        return dataclasses.replace(self.drafter("float32"), kernels=False)

    def options(self) -> SpeculatorOptions:
        """The drafter's sizes: graphs for every capture size, a prefill budget of
        ``max_new_tokens`` per request of the largest, and a KV cache of one full block-table
        row per request, capped at :data:`KV_CACHE_TOKEN_BUDGET` positions (never below one
        full row) plus the sink block."""
        bs = self.config.block_size
        max_blocks = blocks_for(self.config.max_model_len, bs)
        most = max(self.settings.capture_sizes)
        live = min(most * max_blocks, max(max_blocks, KV_CACHE_TOKEN_BUDGET // bs))
        return SpeculatorOptions(
            capture_sizes=self.settings.capture_sizes,
            max_num_prefill_tokens=most * self.settings.max_new_tokens,
            num_blocks=live + 1,
            pad_to_capture_sizes=True,
            first_pass_query_lens=FIRST_PASS_QUERY_LENS,
        )

    def limits(self, k: int) -> BatchLimits:
        return BatchLimits(
            max_num_reqs=max(self.settings.capture_sizes), block_size=self.config.block_size,
            max_model_len=self.config.max_model_len, num_blocks=self.options().num_blocks,
            extra_positions=k - 1, vocab_size=self.settings.vocab_size,
            max_new_tokens=self.settings.max_new_tokens,
        )

    def harness(self, k: int) -> _Harness:
        if k not in self._harness:
            config = self.config.model_copy(update={"num_speculative_steps": k})
            spec = create_speculator(
                "autoregressive", [self.settings.backend] * self.settings.num_layers, config,
                self.drafter(config.dtype), self.device, self.options(),
                matrix=self.settings.matrices.matrix,
                builder_overrides=dict(self.settings.builder_overrides),
                buffer_allocator=self.guards,
                claim_fused=self.settings.claim_fused,
                kv_cache=self._kv_cache,
                dcp=self.dcp,
            )
            assert isinstance(spec, AutoregressiveSpeculator)
            self._kv_cache = spec.kv_cache
            recorder = StepMetadataRecorder(spec.groups)
            spec.step_observer = recorder
            first_pass_recorder = StepMetadataRecorder(spec.groups)
            spec.first_pass_observer = first_pass_recorder
            start = time.perf_counter()
            capture_error = None
            try:
                spec.capture()
            except RuntimeError as exc:
                capture_error = f"capturing the draft-decode graphs failed: {exc}"
            self.capture_seconds += time.perf_counter() - start
            reference = None
            if self.dcp is not None or not (self.settings.backend == "reference"
                                            and config.dtype == "float32"):
                ref_config = config.model_copy(update={
                    "dtype": "float32", "cudagraph_mode": "none", "dcp_world_size": 1})
                ref = create_speculator(
                    "autoregressive", ["reference"] * self.settings.num_layers, ref_config,
                    self.reference_drafter(), self.device, self.options(),
                    matrix=self.settings.matrices.shipped,
                    builder_overrides={"reference": HostLengthsReferenceBuilder},
                    kv_cache=self._reference_kv_cache,
                )
                assert isinstance(ref, AutoregressiveSpeculator)
                self._reference_kv_cache = ref.kv_cache
                reference = ref
            self._harness[k] = _Harness(spec, recorder, first_pass_recorder, reference,
                                        capture_error)
        return self._harness[k]

    @property
    def fused_allowed(self) -> bool:
        """Whether the speculator fuses at the largest K drawn (at K = 1 nothing fuses)."""
        return self.harness(max(self.settings.steps)).spec.use_fused_multi_step_decode

    def candidates(self, k: int | None = None) -> list[Candidate]:
        """What is compared with the eager per-step oracle on an example of ``k`` draft
        steps (default: the largest K drawn), in order: see :func:`candidates_for`. K = 1
        has none: no decode step runs, so the example is the control of the first pass
        (its KV writes and its tokens against the fp32 reference)."""
        k = max(self.settings.steps) if k is None else k
        if k == 1:
            return []
        spec = self.harness(k).spec
        if spec.use_fused_multi_step_decode:
            return candidates_for(DecodePath.FUSED, self.graphs)
        return candidates_for(DecodePath.PREPLANNED if spec.preplanned_capable else None,
                              self.graphs)

    def example_problem(self, example: Example) -> str | None:
        """Why ``example`` cannot run in this harness, as one line that names the limit and
        the option that raises it; ``None`` when it fits. The limits: requests and prefill
        tokens (:meth:`options`, from the capture sizes), lengths and block-table rows
        (``max_model_len``, ``block_size``), block ids (the KV cache :meth:`options` sizes)
        and token ids (the drafter's vocabulary). What else ``DraftBatch.validate`` rejects
        (block-table rows too short for the example's K) means the example was made for
        another configuration."""
        k, batch = example
        options, config = self.options(), self.config
        bs, mml = config.block_size, config.max_model_len
        prefill = sum(len(tokens) for tokens in batch.new_tokens)
        max_tokens = options.limits().max_num_tokens
        max_blocks = blocks_for(mml, bs)
        lengths = [ctx + len(new)
                   for ctx, new in zip(batch.context_lens, batch.new_tokens, strict=True)]
        longest = max(range(batch.num_reqs), key=lengths.__getitem__)
        widest = max(range(batch.num_reqs), key=lambda r: len(batch.block_table[r]))
        top_block = max((b, r) for r, row in enumerate(batch.block_table) for b in row)
        top_token = max((t, r) for r, row in enumerate(batch.new_tokens) for t in row)
        if batch.num_reqs > options.max_num_reqs:
            return (f"--reproduce: the example has {batch.num_reqs} requests, more than the "
                    f"{options.max_num_reqs} this run serves (its largest capture size); raise "
                    "it with --capture-sizes")
        if prefill > max_tokens:
            return (f"--reproduce: the example has {prefill} prefill tokens, more than the "
                    f"{max_tokens} this run's drafter holds ({self.settings.max_new_tokens} per "
                    "request of its largest capture size); raise it with --max-new-tokens or "
                    "--capture-sizes")
        if lengths[longest] > mml:
            return (f"--reproduce: request {longest} reaches length {lengths[longest]} "
                    f"(context {batch.context_lens[longest]} + "
                    f"{len(batch.new_tokens[longest])} new tokens), more than --max-model-len "
                    f"{mml}; raise it with --max-model-len")
        if len(batch.block_table[widest]) > max_blocks:
            return (f"--reproduce: request {widest}'s block table has "
                    f"{len(batch.block_table[widest])} blocks, more than the {max_blocks} a "
                    f"request holds at --max-model-len {mml} and --block-size {bs}; raise it "
                    "with --max-model-len")
        if top_block[0] >= options.num_blocks:
            return (f"--reproduce: block id {top_block[0]} (request {top_block[1]}) is past "
                    f"the {options.num_blocks - 1} live blocks of this run's KV cache; raise "
                    "them with --capture-sizes or --max-model-len")
        if top_token[0] >= self.settings.vocab_size:
            return (f"--reproduce: token id {top_token[0]} (request {top_token[1]}) is outside "
                    f"the drafter's vocabulary of {self.settings.vocab_size} tokens, which no "
                    "option changes")
        try:
            batch.validate(max_model_len=mml, block_size=bs, num_blocks=options.num_blocks,
                           extra_positions=k - 1, max_num_reqs=options.max_num_reqs)
        except ValueError as exc:
            return (f"--reproduce: the example does not fit --block-size {bs} --max-model-len "
                    f"{mml} with K = {k}: {exc}")
        return None

    # ------------------------------------------------------------ one example
    def _start_state(self, h: _Harness, example: Example) -> KVSnapshot:
        """Put the harness in the state ``example`` starts from, a function of the example
        alone: the builders' zero-tail buffers poisoned (:meth:`_tail_buffers`), every
        guard band rearmed (a band an earlier example overwrote is not this example's
        finding), and the KV cache filled with noise seeded by the example. Returns the KV
        snapshot."""
        if h.tail_buffers is None:
            h.tail_buffers = self._tail_buffers(h, example[0])
        for buffer in h.tail_buffers:
            poison_(buffer)
        self.guards.rearm()
        h.spec.kv_cache.fill_random_(example_digest(example))
        return h.spec.kv_cache.snapshot()

    def _tail_buffers(self, h: _Harness, k: int) -> list[torch.Tensor]:
        """The persistent buffers a builder reports a used extent for
        (``persistent_buffer_extents``): their rows past the extent must be zero after every
        build. Found once per K from the metadata of a warm-up run of one minimal request
        (``persistent_buffer_extents`` needs metadata); empty for K = 1, where no decode
        step runs and ``zero_tails`` has nothing to check.

        Every example poisons them whole (:func:`~speccheck.checks.probes.poison_`): a
        build claims the rows its metadata uses, and a correct builder zeroes the rest, so
        it passes; a builder that leaves a tail stale fails on the first example it runs,
        in a long run and in a fresh worker alike, instead of only after an earlier,
        larger batch left something there."""
        bs, mml = self.config.block_size, self.config.max_model_len
        blocks = min(k - 1, mml - 1) // bs + 1
        warm_up = DraftBatch((0,), ((0,),), (tuple(range(1, blocks + 1)),), (0,))
        h.spec.propose(warm_up, DecodePath.PER_STEP, use_graphs=False)
        metadata = h.recorder.last_metadata
        if metadata is None:
            return []
        return [group.builder.persistent_buffers()[name]
                for group, md in zip(h.spec.groups, metadata, strict=True)
                for name in group.builder.persistent_buffer_extents(md)]

    def run_example(self, example: Example) -> list[Outcome]:
        k, batch = example
        h = self.harness(k)
        if h.capture_error is not None:
            return [Outcome(Check.CAPTURE, Result.FAILED, h.capture_error)]
        start = self._start_state(h, example)
        reference = self._submit_reference(h, start, batch)
        try:
            return self._run_candidates(h, example, start, reference)
        finally:
            if reference is not None:
                reference.wait()

    def _submit_reference(
        self, h: _Harness, start: KVSnapshot, batch: DraftBatch
    ) -> SideRun[tuple[torch.Tensor, torch.Tensor]] | None:
        """The fp32 reference's run of ``batch`` from ``start``, on the side lane (``None``
        where the oracle is the fp32 reference): its draft tokens and logits, on the device.
        It reads ``start`` and nothing the oracle or a candidate writes. Only the blocks it
        can read are restored: the batch's and the sink block (what padding lanes and unused
        block-table entries point at)."""
        reference = h.reference
        if reference is None:
            return None
        whole = whole_cache_start(start, batch, self.config.block_size, self.share.world)
        blocks = [SINK_BLOCK, *(block for row in batch.block_table for block in row)]

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            reference.kv_cache.restore(whole, blocks)
            r = reference.launch(batch, DecodePath.PER_STEP)
            # copies: the next example's run reuses the reference's buffers
            return reference.draft_tokens[:r].clone(), reference.draft_logits[:r].clone()

        return self.side_lane.submit(run)

    def _run_candidates(
        self, h: _Harness, example: Example, start: KVSnapshot,
        reference: SideRun[tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> list[Outcome]:
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

        oracle = spec.propose(batch, DecodePath.PER_STEP, use_graphs=False)
        oracle_first_pass = first_pass()
        oracle_steps = h.recorder.collect(lanes)
        oracle_storage = dict(h.recorder.storage_of)
        self.last_derived_changes = derived_step_changes(
            oracle_steps, oracle_storage, input_storages(spec))
        candidates = self.candidates(k)
        # A KV copy only where a later run overwrites the cache: a candidate restores the
        # start state first. Each candidate's own state is compared in the live cache.
        oracle_kv = spec.kv_cache.snapshot() if candidates else spec.kv_cache.layers
        bs, mml = self.config.block_size, self.config.max_model_len
        written = expected_slots(batch, k, bs, mml, share=self.share)
        outcomes = kv_untouched(batch, written, bs, start, oracle_kv, "oracle", oracle_steps,
                                oracle_first_pass, self.share)
        if self.graphs:
            outcomes.append(Outcome(Check.CAPTURE, Result.PASSED))

        for candidate in candidates:
            name = candidate.name
            spec.kv_cache.restore(start)
            probed = candidate == Candidate(DecodePath.FUSED, graphs=False)
            spec.refresh_hook = self._probing_refresh if probed else None
            self._poison_before_refresh = probed and spec.refresh_rebuilds_in_graph
            self._refreshed = set()
            try:
                result = spec.propose(batch, candidate.path, use_graphs=candidate.graphs)
            except RefreshRaised:
                continue  # reported by the probe; nothing else of this candidate to compare
            finally:
                spec.refresh_hook = None
            steps = h.recorder.collect(lanes)
            kv = spec.kv_cache.layers
            outcomes += compare_drafts(oracle, result, name, self.tol)
            outcomes += kv_untouched(batch, written, bs, start, kv, name, steps, first_pass(),
                                     self.share)
            agreed = expected_slots(batch, k, bs, mml, first_divergence(oracle, result, k),
                                    self.share)
            outcomes += kv_matches(agreed, oracle_kv, kv, self.tol, name)
            outcomes += compare_steps(
                oracle_steps, steps, name,
                metadata_only=candidate.path is DecodePath.PREPLANNED,
            )
            outcomes += self._zero_tails(spec, h.recorder, name)
        outcomes += self._declared_fields(spec, oracle_steps, oracle_storage)
        outcomes += self._probe_outcomes
        self._probe_outcomes = []
        outcomes += self._guard_bands()
        if reference is not None:
            tokens, logits = reference.result()
            expected = DraftResult(tokens.cpu(), logits.cpu())
            outcomes += compare_drafts(
                expected, oracle, "oracle vs fp32 reference", self.reference_tol,
                token_check=Check.VS_FP32_REFERENCE, logit_check=Check.VS_FP32_REFERENCE,
            )
        else:
            outcomes.append(Outcome(Check.VS_FP32_REFERENCE, Result.SKIPPED, "the oracle is the fp32 reference"))
        return outcomes

    # ------------------------------------------------------------ checks
    def _declared_fields(
        self, spec: AutoregressiveSpeculator, oracle: dict[int, dict[str, torch.Tensor]],
        storage_of: dict[str, int],
    ) -> list[Outcome]:
        """Claims audit of the oracle run: derived tensors that change between its steps
        must be declared in the matrix entry's step-dependent fields (``refreshed_fields``,
        ``invalidated_caches``), and every declared field must exist. Views of the speculator's own input buffers are not derived (the
        speculator advances them), and a persistent buffer behind a declared field is
        covered by that declaration. ``storage_of`` maps paths to storage addresses as the
        oracle run saw them: a candidate may bind the same field to another buffer (one
        per preplanned step)."""
        if len(oracle) < 2:
            return [Outcome(Check.DECLARED_FIELDS, Result.SKIPPED, "fewer than two draft steps")]
        snapshots = [oracle[s] for s in sorted(oracle)]
        changed = changed_paths(snapshots)
        inputs = input_storages(spec)
        out: list[Outcome] = []
        for group in spec.groups:
            builder = type(group.builder).__name__
            where = f"the matrix entry {group.backend_name!r} (draft_decode.refreshed_fields)"
            prefix = f"{group.backend_name}.metadata."
            declared = {prefix + f for f in group.step_dependent_fields}
            for path in sorted(declared - set(snapshots[0])):
                out.append(Outcome(Check.DECLARED_FIELDS, Result.FAILED,
                                   f"{where} declares step-dependent field "
                                   f"{path[len(prefix):]!r}, which the metadata of {builder} "
                                   "does not have", field=path))
            covered = inputs | {storage_of[p] for p in declared if p in storage_of}
            for path in sorted(changed - declared):
                if path.startswith(group.backend_name + ".") and storage_of[path] not in covered:
                    out.append(Outcome(Check.DECLARED_FIELDS, Result.FAILED,
                                       f"{path} changes between draft steps but {where} does "
                                       "not declare it", field=path))
        return out or [Outcome(Check.DECLARED_FIELDS, Result.PASSED)]

    def _zero_tails(
        self, spec: AutoregressiveSpeculator, recorder: StepMetadataRecorder, name: str
    ) -> list[Outcome]:
        """After a run, every persistent buffer's rows past what the last metadata uses are
        zero (the builder declares the used extents). Every example starts with those
        buffers poisoned (:meth:`_start_state`), so a failure never depends on what earlier
        examples left there."""
        if recorder.last_metadata is None:
            return []
        out: list[Outcome] = []
        for group, md in zip(spec.groups, recorder.last_metadata, strict=True):
            buffers = group.builder.persistent_buffers()
            for buffer_name, used in group.builder.persistent_buffer_extents(md).items():
                problem = check_zero_tail(buffers[buffer_name], used, name=buffer_name)
                if problem:
                    out.append(Outcome(Check.ZERO_TAILS, Result.FAILED,
                                       f"{name}: {group.backend_name}: {problem} (every example "
                                       "starts with this buffer poisoned whole)", name))
                else:
                    out.append(Outcome(Check.ZERO_TAILS, Result.PASSED, candidate=name))
        return out

    def _guard_bands(self) -> list[Outcome]:
        """No write landed in the poisoned bands around any persistent buffer."""
        if not self.guards.buffers:
            return [Outcome(Check.GUARD_BANDS, Result.SKIPPED, "no persistent buffers")]
        violations = self.guards.violations()
        if violations:
            return [Outcome(Check.GUARD_BANDS, Result.FAILED, "; ".join(violations[:3]))]
        return [Outcome(Check.GUARD_BANDS, Result.PASSED)]

    def _probing_refresh(self, group: AttentionGroup, metadata: Any) -> None:
        """The refresh, traced: host synchronisations and replaced tensors are findings; an
        exception is a finding of its own (:class:`RefreshRaised` ends the candidate).

        Where the matrix says the refresh rebuilds the metadata (``refresh_rebuilds``), the
        group's zero-tail buffers are poisoned whole before the first refresh of each
        metadata object: the run built it before the call's inputs existed, as a replay's
        was built for capture, and whatever of them the refresh does not rewrite (a field
        only the build writes, a tail) then fails the step's step_metadata, the zero_tails
        check, or the outputs."""
        pair = (id(group), id(metadata))
        if self._poison_before_refresh and pair not in self._refreshed:
            self._refreshed.add(pair)
            buffers = group.builder.persistent_buffers()
            for name in group.builder.persistent_buffer_extents(metadata):
                poison_(buffers[name])
        roots = {"metadata": metadata, "builder": group.builder}
        name = Candidate(DecodePath.FUSED, graphs=False).name
        try:
            with HostSyncRecorder(cuda_sync_debug=self.gpu) as syncs, IdentityGuard(roots) as ident:
                group.update_draft_decode_metadata(metadata)
        except Exception as exc:
            frames = traceback.format_exception(exc)
            tail = " | ".join(line.strip() for line in "".join(frames[-3:]).splitlines()[-4:])
            self._probe_outcomes.append(Outcome(
                Check.REFRESH_ERROR, Result.FAILED,
                f"{group.backend_name}: the refresh raised {type(exc).__name__}: {exc} "
                f"[{tail}]", name))
            raise RefreshRaised from exc
        self._probe_outcomes.append(Outcome(Check.REFRESH_ERROR, Result.PASSED, candidate=name))
        for check, findings in ((Check.HOST_SYNC, syncs.findings()),
                                (Check.IN_PLACE, ident.findings())):
            if findings:
                self._probe_outcomes.append(
                    Outcome(check, Result.FAILED, f"{group.backend_name}: {findings[0]}", name)
                )
            else:
                self._probe_outcomes.append(Outcome(check, Result.PASSED, candidate=name))

    # ------------------------------------------------------------ the run
    @property
    def breakpoints(self) -> Breakpoints:
        """Where the backend's derived metadata changes as one request grows (probed once,
        on the eager build, before any example): the strategy aims draft steps across them."""
        if self._breakpoints is None:
            spec = self.harness(self.settings.steps[0]).spec
            group = spec.groups[0]
            self._breakpoints = discover_breakpoints(
                group.builder, group.step_dependent_fields, descriptor_for=spec.decode_descriptor)
            logger.info("%s", self._breakpoints.describe())
        return self._breakpoints

    def example_strategy(self) -> st.SearchStrategy[Example]:
        lengths = self.breakpoints.lengths
        return st.sampled_from(self.settings.steps).flatmap(
            lambda k: st.tuples(st.just(k), draft_batches(
                dataclasses.replace(self.limits(k), breakpoints=lengths)))
        )

    def run(self, report: BackendReport, on_example: Callable[[int, Example], None]) -> None:
        """Draw ``settings.examples`` examples; on a failure, shrink it (within
        ``settings.shrink_seconds``) and record the smallest failing example found.

        ``on_example(index, example)`` is called before every example runs, shrink
        candidates included (same index): a worker killed mid-example names the right one.
        """
        shrinking, shrink_started = False, 0.0
        smallest: list[tuple[Example, list[Outcome]]] = []
        report.breakpoints = self.breakpoints.to_json()

        @seed(self.settings.seed)
        @settings(
            max_examples=self.settings.examples, database=None, deadline=None,
            phases=(Phase.generate, Phase.target, Phase.shrink), report_multiple_bugs=False,
            suppress_health_check=list(HealthCheck), print_blob=False,
        )
        @given(self.example_strategy())
        def check(example: Example) -> None:
            nonlocal shrinking, shrink_started
            if not shrinking:
                report.examples += 1
            elif time.monotonic() - shrink_started > self.settings.shrink_seconds:
                return  # budget spent: every further candidate "passes", ending the shrink
            on_example(report.examples, example)
            outcomes = self.run_example(example)
            target_derived_changes(self.last_derived_changes)
            failed = [o for o in outcomes if o.result is Result.FAILED]
            if failed:
                if not shrinking:
                    shrinking, shrink_started = True, time.monotonic()
                smallest[:] = [(example, outcomes)]  # hypothesis only tries smaller candidates
                raise ExampleFailed(example, outcomes)
            if not shrinking:
                report.tally(outcomes)

        try:
            check()
        except (ExampleFailed, Flaky):
            # Flaky: the final replay of the smallest failure passed because the shrink
            # budget was spent; that failure is still the one to report.
            if not smallest:
                raise
            self.record_failure(report, *smallest[0])

    def record_failure(
        self, report: BackendReport, example: Example, outcomes: list[Outcome]
    ) -> None:
        """Record ``example`` as the backend's failure. A ``vs_fp32_reference`` failure
        gets a localisation (:meth:`localise_reference_divergence`) added to its first
        diagnosis."""
        report.tally(outcomes)
        failed = [o for o in outcomes if o.result is Result.FAILED]
        versus = [o for o in failed if o.check is Check.VS_FP32_REFERENCE]
        if versus:
            versus[0].diagnosis += f"; {self.localise_reference_divergence(example)}"
        report.failures = [Failure(o.check, o.diagnosis, o.candidate, o.step, o.field)
                           for o in failed]
        report.minimal_example = example_json(example)
        report.status = Status.FAILED

    def localise_reference_divergence(self, example: Example) -> str:
        """Re-run ``example``'s oracle and fp32 reference from its start state and say where
        and why they part (:func:`~speccheck.checks.verify.localise.localise`)."""
        k, batch = example
        h = self.harness(k)
        assert h.reference is not None, "the oracle is the fp32 reference"
        bs, mml, tol = self.config.block_size, self.config.max_model_len, self.reference_tol
        start = self._start_state(h, example)
        oracle = h.spec.propose(batch, DecodePath.PER_STEP, use_graphs=False)
        h.reference.kv_cache.restore(start)
        expected = h.reference.propose(batch, DecodePath.PER_STEP)
        divergence = earliest_divergence(expected, oracle, tol)
        if divergence is None:
            return ("not localised: re-run from the same start state, the oracle agrees with "
                    "the fp32 reference (the divergence depends on state the start state does "
                    "not set)")
        slots = traced_slots(batch, *divergence, k, bs, mml)
        start = self._start_state(h, example)
        oracle_trace = trace_run(h.spec, batch, start, slots)
        reference_trace = trace_run(h.reference, batch, start, slots)
        return localise(batch, k, bs, mml, divergence, oracle_trace, reference_trace, tol)


def input_storages(spec: AutoregressiveSpeculator) -> set[int]:
    """Storage addresses of the speculator's own input buffers: metadata views of them are
    advanced by the speculator, not derived by the backend."""
    return attribute_storages(spec.buffers)
