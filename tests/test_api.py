"""The public Python API (``speccheck.verify``, ``load_matrix``, ``resolve``, re-exported
lazily at the package root): what ``import speccheck`` costs, bad input, and a real
verification through its worker process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import speccheck
from speccheck.checks.api import (
    EXIT_FAILED,
    EXIT_NOTHING_VERIFIED,
    EXIT_PASSED,
    VerifyReport,
    plan_verification,
)
from speccheck.checks.verify.report import BackendReport, Failure, merge_shards
from speccheck.checks.verify.scale import default_jobs, memory_jobs
from speccheck.checks.verify.vocabulary import Check, Status, Tier
from speccheck.contract.runtime_config import RuntimeConfig
from tests.fixtures.adapters.out_of_tree import PlusOneBuilder

ROOT = Path(__file__).resolve().parents[1]
OUT_OF_TREE = ROOT / "tests" / "fixtures" / "adapters" / "out_of_tree.yaml"


class RenamedPlusOne(PlusOneBuilder):
    """Claims the entry ``plus_one``, which names :class:`PlusOneBuilder`, not this class."""


def test_import_is_fast_and_torch_free() -> None:
    timed = subprocess.run([sys.executable, "-X", "importtime", "-c", "import speccheck"],
                           capture_output=True, text=True, check=True)
    modules = {line.split("|")[-1].strip() for line in timed.stderr.splitlines()}
    assert "speccheck" in modules and not any(m.split(".")[0] == "torch" for m in modules)
    used = subprocess.run(
        [sys.executable, "-c", "import sys, speccheck; "
         "m = speccheck.load_matrix(); speccheck.resolve(m, speccheck.RuntimeConfig()); "
         "speccheck.VerifyReport; speccheck.VerifyRun(examples=2).model_dump_json(); "
         "print('torch' in sys.modules)"],
        capture_output=True, text=True, check=True)
    assert used.stdout.strip() == "False"


def test_every_public_name_resolves() -> None:
    for name in speccheck.__all__:
        assert getattr(speccheck, name) is not None, name
        assert name in dir(speccheck)
    assert speccheck.resolve is speccheck.contract.resolution.resolve_matrix
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        speccheck.nope  # noqa: B018


def test_resolve_a_matrix_against_a_config() -> None:
    by_name = {r.name: r for r in speccheck.resolve(speccheck.load_matrix(OUT_OF_TREE),
                                                    RuntimeConfig(dcp_world_size=2))}
    assert not by_name["plus_one"].fused_multi_step
    assert by_name["plus_one"].reason.startswith("requires dcp_world_size == 1")


@pytest.mark.parametrize(("backend", "kwargs", "message"), [
    ("nope", {}, "unknown backend 'nope'; valid: reference, "),
    ("reference", {"examples": 0}, "examples should be greater than or equal to 1, got 0"),
    ("reference", {"config": {"platform": "cuda"}},
     "config: platform cannot be given to a verification (platform, compute capability and "
     "graph mode come from the machine); allowed: dcp_world_size, "),
    ("reference", {"config": {"dcp_world_size": 0, "dtype": "fp64"}},
     "config: dcp_world_size should be greater than or equal to 1, got 0; dtype should be "
     "'bfloat16', 'float16' or 'float32', got 'fp64'"),
    ("reference", {"config": {"num_speculative_steps": 3}, "steps": [2]},
     "give steps or config num_speculative_steps, not both"),
    ("reference", {"steps": [0, 2]}, "steps: draft step counts must be at least 1, got [0, 2]"),
    ("reference", {"jobs": 17}, "jobs should be less than or equal to 16, got 17"),
    ("reference", {"examples": 0, "example_timeout": 0},
     "examples should be greater than or equal to 1, got 0; example_timeout should be "
     "greater than 0, got 0"),
    ("reference", {"exmaples": 3}, "exmaples: not an option of a verification; options: "),
    ("reference", {"reproduce": "not-a-blob"}, "--reproduce: not an example blob"),
    ("reference", {"reproduce": "not-a-blob", "config": {"dp_size": 2}},
     "--reproduce runs one example in one worker; it cannot be combined with --dp-size"),
    ("reference", {"capture_sizes": [0, 4]},
     "capture_sizes: request counts must lie in 1..1024, got [0, 4]"),
    (RenamedPlusOne, {"matrix": OUT_OF_TREE},
     "the matrix entry 'plus_one' names implementation "
     "'tests.fixtures.adapters.out_of_tree:PlusOneBuilder', not "),
    (PlusOneBuilder, {}, "PlusOneBuilder.backend_name is 'plus_one', which no entry of the "
     "shipped matrix and the installed plug-ins declares"),
    (int, {}, "backend must be a backend name or an AttentionMetadataBuilder subclass"),
])
def test_bad_input_is_one_line_before_any_worker(
    backend: object, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(speccheck.VerifyInputError) as caught:
        plan_verification(backend, **kwargs)  # type: ignore[arg-type]
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_a_class_defined_in_a_function_cannot_reach_a_worker() -> None:
    class Local(PlusOneBuilder):
        pass

    with pytest.raises(speccheck.VerifyInputError, match="cannot be imported by a worker "
                       "process, which imports builders by 'module:Class'"):
        plan_verification(Local, matrix=OUT_OF_TREE)


def test_a_bad_matrix_is_a_matrix_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 2\n")
    with pytest.raises(speccheck.MatrixError, match=r"bad.yaml:1: "):
        speccheck.verify("reference", matrix=bad)


def test_plan_settles_the_tier_config_and_reproduce_command() -> None:
    plan = plan_verification("plus_one", matrix=OUT_OF_TREE, capture_sizes=[4, 1, 4],
                             config=RuntimeConfig(num_speculative_steps=3, dcp_world_size=1))
    run = plan.verify_run
    assert plan.names == ("plus_one",) and run.draft_steps == (3,) and run.capture_sizes == (1, 4)
    assert plan.config.platform == ("cuda" if plan.tier is Tier.GPU else "cpu")
    assert run.config == {"dcp_world_size": 1, "num_speculative_steps": 3}
    assert plan.task("plus_one").reproduce_prefix == (
        f"speccheck verify --backend plus_one --seed 0 --matrix {OUT_OF_TREE} "
        "--capture-sizes 1,4 --dcp-world-size 1 --num-speculative-steps 3")
    assert plan.task("plus_one", claim_fused=True).reproduce_prefix.endswith(
        "--num-speculative-steps 3 --audit-claims")
    assert plan_verification("reference").verify_run.draft_steps == tuple(range(1, 9))


def test_verify_a_builder_class_in_its_worker() -> None:
    report = speccheck.verify(PlusOneBuilder, matrix=OUT_OF_TREE, examples=3,
                              config={"num_speculative_steps": 2}, cells=False)
    assert (report.status, report.passed, report.exit_code) == (Status.PASSED, True, EXIT_PASSED)
    assert report.matrix == OUT_OF_TREE and report.config.num_speculative_steps == 2
    (backend,) = report.backends
    assert backend.backend == "plus_one" and backend.examples == 3
    verdicts = {v.check: v for v in report.verdicts("plus_one")}
    assert verdicts[Check.STEP_METADATA].status is Status.PASSED
    assert verdicts[Check.DP_TOKEN_COUNT].status is Status.SKIPPED
    assert report.summary_lines() == []


def _report(*backends: BackendReport) -> VerifyReport:
    return VerifyReport(backends, Tier.CPU, "CPU", RuntimeConfig(), None)


def test_overall_status_and_exit_code_follow_the_command() -> None:
    passed = BackendReport("a", Tier.CPU, Status.PASSED, fused_allowed=True)
    skipped = BackendReport("b", Tier.NONE, Status.SKIPPED, detail="runs on cuda")
    crashed = BackendReport("c", Tier.CPU, Status.CRASHED, detail="worker exited with status 139")
    assert _report(passed, skipped).exit_code == EXIT_PASSED
    assert _report(skipped).status is Status.SKIPPED
    assert _report(skipped).exit_code == EXIT_NOTHING_VERIFIED
    assert _report(passed, crashed).exit_code == EXIT_FAILED
    assert _report(passed, crashed).summary_lines() == [
        "c: crashed: worker exited with status 139"]
    assert {v.status for v in _report(skipped).verdicts("b")} == {Status.SKIPPED}
    with pytest.raises(KeyError, match="'z' was not verified; verified: a"):
        _report(passed).backend("z")


def test_a_failed_check_carries_its_diagnosis_and_reproduce_command() -> None:
    failed = BackendReport("a", Tier.CPU, Status.FAILED, fused_allowed=True,
                           failures=[Failure(Check.STEP_METADATA, "fused_eager: stale kv_lens",
                                             "fused_eager", 2, "a.metadata.kv_lens")],
                           minimal_example={"num_speculative_steps": 2},
                           reproduce="speccheck verify --backend a --reproduce BLOB")
    failed.checks[Check.DRAFT_TOKENS].passed = 4
    report = _report(failed)
    verdicts = {v.check: v for v in report.verdicts("a")}
    assert verdicts[Check.STEP_METADATA].message.splitlines() == [
        "a: step_metadata failed on the CPU tier, on the minimal example:",
        "  fused_eager: stale kv_lens",
        'minimal example: {"num_speculative_steps": 2}',
        "reproduce: speccheck verify --backend a --reproduce BLOB",
    ]
    assert verdicts[Check.DRAFT_TOKENS].status is Status.PASSED
    assert report.summary_lines()[0] == (
        "FAIL a step_metadata step 2 field a.metadata.kv_lens: fused_eager: stale kv_lens")


def test_a_backends_verify_defaults_sit_between_the_tier_and_the_flags() -> None:
    """fa3's entry verifies at block_size = max_model_len = 16384 unless told otherwise; a
    given field wins; a backend without verify_defaults gets the tier's."""
    plan = plan_verification("fa3")
    assert (plan.config_for("fa3").block_size, plan.config_for("fa3").max_model_len) == (16384, 16384)
    given = plan_verification("fa3", config={"max_model_len": 512, "block_size": 512})
    assert given.config_for("fa3").max_model_len == 512
    assert plan_verification("reference").config_for("reference") == plan.config
    settings = plan.settings_for("fa3")
    assert settings.config == plan.config_for("fa3")
    assert settings.steps == plan.verify_run.draft_steps


