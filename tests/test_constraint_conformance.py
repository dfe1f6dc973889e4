"""Every shipped adapter serves exactly the configurations its ``matrix.yaml`` entry admits.

Generated from the shipped matrix: one case per entry with an implementation. Hypothesis
draws runtime configs over the fields the constraints talk about (dtype, KV-cache dtype,
head size, block size and ``max_model_len``, head layout, MLA sizes, sliding window,
platform, compute capability), biased towards each entry's allowed values so that both
directions occur, and whether the drafter's pass is causal (``causal_only``); the layer has the KV layout the entry reads (GQA keys and values unless
it says ``latent``). When the matrix
admits a config, ``build_attention_groups`` builds the real builder and one attention
forward through its impl matches the fp32 reference on a tiny batch; when it rejects one,
construction raises :class:`ConstraintViolation` carrying the matrix's reason for every
broken requirement. Adapters that need CUDA (fa3, flashinfer) check the refusals on any
machine, since enforcement runs before the kernel import, and the acceptances on a GPU.
"""

from __future__ import annotations

import json
from typing import Any, get_args

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from speccheck.backends.reference.attention import paged_attention_reference
from speccheck.checks.cli.app import app
from speccheck.checks.docgen.capabilities import render_capability_docs
from speccheck.contract.builder import AttentionLayerSpec, AttentionMetadataBuilder, BuilderLimits
from speccheck.contract.conditions import evaluate_condition
from speccheck.contract.constraints import (
    ConstraintViolation,
    causality_failures,
    constraint_failures,
    enforce_constraints,
    layer_config,
    platform_failures,
    sizes_allow,
)
from speccheck.contract.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from speccheck.contract.matrix_loader import load_matrix, parse_matrix
from speccheck.contract.matrix_model import BackendEntry, KvLayout, Matrix, MultipleOf
from speccheck.contract.metadata import AttentionInputBuffers
from speccheck.contract.resolution import resolve_backend
from speccheck.contract.runtime_config import DtypeName, KvCacheDtypeName, RuntimeConfig
from speccheck.contract.token_count import build_attention_metadata
from speccheck.speculator.attention_setup import build_attention_groups
from speccheck.speculator.model import DTYPES

MATRIX = load_matrix()
SHIPPED = [entry.name for entry in MATRIX.backends if entry.implementation is not None]
CPU_RUNNABLE = [name for name in SHIPPED if "cpu" in MATRIX.backend(name).platforms]
CUDA_ONLY = [name for name in SHIPPED if "cpu" not in MATRIX.backend(name).platforms
             and "cuda" in MATRIX.backend(name).platforms]
"""Adapters that need an NVIDIA GPU (ROCm-only adapters, such as rocm_sparse_swa, have no
machine here to serve on)."""

