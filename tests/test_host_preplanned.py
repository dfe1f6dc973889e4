"""The host_preplanned strategy: every draft step planned on the host before one run of
the body, checked against per-step rebuilds, on the CPU (and, with CUDA, one replay).

The builders here are reference attention plus a derived, host-planned field; they stand
in under the name ``flashinfer`` so the matrix's ``host_preplanned`` strategy applies."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.backends.reference.builder import ReferenceMetadata, ReferenceMetadataBuilder
from speccheck.checks.verify.context import MatrixContext
from speccheck.checks.verify.engine import BackendVerifier, VerifySettings, candidates_for
from speccheck.checks.verify.report import BackendReport
from speccheck.checks.verify.strategies import BatchLimits, draft_batches
from speccheck.checks.verify.vocabulary import Candidate
from speccheck.contract.groups import AttentionGroup
from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.matrix_model import Constraints, DraftDecode
from speccheck.contract.metadata import CommonAttentionMetadata
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.autoregressive import AutoregressiveSpeculator, DecodePath
from speccheck.speculator.base import SpeculatorOptions
from speccheck.speculator.batch import DraftBatch
from speccheck.speculator.factory import create_speculator
from speccheck.speculator.model import DrafterConfig
from tests.fixtures.eager_graphs import EagerReplay

SHIPPED = load_matrix()
_FLASHINFER = SHIPPED.backend("flashinfer")
MATRIX = SHIPPED.replacing(_FLASHINFER.model_copy(update={
    "platforms": ("cuda", "cpu"), "constraints": Constraints(),
    "draft_decode": DraftDecode(
        supported=False, reason=_FLASHINFER.draft_decode.reason,
        refresh_strategy="host_preplanned", refreshed_fields=("kv_lens_plus_one",))}))
"""The flashinfer entry as the stand-in adapter below declares it: any platform and dtype
(it is reference attention), ``kv_lens_plus_one`` planned per step."""
MATRICES = MatrixContext(MATRIX, None, SHIPPED)

DEVICE = torch.device("cpu")
DRAFTER = DrafterConfig(vocab_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_size=16,
                        intermediate_size=64, seed=9)
CONFIG = RuntimeConfig(platform="cpu", cudagraph_mode="none", num_speculative_steps=4, block_size=4,
                       max_model_len=40, dtype="float32", head_size=16, num_heads=2, num_kv_heads=1)
BATCH = DraftBatch((3, 37), ((5, 6), (7,)), ((1, 2), tuple(range(3, 13))), (11, 12))


@dataclass
class PlannedMetadata(ReferenceMetadata):
    kv_lens_plus_one: torch.Tensor | None = None


class PlannedBuilder(ReferenceMetadataBuilder):
    """Plans ``kv_lens_plus_one`` into persistent buffers of their own, as FlashInfer's
    wrappers do: ``planned[0]`` for per-step builds, ``planned[i]`` for draft step ``i`` of
    a host_preplanned run. A host_preplanned plan is split as FlashInfer's is: the host half writes
    the lengths, the device half (``finish_draft_step_plans``, in the body) adds the one."""

    def setup(self) -> None:
        self.planned = [
            self.allocate_persistent(f"planned[{row}]", (self.limits.max_num_reqs,), torch.int32)
            for row in range(self.config.num_speculative_steps + 1)
        ]

    def _plan(self, common: CommonAttentionMetadata, row: int, plus: int) -> PlannedMetadata:
        n = common.num_reqs
        self._write_planned(row, common.seq_lens_cpu_upper_bound[:n] + plus)
        return PlannedMetadata(**vars(super().build(common)), kv_lens_plus_one=self.planned[row][:n])

    def _write_planned(self, row: int, lengths: torch.Tensor) -> None:
        """``planned[row]`` holds ``lengths`` and zeros after them."""
        self.planned[row].zero_()
        self.planned[row][: lengths.shape[0]].copy_(lengths)

    def build(self, common: CommonAttentionMetadata) -> PlannedMetadata:
        return self._plan(common, 0, plus=1)

    def plan_draft_steps(self, commons):
        return [self._plan(common, step, plus=0) for step, common in enumerate(commons, start=1)]

    def replan_draft_steps(self, metadata_per_step, seq_lens_per_step):
        for row, lengths in enumerate(self._replanned_rows(seq_lens_per_step), start=1):
            self._write_planned(row, torch.from_numpy(lengths))

    def _replanned_rows(self, seq_lens_per_step):
        return seq_lens_per_step

    def finish_draft_step_plans(self, metadata_per_step):
        for md in metadata_per_step:
            md.kv_lens_plus_one.add_(1)


class StalePlan(PlannedBuilder):
    def plan_draft_steps(self, commons):
        """Plans every step with the first step's lengths."""
        return [self._plan(commons[0], step, plus=0) for step in range(1, len(commons) + 1)]

    def _replanned_rows(self, seq_lens_per_step):
        return [seq_lens_per_step[0]] * len(seq_lens_per_step)


