"""Resolving the shipped matrix against runtime configs, and the speculator's fuse decision."""

from __future__ import annotations

from typing import Any

import pytest

from speccheck.contract.adapter_status import AdapterStatus
from speccheck.contract.constraints import describe_sizes, sizes_allow
from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.matrix_model import BackendEntry, Matrix, MultipleOf, RefreshStrategy
from speccheck.contract.resolution import (
    BackendResolution,
    FusedDecision,
    FusedVerdict,
    decide_fused_multi_step,
    resolve_backend,
    resolve_matrix,
)
from speccheck.contract.runtime_config import RuntimeConfig

MATRIX = load_matrix()
FA3_OK = dict(platform="cuda", compute_capability=90, block_size=4096, max_model_len=4096)


def resolve(name: str, **config: Any) -> BackendResolution:
    return resolve_backend(MATRIX.backend(name), RuntimeConfig(**config))


def test_fa3_fuses_at_dcp_1_with_one_cache_row_per_request() -> None:
    resolution = resolve("fa3", dcp_world_size=1, **FA3_OK)
    assert resolution.fused_multi_step is True
    assert resolution.refresh_strategy is RefreshStrategy.IN_GRAPH
    assert resolution.failures == ()
    assert resolution.reason == "dcp_world_size == 1 holds; refresh strategy in_graph"


def test_fa3_does_not_fuse_under_dcp_and_says_why_with_values() -> None:
    resolution = resolve("fa3", dcp_world_size=2, **FA3_OK)
    assert resolution.fused_multi_step is False
    assert resolution.refresh_strategy is RefreshStrategy.IN_GRAPH
    assert resolution.reason.startswith("requires dcp_world_size == 1, but dcp_world_size is 2 (")
    assert "decode context parallelism" in resolution.reason


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (dict(FA3_OK, block_size=16), "requires block_size == max_model_len, but block_size is "
         "16 and max_model_len is 4096 (This fa3-fwd build has paged KV compiled out"),
        (dict(FA3_OK, compute_capability=80), "requires compute_capability >= 90, but "
         "compute_capability is 80"),
        (dict(FA3_OK, dtype="float16"), "requires dtype in ['bfloat16'], but dtype is 'float16'"),
        (dict(FA3_OK, platform="rocm"), "requires platform in ['cuda'], but platform is 'rocm'"),
    ],
)
def test_fa3_constraints_block_fusing(config: dict[str, Any], reason: str) -> None:
    resolution = resolve("fa3", **config)
    assert resolution.fused_multi_step is False
    assert resolution.reason.startswith(reason)
    assert len(resolution.failures) == 1


def test_every_failure_is_reported_not_just_the_first() -> None:
    resolution = resolve("fa3", platform="cpu", dtype="float32", dcp_world_size=2)
    assert [failure.split(",")[0] for failure in resolution.failures] == [
        "requires platform in ['cuda']",
        "requires dtype in ['bfloat16']",
        "requires block_size == max_model_len",
        "requires dcp_world_size == 1",
    ]
    assert resolution.reason == "; ".join(resolution.failures)


@pytest.mark.parametrize("platform", ["cuda", "rocm", "cpu"])
@pytest.mark.parametrize("dcp_world_size", [1, 2])
def test_rocm_sparse_swa_never_fuses(platform: str, dcp_world_size: int) -> None:
    resolution = resolve("rocm_sparse_swa", platform=platform, dcp_world_size=dcp_world_size)
    assert resolution.fused_multi_step is False
    assert "draft_decode.supported is false: The ROCm ragged SWA indices and indptrs are not " \
        "adapted" in resolution.reason


def test_flashinfer_never_fuses_because_plan_runs_on_the_host() -> None:
    resolution = resolve("flashinfer")
    assert resolution.fused_multi_step is False
    assert resolution.refresh_strategy is RefreshStrategy.HOST_PREPLANNED
    assert resolution.reason == (
        "draft_decode.supported is false: The wrappers' plan() runs on the host and cannot be "
        "captured, so the metadata cannot be refreshed inside the graph between draft steps."
    )


@pytest.mark.parametrize(("name", "strategy"), [("triton_attn", "in_graph"), ("reference", "in_graph")])
@pytest.mark.parametrize("dcp_world_size", [1, 2])
def test_always_supported_backends_fuse_on_cuda(
    name: str, strategy: str, dcp_world_size: int
) -> None:
    resolution = resolve(name, platform="cuda", dcp_world_size=dcp_world_size)
    assert resolution.verdict is FusedVerdict.YES and resolution.fused_multi_step is True
    assert resolution.refresh_strategy.value == strategy
    assert resolution.reason == f"draft_decode.supported is true; refresh strategy {strategy}"


@pytest.mark.parametrize(("dcp_world_size", "verdict"), [
    (1, FusedVerdict.YES), (2, FusedVerdict.NO)])