def test_serving_scale_batches_run_on_the_cpu_tier() -> None:
    """The GPU tier's batch scale (64 requests of up to 16 new tokens, K 1..8) through the
    whole pipeline on the CPU at a short max_model_len: hypothesis' per-example budget, the
    prefill budget and the shared KV cache hold at that scale."""
    report = plan_verification("reference", config={"max_model_len": 512, "block_size": 16},
                               capture_sizes=[1, 2, 4, 8, 16, 32, 64], max_new_tokens=16,
                               examples=12, cells=False).run()
    (backend,) = report.backends
    assert report.passed, report.summary_lines()
    assert backend.examples == 12 and backend.checks[Check.DRAFT_TOKENS].passed > 0


def test_merged_shards_sum_their_examples_and_keep_the_worst_status() -> None:
    """``verify --jobs``: tallies and examples add up; the first of the worst reports
    (crashed before failed before passed) brings its failures and reproduce command."""
    def shard(status: Status, examples: int, passed: int, name: str) -> BackendReport:
        report = BackendReport("a", Tier.CPU, status, examples=examples, capture_seconds=1.0,
                               reproduce=f"speccheck verify --backend a --reproduce {name}",
                               failures=[Failure(Check.KV_CACHE, name)] if status is Status.FAILED else [])
        report.checks[Check.DRAFT_TOKENS].passed = passed
        return report

    merged = merge_shards([shard(Status.PASSED, 3, 10, "p"), shard(Status.FAILED, 2, 4, "f1"),
                           shard(Status.FAILED, 1, 1, "f2")], seconds=7.5)
    assert (merged.status, merged.examples, merged.seconds, merged.capture_seconds) == (
        Status.FAILED, 6, 7.5, 3.0)
    assert merged.checks[Check.DRAFT_TOKENS].passed == 15
    assert [f.diagnosis for f in merged.failures] == ["f1"]
    assert merged.reproduce is not None and merged.reproduce.endswith("f1")
    crashed = merge_shards([shard(Status.FAILED, 1, 0, "f"), shard(Status.CRASHED, 0, 0, "c")], 1.0)
    assert crashed.status is Status.CRASHED and crashed.reproduce is not None
    assert crashed.reproduce.endswith("c")


