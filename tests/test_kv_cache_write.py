"""The one-kernel KV write (backends/kv_cache_write.py) against its tensor-op form: under
the Triton interpreter on CPU, compiled for sm_90, and on CUDA."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.backends.kv_cache_write import SINK_SLOT, write_kv_cache
from tests.fixtures.sm90_compile import compile_one_kernel


def _case(tokens: int, heads: int, head_size: int, blocks: int, block_size: int, seed: int,
          dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """Keys, and values sliced out of wider token rows (as a fused QKV split leaves them:
    each token's heads one contiguous run, tokens further apart), caches full of noise, and
    distinct live slots with padding tokens at the sink."""
    gen = torch.Generator().manual_seed(seed)
    width = heads * head_size
    key = torch.randn(tokens, heads, head_size, generator=gen).to(dtype)
    rows = torch.randn(tokens, width + 8, generator=gen).to(dtype)
    value = rows[:, 4: 4 + width].view(tokens, heads, head_size)
    key_cache = torch.randn(blocks, block_size, heads, head_size, generator=gen).to(dtype)
    value_cache = torch.randn(blocks, block_size, heads, head_size, generator=gen).to(dtype)
    slots = torch.randperm(blocks * block_size - 1, generator=gen)[:tokens] + 1
    slots[torch.rand(tokens, generator=gen) < 0.3] = SINK_SLOT
    return tuple(t.to(device) for t in (key, value, key_cache, value_cache, slots))


def _live(cache: torch.Tensor) -> torch.Tensor:
    """Every slot but the sink (which duplicate padding write wins there is undefined)."""
    return cache.reshape(-1, *cache.shape[2:])[1:]


@settings(max_examples=12, deadline=None)
@given(tokens=st.integers(1, 40), heads=st.integers(1, 3), head_size=st.sampled_from([8, 16, 24]),
       seed=st.integers(0, 99))
def test_kernel_matches_index_copy(tokens: int, heads: int, head_size: int, seed: int) -> None:
    """Strided values, a width that is not a power of two, padding at the sink."""
    key, value, kc_got, vc_got, slots = _case(tokens, heads, head_size, 12, 4, seed, torch.float32)
    kc_want, vc_want = kc_got.clone(), vc_got.clone()
    write_kv_cache(key, value, kc_got, vc_got, slots, kernel=True)
    write_kv_cache(key, value, kc_want, vc_want, slots, kernel=False)
    assert torch.equal(_live(kc_got), _live(kc_want))
    assert torch.equal(_live(vc_got), _live(vc_want))


def test_heads_apart_fall_back_to_index_copy() -> None:
    """Values whose heads are not one run per token (a ``[..., :head_size]`` slice) take the
    tensor-op form even when the kernel is asked for."""
    key, _, kc_got, vc_got, slots = _case(9, 2, 8, 12, 4, 1, torch.float32)
    value = torch.randn(9, 2, 16)[..., :8]
    kc_want, vc_want = kc_got.clone(), vc_got.clone()
    write_kv_cache(key, value, kc_got, vc_got, slots, kernel=True)
    write_kv_cache(key, value, kc_want, vc_want, slots, kernel=False)
    assert torch.equal(_live(vc_got), _live(vc_want))


def test_kernel_compiles_for_sm90() -> None:
    compile_one_kernel(
        "speccheck.backends.kv_cache_write", "_write_kv_kernel",
        {"key_ptr": "*bf16", "value_ptr": "*bf16", "key_cache_ptr": "*bf16",
         "value_cache_ptr": "*bf16", "slot_ptr": "*i64", "key_token_stride": "i32",
         "value_token_stride": "i32", "WIDTH": "constexpr", "BLOCK": "constexpr",
         "PDL": "constexpr"},
        {"WIDTH": 512, "BLOCK": 512, "PDL": True})


@pytest.mark.cuda
def test_kernel_matches_index_copy_on_cuda() -> None:
    """Serving shapes (4 KV heads of 128, bf16), the kernel chosen by default on CUDA."""
    key, value, kc_got, vc_got, slots = _case(64, 4, 128, 40, 16, 3, torch.bfloat16, "cuda")
    kc_want, vc_want = kc_got.clone(), vc_got.clone()
    write_kv_cache(key, value, kc_got, vc_got, slots)
    write_kv_cache(key, value, kc_want, vc_want, slots, kernel=False)
    assert torch.equal(_live(kc_got), _live(kc_want))
    assert torch.equal(_live(vc_got), _live(vc_want))
