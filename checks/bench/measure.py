"""The timing loop: every path of one case side by side on one speculator, and a run over
every K and batch size.

A run has two phases, every case in each. **Timing** (first, with no profiler yet in the
process): per case (K, batch), build and capture a speculator (its graphs serve every
path), then ``warmup_rounds + repeats`` rounds in each of which every path runs
``launch`` once; the order rotates from round to round, so drift and order effects
fall on all paths alike. Wall time is the median of the timed rounds (launch and the copy of
the tokens back); host time, with CUDA, the median time the launching thread spends
queueing the work (:meth:`~speccheck.speculator.autoregressive.AutoregressiveSpeculator.
launch`); decode-graph replays are counted per call. Every call's draft tokens must equal
those of one eager per-step run (no graphs), else
:class:`~speccheck.checks.bench.errors.DraftTokensDiffer`. With CUDA each path then launches
once under a host-synchronisation recorder (a launch that may wait for the device would
count that wait as host time: its sites are reported), and the decode step's GPU time is
timed with CUDA events. **Profiling** (CUDA only, after every case was timed): per case, a
speculator built and captured again runs ``repeats`` calls of each path under the profiler
for GPU time and the profile tables (and the decode step's timeline, where asked).

Why two phases: once ``torch.profiler`` has traced CUDA activity in a process, its CUPTI
callbacks stay behind and every later CUDA call of that process costs the host more (on the
H200, a fused propose's launch about 100 us more, a per-step one about 200 us:
``docs/notes/profiler-residue.md``). Host time measured after a profiled case would
be the profiler's as much as the speculator's, and a serving process never pays it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import partial

import torch

from speccheck.checks.bench.errors import BenchInputError, DraftTokensDiffer
from speccheck.checks.bench.profiling import ProfiledTimes, launch_sync_sites, profile_calls
from speccheck.checks.bench.records import BenchReport, BenchRow
from speccheck.checks.bench.roofline import copy_bandwidth_gbps, decode_step_gpu_ms
from speccheck.checks.bench.step_timeline import StepTimeline, decode_step_timeline
from speccheck.checks.bench.workload import (
    NEW_TOKENS,
    NUM_LAYERS,
    CaptureCost,
    bench_batch,
    build_speculator,
    capture,
    check_runnable,
    context_for,
    decode_paths,
    vocab_size_for,
)
from speccheck.checks.device_memory import release_device_memory
from speccheck.checks.verify.context import MatrixContext
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.attention_setup import device_name
from speccheck.speculator.autoregressive import AutoregressiveSpeculator, DecodePath
from speccheck.speculator.batch import DraftBatch

WARMUP_ROUNDS = 3

class BenchPhase(Enum):
    """The two passes of a run over its cases (see the module docstring)."""

    TIMING = "timing"
    PROFILING = "profiling"


CaseObserver = Callable[[BenchPhase, int, int, int, int], None]
"""Called with (phase, K, batch, case number from 1, number of cases) before a case runs in
that phase."""


@dataclass(frozen=True)
class BenchSettings:
    """What to measure: ``backend`` under ``config`` (its ``num_speculative_steps`` is
    replaced by each K of ``steps``) at each batch size of ``batches``, ``repeats`` timed
    rounds per case. ``paths``: the paths to time, or ``None`` for every path the backend
    allows (:func:`~speccheck.checks.bench.workload.decode_paths`). ``step_timelines``:
    also profile each case's decode step for its timeline (CUDA only; it feeds no figure
    of the report, only :meth:`BenchRun.profile_text`)."""

    backend: str
    config: RuntimeConfig
    matrices: MatrixContext
    steps: tuple[int, ...]
    batches: tuple[int, ...]
    repeats: int
    paths: tuple[DecodePath, ...] | None = None
    warmup_rounds: int = WARMUP_ROUNDS
    step_timelines: bool = False


@dataclass(frozen=True)
class BenchRun:
    """The report, the profiler's tables by (K, batch, path), and the decode step's
    timeline by (K, batch) (both empty without CUDA)."""

    report: BenchReport
    profiles: dict[tuple[int, int, DecodePath], str] = field(default_factory=dict)
    step_timelines: dict[tuple[int, int], StepTimeline] = field(default_factory=dict)

    def profile_text(self) -> str:
        """Every case's decode-step timeline and every case's and path's profiler tables,
        under headings naming them (what ``speccheck bench --profile`` writes); a line
        saying there are none without CUDA."""
        if not self.profiles:
            return "no profiler tables: host and GPU time are measured on CUDA only\n"
        backend = self.report.backend
        parts = [f"=== {backend}: K={k}, batch {batch}, one decode step (single-step graph) "
                 f"===\n{timeline.text()}" for (k, batch), timeline in self.step_timelines.items()]
        parts += [f"=== {backend}: K={k}, batch {batch}, path {path.value} "
                  f"(per call of launch, {self.report.repeats} calls profiled) ===\n"
                  f"{tables}\n" for (k, batch, path), tables in self.profiles.items()]
        return "\n".join(parts)


def run_bench(settings: BenchSettings, device: torch.device, *, commit: str, command: str,
              on_case: CaseObserver | None = None) -> BenchRun:
    """Measure every case of ``settings`` on ``device``. Raises
    :class:`~speccheck.checks.bench.errors.BackendCannotRun`,
    :class:`~speccheck.checks.bench.errors.BenchInputError` or
    :class:`~speccheck.checks.bench.errors.DraftTokensDiffer`."""
    check_runnable(settings.backend, settings.matrices.matrix)
    context = context_for(settings.config, max(settings.steps))
    cases = [(k, batch) for k in settings.steps for batch in settings.batches]
    rows: list[BenchRow] = []
    weight_bytes: int | None = None
    for number, (k, batch) in enumerate(cases, start=1):
        if on_case is not None:
            on_case(BenchPhase.TIMING, k, batch, number, len(cases))
        timed = _time_case(settings, k, batch, context, device)
        rows += timed.rows
        weight_bytes = timed.weight_bytes
        release_device_memory(device)
    profiles: dict[tuple[int, int, DecodePath], str] = {}
    timelines: dict[tuple[int, int], StepTimeline] = {}
    if device.type == "cuda":
        gpu_ms: dict[tuple[int, int, DecodePath], float | None] = {}
        for number, (k, batch) in enumerate(cases, start=1):
            if on_case is not None:
                on_case(BenchPhase.PROFILING, k, batch, number, len(cases))
            paths = tuple(row.path for row in rows if (row.k, row.batch) == (k, batch))
            profiled = _profile_case(settings, k, batch, context, device, paths)
            for path, times in profiled.times.items():
                gpu_ms[(k, batch, path)] = times.gpu_ms
                profiles[(k, batch, path)] = times.tables
            if profiled.step_timeline is not None:
                timelines[(k, batch)] = profiled.step_timeline
            release_device_memory(device)
        rows = [replace(row, gpu_ms=gpu_ms[(row.k, row.batch, row.path)]) for row in rows]
    report = BenchReport(
        backend=settings.backend, device=device_name(device), torch_version=torch.__version__,
        commit=commit, command=command,
        config=settings.config.model_dump(exclude={"num_speculative_steps"}),
        drafter={"vocab_size": vocab_size_for(device), "num_layers": NUM_LAYERS,
                 "context": context, "new_tokens": len(NEW_TOKENS)},
        repeats=settings.repeats, warmup_rounds=settings.warmup_rounds, rows=tuple(rows),
        weight_bytes=weight_bytes,
        bandwidth_gbps=copy_bandwidth_gbps(device) if device.type == "cuda" else None)
    return BenchRun(report, profiles, timelines)


def _chosen_paths(settings: BenchSettings, spec: AutoregressiveSpeculator,
                  k: int) -> tuple[DecodePath, ...]:
    allowed = decode_paths(spec)
    if settings.paths is None:
        return allowed
    refused = [path.value for path in settings.paths if path not in allowed]
    if refused:
        raise BenchInputError(
            f"{settings.backend} at K={k} cannot take path(s) {', '.join(refused)}; it "
            f"allows {', '.join(path.value for path in allowed)}")
    return settings.paths


@dataclass(frozen=True)
class _TimedCase:
    """One case's rows from the timing phase (no GPU time yet: the profiling phase adds
    it) and the bytes of weights a decode step of its drafter reads."""

    rows: list[BenchRow]
    weight_bytes: int


@dataclass(frozen=True)
class _ProfiledCase:
    """One case's profiler figures and tables by path, and its decode step's timeline
    (``None`` at K = 1 or unasked)."""

    times: dict[DecodePath, ProfiledTimes]
    step_timeline: StepTimeline | None


def _built(settings: BenchSettings, k: int, batch: int, context: int, device: torch.device
           ) -> tuple[AutoregressiveSpeculator, CaptureCost, DraftBatch]:
    """The case's speculator, captured, the cost of its capture, and its batch."""
    config = settings.config.model_copy(update={"num_speculative_steps": k})
    spec = build_speculator(settings.backend, config, batch, context,
                            settings.matrices.matrix, device)
    return spec, capture(spec), bench_batch(config, batch, context)