class StaleReplan(PlannedBuilder):
    def replan_draft_steps(self, metadata_per_step, seq_lens_per_step):
        """Leaves the plans the host_preplanned graph was captured with: only replays go wrong,
        the eager host_preplanned body (``plan_draft_steps``) is right."""


class UnfinishedPlan(PlannedBuilder):
    def finish_draft_step_plans(self, metadata_per_step):
        """Leaves the device half of the plans undone."""


def _speculator(builder: type = PlannedBuilder, **options) -> AutoregressiveSpeculator:
    spec = create_speculator(
        "autoregressive", ["reference", "flashinfer"], CONFIG, DRAFTER, DEVICE,
        SpeculatorOptions(capture_sizes=(1, 2, 4), num_blocks=48, **options),
        builder_overrides={"flashinfer": builder}, matrix=MATRIX)
    assert isinstance(spec, AutoregressiveSpeculator)
    return spec


def test_host_preplanned_applies_and_auto_follows_the_option() -> None:
    spec = _speculator()
    assert not spec.use_fused_multi_step_decode and spec.host_preplanned_applies
    assert spec.auto_path == "per_step"
    assert _speculator(host_preplanned=True).auto_path == "host_preplanned"


@settings(max_examples=15)
@given(data=st.data())
def test_host_preplanned_equals_per_step(data) -> None:
    spec = _speculator()
    batch = data.draw(draft_batches(BatchLimits(4, 4, 40, 48, 3, 64)))
    spec.kv_cache.fill_random_(1)
    start = spec.kv_cache.snapshot()
    oracle = spec.propose(batch, "per_step")
    oracle_kv = spec.kv_cache.snapshot()
    spec.kv_cache.restore(start)
    planned = spec.propose(batch, "host_preplanned")
    assert torch.equal(oracle.draft_tokens, planned.draft_tokens)
    assert torch.equal(oracle.logits, planned.logits)
    for (ko, vo), (kp, vp) in zip(oracle_kv, spec.kv_cache.snapshot()):
        assert torch.equal(ko, kp) and torch.equal(vo, vp)


def test_host_preplanned_loop_order_and_one_metadata_object_per_step() -> None:
    spec = _speculator()
    seen: list[tuple[int, int]] = []
    spec.step_observer = lambda lanes, step, md, launched: seen.append((step, id(md[1])))
    spec.trace = []
    spec.propose(BATCH, "host_preplanned")
    events, spec.trace = spec.trace, None
    decode = [e for e, _ in events[events.index(("slots", 1)) + 1 :]]
    assert decode == ["generate", "slots", "refresh", "generate", "slots", "refresh", "generate"]
    assert [s for s, _ in seen] == [1, 2, 3]
    assert len({i for _, i in seen}) == 3, "each step runs with its own planned metadata"


def _settings(builder: type, examples: int | None = None,
              steps: tuple[int, ...] | None = None) -> VerifySettings:
    """The verifier's settings for ``builder``: its default example count and draft step
    counts unless given."""
    counts = {"examples": examples, "steps": steps}
    return VerifySettings("flashinfer", CONFIG.model_copy(update={"head_size": 16}),
                          capture_sizes=(2, 4), vocab_size=64,
                          builder_overrides=(("flashinfer", builder),), matrices=MATRICES,
                          **{name: value for name, value in counts.items() if value is not None})


def _verify(builder: type, examples: int | None = None,
            steps: tuple[int, ...] | None = None) -> BackendReport:
    verifier = BackendVerifier(_settings(builder, examples, steps), DEVICE)
    assert [c.name for c in verifier.candidates()] == ["host_preplanned_eager"]
    report = BackendReport("flashinfer", "cpu", "passed")
    verifier.run(report, lambda i, e: None)
    return report


