"""What the verifier runs examples on: per K, the speculator under test (its persistent
buffers guarded, its steps recorded, its graphs captured) and the fp32 reference speculator,
sized for the run; and the state every example starts from."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from speccheck.checks.probes import poison_
from speccheck.checks.triton_interpreter import restart_program_order
from speccheck.checks.verify.cells import claimed_batch_classes
from speccheck.checks.verify.comparisons import KVSnapshot
from speccheck.checks.verify.examples import Example, example_digest
from speccheck.checks.verify.guard_bands import GuardedAllocator
from speccheck.checks.verify.oracle.builder import OracleMetadataBuilder
from speccheck.checks.verify.padding_rows import PaddingRowsCheck
from speccheck.checks.verify.rank_agreement import any_rank
from speccheck.checks.verify.step_guard import GuardedRun, StepGuard
from speccheck.checks.verify.step_recorder import StepMetadataRecorder
from speccheck.checks.verify.strategies import BatchLimits
from speccheck.checks.verify.zero_tails import zero_tail_buffers
from speccheck.contract.builder import blocks_for
from speccheck.contract.dcp import DcpRank
from speccheck.contract.matrix_model import KvLayout
from speccheck.speculator.autoregressive import AutoregressiveSpeculator, DecodePath
from speccheck.speculator.base import SpeculatorOptions
from speccheck.speculator.batch import DraftBatch
from speccheck.speculator.factory import create_speculator
from speccheck.speculator.kv_cache import PagedKVCache
from speccheck.speculator.model import DrafterConfig

if TYPE_CHECKING:
    from speccheck.checks.verify.engine import VerifySettings

FIRST_PASS_QUERY_LENS = (1, 2)
"""Uniform first passes the verified speculators pad and capture (one or two new tokens per
request: a draft fully rejected, or one accepted): a batch of one request, or of requests
that all bring one of these counts, runs its first pass as a graph in the candidates and as
the same padded body in the oracle."""

KV_CACHE_TOKEN_BUDGET = 1 << 20
"""Most KV-cache positions the harness allocates per layer on a GPU (past one full request
row): with many requests at a long ``max_model_len`` the cache holds this many, and a drawn
batch takes requests only while their block tables fit (block ids are disjoint)."""

CPU_KV_CACHE_TOKEN_BUDGET = 1 << 16
""":data:`KV_CACHE_TOKEN_BUDGET` on the CPU, where every example fills and snapshots the
whole cache on the host: at the long cell's ``max_model_len`` (about 33 000) two request
rows, so that lengths past 32767 run with few blocks in use."""


def kv_cache_token_budget(device: torch.device) -> int:
    """Most KV-cache positions per layer the harness allocates on ``device`` (past one full
    request row)."""
    return CPU_KV_CACHE_TOKEN_BUDGET if device.type == "cpu" else KV_CACHE_TOKEN_BUDGET


@dataclass
class Harness:
    """The speculators for one K: the backend under test and the fp32 reference."""

    spec: AutoregressiveSpeculator
    recorder: StepMetadataRecorder
    first_pass_recorder: StepMetadataRecorder
    """The metadata of the padded first pass (step 0), for the padding-lane check."""
    guard: StepGuard
    """The speculator's step observer: records into ``recorder`` and checks an armed run's
    eager steps (:mod:`~speccheck.checks.verify.step_guard`: on a GPU before each runs, on
    the CPU once the run raised)."""
    first_pass_guard: StepGuard
    """The same for the padded first pass (into ``first_pass_recorder``)."""
    reference: AutoregressiveSpeculator
    """The fp32 reference: the drafter on the oracle's attention
    (:mod:`~speccheck.checks.verify.oracle`), whatever the backend under test."""
    padding_rows: PaddingRowsCheck
    """Counts the attention output's padding rows ``spec``'s runs write (graphs included)."""
    capture_error: str | None
    """Why capture failed (a host sync or host copy inside the captured body), if it did."""
    tail_buffers: list[torch.Tensor] | None = None
    """The persistent buffers under the zero-tail rule, once known
    (:meth:`HarnessSet.start_state`); every example starts with them poisoned."""

    @contextlib.contextmanager
    def armed(self, run: GuardedRun) -> Iterator[None]:
        """Both guards check ``run``'s eager steps within the block."""
        with self.guard.arm(run), self.first_pass_guard.arm(run):
            yield

    def discard_run(self, lanes: int, query_len: int | None) -> None:
        """End a run stopped mid-way: what it recorded over ``lanes`` decode lanes (and
        ``lanes * query_len`` first-pass tokens) is dropped, not reported by the next
        run's collect."""
        self.recorder.collect(lanes)
        if query_len is not None:
            self.first_pass_recorder.collect(lanes * query_len)