HEAD_SIZES = (8, 12, 16, 24, 32, 64, 100, 128, 256, 264)
"""Head sizes every adapter is tried with, on top of its own allowed ones."""
MAX_MODEL_LENS = (16, 32, 64)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
"""atol = rtol of the forward against the fp32 reference, per dtype."""
LIMITS = BuilderLimits(max_num_reqs=2, max_num_tokens=4)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""Where CPU-runnable adapters run admitted configs: the Triton interpreter on CPU (conftest
sets it when there is no GPU), compiled kernels on a GPU."""
SEQ_LENS = (3, 16)
"""KV lengths of the two requests of the tiny batch (the second capped at max_model_len)."""
QUERY_LENS = (1, 2)


def test_the_matrix_ships_adapters_of_both_kinds() -> None:
    assert set(CPU_RUNNABLE) >= {"reference", "triton_attn"}
    assert set(CUDA_ONLY) >= {"fa3", "flashinfer"}


# --- the oracle: what the entry's data says, requirement by requirement --------------------


def broken_requirements(entry: BackendEntry, config: RuntimeConfig,
                        causal: bool = True) -> list[str]:
    """For every requirement of ``entry`` that ``config`` (and a pass that is ``causal`` or
    not) breaks, the text its refusal must contain: the matrix's reason when it gives one,
    else the "requires FIELD" phrase. Read straight from the entry's data, independently of
    how refusals are assembled."""
    constraints = entry.constraints
    broken = []
    if config.platform not in entry.platforms:
        broken.append("requires platform")
    minimum = entry.min_compute_capability
    if minimum is not None and config.platform == "cuda" and config.compute_capability < minimum:
        broken.append("requires compute_capability")
    for name, field in (("dtypes", "dtype"), ("kv_cache_dtypes", "kv_cache_dtype")):
        allowed = getattr(constraints, name)
        if allowed is not None and getattr(config, field) not in allowed:
            broken.append(constraints.reason_for(name) or f"requires {field}")
    for name, field in (("head_sizes", "head_size"), ("block_sizes", "block_size")):
        spec = getattr(constraints, name)
        if spec is not None and not sizes_allow(spec, getattr(config, field)):
            broken.append(constraints.reason_for(name) or f"requires {field}")
    for constraint in constraints.conditions:
        if not evaluate_condition(constraint.condition, config):
            broken.append(constraint.reason)
    if constraints.causal_only and not causal:
        broken.append(constraints.reason_for("causal_only") or "requires causal attention")
    return broken


def _allowed_head_sizes(entry: BackendEntry) -> tuple[int, ...]:
    spec = entry.constraints.head_sizes
    if spec is None:
        return HEAD_SIZES
    if isinstance(spec, MultipleOf):
        top = spec.max if spec.max is not None else 8 * spec.multiple_of
        return tuple(range(spec.multiple_of, top + 1, spec.multiple_of))
    return spec


@st.composite
def runtime_configs(
    draw: st.DrawFn,
    entry: BackendEntry,
    *,
    platform: str | None = None,
    compute_capability: int | None = None,
) -> RuntimeConfig:
    """A runtime config for ``entry``: each constrained field comes, with even odds, from
    the entry's allowed values or from the whole vocabulary. ``platform`` and
    ``compute_capability`` pin those fields (to the machine the test runs on)."""
    all_dtypes: tuple[str, ...] = get_args(DtypeName)
    dtype = draw(st.sampled_from(entry.constraints.dtypes or all_dtypes)
                 | st.sampled_from(all_dtypes))
    kv_cache_dtype = draw(st.sampled_from(("auto", dtype))
                          | st.sampled_from(get_args(KvCacheDtypeName)))
    head_size = draw(st.sampled_from(_allowed_head_sizes(entry)) | st.sampled_from(HEAD_SIZES))
    max_model_len = draw(st.sampled_from(MAX_MODEL_LENS))
    block_size = draw(st.just(max_model_len) | st.sampled_from((1, 4, 16)))
    latent = entry.constraints.kv_layout is KvLayout.LATENT
    num_kv_heads = 1 if latent else draw(st.sampled_from((1, 2)))
    group = draw(st.sampled_from((1, 2, 3)))
    kv_lora_rank = draw(st.just(16) | st.sampled_from((16, 32, 48)))
    qk_rope_head_dim = draw(st.just(16) | st.sampled_from((8, 16)))
    sliding_window = draw(st.just(0) | st.sampled_from((0, 3)))
    if platform is None:
        platform = draw(st.sampled_from(entry.platforms) | st.sampled_from(("cuda", "cpu", "rocm")))
    if compute_capability is None:
        compute_capability = draw(st.sampled_from((entry.min_compute_capability or 90, 80)))
    return RuntimeConfig(
        platform=platform, compute_capability=compute_capability, dtype=dtype,
        kv_cache_dtype=kv_cache_dtype, head_size=head_size, block_size=block_size,
        max_model_len=max_model_len, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
        kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
        sliding_window=sliding_window, cudagraph_mode="none",
    )


def layer_of(config: RuntimeConfig, entry: BackendEntry) -> AttentionLayerSpec:
    """The layer ``config`` describes, in the KV layout ``entry`` reads."""
    return AttentionLayerSpec(
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_size=config.head_size,
        dtype=DTYPES[config.dtype], block_size=config.block_size,
        max_model_len=config.max_model_len, kv_layout=entry.constraints.kv_layout or KvLayout.NHD,
        kv_lora_rank=config.kv_lora_rank, qk_rope_head_dim=config.qk_rope_head_dim,
        sliding_window=config.sliding_window,
    )


def build(name: str, config: RuntimeConfig, device: torch.device,
          causal: bool = True) -> AttentionMetadataBuilder[Any]:
    """``name``'s builder for ``config``, for a drafter whose passes are ``causal`` or not."""
    (group,) = build_attention_groups(
        [name], layer_of(config, MATRIX.backend(name)), config, device, LIMITS, matrix=MATRIX,
        non_causal=not causal,
    )
    return group.builder