def test_triton_mla_follows_its_dcp_condition(
    dcp_world_size: int, verdict: FusedVerdict
) -> None:
    resolution = resolve("triton_mla", dcp_world_size=dcp_world_size)
    assert resolution.verdict is verdict
    assert resolution.fused_multi_step is (verdict is FusedVerdict.YES)


def test_entry_without_adapter_is_declared_unverified_not_yes() -> None:
    resolution = resolve_backend(_entry(implementation=None), RuntimeConfig())
    assert resolution.verdict is FusedVerdict.DECLARED_UNVERIFIED
    assert resolution.adapter is AdapterStatus.NOT_SHIPPED
    assert resolution.fused_multi_step is False
    assert "no adapter is shipped" in resolution.reason
    assert resolution.to_json()["verdict"] == "declared, unverified"


def test_entry_whose_module_is_missing_is_declared_unverified() -> None:
    entry = _entry(implementation="speccheck.backends.nowhere.builder:Missing")
    resolution = resolve_backend(entry, RuntimeConfig())
    assert resolution.adapter is AdapterStatus.NOT_FOUND
    assert resolution.verdict is FusedVerdict.DECLARED_UNVERIFIED
    assert "speccheck.backends.nowhere.builder" in resolution.reason


def test_adapter_lookup_imports_nothing() -> None:
    import sys

    entry = _entry(implementation="tests.fixtures.adapters.faulty:DyingBuilder")
    before = set(sys.modules)
    assert resolve_backend(entry, RuntimeConfig(platform="cpu")).adapter is AdapterStatus.FOUND
    assert "tests.fixtures.adapters.faulty" not in set(sys.modules) - before


def test_cpu_backends() -> None:
    fused = {r.name for r in resolve_matrix(MATRIX, RuntimeConfig(platform="cpu", dtype="float32"))
             if r.fused_multi_step}
    assert fused == {"reference", "triton_attn", "triton_mla"}


def test_resolve_matrix_keeps_file_order_and_fields() -> None:
    resolutions = resolve_matrix(MATRIX, RuntimeConfig())
    assert [r.name for r in resolutions] == list(MATRIX.names)
    fa3 = resolutions[MATRIX.names.index("fa3")]
    assert fa3.cudagraph_support is not None and fa3.cudagraph_support.value == "always"
    assert fa3.implementation == "speccheck.backends.fa3.builder:FA3MetadataBuilder"


def _entry(**overrides: Any) -> BackendEntry:
    data: dict[str, Any] = {
        "name": "alpha",
        "display_name": "Alpha",
        "description": "A test backend.",
        "implementation": "speccheck.backends.reference.builder:ReferenceMetadataBuilder",
        "platforms": ["cuda"],
        "package": {"distribution": "alpha", "import_name": "alpha"},
        "cudagraph_support": "always",
        "draft_decode": {"supported": True, "refresh_strategy": "none_needed"},
    }
    data.update(overrides)
    return BackendEntry.model_validate(data)


def test_full_graphs_need_some_cudagraph_support() -> None:
    entry = _entry(cudagraph_support="never")
    assert not resolve_backend(entry, RuntimeConfig(cudagraph_mode="full")).fused_multi_step
    assert resolve_backend(entry, RuntimeConfig(cudagraph_mode="none")).fused_multi_step


@pytest.mark.parametrize(
    ("constraints", "config", "reason"),
    [
        ({"head_sizes": [64, 128]}, {"head_size": 96},
         "requires head_size in [64, 128], but head_size is 96"),
        ({"block_sizes": {"multiple_of": 16}}, {"block_size": 8},
         "requires block_size to be a multiple of 16, but block_size is 8"),
        ({"block_sizes": {"multiple_of": 16, "max": 64}}, {"block_size": 128},
         "requires block_size to be a multiple of 16 (at most 64), but block_size is 128"),
        ({"kv_cache_dtypes": ["auto"]}, {"kv_cache_dtype": "fp8_e4m3"},
         "requires kv_cache_dtype in ['auto'], but kv_cache_dtype is 'fp8_e4m3'"),
        ({"conditions": [{"condition": "dp_size == 1", "reason": "No DP."}]}, {"dp_size": 2},
         "requires dp_size == 1, but dp_size is 2 (No DP.)"),
    ],
)
def test_constraint_reasons_carry_the_values(
    constraints: dict[str, Any], config: dict[str, Any], reason: str
) -> None:
    resolution = resolve_backend(_entry(constraints=constraints), RuntimeConfig(**config))
    assert resolution.fused_multi_step is False
    assert resolution.reason == reason


def test_compute_capability_only_matters_on_cuda() -> None:
    entry = _entry(platforms=["cuda", "cpu"], min_compute_capability=90)
    on_cpu = RuntimeConfig(platform="cpu", compute_capability=0)
    assert resolve_backend(entry, on_cpu).fused_multi_step
    assert not resolve_backend(entry, RuntimeConfig(compute_capability=89)).fused_multi_step