def _time_case(settings: BenchSettings, k: int, batch: int, context: int,
               device: torch.device) -> _TimedCase:
    spec, cost, work = _built(settings, k, batch, context, device)
    paths = _chosen_paths(settings, spec, k)
    timed = _timed_rounds(settings, spec, work, paths, k)
    gpu = device.type == "cuda"
    step_ms = decode_step_gpu_ms(spec, batch, settings.repeats) if gpu and k > 1 else None
    rows = []
    for path in paths:
        host_ms = statistics.median(timed.hosts[path]) * 1e3 if gpu else None
        sync_sites = launch_sync_sites(partial(spec.launch, work, path)) if gpu else ()
        rows.append(BenchRow(path, k, batch, statistics.median(timed.walls[path]) * 1e3,
                             host_ms, None, statistics.fmean(timed.replays[path]),
                             cost.seconds, cost.allocated_bytes, cost.reserved_bytes, step_ms,
                             sync_sites))
    return _TimedCase(rows, spec.model.decode_weight_bytes())


def _profile_case(settings: BenchSettings, k: int, batch: int, context: int,
                  device: torch.device, paths: Sequence[DecodePath]) -> _ProfiledCase:
    """``repeats`` calls of each of ``paths`` under the profiler, after ``warmup_rounds``
    unprofiled ones (a graph's first replays upload it), on a speculator built and captured
    again. CUDA only."""
    spec, _, work = _built(settings, k, batch, context, device)
    times = {}
    for path in paths:
        launch = partial(spec.launch, work, path)
        for _ in range(settings.warmup_rounds):
            launch()
        times[path] = profile_calls(launch, settings.repeats)
    timeline = (decode_step_timeline(spec, batch, settings.repeats)
                if k > 1 and settings.step_timelines else None)
    return _ProfiledCase(times, timeline)


