"""The DFlash drafter verified on real ranks: data-parallel ranks (seed 004), or the ranks of
a DCP group.

:func:`verify_dp` spawns ``dp_size`` ranks (:func:`~speccheck.speculator.dp_launch.run_ranks`)
joined by the collectives :func:`~speccheck.speculator.collectives.rank_collectives` picks:
with a GPU per rank, gloo for CPU tensors and NCCL for CUDA tensors, each rank on
``cuda:<rank>``; otherwise gloo, the ranks sharing the device. Every rank builds the same
drafter (same weight seed) on its device, and for each graph mode and each round of
batches (a different real batch size on each rank):

1. fills its KV cache with the same deterministic values and drafts its batch alone, eagerly,
   with no padding (the single-rank run);
2. agrees with the other ranks (:func:`~speccheck.speculator.dp_sync.sync_dp_padding`: one
   CPU all-reduce) and pads its model input to the agreed token count;
3. drafts the same batch again from the same KV state under the agreed descriptor.

Three checks per rank, mode and round:

- ``dp_token_count``: the attention metadata of the padded pass covers what
  :func:`~speccheck.contract.token_count.attention_token_count` says: FULL, the padded
  count; eager, the real ``query_start_loc[-1]``. An eager drafter that hands attention the
  padded count fails it on every rank that padded (and crashes FlashInfer);
- ``dp_matches_single_rank``: the padded pass drafts the tokens of the single-rank run
  (a difference at a near-tie of the single-rank logits is indeterminate);
- ``dp_vs_fp32_reference``: the single-rank run agrees with the same drafter in fp32 over
  the oracle's attention (:mod:`~speccheck.checks.verify.oracle`, which shares no code with
  ``backends/``), run eagerly from the same KV state: the block's non-causal attention is
  checked against an independent definition, not only against itself padded.

The eager mode (``"none"``) runs anywhere; ``"full"`` needs CUDA (with one GPU every rank
shares ``cuda:0``). The result names the collectives and every rank's device.

:func:`verify_dcp_blocks` runs the same drafter on the ``N`` ranks of a real DCP group
(:class:`RankSplit.DCP`): every rank drafts the same batch, holding its interleaved share
of the KV cache (:mod:`~speccheck.checks.verify.kv_share`), attends each block
non-causally over that share and merges its partial attention with the other ranks'. No
causal bound clips a rank's share there, as it does in every autoregressive step, so a
local length or mask that covers one position too many changes the drafts only here. Per
rank, mode and round, ``dcp_blocks_vs_fp32_reference``: the rank's drafts agree with the
fp32 DFlash drafter over the oracle's attention, run by the rank as one process holding
the whole cache that the ranks hold together
(:func:`~speccheck.checks.verify.kv_share.whole_cache_start`); and ``padding_rows``. The
graph mode ``"full"`` needs a GPU per rank (a group that runs NCCL for CUDA tensors, whose
all-gather a graph captures); ranks sharing one GPU run eagerly, and the result says why.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from hypothesis import strategies as st

from speccheck.backends.availability import BackendUnavailable
from speccheck.checks.triton_interpreter import patch_interpreter
from speccheck.checks.verify.comparisons import compare_drafts
from speccheck.checks.verify.context import MatrixContext
from speccheck.checks.verify.engine import FP32_REFERENCE_TOLERANCE_FACTOR, TOLERANCE
from speccheck.checks.verify.examples import example_json
from speccheck.checks.verify.kv_share import KVSnapshot, whole_cache_start
from speccheck.checks.verify.oracle.builder import OracleMetadataBuilder
from speccheck.checks.verify.one_line import exception_line
from speccheck.checks.verify.padding_rows import PaddingRowsCheck
from speccheck.checks.verify.report import BackendReport, Failure
from speccheck.checks.verify.strategies import BatchLimits, draft_batches, draw_values
from speccheck.checks.verify.vocabulary import Check, Result, Status, Tier
from speccheck.contract.builder import AttentionMetadataBuilder, blocks_for
from speccheck.contract.constraints import causality_failures
from speccheck.contract.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from speccheck.contract.dcp import DcpRank
from speccheck.contract.matrix_model import KvLayout, Matrix
from speccheck.contract.resolution import graph_capture_shortfall, resolve_backend
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.contract.token_count import attention_token_count, uniform_query_start_loc
from speccheck.speculator.attention_setup import device_name, machine_platform, unrunnable_reason
from speccheck.speculator.base import SpeculatorOptions
from speccheck.speculator.batch import DraftBatch, DraftResult
from speccheck.speculator.collectives import Collectives, rank_collectives
from speccheck.speculator.dflash import DFlashSpeculator
from speccheck.speculator.dp_launch import RankFailed, rank_device, run_ranks
from speccheck.speculator.dp_sync import agreed_descriptor, sync_dp_padding
from speccheck.speculator.drafter_kind import DrafterKind
from speccheck.speculator.factory import create_speculator
from speccheck.speculator.model import DrafterConfig

logger = logging.getLogger(__name__)

CHECK_TOKEN_COUNT = Check.DP_TOKEN_COUNT
CHECK_MATCHES_SINGLE_RANK = Check.DP_MATCHES_SINGLE_RANK
CHECK_VS_FP32_REFERENCE = Check.DP_VS_FP32_REFERENCE
CHECK_DCP_VS_FP32_REFERENCE = Check.DCP_BLOCKS_VS_FP32_REFERENCE
DP_MODES = ("none", "full")
"""Graph modes :func:`verify_dp` can test; ``full`` only where CUDA is available."""
SHARED_GPU_DCP = ("the DCP ranks share one GPU over gloo, whose all-gather a CUDA graph "
                  "cannot capture (a machine with a GPU per rank runs it)")
"""Why :func:`verify_dcp_blocks` does not run ``full`` on ranks sharing a GPU."""


class RankSplit(enum.StrEnum):
    """How the ranks of a run share the work; the value is the runtime field that counts
    them."""

    DATA = "dp_size"
    """Each rank its own batch, its input padded to the count the ranks agree on."""
    DCP = "dcp_world_size"
    """Every rank the same batch, each holding its interleaved share of the KV cache."""

T = TypeVar("T")


@dataclass(frozen=True)
class DPOutcome:
    """One check on one rank, in one graph mode, for one round of batches."""

    rank: int
    mode: str
    round: int
    check: Check
    """:data:`CHECK_TOKEN_COUNT`, :data:`CHECK_MATCHES_SINGLE_RANK`,
    :data:`CHECK_VS_FP32_REFERENCE` or ``padding_rows`` (of the padded run); under DCP,
    :data:`CHECK_DCP_VS_FP32_REFERENCE` or ``padding_rows``."""
    result: Result
    """Passed, failed or indeterminate."""
    diagnosis: str = ""
    """One line; empty when passed."""


@dataclass
class DPVerifyResult:
    """Everything :func:`verify_dp` or :func:`verify_dcp_blocks` found.
    ``batches_per_rank[r][i]`` is rank ``r``'s batch in round ``i`` (under DCP the same on
    every rank); ``skipped_modes`` maps a mode that could not run to why; ``skipped`` is set
    when the backend could not run at all."""

    backend: str
    ranks: int
    """``dp_size``, or under DCP ``dcp_world_size``."""
    config: RuntimeConfig
    gpu: bool
    """Whether the ranks ran on CUDA."""
    device: str
    """The device's name, as reports show it."""
    collectives: Collectives
    """The ranks' process group: gloo, or gloo for CPU and NCCL for CUDA tensors."""
    devices: tuple[str, ...]
    """Rank ``r``'s device, ``devices[r]`` (``"cuda:1"``)."""
    modes: tuple[str, ...]
    batches_per_rank: list[list[DraftBatch]]
    outcomes: list[DPOutcome] = field(default_factory=list)
    skipped_modes: dict[str, str] = field(default_factory=dict)
    skipped: str | None = None
    seconds: float = 0.0
    fused_allowed: bool = False
    """The matrix's verdict for the backend under ``config``."""
    fused_reason: str = ""
    split: RankSplit = RankSplit.DATA

    @property
    def label(self) -> str:
        """The runs' candidate prefix: ``dp2``, ``dcp2``."""
        return f"{'dp' if self.split is RankSplit.DATA else 'dcp'}{self.ranks}"

    @property
    def passed(self) -> bool:
        """Something ran and nothing failed."""
        return self.skipped is None and bool(self.outcomes) and not self.failures()

    def failures(self) -> list[DPOutcome]:
        return [o for o in self.outcomes if o.result is Result.FAILED]

    def select(
        self, *, rank: int | None = None, mode: str | None = None, check: Check | None = None
    ) -> list[DPOutcome]:
        """The outcomes matching every filter given."""
        return [
            o for o in self.outcomes
            if (rank is None or o.rank == rank) and (mode is None or o.mode == mode)
            and (check is None or o.check == check)
        ]

    def to_report(self) -> BackendReport:
        """The result as a :class:`BackendReport` (tier ``gpu`` when the ranks ran on CUDA),
        whose ``data_parallel`` names the collectives and the ranks' devices when
        data-parallel ranks ran (under DCP its ``detail`` does), with one tally per check
        and one :class:`Failure` per failed check and mode, whose diagnosis is its first
        failure's (rank, mode and round) followed by every rank's failing rounds;
        ``minimal_example`` holds the first failing round's batches, one per rank."""
        rounds = len(self.batches_per_rank[0]) if self.batches_per_rank else 0
        report = BackendReport(
            self.backend, Tier.GPU if self.gpu else Tier.CPU, Status.PASSED, device=self.device,
            runtime_config=self.config.model_dump(), seconds=self.seconds,
            examples=rounds, examples_asked=rounds,
            candidates=[f"{self.label}_{mode}" for mode in self.modes],
        )
        report.fused_allowed, report.fused_reason = self.fused_allowed, self.fused_reason
        notes = [f"{mode}: not run ({why})" for mode, why in self.skipped_modes.items()]
        if self.skipped is not None or not self.modes:
            report.status = Status.SKIPPED
            report.detail = "; ".join([self.skipped] if self.skipped else notes)
            return report
        if self.split is RankSplit.DATA:
            report.data_parallel = {"dp_size": self.ranks,
                                    "collectives": self.collectives.backend,
                                    "devices": list(self.devices)}
        else:
            notes.insert(0, f"the DFlash drafter (blocks of 1 + K tokens, attended "
                            f"non-causally) on {self.ranks} real DCP ranks over "
                            f"{self.collectives.backend} on {', '.join(self.devices)}, each "
                            "holding its interleaved share of the KV cache")
        report.detail = "; ".join(notes)
        report.tally(self.outcomes)
        failed = self.failures()
        if failed:
            report.status = Status.FAILED
            report.failures = [
                Failure(group[0].check, _grouped_diagnosis(group),
                        candidate=f"{self.label}_{group[0].mode}")
                for group in _by_check_and_mode(failed)
            ]
            first = failed[0]
            k = self.config.num_speculative_steps
            report.minimal_example = {
                self.split.value: self.ranks, "mode": first.mode, "round": first.round,
                "batches_per_rank": [example_json((k, rank[first.round]))
                                     for rank in self.batches_per_rank],
            }
        return report


