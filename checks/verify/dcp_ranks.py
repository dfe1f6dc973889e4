"""Verification under decode context parallelism (DCP) on real ranks.

:func:`verify_dcp` verifies a backend whose builders hold a real share of the KV cache
(:func:`~speccheck.speculator.attention_setup.holds_dcp_share`: ``reference``,
``triton_attn``) at ``dcp_world_size = N > 1`` on ``N`` rank processes
(:func:`~speccheck.speculator.dp_launch.run_ranks`), each building its speculator with
``create_speculator(dcp=DcpRank(rank, N, group))`` over the run's process group.

The examples are drawn once, in the parent, with hypothesis (:func:`draw_examples`), and
every rank runs the same ones in the same order: hypothesis running in each rank could
shrink differently on different ranks and leave them waiting in different collectives.
Each rank runs, per example, exactly what the single-process verifier runs
(:meth:`~speccheck.checks.verify.engine.BackendVerifier.run_example`) with the rank's DCP
share: the eager per-step oracle, the candidates the matrix allows (fused where
``draft_decode`` is supported under the config, else the per-step fallback), step metadata,
the claims audit, capture-safety probes, and KV writes against the rank's *local* slots.
Draft tokens are also compared with an fp32 ``reference`` run by one process that holds the
whole cache, started from what the ranks hold together: it is independent of the DCP layout
and of the merge of the ranks' partial attention, so a fault shared by the oracle and the
candidates there still fails ``vs_fp32_reference``.

After each example the ranks agree (one all-reduce of a flag over the group) whether any of
them failed, and all stop at the first such example. Failures are not shrunk (a shrink is a
search of its own, which the ranks would have to run in lockstep): the report's example is
the first drawn example that failed, and its reproduce command runs it alone on ``N``
ranks again.

Graphs: a CUDA graph captures the ranks' all-gather only over a process group that runs
NCCL for CUDA tensors (:func:`~speccheck.backends.dcp.group_capturable`). Where it does not
(gloo on the CPU, or ranks that share a GPU), the ranks run with ``cudagraph_mode`` none: the
fused candidate runs the fused loop with its in-place refresh eagerly, and the report says so.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from hypothesis import strategies as st

from speccheck.backends.availability import BackendUnavailable
from speccheck.backends.dcp import group_capturable
from speccheck.checks.triton_interpreter import patch_interpreter
from speccheck.checks.verify.cells import BatchClass
from speccheck.checks.verify.engine import BackendVerifier, VerifySettings
from speccheck.checks.verify.examples import (
    Example,
    encode_example,
    example_json,
    reproduce_command,
)
from speccheck.checks.verify.rank_agreement import any_rank
from speccheck.checks.verify.report import BackendReport, Failure
from speccheck.checks.verify.search import Coverage, draw_covering
from speccheck.checks.verify.strategies import draft_batches, of_shape
from speccheck.checks.verify.vocabulary import Result, Status, Tier
from speccheck.contract.dcp import DcpRank
from speccheck.contract.resolution import resolve_backend
from speccheck.speculator.attention_setup import device_name, machine_platform, unrunnable_reason
from speccheck.speculator.dp_launch import RankFailed, RanksTimedOut, rank_device, run_ranks

logger = logging.getLogger(__name__)

SECONDS_PER_EXAMPLE = 30.0
"""What the ranks' run may take per example, on top of one ``example_timeout``, before it
counts as hung (:func:`verify_dcp`)."""


@dataclass(frozen=True)
class DcpRankPlan:
    """What every rank runs (picklable: it travels to the rank processes)."""

    settings: VerifySettings
    examples: tuple[Example, ...]


@dataclass
class DcpRankResult:
    """One rank's share of a run: ``report`` tallies every check the rank decided on the
    examples it ran (its failures name the rank); ``failing`` is the index of the example
    at which the ranks stopped because one of them failed, else ``None``."""

    rank: int
    report: BackendReport
    failing: int | None
    graphs: bool
    """Whether the rank captured and replayed graphs."""
    group_backend: str
    """The process group's backend config (``gloo``, ``cpu:gloo,cuda:nccl``, ...)."""


@dataclass
class DcpRun:
    """How :func:`verify_dcp` ran: the process group and whether graphs were captured."""

    world: int
    per_rank: list[DcpRankResult] = field(default_factory=list)

    def note(self) -> str:
        """One line for the report: the ranks, their group, and how the fused candidate ran."""
        first = self.per_rank[0]
        ranks = f"DCP: {self.world} real ranks over a {first.group_backend} process group"
        if first.graphs:
            return f"{ranks}; the fused path replayed CUDA graphs that capture the all-gather"
        if first.report.tier is Tier.GPU:
            return (f"{ranks}; this group cannot be captured in a CUDA graph (no NCCL for CUDA "
                    "tensors), so the fused candidate ran its in-place refresh eagerly, without "
                    "graph capture")
        return f"{ranks}; the fused candidate ran its in-place refresh eagerly (CPU tier)"


def draw_examples(settings: VerifySettings) -> list[Example]:
    """``settings.examples`` examples drawn with hypothesis from ``settings.seed`` (generation
    only, no shrinking): a K from ``settings.steps`` and a batch within the harness's limits
    for it, as the single-process verifier draws them but without aiming at probed
    breakpoints (under DCP the local lengths change at every length on some rank), and
    with every claimed batch class among them (as :func:`~speccheck.checks.verify.search.
    search_all` holds back examples for those the draw missed). Deterministic in the
    seed."""
    limits = BackendVerifier(settings, torch.device("cpu")).limits
    classes = limits(settings.steps[0]).batch_classes

    def strategy(shape: BatchClass | None) -> st.SearchStrategy[Example]:
        return st.sampled_from(settings.steps).flatmap(
            lambda k: st.tuples(st.just(k), draft_batches(of_shape(limits(k), shape))))

    coverage = [Coverage(shape, limits, strategy(shape)) for shape in classes]
    return draw_covering(strategy(None), coverage, settings.examples, settings.seed)


