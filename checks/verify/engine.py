"""One backend, one runtime config, in this process: draw batches, run the oracle (eager
per-step, metadata rebuilt before every step) and the candidates (fused FULL-graph replay
on a GPU, and the eager fused loop) from identical state, and compare.

Run it through :mod:`speccheck.checks.verify.runner`, which gives each backend a process
of its own: an illegal memory access breaks a CUDA context for good.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky

from speccheck.checks.verify.comparisons import (
    Outcome,
    compare_drafts,
    compare_steps,
    expected_slots,
    first_divergence,
    kv_matches,
    kv_untouched,
)
from speccheck.checks.probes import GuardedBuffer, HostSyncRecorder, IdentityGuard, check_zero_tail
from speccheck.checks.verify.state_walk import changed_paths
from speccheck.checks.verify.step_recorder import StepMetadataRecorder
from speccheck.checks.verify.strategies import BatchLimits, draft_batches
from speccheck.checks.verify.report import BackendReport, CheckTally, Failure
from speccheck.contract.builder import AttentionMetadataBuilder
from speccheck.contract.groups import AttentionGroup
from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.autoregressive import AutoregressiveSpeculator
from speccheck.speculator.base import SpeculatorOptions
from speccheck.speculator.batch import DraftBatch
from speccheck.speculator.factory import create_speculator
from speccheck.speculator.model import DrafterConfig

logger = logging.getLogger(__name__)

TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 6e-2}
"""Absolute logit / KV tolerance per dtype; a top-2 logit gap below twice this makes the
oracle's token choice indeterminate."""

Example = tuple[int, DraftBatch]


@dataclass(frozen=True)
class VerifySettings:
    backend: str
    config: RuntimeConfig
    examples: int = 50
    seed: int = 0
    steps: tuple[int, ...] = (2, 3, 4, 5, 6, 7, 8)
    capture_sizes: tuple[int, ...] = (1, 2, 4, 8)
    vocab_size: int = 256
    num_layers: int = 2
    builder_overrides: tuple[tuple[str, type[AttentionMetadataBuilder[Any]]], ...] = ()
    """(backend name, builder class) swaps: tests use them to plant known-bad builders."""
    shrink_seconds: float = 120.0
    """Time budget for shrinking a failure; past it the smallest failure so far is kept."""
    matrix_path: str | None = None
    """Capability matrix to verify against (default: the one shipped with speccheck); the
    fp32 reference always comes from the shipped matrix."""


class ExampleFailed(Exception):
    def __init__(self, example: Example, outcomes: list[Outcome]) -> None:
        super().__init__(f"{sum(o.result == 'failed' for o in outcomes)} checks failed")
        self.example = example
        self.outcomes = outcomes


def encode_example(example: Example) -> str:
    """A compact, URL-safe blob for ``--reproduce``."""
    return base64.urlsafe_b64encode(zlib.compress(json.dumps(example_json(example)).encode())).decode()


def decode_example(blob: str) -> Example:
    try:
        return example_from_json(json.loads(zlib.decompress(base64.urlsafe_b64decode(blob.encode()))))
    except (ValueError, KeyError, TypeError, zlib.error) as exc:
        raise ValueError(f"--reproduce: not an example blob ({exc})") from None


def example_json(example: Example) -> dict[str, Any]:
    k, batch = example
    return {"num_speculative_steps": k, "context_lens": list(batch.context_lens),
            "new_tokens": [list(r) for r in batch.new_tokens],
            "block_table": [list(r) for r in batch.block_table], "seeds": list(batch.seeds)}


def example_from_json(data: dict[str, Any]) -> Example:
    return int(data["num_speculative_steps"]), DraftBatch(
        tuple(data["context_lens"]), tuple(tuple(r) for r in data["new_tokens"]),
        tuple(tuple(r) for r in data["block_table"]), tuple(data["seeds"]),
    )


@dataclass
class _Harness:
    """The speculators for one K: the backend under test and the fp32 reference."""

    spec: AutoregressiveSpeculator
    recorder: StepMetadataRecorder
    reference: AutoregressiveSpeculator | None
    capture_error: str | None
    """Why capture failed (a host sync or host copy inside the captured body), if it did."""