@pytest.mark.parametrize(("tier", "examples", "cpus", "gib", "jobs"), [
    (Tier.GPU, 200, 16, 139.8, 2), (Tier.GPU, 100, 16, 139.8, 2), (Tier.GPU, 99, 16, 139.8, 1),
    (Tier.GPU, 200, 3, 139.8, 1), (Tier.GPU, 200, 4, 139.8, 2), (Tier.GPU, 200, 16, 63.5, 1),
    (Tier.GPU, 200, 16, 24.0, 1), (Tier.GPU, 1, 16, 139.8, 1), (Tier.CPU, 200, 64, 0.0, 1),
])
def test_jobs_default_to_two_workers_where_the_gpu_tier_machine_holds_them(
    tier: Tier, examples: int, cpus: int, gib: float, jobs: int
) -> None:
    """Two workers on the GPU tier where each gets 50 examples, two CPU cores and 32 GiB of
    the device; one otherwise, and always one on the CPU tier."""
    assert default_jobs(tier, examples, cpus, gib) == jobs


@pytest.mark.parametrize(("gib", "dtype", "hidden", "jobs"), [
    (79.2, "bfloat16", 2048, 2), (79.2, "float32", 2048, 1), (139.8, "float32", 2048, 2),
    (24.0, "float32", 2048, 1), (79.2, "float16", 4096, 1), (139.8, "float16", 4096, 2),
    (79.2, "bfloat16", 512, 2),
])
def test_fp32_or_wider_configurations_workers_ask_more_device_memory(
    gib: float, dtype: str, hidden: int, jobs: int
) -> None:
    """Two fp32 workers ran an 80 GiB H100 out of memory (34 and 44 GiB), and so did two
    fp16 workers of a 32-head cell (36 and 42 GiB); a narrower drafter asks no less."""
    assert memory_jobs(gib, dtype, hidden) == jobs