def test_verifier_checks_the_host_preplanned_path() -> None:
    report = _verify(PlannedBuilder, examples=12, steps=(4,))
    assert report.status == "passed", report.failures
    assert report.checks["step_metadata"].passed > 0


@pytest.mark.parametrize("builder", [StalePlan, UnfinishedPlan])
def test_verifier_catches_a_stale_plan(builder: type) -> None:
    """At the verifier's default example count and draft step counts."""
    report = _verify(builder)
    stale = [f for f in report.failures if f.check == "step_metadata"]
    assert stale and stale[0].field == "flashinfer.metadata.kv_lens_plus_one", report.failures


@pytest.mark.cuda
def test_host_preplanned_full_graph_is_one_replay() -> None:
    config = CONFIG.model_copy(update={"platform": "cuda", "cudagraph_mode": "full"})
    spec = create_speculator("autoregressive", ["reference", "flashinfer"], config, DRAFTER,
                             torch.device("cuda"), SpeculatorOptions(capture_sizes=(1, 2, 4), num_blocks=48),
                             builder_overrides={"flashinfer": PlannedBuilder}, matrix=MATRIX)
    spec.capture()
    spec.propose(BATCH, "host_preplanned")
    assert (spec.counters.eager_step_calls, spec.counters.graph_replays) == (0, 1)


@pytest.mark.cuda
@pytest.mark.parametrize("builder", [PlannedBuilder, StaleReplan])
def test_the_graph_candidate_checks_the_replan(builder: type) -> None:
    """On the GPU the host_preplanned graph candidate replays, re-planning through
    ``replan_draft_steps``: a replan that leaves the capture's plans is caught there, at the
    verifier's default example count and draft step counts, though the eager candidate,
    planned by ``plan_draft_steps``, passes."""
    config = CONFIG.model_copy(update={"platform": "cuda", "cudagraph_mode": "full",
                                       "head_size": 16})
    settings_ = dataclasses.replace(_settings(builder), config=config)
    verifier = BackendVerifier(settings_, torch.device("cuda"))
    report = BackendReport("flashinfer", "cuda", "passed")
    verifier.run(report, lambda i, e: None)
    if builder is PlannedBuilder:
        assert report.status == "passed", report.failures
        return
    stale = [f for f in report.failures if f.check == "step_metadata"]
    assert stale and stale[0].candidate == "host_preplanned_graph", report.failures
    assert stale[0].field == "flashinfer.metadata.kv_lens_plus_one", report.failures


def test_gpu_candidates_run_the_per_step_graphs_first() -> None:
    def names(path: DecodePath | None, gpu: bool) -> list[str]:
        return [candidate.name for candidate in candidates_for(path, gpu)]

    assert names(DecodePath.HOST_PREPLANNED, gpu=True) == ["per_step_graph", "host_preplanned_graph", "host_preplanned_eager"]
    assert names(DecodePath.HOST_PREPLANNED, gpu=False) == ["host_preplanned_eager"]
    assert names(DecodePath.FUSED, gpu=True) == ["fused_eager", "fused_graph"]
    assert names(None, gpu=True) == ["per_step_graph"]
    assert names(None, gpu=False) == []


class _OrderedVerifier(BackendVerifier):
    """Runs a per-step candidate (eagerly: no graphs on the CPU) beside the host_preplanned one,
    in the order given, to show why the per-step candidate must come first."""

    def __init__(self, settings_: VerifySettings, order: list[Candidate]) -> None:
        super().__init__(settings_, DEVICE)
        self.order = order

    def candidates(self, k: int | None = None) -> list[Candidate]:
        return [] if k == 1 else self.order


@pytest.mark.parametrize("per_step_first", [True, False])
def test_a_per_step_candidate_after_a_host_preplanned_one_sees_rewritten_step_buffers(
    per_step_first: bool,
) -> None:
    pair = [Candidate(DecodePath.PER_STEP, graphs=False), Candidate(DecodePath.HOST_PREPLANNED, graphs=False)]
    verifier = _OrderedVerifier(_settings(PlannedBuilder, examples=6, steps=(4,)),
                                pair if per_step_first else pair[::-1])
    report = BackendReport("flashinfer", "cpu", "passed")
    verifier.run(report, lambda i, e: None)
    if per_step_first:
        assert report.status == "passed", report.failures
    else:
        stale = [f for f in report.failures if f.check == "step_metadata"]
        assert stale and stale[0].field is not None and "planned[" in stale[0].field, report.failures