class HarnessSet:
    """The harnesses of one run of ``settings.backend`` under ``settings.config`` on
    ``device`` (one per K, built on first use), and what they share: the guarded allocator
    of the persistent buffers, one KV cache for the speculators of every K and one for their
    fp32 references (examples run one at a time and each starts from its own noise, and at
    serving scale a cache is gigabytes per layer).

    With ``dcp`` the speculator under test is one rank of a DCP group and holds the rank's
    share of the KV cache; the fp32 reference holds the whole cache.
    """

    def __init__(
        self, settings: VerifySettings, device: torch.device, dcp: DcpRank | None = None
    ) -> None:
        self.settings = settings
        self.device = device
        self.config = settings.config
        self.dcp = dcp
        self.guards = GuardedAllocator()
        self.capture_seconds = 0.0
        """Time spent capturing graphs so far."""
        self._harness: dict[int, Harness] = {}
        self._kv_cache: PagedKVCache | None = None
        self._reference_kv_cache: PagedKVCache | None = None

    def drafter(self, dtype: str) -> DrafterConfig:
        """The drafter of this run in ``dtype``: its layers are of the kind the backend under
        test reads (the run's ``kv_layout`` where it gives one, else GQA for an ``NHD`` cache or
        an entry that states no layout, MLA for a ``latent`` one), and the fp32 reference
        speculator gets the same kind."""
        entry = self.settings.matrices.matrix.backend(self.settings.backend)
        layout = self.settings.kv_layout or entry.constraints.kv_layout
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
        full row; :func:`kv_cache_token_budget`) plus the sink block."""
        bs = self.config.block_size
        max_blocks = blocks_for(self.config.max_model_len, bs)
        most = max(self.settings.capture_sizes)
        live = min(most * max_blocks, max(max_blocks, kv_cache_token_budget(self.device) // bs))
        return SpeculatorOptions(
            capture_sizes=self.settings.capture_sizes,
            max_num_prefill_tokens=most * self.settings.max_new_tokens,
            num_blocks=live + 1,
            pad_to_capture_sizes=True,
            first_pass_query_lens=FIRST_PASS_QUERY_LENS,
        )

    def limits(self, k: int) -> BatchLimits:
        """What a batch of ``k`` draft steps may hold in these harnesses, in the batch classes
        the entry's CUDA-graph claim covers."""
        entry = self.settings.matrices.matrix.backend(self.settings.backend)
        return BatchLimits(
            max_num_reqs=max(self.settings.capture_sizes), block_size=self.config.block_size,
            max_model_len=self.config.max_model_len, num_blocks=self.options().num_blocks,
            extra_positions=k - 1, vocab_size=self.settings.vocab_size,
            max_new_tokens=self.settings.max_new_tokens,
            batch_classes=claimed_batch_classes(entry.cudagraph_support),
            capture_sizes=self.settings.capture_sizes, padded_widths=FIRST_PASS_QUERY_LENS,
        )

    def harness(self, k: int) -> Harness:
        """The harness of ``k`` draft steps, built (and its graphs captured) on first use."""
        if k not in self._harness:
            self._harness[k] = self._build(k)
        return self._harness[k]

    def _build(self, k: int) -> Harness:
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
        first_pass_recorder = StepMetadataRecorder(spec.groups)
        agree = None
        if self.dcp is not None and self.dcp.group is not None:
            agree = functools.partial(any_rank, group=self.dcp.group)
        stop = self.device.type == "cuda"
        guard = StepGuard(recorder, stop=stop, agree=agree)
        first_pass_guard = StepGuard(first_pass_recorder, stop=stop, agree=agree,
                                     first_pass=True)
        spec.step_observer = guard
        spec.first_pass_observer = first_pass_guard
        padding_rows = PaddingRowsCheck(spec)  # before capture: the graphs count too
        start = time.perf_counter()
        capture_error = None
        try:
            spec.capture()
        except RuntimeError as exc:
            capture_error = f"capturing the draft-decode graphs failed: {exc}"
        self.capture_seconds += time.perf_counter() - start
        ref_config = config.model_copy(update={
            "dtype": "float32", "cudagraph_mode": "none", "dcp_world_size": 1})
        reference = create_speculator(
            "autoregressive", ["reference"] * self.settings.num_layers, ref_config,
            self.reference_drafter(), self.device, self.options(),
            matrix=self.settings.matrices.shipped,
            builder_overrides={"reference": OracleMetadataBuilder},
            kv_cache=self._reference_kv_cache,
        )
        assert isinstance(reference, AutoregressiveSpeculator)
        self._reference_kv_cache = reference.kv_cache
        return Harness(spec, recorder, first_pass_recorder, guard, first_pass_guard, reference,
                       padding_rows, capture_error)

    def start_state(self, h: Harness, example: Example) -> KVSnapshot:
        """Put ``h`` in the state ``example`` starts from, a function of the example alone:
        the builders' zero-tail buffers poisoned (:meth:`_tail_buffers`), every guard band
        rearmed (a band an earlier example overwrote is not this example's finding), and the
        KV cache filled with noise seeded by the example, and the interpreter's program
        order restarted (:func:`~speccheck.checks.triton_interpreter.restart_program_order`).
        Returns the KV snapshot."""
        restart_program_order()
        if h.tail_buffers is None:
            h.tail_buffers = self._tail_buffers(h, example[0])
        for buffer in h.tail_buffers:
            poison_(buffer)
        self.guards.rearm()
        h.spec.kv_cache.fill_random_(example_digest(example))
        return h.spec.kv_cache.snapshot()

    def _tail_buffers(self, h: Harness, k: int) -> list[torch.Tensor]:
        """The persistent buffers under the zero-tail rule
        (:func:`~speccheck.checks.verify.zero_tails.zero_tail_buffers`), found once per K
        from the metadata of a warm-up run of one minimal request
        (``persistent_buffer_extents`` needs metadata): its last decode step's, or for
        K = 1, where no decode step runs, its padded first pass's, so that the K = 1
        harness starts each example from poisoned buffers too.

        Every example poisons them whole (:func:`~speccheck.checks.probes.poison_`): a
        build claims the rows its metadata uses, and a correct builder zeroes the rest, so
        it passes; a builder that leaves a tail stale fails on the first example it runs,
        in a long run and in a fresh worker alike, instead of only after an earlier,
        larger batch left something there."""
        bs, mml = self.config.block_size, self.config.max_model_len
        blocks = min(k - 1, mml - 1) // bs + 1
        warm_up = DraftBatch((0,), ((0,),), (tuple(range(1, blocks + 1)),), (0,))
        h.spec.propose(warm_up, DecodePath.PER_STEP, use_graphs=False)
        metadata = h.recorder.last_metadata or h.first_pass_recorder.last_metadata
        if metadata is None:
            return []
        return zero_tail_buffers(h.spec.groups, metadata)