def test_sizes() -> None:
    assert sizes_allow((16, 32), 32) and not sizes_allow((16, 32), 48)
    assert sizes_allow(MultipleOf(multiple_of=16), 48)
    assert not sizes_allow(MultipleOf(multiple_of=16, max=32), 48)
    assert describe_sizes((16, 32)) == "16, 32"
    assert describe_sizes(MultipleOf(multiple_of=8, max=256)) == "a multiple of 8 (at most 256)"


# --- decide_fused_multi_step ---------------------------------------------------------------


@pytest.mark.parametrize("groups", [[], [("fa3", True)], [("flashinfer", False)]])
def test_single_step_speculation_is_never_fused(groups: list[tuple[str, bool]]) -> None:
    decision = decide_fused_multi_step(RuntimeConfig(num_speculative_steps=1), groups)
    assert decision == FusedDecision(
        False,
        "Fused multi-step draft decode is off: num_speculative_steps is 1, so there is only one "
        "draft step.",
        (),
    )


def test_non_advancing_drafters_are_always_fused() -> None:
    config = RuntimeConfig(num_speculative_steps=4, advance_draft_positions=False)
    decision = decide_fused_multi_step(config, [("flashinfer", False)])
    assert decision.enabled is True
    assert decision.blocking_backends == ()
    assert "does not advance draft positions" in decision.reason


def test_fused_when_every_group_supports_it() -> None:
    decision = decide_fused_multi_step(
        RuntimeConfig(num_speculative_steps=3), [("triton_attn", True), ("fa3", True)]
    )
    assert decision.enabled is True
    assert decision.reason == (
        "Fused multi-step draft decode is on: every attention group supports draft-decode "
        "metadata update (backends: fa3, triton_attn)."
    )


def test_one_unsupported_group_forces_the_fallback() -> None:
    decision = decide_fused_multi_step(
        RuntimeConfig(num_speculative_steps=3),
        [("triton_attn", True), ("flashinfer", False), ("fa3", True)],
    )
    assert decision == FusedDecision(
        False,
        "Fused multi-step draft decode is not supported by attention backend(s) flashinfer; "
        "falling back to rebuilding attention metadata between draft steps.",
        ("flashinfer",),
    )


def test_blocking_backends_are_sorted_and_unique() -> None:
    decision = decide_fused_multi_step(
        RuntimeConfig(),
        [("sparse_swa", True), ("rocm_sparse_swa", False), ("flashinfer", False),
         ("flashinfer", False)],
    )
    assert decision.blocking_backends == ("flashinfer", "rocm_sparse_swa")
    assert "backend(s) flashinfer, rocm_sparse_swa;" in decision.reason


def test_no_groups_is_vacuously_fused() -> None:
    assert decide_fused_multi_step(RuntimeConfig(), []).enabled is True


def test_decision_from_resolutions_of_the_shipped_matrix() -> None:
    config = RuntimeConfig(dcp_world_size=2, **FA3_OK)
    by_name = {r.name: r.fused_multi_step for r in resolve_matrix(MATRIX, config)}
    groups = [(name, by_name[name]) for name in ("triton_attn", "fa3", "triton_mla")]
    decision = decide_fused_multi_step(config, groups)
    assert decision.blocking_backends == ("fa3", "triton_mla")


def test_results_are_frozen() -> None:
    decision = decide_fused_multi_step(RuntimeConfig(), [])
    with pytest.raises(AttributeError):
        decision.enabled = False  # type: ignore[misc]
    assert isinstance(MATRIX, Matrix)


def test_entry_whose_class_is_a_typo_is_declared_unverified_with_a_suggestion() -> None:
    """A typo in the class part of ``module:Class`` is found from the module's source alone:
    ``speccheck matrix`` and ``docs`` never say "yes" for it."""
    import sys

    from speccheck.contract.adapter_status import missing_class

    typo = "speccheck.backends.reference.builder:ReferenceMetadataBuildr"
    before = set(sys.modules)
    resolution = resolve_backend(_entry(implementation=typo), RuntimeConfig())
    assert resolution.adapter is AdapterStatus.CLASS_NOT_FOUND
    assert resolution.verdict is FusedVerdict.DECLARED_UNVERIFIED
    assert "implementation class" in resolution.reason
    assert "torch" not in set(sys.modules) - before
    why = missing_class(typo)
    assert why is not None and "did you mean 'ReferenceMetadataBuilder'?" in why
    correct = typo.removesuffix("Buildr") + "Builder"
    assert missing_class(correct) is None
    assert resolve_backend(_entry(implementation=correct),
                           RuntimeConfig(platform="cpu")).adapter is AdapterStatus.FOUND