def _by_check_and_mode(failed: list[DPOutcome]) -> list[list[DPOutcome]]:
    """``failed`` grouped by check and mode, in the order each group first fails."""
    groups: dict[tuple[Check, str], list[DPOutcome]] = {}
    for outcome in failed:
        groups.setdefault((outcome.check, outcome.mode), []).append(outcome)
    return list(groups.values())


def _grouped_diagnosis(group: list[DPOutcome]) -> str:
    """One line for the failures of one check in one mode: the first's rank, mode, round and
    diagnosis, then, where more failed, every rank's failing rounds as runs
    (``rank 1: rounds 0-3, 7``)."""
    first = group[0]
    line = f"rank {first.rank}, mode {first.mode}, round {first.round}: {first.diagnosis}"
    if len(group) == 1:
        return line
    rounds: dict[int, list[int]] = {}
    for outcome in group:
        rounds.setdefault(outcome.rank, []).append(outcome.round)
    where = "; ".join(f"rank {rank}: rounds {_runs_of(sorted(set(r)))}"
                      for rank, r in sorted(rounds.items()))
    return f"{line} ({len(group)} failures in this mode: {where})"


def _runs_of(values: list[int]) -> str:
    """Sorted distinct integers as runs: ``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    runs: list[list[int]] = []
    for value in values:
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@dataclass(frozen=True)
class _RankPlan:
    """What every rank runs (picklable: it travels to the rank processes)."""

    backend: str
    config: RuntimeConfig
    modes: tuple[str, ...]
    batches_per_rank: list[list[DraftBatch]]
    drafter: DrafterConfig
    options: SpeculatorOptions
    speculator_cls: type[DFlashSpeculator]
    seed: int
    matrix: Matrix
    shipped: Matrix
    """speccheck's own matrix: the fp32 reference's layers are its ``reference`` entry with
    the oracle's builder."""
    collectives: Collectives
    split: RankSplit
    builder_overrides: tuple[tuple[str, type[AttentionMetadataBuilder[Any]]], ...] = ()


