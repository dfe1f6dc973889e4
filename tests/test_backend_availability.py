"""The FA3 and FlashInfer adapters on a machine without their kernel packages.

Their modules must import everywhere (the matrix names their builders); constructing a
builder or running an impl must fail with :class:`BackendUnavailable` carrying the install
hint, not with a raw ``ImportError`` from inside the package. Configurations their matrix
entries refuse (FA3's bf16-only and one-row-per-request rules, FlashInfer's fp16/bf16 rule)
are refused by ``build_attention_groups`` from the matrix, before the import.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from speccheck.backends.availability import BackendUnavailable, require_module
from speccheck.contract.builder import AttentionLayerSpec, BuilderLimits
from speccheck.contract.constraints import ConstraintViolation
from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.attention_setup import build_attention_groups


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return False
    return True


needs_no_fa3 = pytest.mark.skipif(
    _importable("fa3_fwd_interface"), reason="fa3_fwd_interface imports on this machine"
)
needs_no_flashinfer = pytest.mark.skipif(
    _importable("flashinfer"), reason="flashinfer imports on this machine"
)

LIMITS = BuilderLimits(max_num_reqs=4, max_num_tokens=16)


def _fa3_layer(dtype: torch.dtype = torch.bfloat16, block_size: int = 64) -> AttentionLayerSpec:
    return AttentionLayerSpec(
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
        dtype=dtype,
        block_size=block_size,
        max_model_len=64,
    )


def _fi_layer(dtype: torch.dtype = torch.bfloat16) -> AttentionLayerSpec:
    return AttentionLayerSpec(
        num_heads=4, num_kv_heads=2, head_size=64, dtype=dtype, block_size=16, max_model_len=64
    )


def _assert_install_hint(exc: BackendUnavailable, package: str, extra: str) -> None:
    assert isinstance(exc, RuntimeError)
    assert not isinstance(exc, ImportError)
    assert exc.package == package
    assert f"speccheck[{extra}]" in exc.hint
    assert str(exc).startswith(f"{package} not installed: pip install 'speccheck[{extra}]'")
    assert exc.__cause__ is None
    assert exc.__context__ is None, "the raw import error must not be chained into the report"


def test_modules_import_without_kernel_packages() -> None:
    fa3 = importlib.import_module("speccheck.backends.fa3.builder")
    fi = importlib.import_module("speccheck.backends.flashinfer.builder")
    assert fa3.FA3MetadataBuilder.backend_name == "fa3"
    assert fi.FlashInferMetadataBuilder.backend_name == "flashinfer"
    # step-dependent fields are declared once, in the matrix, never on the builder class
    assert not hasattr(fa3.FA3MetadataBuilder, "step_dependent_fields")
    # the packages re-export the builders (matrix.yaml names the builder modules)
    assert importlib.import_module("speccheck.backends.fa3").FA3MetadataBuilder is (
        fa3.FA3MetadataBuilder
    )
    assert importlib.import_module("speccheck.backends.flashinfer").FlashInferMetadataBuilder is (
        fi.FlashInferMetadataBuilder
    )


def test_require_module() -> None:
    assert require_module("json", "json", "stdlib") is importlib.import_module("json")
    with pytest.raises(BackendUnavailable) as info:
        require_module("speccheck_no_such_module_xyz", "no-such-dist", "pip install nothing")
    exc = info.value
    assert str(exc).startswith("no-such-dist not installed: pip install nothing")
    assert exc.import_name == "speccheck_no_such_module_xyz"
    assert isinstance(exc.error, ModuleNotFoundError)
    assert "ModuleNotFoundError" in (exc.reason or "")


@needs_no_fa3
def test_fa3_builder_without_package_raises_install_hint() -> None:
    from speccheck.backends.fa3.builder import FA3MetadataBuilder

    with pytest.raises(BackendUnavailable) as info:
        FA3MetadataBuilder(_fa3_layer(), RuntimeConfig(), torch.device("cpu"), LIMITS)
    _assert_install_hint(info.value, "fa3-fwd", "fa3")
    assert "(fa3-fwd, CUDA, sm90)" in str(info.value)


@needs_no_fa3
def test_fa3_impl_without_package_raises_install_hint() -> None:
    from speccheck.backends.fa3.builder import FA3AttentionImpl, fa3_interface

    with pytest.raises(BackendUnavailable) as info:
        fa3_interface()
    _assert_install_hint(info.value, "fa3-fwd", "fa3")
    impl = FA3AttentionImpl(_fa3_layer(), 0.125)
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    kv = torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 64, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(BackendUnavailable):
        impl.forward(q, kv, kv, cache, cache.clone(), None, torch.empty_like(q))  # type: ignore[arg-type]


def _build(backend: str, layer: AttentionLayerSpec) -> None:
    build_attention_groups(
        [backend], layer, RuntimeConfig(), torch.device("cpu"), LIMITS, matrix=load_matrix()
    )


def test_fa3_rejects_other_dtypes_before_importing() -> None:
    for dtype in (torch.float16, torch.float32):
        with pytest.raises(ConstraintViolation, match="bfloat16 only"):
            _build("fa3", _fa3_layer(dtype))


def test_fa3_requires_one_cache_row_per_request() -> None:
    with pytest.raises(ConstraintViolation, match="requires block_size == max_model_len"):
        _build("fa3", _fa3_layer(block_size=16))


def test_fa3_scheduler_metadata_size_bound() -> None:
    from speccheck.backends.fa3.builder import scheduler_metadata_size_bound

    # 1 semaphore + 4 vectors of round_up(b, 4) (FA3 flash_api, causal varlen layout)
    assert scheduler_metadata_size_bound(1) == 1 + 4 * 4
    assert scheduler_metadata_size_bound(4) == 1 + 4 * 4
    assert scheduler_metadata_size_bound(5) == 1 + 4 * 8


@needs_no_flashinfer
def test_flashinfer_builder_without_package_raises_install_hint() -> None:
    from speccheck.backends.flashinfer.builder import FlashInferMetadataBuilder

    with pytest.raises(BackendUnavailable) as info:
        FlashInferMetadataBuilder(_fi_layer(), RuntimeConfig(), torch.device("cpu"), LIMITS)
    _assert_install_hint(info.value, "flashinfer-python", "flashinfer")


@needs_no_flashinfer
def test_flashinfer_impl_without_package_raises_install_hint() -> None:
    from speccheck.backends.flashinfer.builder import FlashInferAttentionImpl

    impl = FlashInferAttentionImpl(_fi_layer(), 0.125)
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    kv = torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(BackendUnavailable) as info:
        impl.forward(q, kv, kv, cache, cache.clone(), None, torch.empty_like(q))  # type: ignore[arg-type]
    _assert_install_hint(info.value, "flashinfer-python", "flashinfer")


def test_flashinfer_rejects_fp32_before_importing() -> None:
    with pytest.raises(ConstraintViolation, match="not float32"):
        _build("flashinfer", _fi_layer(torch.float32))


def test_flashinfer_paged_kv_layout() -> None:
    """The host CSR page table: the reference for the device-built indices (pure host
    code, no package)."""
    from speccheck.backends.flashinfer.page_indices import paged_kv_layout

    table = np.array([[7, 3, 9, 0], [5, 0, 0, 0], [2, 4, 0, 0], [0, 0, 0, 0]], dtype=np.int32)
    seq = np.array([33, 16, 17, 0], dtype=np.int32)  # 3 pages, exactly 1, 2, padding lane
    layout = paged_kv_layout(seq, table, 16)
    assert layout.indptr.tolist() == [0, 3, 4, 6, 6]
    assert layout.indices.tolist() == [7, 3, 9, 5, 2, 4]
    assert layout.last_page_len.tolist() == [1, 16, 1, 0]
    assert layout.num_pages == 6
    for t in (layout.indptr, layout.indices, layout.last_page_len):
        assert t.dtype == torch.int32 and t.device.type == "cpu" and t.is_contiguous()
    with pytest.raises(ValueError, match="columns"):
        paged_kv_layout(np.array([65]), table[:1], 16)


def test_a_hip_build_of_torch_is_the_rocm_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch names ROCm devices ``cuda``; the matrix's platform is ``rocm`` there, so
    rocm_sparse_swa is built and sparse_swa (cuda, cpu) is not."""
    import torch

    from speccheck.contract.matrix_loader import load_matrix
    from speccheck.speculator.attention_setup import machine_platform, unrunnable_reason

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert machine_platform() == "rocm"
    matrix = load_matrix(None)
    assert unrunnable_reason("sparse_swa", machine_platform(), matrix) == (
        "sparse_swa runs on cuda, cpu; this machine offers rocm")
    assert unrunnable_reason("rocm_sparse_swa", machine_platform(), matrix) is None
    monkeypatch.setattr(torch.version, "hip", None)
    assert machine_platform() == "cuda"