class _CountingHook:
    """A refresh hook that counts the refreshes of each backend's group and records any
    ``update_draft_decode_metadata`` that does not come through it: a path that calls the
    refresh directly, bypassing the hook through which the verifier observes it."""

    def __init__(self, spec: AutoregressiveSpeculator) -> None:
        self.calls: Counter[str] = Counter()
        self.bypassed: list[str] = []
        self._inside = False
        for group in spec.groups:
            refresh = group.builder.update_draft_decode_metadata

            def guarded(metadata, _refresh=refresh, _name=group.backend_name) -> None:
                if not self._inside:
                    self.bypassed.append(_name)
                _refresh(metadata)

            group.builder.update_draft_decode_metadata = guarded  # type: ignore[method-assign]

    def __call__(self, group: AttentionGroup, metadata: object) -> None:
        self.calls[group.backend_name] += 1
        self._inside = True
        try:
            group.update_draft_decode_metadata(metadata)
        finally:
            self._inside = False


UNIFORM_BATCH = DraftBatch((3, 37), ((5, 6), (7, 8)), ((1, 2), tuple(range(3, 13))), (11, 12))
"""Two new tokens per request: a padded first pass where width 2 is captured."""


@pytest.mark.parametrize(
    ("layer_backends", "path", "graphs", "batch", "expected"),
    [
        # K = 4: the fused body refreshes before step 1 (the shipped reference entry's refresh
        # rebuilds) and between steps; a padded first pass refreshes once more, in its body.
        (("reference", "reference"), DecodePath.FUSED, False, BATCH, {"reference": 3}),
        (("reference", "reference"), DecodePath.FUSED, False, UNIFORM_BATCH, {"reference": 4}),
        (("reference", "reference"), DecodePath.FUSED, True, BATCH, {"reference": 3}),
        (("reference", "reference"), DecodePath.FUSED, True, UNIFORM_BATCH, {"reference": 4}),
        # Only the group that refreshes in-graph, between steps; the other was planned.
        (("reference", "flashinfer"), DecodePath.HOST_PREPLANNED, False, BATCH, {"reference": 2}),
        (("reference", "flashinfer"), DecodePath.HOST_PREPLANNED, True, BATCH, {"reference": 2}),
        (("reference", "flashinfer"), DecodePath.PER_STEP, False, BATCH, {}),
        (("reference", "flashinfer"), DecodePath.PER_STEP, True, BATCH, {}),
    ],
    ids=["fused-eager", "fused-eager-padded-pass", "fused-graph", "fused-whole-propose-graph",
         "host_preplanned-eager", "host_preplanned-graph", "per_step-eager", "per_step-graph"],
)
def test_every_refresh_on_every_path_goes_through_the_hook(
    layer_backends: tuple[str, ...], path: DecodePath, graphs: bool, batch: DraftBatch,
    expected: dict[str, int],
) -> None:
    """The refresh hook sees each refresh of one propose, eager bodies and replayed graph
    bodies (run eagerly by the CPU stand-in for the graph manager) alike, and no path
    refreshes without it."""
    spec = create_speculator(
        "autoregressive", list(layer_backends), CONFIG, DRAFTER, DEVICE,
        SpeculatorOptions(capture_sizes=(1, 2, 4), num_blocks=48, pad_to_capture_sizes=True,
                          first_pass_query_lens=(2,)),
        builder_overrides={"flashinfer": PlannedBuilder}, matrix=MATRIX)
    assert isinstance(spec, AutoregressiveSpeculator)
    if graphs:
        spec.graphs = EagerReplay((1, 2, 4))  # type: ignore[assignment]
        spec.capture()
    hook = _CountingHook(spec)
    spec.refresh_hook = hook
    replays = spec.counters.graph_replays
    spec.propose(batch, path, use_graphs=graphs)
    assert hook.bypassed == []
    assert dict(hook.calls) == expected
    assert (spec.counters.graph_replays > replays) is graphs