def default_drafter(
    config: RuntimeConfig, seed: int = 0, kv_layout: KvLayout = KvLayout.NHD
) -> DrafterConfig:
    """The drafter :func:`verify_dp` builds unless given one: the config's head layout and
    dtype, layers of ``kv_layout``, 2 layers, vocabulary 256, weights from ``seed``."""
    return DrafterConfig.for_runtime(config, seed=seed, kv_layout=kv_layout)


def default_options(config: RuntimeConfig) -> SpeculatorOptions:
    """Buckets 1, 2, 4, 8 and a KV cache that holds 8 requests at ``max_model_len``."""
    max_blocks = blocks_for(config.max_model_len, config.block_size)
    return SpeculatorOptions(capture_sizes=(1, 2, 4, 8), max_num_prefill_tokens=32,
                             num_blocks=8 * max_blocks + 1)


def dflash_batch_limits(config: RuntimeConfig, options: SpeculatorOptions, vocab_size: int) -> BatchLimits:
    """Bounds of the batches a DFlash drafter built with ``config`` and ``options`` serves
    (a block of ``1 + K`` positions fits before ``max_model_len``)."""
    return BatchLimits(
        max_num_reqs=options.max_num_reqs, block_size=config.block_size,
        max_model_len=config.max_model_len, num_blocks=options.num_blocks,
        extra_positions=config.num_speculative_steps, vocab_size=vocab_size, room_for_block=True,
    )


