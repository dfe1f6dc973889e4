"""Writing new keys and values (or MLA latent entries) into a paged KV cache (shared by the
adapters)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from speccheck.contract.dependent_launch import (
    await_predecessor,
    dependent_launch,
    release_dependents,
)

SINK_SLOT = 0
"""The reserved sink slot (the first slot of block 0, which no block table holds): padding
tokens, and under decode context parallelism tokens another rank stores, write there, and
nothing reads it. It is the speculator's ``PAD_SLOT``; a test holds the two equal."""


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
                     key_token_stride, value_token_stride,
                     WIDTH: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program ``t``: token ``t``'s key and value rows (``WIDTH`` contiguous elements each)
    into slot ``slot_mapping[t]`` of each cache (contiguous: a slot every ``WIDTH``
    elements), converted to the cache's dtype."""
    token = tl.program_id(0)
    release_dependents(PDL)
    await_predecessor(PDL)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < WIDTH
    key = tl.load(key_ptr + token * key_token_stride + cols, mask=mask)
    value = tl.load(value_ptr + token * value_token_stride + cols, mask=mask)
    tl.store(key_cache_ptr + slot * WIDTH + cols,
             key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + slot * WIDTH + cols,
             value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def _rows_contiguous(x: torch.Tensor) -> bool:
    """Each ``[heads, head_size]`` row of ``x`` is one contiguous run."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kernel: bool | None = None,
) -> None:
    """Scatter ``key``/``value`` (``[T, num_kv_heads, head_size]``) into the caches
    (``[num_blocks, block_size, num_kv_heads, head_size]``) at ``slot_mapping`` (``[T]``).

    Capture-safe, every write in place: on CUDA one Triton kernel writes both caches, a
    programmatic dependent on Hopper (:mod:`~speccheck.contract.dependent_launch`; two
    ``index_copy_`` launches elsewhere, or where a token's heads are not one contiguous
    run; ``kernel`` forces or avoids the kernel). Padding tokens must map to the reserved
    sink slot, never to a live one; which duplicate write wins there is undefined.
    """
    num_tokens = slot_mapping.shape[0]
    kv_heads, head_size = key_cache.shape[-2:]
    use_kernel = key.is_cuda if kernel is None else kernel
    if (use_kernel and num_tokens > 0 and _rows_contiguous(key) and _rows_contiguous(value)
            and key_cache.is_contiguous() and value_cache.is_contiguous()):
        width = kv_heads * head_size
        _write_kv_kernel[(num_tokens,)](
            key, value, key_cache, value_cache, slot_mapping, key.stride(0), value.stride(0),
            WIDTH=width, BLOCK=triton.next_power_of_2(width), **dependent_launch(key))
        return
    key_cache.view(-1, kv_heads, head_size).index_copy_(
        0, slot_mapping, key[:num_tokens].to(key_cache.dtype)
    )
    value_cache.view(-1, kv_heads, head_size).index_copy_(
        0, slot_mapping, value[:num_tokens].to(value_cache.dtype)
    )


def write_latent_cache(
    latent: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter MLA latent entries ``latent`` (``[T, 1, kv_lora_rank + qk_rope_head_dim]``)
    into a latent cache (``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``)
    at ``slot_mapping`` (``[T]``). The layer's second cache tensor is empty and untouched.

    Capture-safe: one in-place ``index_copy_``. Padding tokens must map to the reserved
    sink slot, as for :func:`write_kv_cache`.
    """
    num_tokens = slot_mapping.shape[0]
    latent_cache.view(-1, *latent_cache.shape[2:]).index_copy_(
        0, slot_mapping, latent[:num_tokens].to(latent_cache.dtype)
    )
