"""One backend, one runtime config, in this process: draw batches, run the oracle (eager
per-step, metadata rebuilt before every step) and the candidates (fused FULL-graph replay
on a GPU, and the eager fused loop) from identical state, and compare.

Run it through :mod:`speccheck.checks.verify_runner`, which gives each backend a process
of its own: an illegal memory access breaks a CUDA context for good.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from speccheck.checks.capture_probes import GuardedBuffer, HostSyncRecorder, IdentityGuard, check_zero_tail
from speccheck.checks.state_walk import changed_paths, same_value
from speccheck.checks.step_recorder import StepMetadataRecorder
from speccheck.checks.strategies import BatchLimits, draft_batches
from speccheck.checks.verify_report import BackendReport, CheckTally, Failure
from speccheck.contract.builder import AttentionMetadataBuilder
from speccheck.contract.groups import AttentionGroup
from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.autoregressive import AutoregressiveSpeculator
from speccheck.speculator.base import SpeculatorOptions
from speccheck.speculator.batch import DraftBatch, DraftResult
from speccheck.speculator.factory import create_speculator
from speccheck.speculator.kv_cache import SINK_BLOCK
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
    matrix_path: str | None = None
    """Capability matrix to verify against (default: the one shipped with speccheck); the
    fp32 reference always comes from the shipped matrix."""


@dataclass
class Outcome:
    check: str
    result: str  # passed | failed | indeterminate | skipped
    diagnosis: str = ""
    candidate: str | None = None
    step: int | None = None
    field: str | None = None


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
        c = self.config
        return DrafterConfig(
            vocab_size=self.settings.vocab_size, num_layers=self.settings.num_layers,
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_size=c.head_size,
            intermediate_size=2 * c.num_heads * c.head_size, seed=self.settings.seed, dtype=dtype,
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
        if self.fused_allowed:
            return ["fused_graph", "fused_eager"] if self.gpu else ["fused_eager"]
        return ["per_step_graph"] if self.gpu else []

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
        oracle_kv = spec.kv_cache.snapshot()
        outcomes = self._kv_untouched(batch, k, start, oracle_kv, "oracle")
        if self.gpu:
            outcomes.append(Outcome("capture", "passed"))

        for name in self.candidates():
            spec.kv_cache.restore(start)
            spec.refresh_hook = self._probing_refresh if name == "fused_eager" else None
            try:
                result = spec.propose(
                    batch, "fused" if name.startswith("fused") else "per_step",
                    use_graphs=name.endswith("graph"),
                )
            finally:
                spec.refresh_hook = None
            steps = h.recorder.collect(lanes)
            kv = spec.kv_cache.snapshot()
            outcomes += self._compare_tokens(oracle, result, name)
            outcomes += self._kv_untouched(batch, k, start, kv, name)
            outcomes += self._kv_matches(batch, k, oracle_kv, kv, oracle, result, name)
            outcomes += self._compare_steps(oracle_steps, steps, name)
            outcomes += self._zero_tails(spec, h.recorder, name)
        outcomes += self._declared_fields(spec, h.recorder, oracle_steps)
        outcomes += self._probe_outcomes
        self._probe_outcomes = []
        outcomes += self._guard_bands()
        if h.reference is not None:
            h.reference.kv_cache.restore(start)
            expected = h.reference.propose(batch, "per_step")
            outcomes += self._compare_tokens(
                expected, oracle, "oracle vs fp32 reference", 4 * self.tol,
                token_check="vs_fp32_reference", logit_check="vs_fp32_reference",
            )
        else:
            outcomes.append(Outcome("vs_fp32_reference", "skipped", "the oracle is the fp32 reference"))
        return outcomes

    # ------------------------------------------------------------ checks
    def _compare_tokens(
        self, oracle: DraftResult, cand: DraftResult, name: str, tol: float | None = None,
        *, token_check: str = "draft_tokens", logit_check: str = "logits",
    ) -> list[Outcome]:
        """Exact tokens; logits within tolerance up to each request's first divergence.
        A divergence where the oracle's top-2 logits are within tolerance is indeterminate,
        and so is everything after it in that request."""
        tol = self.tol if tol is None else tol
        check_tokens, check_logits = token_check, logit_check
        out: list[Outcome] = []
        top2 = oracle.logits.topk(2, dim=-1).values
        gap = top2[..., 0] - top2[..., 1]
        for r in range(oracle.draft_tokens.shape[0]):
            for step in range(oracle.draft_tokens.shape[1]):
                o_tok, c_tok = int(oracle.draft_tokens[r, step]), int(cand.draft_tokens[r, step])
                diff = float((oracle.logits[r, step] - cand.logits[r, step]).abs().max())
                if diff > tol * max(1.0, float(oracle.logits[r, step].abs().max()) / 10):
                    if o_tok != c_tok and float(gap[r, step]) < 2 * tol:
                        out.append(Outcome(check_tokens, "indeterminate", candidate=name, step=step))
                        break
                    out.append(Outcome(check_logits, "failed",
                                       f"{name}: request {r} step {step}: logits differ by {diff:.3g} "
                                       f"(tolerance {tol:g})", name, step))
                    break
                out.append(Outcome(check_logits, "passed", candidate=name))
                if o_tok == c_tok:
                    out.append(Outcome(check_tokens, "passed", candidate=name))
                    continue
                if float(gap[r, step]) < 2 * tol:
                    out.append(Outcome(check_tokens, "indeterminate", candidate=name, step=step))
                else:
                    out.append(Outcome(check_tokens, "failed",
                                       f"{name}: request {r} step {step}: draft token {c_tok}, "
                                       f"oracle {o_tok} (oracle top-2 gap {float(gap[r, step]):.3g})",
                                       name, step))
                break
        return out

    def _expected_slots(self, batch: DraftBatch, k: int, upto: Sequence[int] | None = None) -> set[int]:
        """Slots each real request writes: its new tokens, then one per decode step (clamped);
        ``upto[r]`` limits request ``r`` to its first ``upto[r]`` decode steps."""
        bs, mml = self.config.block_size, self.config.max_model_len
        slots: set[int] = set()
        for r, (ctx, new, row) in enumerate(zip(batch.context_lens, batch.new_tokens, batch.block_table)):
            steps = k - 1 if upto is None else upto[r]
            for pos in range(ctx, ctx + len(new)):
                slots.add(row[pos // bs] * bs + pos % bs)
            base = ctx + len(new)
            for s in range(steps):
                pos = min(base + s, mml - 1)
                slots.add(row[pos // bs] * bs + pos % bs)
        return slots

    def _kv_untouched(
        self, batch: DraftBatch, k: int, start: list[tuple[torch.Tensor, torch.Tensor]],
        after: list[tuple[torch.Tensor, torch.Tensor]], name: str,
    ) -> list[Outcome]:
        """Nothing outside the expected slots and the sink block changed."""
        expected = self._expected_slots(batch, k)
        bs = self.config.block_size
        for layer, ((k0, v0), (k1, v1)) in enumerate(zip(start, after)):
            changed = ((k0 != k1) | (v0 != v1)).flatten(2).any(-1).flatten()
            changed[SINK_BLOCK * bs : (SINK_BLOCK + 1) * bs] = False
            stray = sorted(set(torch.nonzero(changed).flatten().tolist()) - expected)
            if stray:
                owner = {b: r for r, row in enumerate(batch.block_table) for b in row}
                where = ", ".join(
                    f"slot {s} (block {s // bs}, {'request ' + str(owner[s // bs]) if s // bs in owner else 'unowned'})"
                    for s in stray[:4]
                )
                return [Outcome("kv_cache", "failed",
                                f"{name}: layer {layer} wrote {len(stray)} slot(s) outside the expected "
                                f"ones: {where} — a padding lane or a stale slot mapping writes a live block",
                                name)]
        return [Outcome("kv_cache", "passed", candidate=name)]

    def _kv_matches(
        self, batch: DraftBatch, k: int, oracle_kv: list[tuple[torch.Tensor, torch.Tensor]],
        kv: list[tuple[torch.Tensor, torch.Tensor]], oracle: DraftResult, cand: DraftResult, name: str,
    ) -> list[Outcome]:
        """The expected slots hold the oracle's values, up to each request's first token
        divergence (later slots were computed from different inputs)."""
        upto = []
        for r in range(batch.num_reqs):
            same = (oracle.draft_tokens[r] == cand.draft_tokens[r]).tolist() + [False]
            upto.append(min(same.index(False), k - 1))
        slots = torch.tensor(sorted(self._expected_slots(batch, k, upto)), dtype=torch.long)
        for layer, ((ko, vo), (kc, vc)) in enumerate(zip(oracle_kv, kv)):
            for label, a, b in (("keys", ko, kc), ("values", vo, vc)):
                a_s = a.flatten(0, 1)[slots].float().cpu()
                b_s = b.flatten(0, 1)[slots].float().cpu()
                diff = (a_s - b_s).abs()
                if diff.numel() and float(diff.max()) > self.tol:
                    bad = int(slots[diff.flatten(1).amax(1).argmax()])
                    return [Outcome("kv_cache", "failed",
                                    f"{name}: layer {layer} {label} at slot {bad} differ from the oracle "
                                    f"by {float(diff.max()):.3g}", name)]
        return [Outcome("kv_cache", "passed", candidate=name)]

    def _compare_steps(
        self, oracle: dict[int, dict[str, torch.Tensor]], cand: dict[int, dict[str, torch.Tensor]], name: str
    ) -> list[Outcome]:
        """Every metadata tensor after every step equals the oracle's fresh eager build."""
        if not oracle:
            return [Outcome("step_metadata", "skipped", "single draft step", name)]
        for step in sorted(oracle):
            if step not in cand:
                return [Outcome("step_metadata", "failed",
                                f"{name}: no metadata observed before draft step {step}", name, step)]
            for path, expected in oracle[step].items():
                got = cand[step].get(path)
                if got is None or not same_value(expected, got):
                    detail = "missing" if got is None else _difference(expected, got)
                    return [Outcome("step_metadata", "failed",
                                    f"{name}: before draft step {step}, {path} differs from a fresh "
                                    f"eager build ({detail}) — the refresh does not recompute it",
                                    name, step, path)]
        return [Outcome("step_metadata", "passed", candidate=name)]

    def _declared_fields(
        self, spec: AutoregressiveSpeculator, recorder: StepMetadataRecorder,
        oracle: dict[int, dict[str, torch.Tensor]],
    ) -> list[Outcome]:
        """Claims audit: derived tensors that change between steps must be declared in the
        builder's ``step_dependent_fields``, and every declared field must exist. Views of
        the speculator's own input buffers are not derived (the speculator advances them),
        and a persistent buffer behind a declared field is covered by that declaration."""
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
            covered = inputs | {recorder.storage_of[p] for p in declared if p in recorder.storage_of}
            for path in sorted(changed - declared):
                if path.startswith(group.backend_name + ".") and recorder.storage_of[path] not in covered:
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
        """Draw ``settings.examples`` examples; on a failure, shrink it and record it."""
        state = {"shrinking": False}

        @seed(self.settings.seed)
        @settings(
            max_examples=self.settings.examples, database=None, deadline=None,
            phases=(Phase.generate, Phase.shrink), report_multiple_bugs=False,
            suppress_health_check=list(HealthCheck), print_blob=False,
        )
        @given(self.example_strategy())
        def check(example: Example) -> None:
            if not state["shrinking"]:
                report.examples += 1
                on_example(report.examples, example)
            outcomes = self.run_example(example)
            failed = [o for o in outcomes if o.result == "failed"]
            if failed:
                state["shrinking"] = True
                raise ExampleFailed(example, outcomes)
            if not state["shrinking"]:
                tally(report, outcomes)

        try:
            check()
        except ExampleFailed as failure:
            self.record_failure(report, failure.example, failure.outcomes)

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


def _difference(expected: torch.Tensor, got: torch.Tensor) -> str:
    if expected.shape != got.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    bad = (expected != got).flatten()
    first = int(torch.nonzero(bad).flatten()[0]) if bool(bad.any()) else 0
    return (f"{int(bad.sum())} of {bad.numel()} elements; first at flat index {first}: "
            f"{expected.flatten()[first].item()} expected, {got.flatten()[first].item()} found")