def draw_dp_rounds(limits: BatchLimits, dp_size: int, rounds: int, seed_value: int) -> list[list[DraftBatch]]:
    """``rounds`` hypothesis-drawn rounds, as ``[rank][round]``: in each round every rank gets
    an independent batch, and (for ``dp_size > 1``) not every rank has the same request
    count, so some rank pads. Deterministic in ``seed_value``."""
    strategy = st.lists(draft_batches(limits), min_size=dp_size, max_size=dp_size).map(tuple)
    if dp_size > 1:
        strategy = strategy.filter(lambda batches: len({b.num_reqs for b in batches}) > 1)

    drawn = draw_values(strategy, rounds, seed_value)
    return [[batches[rank] for batches in drawn] for rank in range(dp_size)]


def verify_dp(
    backend: str,
    config: RuntimeConfig,
    dp_size: int,
    batches_per_rank: Sequence[Sequence[DraftBatch]] | None = None,
    modes: Sequence[str] | None = None,
    *,
    matrices: MatrixContext,
    examples: int = 8,
    seed: int = 0,
    drafter: DrafterConfig | None = None,
    options: SpeculatorOptions | None = None,
    speculator_cls: type[DFlashSpeculator] = DFlashSpeculator,
    builder_overrides: tuple[tuple[str, type[AttentionMetadataBuilder[Any]]], ...] = (),
    kv_layout: KvLayout | None = None,
    timeout_s: float = 300.0,
) -> DPVerifyResult:
    """Verify ``backend``'s DFlash drafting under data parallelism on ``dp_size`` ranks, over
    the collectives :func:`~speccheck.speculator.collectives.rank_collectives` picks (decided
    here, once, and recorded in the result with every rank's device).

    ``batches_per_rank[r][i]`` is rank ``r``'s batch in round ``i`` (every rank needs the
    same number of rounds); ``None`` draws ``examples`` rounds with hypothesis from ``seed``
    (:func:`draw_dp_rounds`). ``modes`` are graph modes from :data:`DP_MODES` (``None``:
    all of them); ``"full"`` on a machine without CUDA is recorded in ``skipped_modes``,
    not run. ``matrices.matrix`` declares ``backend``. ``config``'s ``cudagraph_mode`` (per
    mode) and ``dp_size`` are replaced; its ``num_speculative_steps`` is K (blocks of 1 + K
    tokens).

    ``drafter``/``options`` default to :func:`default_drafter` (its layers of ``kv_layout``,
    else of the layout the entry reads, else ``NHD``)/:func:`default_options`
    (request padding to capture sizes is always off: eager ranks pad only to the agreed
    count). ``speculator_cls`` swaps the drafter class (tests plant the seed-004 bug with
    it) and ``builder_overrides`` a backend's builder class (``(name, class)`` pairs); like
    every argument they are pickled to the ranks, so they must be importable there.
    ``timeout_s`` bounds the whole multi-process run.

    A backend without an adapter, for another platform, whose kernel package is missing, or
    that serves causal attention only (``constraints.causal_only``) is reported as skipped.
    Raises :class:`~speccheck.speculator.dp_launch.RankFailed` or
    :class:`~speccheck.speculator.dp_launch.RanksTimedOut` when a rank crashes or hangs
    (an exception inside a propose call is a failed check instead).
    """
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size} must be >= 1")
    return _verify_on_ranks(
        backend, config.model_copy(update={"dp_size": dp_size}), RankSplit.DATA, dp_size,
        batches_per_rank, modes, matrices=matrices, examples=examples, seed=seed,
        drafter=drafter, options=options, speculator_cls=speculator_cls,
        builder_overrides=builder_overrides, kv_layout=kv_layout, timeout_s=timeout_s)


