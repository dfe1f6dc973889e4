"""Writing new keys and values (or MLA latent entries) into a paged KV cache (shared by the
adapters)."""

from __future__ import annotations

import torch

SINK_SLOT = 0
"""The reserved sink slot (the first slot of block 0, which no block table holds): padding
tokens, and under decode context parallelism tokens another rank stores, write there, and
nothing reads it. It is the speculator's ``PAD_SLOT``; a test holds the two equal."""


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` (``[T, num_kv_heads, head_size]``) into the caches
    (``[num_blocks, block_size, num_kv_heads, head_size]``) at ``slot_mapping`` (``[T]``).

    Capture-safe: one in-place ``index_copy_`` per cache. Padding tokens must map to the
    reserved sink slot, never to a live one; which duplicate write wins there is undefined.
    """
    num_tokens = slot_mapping.shape[0]
    kv_heads, head_size = key_cache.shape[-2:]
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