class GuardedAllocator:
    """A :data:`~speccheck.contract.builder.BufferAllocator` that surrounds every persistent
    buffer with poisoned guard bands and remembers them."""

    def __init__(self) -> None:
        self.buffers: list[GuardedBuffer] = []

    def __call__(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        guarded = GuardedBuffer(shape, dtype, device, name=name)
        self.buffers.append(guarded)
        return guarded.tensor

    def violations(self) -> list[str]:
        return [v for b in self.buffers for v in b.violations()]


def candidate_names(multi_step_path: str | None, gpu: bool) -> list[str]:
    """The candidates of one example, in the order they run after the oracle.

    ``multi_step_path`` is ``"fused"`` when the matrix allows fused decoding,
    ``"preplanned"`` when the host_preplanned strategy applies, else ``None``. The multi-step
    body runs as a graph replay on the GPU and eagerly everywhere. On the GPU, when fused
    decoding is not allowed, the per-step graph replays the speculator falls back to are a
    candidate too, and they run first: their step comparison covers every persistent
    buffer, and a preplanned candidate rewrites its per-step buffers, which the oracle saw
    holding the previous example's plans.
    """
    fallback = ["per_step_graph"] if gpu and multi_step_path != "fused" else []
    if multi_step_path is None:
        return fallback
    body = [f"{multi_step_path}_graph", f"{multi_step_path}_eager"] if gpu else [f"{multi_step_path}_eager"]
    return fallback + body


class BackendVerifier:
    """Verifies ``settings.backend`` under ``settings.config`` on ``device``."""

    def __init__(self, settings: VerifySettings, device: torch.device) -> None:
        self.settings = settings
        self.device = device
        self.config = settings.config
        self.gpu = device.type == "cuda"
        self.tol = TOLERANCE[self.config.dtype]
        self._harness: dict[int, _Harness] = {}
        self.capture_seconds = 0.0
        self._probe_outcomes: list[Outcome] = []
        self.guards = GuardedAllocator()

    # ------------------------------------------------------------ set-up
    def drafter(self, dtype: str) -> DrafterConfig:
        return DrafterConfig.for_runtime(
            self.config, vocab_size=self.settings.vocab_size,
            num_layers=self.settings.num_layers, seed=self.settings.seed, dtype=dtype,
        )

    def options(self) -> SpeculatorOptions:
        max_blocks = -(-self.config.max_model_len // self.config.block_size)
        return SpeculatorOptions(
            capture_sizes=self.settings.capture_sizes,
            max_num_prefill_tokens=max(self.settings.capture_sizes) * 4,
            num_blocks=max(self.settings.capture_sizes) * max_blocks + 1,
            pad_to_capture_sizes=True,
        )

    def limits(self, k: int) -> BatchLimits:
        return BatchLimits(
            max_num_reqs=max(self.settings.capture_sizes), block_size=self.config.block_size,
            max_model_len=self.config.max_model_len, num_blocks=self.options().num_blocks,
            extra_positions=k - 1, vocab_size=self.settings.vocab_size,
        )

    def harness(self, k: int) -> _Harness:
        if k not in self._harness:
            config = self.config.model_copy(update={"num_speculative_steps": k})
            spec = create_speculator(
                "autoregressive", [self.settings.backend] * self.settings.num_layers, config,
                self.drafter(config.dtype), self.device, self.options(),
                matrix=load_matrix(self.settings.matrix_path),
                builder_overrides=dict(self.settings.builder_overrides),
                buffer_allocator=self.guards,
            )
            assert isinstance(spec, AutoregressiveSpeculator)
            recorder = StepMetadataRecorder(spec.groups)
            spec.step_observer = recorder
            start = time.perf_counter()
            capture_error = None
            try:
                spec.capture()
            except RuntimeError as exc:
                capture_error = f"capturing the draft-decode graphs failed: {exc}"
            self.capture_seconds += time.perf_counter() - start
            reference = None
            if not (self.settings.backend == "reference" and config.dtype == "float32"):
                ref_config = config.model_copy(update={"dtype": "float32", "cudagraph_mode": "none"})
                ref = create_speculator(
                    "autoregressive", ["reference"] * self.settings.num_layers, ref_config,
                    self.drafter("float32"), self.device, self.options(),
                )
                assert isinstance(ref, AutoregressiveSpeculator)
                reference = ref
            self._harness[k] = _Harness(spec, recorder, reference, capture_error)
        return self._harness[k]

    @property
    def fused_allowed(self) -> bool:
        return self.harness(self.settings.steps[0]).spec.use_fused_multi_step_decode

    def candidates(self) -> list[str]:
        """What is compared with the eager per-step oracle, in order: see
        :func:`candidate_names`."""
        spec = self.harness(self.settings.steps[0]).spec
        if spec.use_fused_multi_step_decode:
            return candidate_names("fused", self.gpu)
        return candidate_names("preplanned" if spec.preplanned_capable else None, self.gpu)

    # ------------------------------------------------------------ one example
    def run_example(self, example: Example) -> list[Outcome]:
        k, batch = example
        h = self.harness(k)
        if h.capture_error is not None:
            return [Outcome("capture", "failed", h.capture_error)]
        spec = h.spec
        lanes = spec.bucket_for(batch.num_reqs)
        generator = torch.Generator().manual_seed(zlib.crc32(encode_example(example).encode()))
        spec.kv_cache.fill_random_(generator)
        start = spec.kv_cache.snapshot()

        oracle = spec.propose(batch, "per_step", use_graphs=False)
        oracle_steps = h.recorder.collect(lanes)
        oracle_storage = dict(h.recorder.storage_of)
        oracle_kv = spec.kv_cache.snapshot()
        bs, mml = self.config.block_size, self.config.max_model_len
        written = expected_slots(batch, k, bs, mml)
        outcomes = kv_untouched(batch, written, bs, start, oracle_kv, "oracle")
        if self.gpu:
            outcomes.append(Outcome("capture", "passed"))

        for name in self.candidates():
            spec.kv_cache.restore(start)
            spec.refresh_hook = self._probing_refresh if name == "fused_eager" else None
            try:
                result = spec.propose(
                    batch, name.rsplit("_", 1)[0],  # type: ignore[arg-type]
                    use_graphs=name.endswith("graph"),
                )
            finally:
                spec.refresh_hook = None
            steps = h.recorder.collect(lanes)
            kv = spec.kv_cache.snapshot()
            outcomes += compare_drafts(oracle, result, name, self.tol)
            outcomes += kv_untouched(batch, written, bs, start, kv, name)
            agreed = expected_slots(batch, k, bs, mml, first_divergence(oracle, result, k))
            outcomes += kv_matches(agreed, oracle_kv, kv, self.tol, name)
            outcomes += compare_steps(
                oracle_steps, steps, name, metadata_only=name.startswith("preplanned")
            )
            outcomes += self._zero_tails(spec, h.recorder, name)
        outcomes += self._declared_fields(spec, oracle_steps, oracle_storage)
        outcomes += self._probe_outcomes
        self._probe_outcomes = []
        outcomes += self._guard_bands()
        if h.reference is not None:
            h.reference.kv_cache.restore(start)
            expected = h.reference.propose(batch, "per_step")
            outcomes += compare_drafts(
                expected, oracle, "oracle vs fp32 reference", 4 * self.tol,
                token_check="vs_fp32_reference", logit_check="vs_fp32_reference",
            )
        else:
            outcomes.append(Outcome("vs_fp32_reference", "skipped", "the oracle is the fp32 reference"))
        return outcomes

    # ------------------------------------------------------------ checks
    def _declared_fields(
        self, spec: AutoregressiveSpeculator, oracle: dict[int, dict[str, torch.Tensor]],
        storage_of: dict[str, int],
    ) -> list[Outcome]:
        """Claims audit of the oracle run: derived tensors that change between its steps
        must be declared in the builder's ``step_dependent_fields``, and every declared
        field must exist. Views of the speculator's own input buffers are not derived (the
        speculator advances them), and a persistent buffer behind a declared field is
        covered by that declaration. ``storage_of`` maps paths to storage addresses as the
        oracle run saw them: a candidate may bind the same field to another buffer (one
        per preplanned step)."""
        if len(oracle) < 2:
            return [Outcome("declared_fields", "skipped", "fewer than two draft steps")]
        snapshots = [oracle[s] for s in sorted(oracle)]
        changed = changed_paths(snapshots)
        inputs = {t.untyped_storage().data_ptr() for t in vars(spec.buffers).values()}
        out: list[Outcome] = []
        for group in spec.groups:
            builder = type(group.builder).__name__
            prefix = f"{group.backend_name}.metadata."
            declared = {prefix + f for f in type(group.builder).step_dependent_fields}
            for path in sorted(declared - set(snapshots[0])):
                out.append(Outcome("declared_fields", "failed",
                                   f"{builder} declares step-dependent field {path[len(prefix):]!r}, "
                                   "which its metadata does not have", field=path))
            covered = inputs | {storage_of[p] for p in declared if p in storage_of}
            for path in sorted(changed - declared):
                if path.startswith(group.backend_name + ".") and storage_of[path] not in covered:
                    out.append(Outcome("declared_fields", "failed",
                                       f"{path} changes between draft steps but {builder}"
                                       ".step_dependent_fields does not declare it", field=path))
        return out or [Outcome("declared_fields", "passed")]

    def _zero_tails(
        self, spec: AutoregressiveSpeculator, recorder: StepMetadataRecorder, name: str
    ) -> list[Outcome]:
        """After a run, every persistent buffer's rows past what the last metadata uses are
        zero (the builder declares the used extents)."""
        if recorder.last_metadata is None:
            return []
        out: list[Outcome] = []
        for group, md in zip(spec.groups, recorder.last_metadata, strict=True):
            buffers = group.builder.persistent_buffers()
            for buffer_name, used in group.builder.persistent_buffer_extents(md).items():
                problem = check_zero_tail(buffers[buffer_name], used, name=buffer_name)
                if problem:
                    out.append(Outcome("zero_tails", "failed", f"{name}: {group.backend_name}: {problem}", name))
                else:
                    out.append(Outcome("zero_tails", "passed", candidate=name))
        return out

    def _guard_bands(self) -> list[Outcome]:
        """No write landed in the poisoned bands around any persistent buffer."""
        if not self.guards.buffers:
            return [Outcome("guard_bands", "skipped", "no persistent buffers")]
        violations = self.guards.violations()
        if violations:
            return [Outcome("guard_bands", "failed", "; ".join(violations[:3]))]
        return [Outcome("guard_bands", "passed")]

    def _probing_refresh(self, group: AttentionGroup, metadata: Any) -> None:
        """The refresh, traced: host synchronisations and replaced tensors are findings."""
        roots = {"metadata": metadata, "builder": group.builder}
        try:
            with HostSyncRecorder(cuda_sync_debug=self.gpu) as syncs, IdentityGuard(roots) as ident:
                group.update_draft_decode_metadata(metadata)
        except RuntimeError as exc:
            self._probe_outcomes.append(Outcome("host_sync", "failed", f"refresh raised: {exc}", "fused_eager"))
            raise
        for check, findings in (("host_sync", syncs.findings()), ("in_place", ident.findings())):
            if findings:
                self._probe_outcomes.append(
                    Outcome(check, "failed", f"{group.backend_name}: {findings[0]}", "fused_eager")
                )
            else:
                self._probe_outcomes.append(Outcome(check, "passed", candidate="fused_eager"))

    # ------------------------------------------------------------ the run
    def example_strategy(self) -> st.SearchStrategy[Example]:
        return st.sampled_from(self.settings.steps).flatmap(
            lambda k: st.tuples(st.just(k), draft_batches(self.limits(k)))
        )

    def run(self, report: BackendReport, on_example: Callable[[int, Example], None]) -> None:
        """Draw ``settings.examples`` examples; on a failure, shrink it (within
        ``settings.shrink_seconds``) and record the smallest failing example found.

        ``on_example(index, example)`` is called before every example runs, shrink
        candidates included (same index): a worker killed mid-example names the right one.
        """
        shrinking, shrink_started = False, 0.0
        smallest: list[tuple[Example, list[Outcome]]] = []

        @seed(self.settings.seed)
        @settings(
            max_examples=self.settings.examples, database=None, deadline=None,
            phases=(Phase.generate, Phase.shrink), report_multiple_bugs=False,
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
            failed = [o for o in outcomes if o.result == "failed"]
            if failed:
                if not shrinking:
                    shrinking, shrink_started = True, time.monotonic()
                smallest[:] = [(example, outcomes)]  # hypothesis only tries smaller candidates
                raise ExampleFailed(example, outcomes)
            if not shrinking:
                tally(report, outcomes)

        try:
            check()
        except (ExampleFailed, Flaky):
            # Flaky: the final replay of the smallest failure passed because the shrink
            # budget was spent; that failure is still the one to report.
            if not smallest:
                raise
            self.record_failure(report, *smallest[0])

    def record_failure(self, report: BackendReport, example: Example, outcomes: list[Outcome]) -> None:
        tally(report, outcomes)
        report.failures = [
            Failure(o.check, o.diagnosis, o.candidate, o.step, o.field) for o in outcomes if o.result == "failed"
        ]
        report.minimal_example = example_json(example)
        report.status = "failed"


def tally(report: BackendReport, outcomes: list[Outcome]) -> None:
    for o in outcomes:
        t: CheckTally = report.checks[o.check]
        setattr(t, o.result, getattr(t, o.result) + 1)