def verify_dcp_blocks(
    backend: str,
    config: RuntimeConfig,
    rounds: Sequence[DraftBatch] | None = None,
    modes: Sequence[str] | None = None,
    *,
    matrices: MatrixContext,
    examples: int = 8,
    seed: int = 0,
    drafter: DrafterConfig | None = None,
    options: SpeculatorOptions | None = None,
    builder_overrides: tuple[tuple[str, type[AttentionMetadataBuilder[Any]]], ...] = (),
    kv_layout: KvLayout | None = None,
    timeout_s: float = 300.0,
) -> DPVerifyResult:
    """Verify ``backend``'s DFlash drafting on the ``config.dcp_world_size`` ranks of a real
    DCP group (at least 2; the backend's builders must hold a DCP share), every rank
    drafting each batch of ``rounds`` (``None``: ``examples`` batches drawn with hypothesis
    from ``seed``) from the same KV noise, against the fp32 drafter over the whole cache
    they hold together (the module's docstring). ``modes`` as :func:`verify_dp`'s, where
    ``"full"`` also needs a GPU per rank (:data:`SHARED_GPU_DCP`); the other arguments as
    :func:`verify_dp`'s."""
    world = config.dcp_world_size
    if world < 2:
        raise ValueError(f"verify_dcp_blocks runs 2 or more DCP ranks, got dcp_world_size={world}")
    if config.dp_size != 1:
        raise ValueError(f"DCP ranks run without data parallelism, got dp_size={config.dp_size}")
    batches = None if rounds is None else [list(rounds)] * world
    return _verify_on_ranks(
        backend, config, RankSplit.DCP, world, batches, modes, matrices=matrices,
        examples=examples, seed=seed, drafter=drafter, options=options,
        speculator_cls=DFlashSpeculator, builder_overrides=builder_overrides,
        kv_layout=kv_layout, timeout_s=timeout_s)