def assert_refused(name: str, config: RuntimeConfig, broken: list[str],
                   causal: bool = True) -> None:
    """Building ``name`` for ``config`` (and a drafter whose passes are ``causal`` or not)
    raises ConstraintViolation naming every broken requirement with its matrix reason, as
    ``speccheck matrix`` does for the configuration's."""
    with pytest.raises(ConstraintViolation) as info:
        build(name, config, torch.device("cpu"), causal)
    refusal = info.value
    assert refusal.backend == name
    assert len(refusal.failures) == len(broken), (refusal.failures, broken)
    for text in broken:
        assert text in str(refusal), (text, str(refusal))
    entry = MATRIX.backend(name)
    of_config = set(refusal.failures) - set(causality_failures(entry, not causal))
    resolution = resolve_backend(entry, config)
    assert of_config <= set(resolution.failures)
    assert not of_config or not resolution.fused_multi_step


def run_tiny_forward(builder: AttentionMetadataBuilder[Any], device: torch.device,
                     causal: bool = True) -> None:
    """Two requests (one decode token, one two-token query, attending ``causal``ly or not)
    through the builder's impl: the new keys (latent entries, for an MLA layer) land in the
    cache and the output matches the fp32 reference, with the layer's sliding window."""
    layer = builder.layer
    gen = torch.Generator().manual_seed(0)
    seq_lens = [min(length, layer.max_model_len) for length in SEQ_LENS]
    num_reqs = len(seq_lens)
    buffers = AttentionInputBuffers.allocate(
        LIMITS.max_num_reqs, LIMITS.max_num_tokens, layer.max_blocks_per_req, device
    )
    num_blocks = num_reqs * layer.max_blocks_per_req + 1  # block 0 is the sink
    pages = torch.randperm(num_blocks - 1, generator=gen) + 1
    table = pages.view(num_reqs, layer.max_blocks_per_req).int()
    buffers.block_table[:num_reqs] = table.to(device)
    buffers.seq_lens[:num_reqs] = torch.tensor(seq_lens, dtype=torch.int32)
    slots = []
    for req, (seq_len, q_len) in enumerate(zip(seq_lens, QUERY_LENS, strict=True)):
        for pos in range(seq_len - q_len, seq_len):
            block = int(table[req, pos // layer.block_size])
            slots.append(block * layer.block_size + pos % layer.block_size)
    buffers.slot_mapping[: len(slots)] = torch.tensor(slots, dtype=torch.int64)
    qsl = np.concatenate([[0], np.cumsum(QUERY_LENS)]).astype(np.int32)
    common = build_attention_metadata(
        buffers=buffers,
        batch_desc=BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=len(slots)),
        num_reqs=num_reqs,
        query_start_loc_np=qsl,
        base_seq_lens_np=np.array(seq_lens, dtype=np.int32),
        step=0,
        max_model_len=layer.max_model_len,
        causal=causal,
    )
    metadata = builder.build(common)

    latent = layer.kv_layout is KvLayout.LATENT
    first, second = layer.kv_cache_shapes(num_blocks)
    key_cache = torch.randn(first, generator=gen).to(device, layer.dtype)
    value_cache = torch.randn(second, generator=gen).to(device, layer.dtype)
    n = len(slots)
    query_width = layer.latent_size if latent else layer.head_size
    query = torch.randn(n, layer.num_heads, query_width, generator=gen).to(device, layer.dtype)
    key = torch.randn(n, *first[2:], generator=gen).to(device, layer.dtype)
    value = (key[..., : layer.kv_lora_rank] if latent
             else torch.randn(n, *second[2:], generator=gen).to(device, layer.dtype))
    values = key_cache[..., : layer.kv_lora_rank] if latent else value_cache
    output = torch.full((n, layer.num_heads, values.shape[-1]), float("nan"), dtype=layer.dtype,
                        device=device)
    scale = (layer.head_size + (layer.qk_rope_head_dim if latent else 0)) ** -0.5
    builder.make_impl(scale).forward(query, key, value, key_cache, value_cache, metadata, output)

    flat_keys = key_cache.view(-1, *first[2:])
    assert torch.equal(flat_keys[common.slot_mapping], key), "new keys not in the cache"
    want = paged_attention_reference(
        query, key_cache, values, common.query_start_loc, common.seq_lens,
        common.block_table, scale, causal, layer.sliding_window,
    )
    tol = TOLERANCE[layer.dtype]
    torch.testing.assert_close(output.float(), want.float(), atol=tol, rtol=tol)


# --- CPU-runnable adapters: both directions on any machine --------------------------------


@pytest.mark.parametrize("name", CPU_RUNNABLE)
def test_cpu_adapter_serves_exactly_what_the_matrix_admits(name: str) -> None:
    entry = MATRIX.backend(name)
    seen = {"admitted": 0, "rejected": 0, "non_causal": 0}

    @settings(max_examples=30)  # a tiny forward costs ~0.1 s, also under the Triton interpreter
    @given(config=runtime_configs(entry), causal=st.booleans())
    def check(config: RuntimeConfig, causal: bool) -> None:
        broken = broken_requirements(entry, config, causal)
        assert (not broken) == (platform_failures(entry, config) + constraint_failures(entry, config)
                                + causality_failures(entry, not causal) == ())
        if broken:
            seen["rejected"] += 1
            assert_refused(name, config, broken, causal)
        else:
            seen["admitted"] += 1
            seen["non_causal"] += not causal
            run_tiny_forward(build(name, config, DEVICE, causal), DEVICE, causal)

    check()
    assert seen["admitted"] and seen["rejected"], seen
    assert bool(seen["non_causal"]) != entry.constraints.causal_only, seen


# --- CUDA-only adapters: refusals anywhere, acceptances on a GPU --------------------------


@pytest.mark.parametrize("name", CUDA_ONLY)
@settings(max_examples=40)
@given(data=st.data())
def test_cuda_adapter_refuses_what_the_matrix_rejects_before_importing(
    name: str, data: st.DataObject
) -> None:
    entry = MATRIX.backend(name)
    config = data.draw(runtime_configs(entry))
    broken = broken_requirements(entry, config)
    assume(broken)
    assert_refused(name, config, broken)


@pytest.mark.cuda
@pytest.mark.parametrize("name", CUDA_ONLY)
def test_cuda_adapter_serves_what_the_matrix_admits(name: str) -> None:
    entry = MATRIX.backend(name)
    pytest.importorskip(entry.package.import_name)
    device = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability(device)
    capability = major * 10 + minor
    if entry.min_compute_capability is not None and capability < entry.min_compute_capability:
        pytest.skip(f"{name} needs compute capability {entry.min_compute_capability}")

    @settings(max_examples=25)
    @given(config=runtime_configs(entry, platform="cuda", compute_capability=capability),
           causal=st.booleans())
    def check(config: RuntimeConfig, causal: bool) -> None:
        assume(not broken_requirements(entry, config, causal))
        run_tiny_forward(build(name, config, device, causal), device, causal)

    check()


# --- the contract's pieces ----------------------------------------------------------------


def _entry(constraints: dict[str, Any]) -> BackendEntry:
    return BackendEntry.model_validate({
        "name": "alpha", "display_name": "Alpha", "description": "A test backend.",
        "implementation": None, "platforms": ["cuda"], "min_compute_capability": 90,
        "package": {"distribution": "alpha", "import_name": "alpha"},
        "cudagraph_support": "always",
        "draft_decode": {"supported": True, "refresh_strategy": "none_needed"},
        "constraints": constraints,
    })


@pytest.mark.parametrize(
    ("constraints", "config", "failure"),
    [
        ({"head_sizes": [64, 128], "reasons": {"head_sizes": "Compiled for 64 and 128."}},
         {"head_size": 96},
         "requires head_size in [64, 128], but head_size is 96 (Compiled for 64 and 128.)"),
        ({"block_sizes": {"multiple_of": 16}, "reasons": {"block_sizes": "Tiles of 16."}},
         {"block_size": 8},
         "requires block_size to be a multiple of 16, but block_size is 8 (Tiles of 16.)"),
        ({"dtypes": ["bfloat16"], "reasons": {"dtypes": "No fp16 build."}},
         {"dtype": "float16"},
         "requires dtype in ['bfloat16'], but dtype is 'float16' (No fp16 build.)"),
        ({"kv_cache_dtypes": ["auto"]}, {"kv_cache_dtype": "fp8_e4m3"},
         "requires kv_cache_dtype in ['auto'], but kv_cache_dtype is 'fp8_e4m3'"),
    ],
)
def test_each_failure_carries_the_matrix_reason(
    constraints: dict[str, Any], config: dict[str, Any], failure: str
) -> None:
    entry = _entry(constraints)
    assert constraint_failures(entry, RuntimeConfig(**config)) == (failure,)
    with pytest.raises(ConstraintViolation) as info:
        enforce_constraints(entry, RuntimeConfig(**config))
    assert info.value.failures == (failure,)
    assert str(info.value) == (
        f"alpha backend cannot serve this configuration (matrix.yaml): {failure}"
    )


def test_enforcement_covers_platform_and_compute_capability() -> None:
    entry = _entry({})
    enforce_constraints(entry, RuntimeConfig(compute_capability=90))
    with pytest.raises(ConstraintViolation) as info:
        enforce_constraints(entry, RuntimeConfig(platform="cpu", compute_capability=0))
    assert info.value.failures == ("requires platform in ['cuda'], but platform is 'cpu'",)
    assert platform_failures(entry, RuntimeConfig(compute_capability=89)) == (
        "requires compute_capability >= 90, but compute_capability is 89",
    )


def test_a_violation_needs_a_failure() -> None:
    with pytest.raises(ValueError, match="at least one failure"):
        ConstraintViolation("alpha", ())


def test_layer_config_takes_the_layer_values() -> None:
    layer = AttentionLayerSpec(6, 2, 64, torch.float16, block_size=8, max_model_len=32)
    config = layer_config(RuntimeConfig(dcp_world_size=2), layer)
    assert (config.dtype, config.head_size, config.num_heads, config.num_kv_heads) == (
        "float16", 64, 6, 2,
    )
    assert (config.block_size, config.max_model_len, config.dcp_world_size) == (8, 32, 2)


def test_building_judges_the_layer_not_only_the_config() -> None:
    """A config that fa3 admits, with a layer it does not: the layer's head size is what
    the builder would run, so that is what is refused."""
    config = RuntimeConfig(block_size=64, max_model_len=64, head_size=128)
    layer = AttentionLayerSpec(4, 2, 100, torch.bfloat16, block_size=64, max_model_len=64)
    with pytest.raises(ConstraintViolation, match="head_size is 100"):
        build_attention_groups(["fa3"], layer, config, torch.device("cpu"), LIMITS, matrix=MATRIX)


def test_reasons_load_and_render() -> None:
    text = (
        "version: 1\nbackends:\n  - name: alpha\n    display_name: Alpha\n"
        "    description: A test backend.\n    implementation: null\n    platforms: [cuda]\n"
        "    package: {distribution: alpha, import_name: alpha}\n"
        "    cudagraph_support: always\n"
        "    draft_decode: {supported: true, refresh_strategy: none_needed}\n"
        "    constraints:\n      head_sizes: [64, 128]\n      kv_layout: HND\n"
        "      reasons:\n        head_sizes: Compiled for 64 and 128.\n"
        "        kv_layout: Reads HND pages.\n"
    )
    matrix = parse_matrix(text, path="m.yaml")
    assert isinstance(matrix, Matrix)
    constraints = matrix.backend("alpha").constraints
    assert constraints.reason_for("head_sizes") == "Compiled for 64 and 128."
    assert constraints.reason_for("dtypes") is None
    with pytest.raises(KeyError, match="not a structured constraint"):
        constraints.reason_for("conditions")
    docs = render_capability_docs(matrix)
    assert "- Head sizes: 64, 128\n  - Reason: Compiled for 64 and 128.\n" in docs
    assert "  - Reason: Reads HND pages.\n" in docs


def test_shipped_fa3_head_size_rule_comes_from_the_matrix() -> None:
    reason = MATRIX.backend("fa3").constraints.reason_for("head_sizes")
    assert reason is not None and "64/96/128/192/256" in reason


# --- the measured bug: speccheck matrix and the FA3 builder agree on head size 100 ---------


def test_cli_matrix_refuses_fa3_head_size_100_with_the_matrix_reason() -> None:
    result = CliRunner().invoke(app, [
        "matrix", "--head-size", "100", "--block-size", "4096", "--max-model-len", "4096",
        "--json",
    ])
    assert result.exit_code == 0, result.stderr
    fa3 = {item["name"]: item for item in json.loads(result.stdout)}["fa3"]
    assert fa3["fused_multi_step"] is False
    reason = MATRIX.backend("fa3").constraints.reason_for("head_sizes")
    assert reason is not None
    assert "requires head_size to be a multiple of 8 (at most 256), but head_size is 100" in (
        fa3["reason"]
    )
    assert reason in fa3["reason"]