def verify_dcp(
    settings: VerifySettings,
    world: int,
    examples: Sequence[Example] | None = None,
    *,
    example_timeout: float = 300.0,
    reproduce_prefix: str = "",
) -> BackendReport:
    """Verify ``settings.backend`` under ``settings.config`` on ``world`` DCP ranks (the
    config's ``dcp_world_size`` must be ``world``, and the backend's builder must hold a
    DCP share).

    ``examples`` (``None``: :func:`draw_examples`) run on every rank, in order, until one
    fails on some rank. The result is one :class:`BackendReport`, as a single-process run's:
    every rank's tallies summed, every rank's failures (each diagnosis starts ``DCP rank R
    of N:``), the failing example and its reproduce command (``reproduce_prefix`` plus
    ``--reproduce BLOB``), and in ``detail`` how the ranks ran. A backend that cannot run
    here is ``skipped``; a rank that dies, raises outside the checks, or does not finish
    within ``example_timeout`` plus :data:`SECONDS_PER_EXAMPLE` per example makes the
    report ``crashed``, naming the rank.
    """
    if world < 2 or settings.config.dcp_world_size != world:
        raise ValueError(f"verify_dcp runs 2 or more ranks at the config's dcp_world_size "
                         f"({settings.config.dcp_world_size}), got {world}")
    started = time.perf_counter()
    device = rank_device(0)
    tier = Tier.GPU if device.type == "cuda" else Tier.CPU
    matrix = settings.matrices.matrix
    report = BackendReport(settings.backend, tier, Status.PASSED, device=device_name(device),
                           runtime_config=settings.config.model_dump())
    resolution = resolve_backend(matrix.backend(settings.backend), settings.config)
    report.fused_allowed, report.fused_reason = resolution.fused_multi_step, resolution.reason
    skipped = unrunnable_reason(settings.backend, machine_platform(), matrix)
    if skipped is not None:
        report.status, report.tier, report.detail = Status.SKIPPED, Tier.NONE, skipped
        return report
    chosen = tuple(examples) if examples is not None else tuple(draw_examples(settings))
    timeout = example_timeout + SECONDS_PER_EXAMPLE * len(chosen)
    run = DcpRun(world)
    try:
        run.per_rank = run_ranks(_verify_rank, world, (DcpRankPlan(settings, chosen),),
                                 timeout_s=timeout)
    except RankFailed as exc:
        if exc.exc_type == BackendUnavailable.__name__:
            report.status, report.tier, report.detail = Status.SKIPPED, Tier.NONE, exc.message
        else:
            report.status, report.detail = Status.CRASHED, f"DCP {exc}"
        report.seconds = time.perf_counter() - started
        return report
    except RanksTimedOut as exc:
        report.status, report.detail = Status.CRASHED, f"DCP {exc}"
        report.seconds = time.perf_counter() - started
        return report
    _merge(report, run, chosen, reproduce_prefix)
    report.seconds = time.perf_counter() - started
    logger.info("verify_dcp %s dcp=%d: %d examples, status %s", settings.backend, world,
                report.examples, report.status.value)
    return report


def _merge(report: BackendReport, run: DcpRun, examples: Sequence[Example], prefix: str) -> None:
    """Fold the ranks' results into ``report``."""
    first = run.per_rank[0]
    report.examples = first.report.examples
    report.candidates = list(first.report.candidates)
    report.capture_seconds = max(r.report.capture_seconds for r in run.per_rank)
    report.detail = run.note()
    for result in run.per_rank:
        for check, tally in result.report.checks.items():
            report.checks[check].include(tally)
        report.failures += result.report.failures
    if first.failing is not None:
        example = examples[first.failing]
        report.status = Status.FAILED
        report.minimal_example = example_json(example)
        if prefix:
            report.reproduce = reproduce_command(prefix, encode_example(example))


def _verify_rank(rank: int, world: int, plan: DcpRankPlan) -> DcpRankResult:
    """One rank's share of :func:`verify_dcp` (runs in a rank process, in the
    default process group :func:`run_ranks` initialised, which is the DCP group)."""
    patch_interpreter()
    device = rank_device(rank)
    group = dist.group.WORLD
    assert group is not None
    settings = plan.settings
    graphs = device.type == "cuda" and group_capturable(group)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if not graphs:
            config = settings.config.model_copy(update={"cudagraph_mode": "none"})
            settings = dataclasses.replace(settings, config=config)
    tier = Tier.GPU if device.type == "cuda" else Tier.CPU
    verifier = BackendVerifier(settings, device, DcpRank(rank, world, group))
    report = BackendReport(settings.backend, tier, Status.PASSED)
    report.fused_allowed = verifier.fused_allowed
    report.candidates = [candidate.name for candidate in verifier.candidates()]
    failing = None
    for index, example in enumerate(plan.examples):
        outcomes = verifier.run_example(example)
        report.examples += 1
        report.tally(outcomes)
        failed = [o for o in outcomes if o.result is Result.FAILED]
        report.failures += [
            Failure(o.check, f"DCP rank {rank} of {world}: {o.diagnosis}", o.candidate, o.step,
                    o.field)
            for o in failed
        ]
        if any_rank(bool(failed), group):
            failing = index
            break
    report.capture_seconds = verifier.capture_seconds
    return DcpRankResult(rank, report, failing, verifier.graphs,
                         dist.get_backend_config(group))