def _verify_on_ranks(
    backend: str,
    config: RuntimeConfig,
    split: RankSplit,
    ranks: int,
    batches_per_rank: Sequence[Sequence[DraftBatch]] | None,
    modes: Sequence[str] | None,
    *,
    matrices: MatrixContext,
    examples: int,
    seed: int,
    drafter: DrafterConfig | None,
    options: SpeculatorOptions | None,
    speculator_cls: type[DFlashSpeculator],
    builder_overrides: tuple[tuple[str, type[AttentionMetadataBuilder[Any]]], ...],
    kv_layout: KvLayout | None,
    timeout_s: float,
) -> DPVerifyResult:
    """:func:`verify_dp` and :func:`verify_dcp_blocks`: ``ranks`` processes splitting the
    work as ``split`` says, at ``config`` (its ``dp_size`` or ``dcp_world_size`` set)."""
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    wanted = DP_MODES if modes is None else tuple(modes)
    unknown = sorted(set(wanted) - set(DP_MODES))
    if unknown:
        raise ValueError(f"unknown DP verification mode(s) {unknown}; valid: {', '.join(DP_MODES)}")
    entry = matrices.matrix.backend(backend)
    drafter = drafter or default_drafter(
        config, seed, kv_layout or entry.constraints.kv_layout or KvLayout.NHD)
    options = replace(options or default_options(config), pad_to_capture_sizes=False)
    if batches_per_rank is None:
        limits = dflash_batch_limits(config, options, drafter.vocab_size)
        if split is RankSplit.DATA:
            batches = draw_dp_rounds(limits, ranks, examples, seed)
        else:
            batches = [draw_values(draft_batches(limits), examples, seed)] * ranks
    else:
        batches = [list(rank) for rank in batches_per_rank]
    if len(batches) != ranks or len({len(rank) for rank in batches}) != 1:
        raise ValueError(
            f"batches_per_rank must hold one equally long list per rank ({ranks}), got lengths "
            f"{[len(rank) for rank in batches]}"
        )
    collectives = rank_collectives(ranks)
    skipped_modes = {m: "needs a CUDA device" for m in wanted if m == "full" and not cuda}
    shortfall = graph_capture_shortfall(
        {backend: entry.cudagraph_support}, config.num_speculative_steps + 1
    )
    if "full" in wanted and cuda and shortfall is not None:
        skipped_modes["full"] = shortfall
    if ("full" in wanted and cuda and split is RankSplit.DCP
            and not collectives.one_gpu_per_rank):
        skipped_modes.setdefault("full", SHARED_GPU_DCP)
    runnable = tuple(m for m in wanted if m not in skipped_modes)
    device = device_name(rank_device(0))
    devices = tuple(str(rank_device(rank)) for rank in range(ranks))
    result = DPVerifyResult(
        backend, ranks, config, cuda, device, collectives, devices, runnable, batches,
        skipped_modes=skipped_modes, split=split,
    )
    resolution = resolve_backend(entry, result.config)
    result.fused_allowed, result.fused_reason = resolution.fused_multi_step, resolution.reason
    result.skipped = unrunnable_reason(backend, machine_platform(), matrices.matrix)
    refused = causality_failures(entry, speculator_cls.attends_non_causally)
    if result.skipped is None and refused:
        result.skipped = f"{backend} cannot serve the DFlash drafter: {refused[0]}"
    if result.skipped is None and runnable:
        plan = _RankPlan(backend, result.config, runnable, batches, drafter, options,
                         speculator_cls, seed, matrices.matrix, matrices.shipped, collectives,
                         split, builder_overrides)
        try:
            per_rank = run_ranks(_verify_rank, ranks, (plan,), timeout_s=timeout_s,
                                 collectives=collectives)
        except RankFailed as exc:
            if exc.exc_type != BackendUnavailable.__name__:
                raise
            result.skipped = exc.message
        else:
            result.outcomes = [o for outcomes in per_rank for o in outcomes]
    result.seconds = time.perf_counter() - started
    logger.info("DFlash on %s (%s on %s) modes=%s: %d outcomes, %d failed", result.label,
                collectives.backend, ", ".join(devices), runnable, len(result.outcomes),
                len(result.failures()))
    return result


def _build(
    plan: _RankPlan, config: RuntimeConfig, device: torch.device, dcp: DcpRank | None
) -> DFlashSpeculator:
    """The drafter of one rank: the matrix's builder (or the plan's override) for every
    layer, the plan's class, holding the share of DCP rank ``dcp`` where given."""
    spec = create_speculator(
        DrafterKind.DFLASH, [plan.backend] * plan.drafter.num_layers, config, plan.drafter,
        device, plan.options, matrix=plan.matrix, speculator_cls=plan.speculator_cls,
        builder_overrides=dict(plan.builder_overrides), dcp=dcp,
    )
    assert isinstance(spec, DFlashSpeculator)
    return spec


def _build_reference(plan: _RankPlan, device: torch.device) -> DFlashSpeculator:
    """The fp32 reference of one rank: the plan's drafter in fp32 on the tensor-op form of
    every layer and of sampling, eager, its attention the oracle's
    (:class:`~speccheck.checks.verify.oracle.builder.OracleMetadataBuilder`), the plain
    DFlash drafter whatever the plan's class, one process holding the whole cache (no
    DCP)."""
    config = plan.config.model_copy(update={"dtype": "float32", "cudagraph_mode": "none",
                                            "dcp_world_size": 1})
    drafter = replace(plan.drafter, dtype="float32", kernels=False)
    spec = create_speculator(
        DrafterKind.DFLASH, ["reference"] * drafter.num_layers, config, drafter, device,
        plan.options,
        matrix=plan.shipped, builder_overrides={"reference": OracleMetadataBuilder},
    )
    assert isinstance(spec, DFlashSpeculator)
    return spec