def test_a_wider_kv_cache_asks_more_device_memory() -> None:
    """The heads cell's 8 KV heads of 128 (twice the GPU tier's 4) ask twice the memory."""
    assert memory_jobs(79.2, "bfloat16", 24 * 128, 8 * 128) == 1
    assert memory_jobs(139.8, "bfloat16", 24 * 128, 8 * 128) == 2
    assert memory_jobs(79.2, "bfloat16", 16 * 128, 4 * 128) == 2


def test_jobs_split_the_examples_and_seeds_as_the_workers_draw_them() -> None:
    """On this (CPU) tier the default is one worker; ``jobs`` splits the examples as evenly
    as they go, worker ``i`` on ``seed + i``, and each worker's engine settings say so."""
    assert plan_verification("reference", examples=50).jobs == 1
    plan = plan_verification("reference", examples=7, seed=3, jobs=3)
    assert [(t.examples, t.seed) for t in plan.shard_tasks("reference")] == [(3, 3), (2, 4), (2, 5)]
    assert all(t.run == plan.verify_run for t in plan.shard_tasks("reference"))
    assert [(s.examples, s.seed) for s in plan.shard_settings("reference")] == [
        (3, 3), (2, 4), (2, 5)]
    assert plan_verification("reference", examples=2, jobs=3).shards("reference") == 2
    assert plan_verification("reference", examples=4, jobs=2,
                             config={"dp_size": 2}).shards("reference") == 1


def test_the_shrink_budget_reaches_every_worker() -> None:
    """``shrink_seconds`` (``--shrink-seconds``) is each worker's: in its engine settings and
    in the task a worker process reads; the default is the engine's own; a negative or
    NaN budget is bad input."""
    from speccheck.checks.verify.run import WorkerTask
    from speccheck.checks.verify.scale import DEFAULT_SHRINK_SECONDS

    assert plan_verification("reference").settings_for("reference").shrink_seconds == (
        DEFAULT_SHRINK_SECONDS)
    plan = plan_verification("reference", examples=4, jobs=2, shrink_seconds=7.5)
    assert [s.shrink_seconds for s in plan.shard_settings("reference")] == [7.5, 7.5]
    sent = plan.task("reference").model_dump_json()
    assert WorkerTask.model_validate_json(sent).run.shrink_seconds == 7.5
    for bad, why in ((-1.0, "greater than or equal to 0"), (float("nan"), "a finite number")):
        with pytest.raises(speccheck.VerifyInputError, match=f"shrink_seconds should be {why}"):
            plan_verification("reference", shrink_seconds=bad)