@dataclass(frozen=True)
class _TimedRounds:
    """Per path, one entry per timed call: seconds of the whole call (``walls``), seconds
    the launch took (``hosts``), decode-graph replays (``replays``)."""

    walls: dict[DecodePath, list[float]]
    hosts: dict[DecodePath, list[float]]
    replays: dict[DecodePath, list[int]]


def _timed_rounds(settings: BenchSettings, spec: AutoregressiveSpeculator, work: DraftBatch,
                  paths: Sequence[DecodePath], k: int) -> _TimedRounds:
    """The timed calls (warm-up rounds left out); every call's tokens are checked against
    an eager per-step run's (no graph at all: the first-pass and decode graphs are checked
    too)."""
    gpu = spec.device.type == "cuda"
    timed = _TimedRounds({path: [] for path in paths}, {path: [] for path in paths},
                         {path: [] for path in paths})
    eager = spec.propose(work, DecodePath.PER_STEP, use_graphs=False).draft_tokens
    first = ("eager per_step", eager)
    for round_ in range(settings.warmup_rounds + settings.repeats):
        shift = round_ % len(paths)
        for path in (*paths[shift:], *paths[:shift]):
            if gpu:
                torch.cuda.synchronize(spec.device)
            replayed = spec.counters.graph_replays
            start = time.perf_counter()
            r = spec.launch(work, path)
            launched = time.perf_counter()
            tokens = spec.draft_tokens[:r].cpu()
            done = time.perf_counter()
            if round_ >= settings.warmup_rounds:
                timed.walls[path].append(done - start)
                timed.hosts[path].append(launched - start)
                timed.replays[path].append(spec.counters.graph_replays - replayed)
            _require_same_tokens(settings.backend, k, work.num_reqs, first, (path.value, tokens))
    return timed


def _require_same_tokens(backend: str, k: int, batch: int, expected: tuple[str, torch.Tensor],
                         actual: tuple[str, torch.Tensor]) -> None:
    (want_path, want), (got_path, got) = expected, actual
    if torch.equal(want, got):
        return
    request = int((want != got).any(dim=1).nonzero()[0])
    raise DraftTokensDiffer(
        f"{backend}: draft tokens differ at K={k}, batch {batch}: request {request} drafted "
        f"{want[request].tolist()} on {want_path} and {got[request].tolist()} on {got_path}")