def _verify_rank(rank: int, ranks: int, plan: _RankPlan) -> list[DPOutcome]:
    """One rank's share of :func:`verify_dp` or :func:`verify_dcp_blocks` (runs in a rank
    process, in the default process group :func:`run_ranks` initialised, which under DCP is
    the DCP group). Under one GPU per rank, ``rank_device(rank)`` is the device
    :func:`run_ranks` made current; the rank refuses to run elsewhere."""
    patch_interpreter()
    device = rank_device(rank)
    if plan.collectives.one_gpu_per_rank and torch.cuda.current_device() != device.index:
        raise RuntimeError(f"rank {rank} runs on {device}, but "
                           f"cuda:{torch.cuda.current_device()} is its current device")
    dcp = None
    if plan.split is RankSplit.DCP:
        group = dist.group.WORLD
        assert group is not None
        dcp = DcpRank(rank, ranks, group)
    outcomes: list[DPOutcome] = []
    reference = _build_reference(plan, device)
    # The fp32 reference's drafts of each round: the same in every mode.
    expected: dict[int, DraftResult] = {}
    for mode in plan.modes:
        config = plan.config.model_copy(update={"cudagraph_mode": mode})
        spec = _build(plan, config, device, dcp)
        padding_rows = PaddingRowsCheck(spec)  # before capture: the graphs count too
        spec.capture()
        tol = TOLERANCE[config.dtype]
        for index, batch in enumerate(plan.batches_per_rank[rank]):
            # The round's KV noise, the same on every rank and in every mode.
            spec.kv_cache.fill_random_(plan.seed * 1_000_003 + index)
            start = spec.kv_cache.snapshot()
            if index not in expected:
                whole = whole_cache_start(start, batch, config.block_size, ranks) if dcp else start
                expected[index] = _reference_drafts(reference, batch, whole)
            if dcp is None:
                outcomes += _verify_round(spec, padding_rows, batch, rank, ranks, mode,
                                          index, start, tol, expected[index])
            else:
                outcomes += _verify_dcp_round(spec, padding_rows, batch, rank, mode, index,
                                              tol, expected[index])
    return outcomes


def _verify_dcp_round(
    spec: DFlashSpeculator, padding_rows: PaddingRowsCheck, batch: DraftBatch, rank: int,
    mode: str, index: int, tol: float, fp32_drafts: DraftResult,
) -> list[DPOutcome]:
    """One DCP rank's run of ``batch`` under its own descriptor (its cache holding its share
    of the round's start; eager and unpadded, or in ``full`` replayed at its bucket): its
    drafts against ``fp32_drafts``, the fp32 reference's over the whole cache, and
    ``padding_rows``."""
    padding_rows.reset()
    drafts, error = _attempt(spec.propose, batch)

    def outcome(check: Check, result: Result, diagnosis: str = "") -> DPOutcome:
        return DPOutcome(rank, mode, index, check, result, diagnosis)

    if drafts is None:
        return [outcome(CHECK_DCP_VS_FP32_REFERENCE, Result.FAILED,
                        f"the DCP rank's run raised {error}")]
    versus = outcome(CHECK_DCP_VS_FP32_REFERENCE, *_versus_reference(
        fp32_drafts, drafts, FP32_REFERENCE_TOLERANCE_FACTOR * tol,
        f"DCP rank {rank}'s run vs fp32 reference over the whole cache",
        CHECK_DCP_VS_FP32_REFERENCE))
    rows = [outcome(o.check, o.result, o.diagnosis) for o in padding_rows.outcomes("DCP run")]
    return [versus, *rows]


def _reference_drafts(
    reference: DFlashSpeculator, batch: DraftBatch, start: KVSnapshot
) -> DraftResult:
    """``reference``'s eager drafts of ``batch`` from the KV state ``start`` (the
    candidate's, in its dtype: converted, so both read the same values)."""
    reference.kv_cache.restore(start)
    r, q = batch.num_reqs, reference.query_per_req
    return reference.propose(batch, BatchExecutionDescriptor(CUDAGraphMode.NONE, r * q, None, q))


def _verify_round(
    spec: DFlashSpeculator, padding_rows: PaddingRowsCheck, batch: DraftBatch, dp_rank: int,
    dp_size: int, mode: str, index: int, start: KVSnapshot, tol: float,
    fp32_drafts: DraftResult,
) -> list[DPOutcome]:
    """From the KV state ``start`` (``spec``'s cache holds it): the single-rank run, the
    DP agreement (one collective, on every rank whatever happened before), the padded run,
    and the three checks (``fp32_drafts``: the fp32 reference's drafts of the round), and
    ``padding_rows`` of the padded run where it completed."""
    r, q = batch.num_reqs, spec.query_per_req
    alone, alone_error = _attempt(
        spec.propose, batch, BatchExecutionDescriptor(CUDAGraphMode.NONE, r * q, None, q)
    )
    spec.kv_cache.restore(start)
    state = sync_dp_padding(spec.block_descriptor(r), r, dp_rank, dp_size)
    desc = agreed_descriptor(state, r, q)
    spec.last_common_metadata = None
    padding_rows.reset()
    padded, padded_error = _attempt(spec.propose, batch, desc)

    def outcome(check: Check, result: Result, diagnosis: str = "") -> DPOutcome:
        return DPOutcome(dp_rank, mode, index, check, result, diagnosis)

    real = int(uniform_query_start_loc(r, q)[-1])
    expected = attention_token_count(desc, uniform_query_start_loc(r, q))
    md = spec.last_common_metadata
    if md is None:
        count = outcome(CHECK_TOKEN_COUNT, Result.FAILED,
                        f"no attention metadata was built for the padded pass ({padded_error})")
    elif md.num_actual_tokens != expected:
        rule = "FULL: the padded count" if desc.cg_mode == CUDAGraphMode.FULL else (
            f"{desc.cg_mode.name}: the real query_start_loc[-1]")
        count = outcome(CHECK_TOKEN_COUNT, Result.FAILED,
                        f"attention covers {md.num_actual_tokens} tokens but the rule says {expected} "
                        f"({rule}); the input is padded to {desc.num_tokens}, real tokens {real}")
    else:
        count = outcome(CHECK_TOKEN_COUNT, Result.PASSED)

    if alone_error is not None:
        match = outcome(CHECK_MATCHES_SINGLE_RANK, Result.FAILED, f"the single-rank run raised {alone_error}")
    elif padded_error is not None:
        match = outcome(CHECK_MATCHES_SINGLE_RANK, Result.FAILED,
                        f"the run padded to {desc.num_tokens} tokens ({desc.cg_mode.name}) raised "
                        f"{padded_error}")
    else:
        assert alone is not None and padded is not None
        result, diagnosis = _compare_drafts(alone, padded, tol)
        match = outcome(CHECK_MATCHES_SINGLE_RANK, result, diagnosis)
    if alone is None:
        versus = outcome(CHECK_VS_FP32_REFERENCE, Result.FAILED,
                         f"the single-rank run raised {alone_error}")
    else:
        versus = outcome(CHECK_VS_FP32_REFERENCE, *_versus_reference(
            fp32_drafts, alone, FP32_REFERENCE_TOLERANCE_FACTOR * tol,
            "single-rank run vs fp32 reference", CHECK_VS_FP32_REFERENCE))
    rows = [] if padded_error is not None else [
        outcome(o.check, o.result, o.diagnosis) for o in padding_rows.outcomes("padded run")]
    return [count, match, versus, *rows]


def _versus_reference(
    expected: DraftResult, drafts: DraftResult, tol: float, what: str, check: Check
) -> tuple[Result, str]:
    """A run's ``drafts`` against the fp32 reference's
    (:func:`~speccheck.checks.verify.comparisons.compare_drafts` as ``check``, ``what``
    naming the two, ``tol`` allowing for the run's dtype): failed with the first
    divergence's words, else indeterminate where a near-tie left a token undecided, else
    passed."""
    compared = compare_drafts(expected, drafts, what, tol, token_check=check,
                              logit_check=check)
    failed = [o for o in compared if o.result is Result.FAILED]
    if failed:
        return Result.FAILED, failed[0].diagnosis
    if any(o.result is Result.INDETERMINATE for o in compared):
        return Result.INDETERMINATE, ""
    return Result.PASSED, ""


def _attempt(call: Callable[..., T], *args: Any) -> tuple[T | None, str | None]:
    """``(call(*args), None)``, or ``(None, "Type: first line of the message")``."""
    try:
        return call(*args), None
    except Exception as exc:  # a raising propose is a finding, not a crash
        logger.debug("propose raised", exc_info=True)
        return None, exception_line(exc)


def _compare_drafts(alone: DraftResult, padded: DraftResult, tol: float) -> tuple[Result, str]:
    """Exact tokens. The first difference is indeterminate when the single-rank run's top-2
    logits there are closer than ``2 * tol`` (a near-tie), else a failure."""
    differ = (alone.draft_tokens != padded.draft_tokens).nonzero()
    if differ.numel() == 0:
        return Result.PASSED, ""
    req, step = (int(v) for v in differ[0])
    top2 = alone.logits[req, step].topk(2).values
    gap = float(top2[0] - top2[1])
    diff = float((alone.logits[req, step] - padded.logits[req, step]).abs().max())
    text = (f"request {req} step {step}: draft token {int(padded.draft_tokens[req, step])} with "
            f"DP padding, {int(alone.draft_tokens[req, step])} alone (top-2 gap {gap:.3g}, "
            f"logits differ by up to {diff:.3g})")
    return (Result.INDETERMINATE if gap < 2 * tol else Result.FAILED), text
