"""The drafter's paged KV cache and slot-mapping computation.

Block 0 is reserved as the *sink*: padding lanes write there and nothing reads it, so a
padding lane can never overwrite a live slot. Live blocks are ``1 .. num_blocks - 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from speccheck.contract.builder import AttentionLayerSpec
from speccheck.contract.host_copy import int64_on
from speccheck.speculator.model_kernels import use_kernels

SINK_BLOCK = 0
PAD_SLOT = SINK_BLOCK  # first slot of the sink block


@dataclass
class PagedKVCache:
    """Per layer, the cache pair its :class:`AttentionLayerSpec` describes: (keys, values)
    ``[num_blocks, block_size, num_kv_heads, head_size]`` for a GQA layer, (latent, empty)
    ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]`` and
    ``[num_blocks, block_size, 1, 0]`` for an MLA layer.

    The tensors are allocated once; captured graphs hold their addresses, so snapshots are
    restored with in-place copies, never by rebinding.
    """

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    block_size: int

    @classmethod
    def allocate(
        cls,
        layers: Sequence[AttentionLayerSpec],
        num_blocks: int,
        device: torch.device,
    ) -> PagedKVCache:
        """Zeroed caches of ``num_blocks`` blocks for each layer, in the layer's dtype; every
        layer must have one block size."""
        block_sizes = {layer.block_size for layer in layers}
        if len(block_sizes) != 1:
            raise ValueError(f"layers need one block size, got {sorted(block_sizes)}")
        pairs = []
        for layer in layers:
            first, second = layer.kv_cache_shapes(num_blocks)
            pairs.append((torch.zeros(first, dtype=layer.dtype, device=device),
                          torch.zeros(second, dtype=layer.dtype, device=device)))
        return cls(layers=pairs, block_size=block_sizes.pop())

    def require_layout(self, layers: Sequence[AttentionLayerSpec], num_blocks: int) -> None:
        """Raise ``ValueError`` unless this cache is what :meth:`allocate` would make for
        ``layers`` and ``num_blocks`` (shapes and dtypes): the check before sharing it."""
        expected = [(layer.kv_cache_shapes(num_blocks), layer.dtype) for layer in layers]
        actual = [((tuple(k.shape), tuple(v.shape)), k.dtype) for k, v in self.layers]
        if expected != actual:
            raise ValueError(f"the shared KV cache {actual} does not match the layers "
                             f"{expected}")

    @property
    def num_blocks(self) -> int:
        return self.layers[0][0].shape[0]

    def snapshot(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k.clone(), v.clone()) for k, v in self.layers]

    def restore(
        self, snapshot: list[tuple[torch.Tensor, torch.Tensor]],
        blocks: Sequence[int] | None = None,
    ) -> None:
        """Copy ``snapshot`` (any dtype; converted) back in place: every block, or only
        ``blocks``, leaving the others as they are."""
        if blocks is None:
            for (k, v), (ks, vs) in zip(self.layers, snapshot, strict=True):
                k.copy_(ks)
                v.copy_(vs)
            return
        index = int64_on(sorted(set(blocks)), self.layers[0][0].device)
        for pair, saved in zip(self.layers, snapshot, strict=True):
            for tensor, source in zip(pair, saved, strict=True):
                tensor.index_copy_(0, index, source.index_select(0, index).to(tensor.dtype))

    def fill_random_(self, seed: int) -> None:
        """Fill every layer with noise drawn from ``seed`` on the cache's own device
        (stands for earlier context KV): the same seed gives the same noise on one device,
        and no host memory or host-to-device copy is involved at any cache size."""
        generator = torch.Generator(device=self.layers[0][0].device).manual_seed(seed)
        for k, v in self.layers:
            for tensor in (k, v):
                torch.randn(tensor.shape, generator=generator, out=tensor)


PAD_SLOT_CONSTEXPR: tl.constexpr = tl.constexpr(PAD_SLOT)
""":data:`PAD_SLOT` as a Triton compile-time constant, for kernels that write slots."""


@triton.jit
def table_slot(table_ptr, table_row_stride, request, position, block_size, real, readable,
               pad_slot):
    """The slot formula every slot-writing kernel shares: for ``real`` lanes
    ``table[request, position // block_size] * block_size + position % block_size`` (int64),
    reading the table entry only where ``readable`` (an entry not read counts as block 0, the
    value a reset table holds); ``pad_slot`` for every other lane."""
    block = tl.load(table_ptr + request * table_row_stride + position // block_size,
                    mask=real & readable, other=0).to(tl.int64)
    return tl.where(real, block * block_size + position % block_size, pad_slot)


@triton.jit(do_not_specialize=("num_tokens",))
def _slot_mapping_kernel(positions_ptr, token_request_ptr, block_table_ptr, is_real_ptr, out_ptr,
                         table_row_stride, num_tokens, block_size, pad_slot,
                         BLOCK: tl.constexpr):
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = lanes < num_tokens
    real = tl.load(is_real_ptr + lanes, mask=in_range, other=0).to(tl.int1)
    position = tl.load(positions_ptr + lanes, mask=in_range, other=0)
    request = tl.load(token_request_ptr + lanes, mask=in_range, other=0)
    slot = table_slot(block_table_ptr, table_row_stride, request, position, block_size, real,
                      in_range, pad_slot)
    tl.store(out_ptr + lanes, slot, mask=in_range)


_SLOT_BLOCK = 256


def compute_slot_mapping(
    positions: torch.Tensor,
    token_request: torch.Tensor,
    block_table: torch.Tensor,
    is_real_token: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
    *,
    kernel: bool | None = None,
) -> None:
    """``out[t] = block_table[req, pos // bs] * bs + pos % bs`` for real tokens, the sink
    slot for padding tokens. Capture-safe: gathers and an in-place write, no host values.
    One Triton kernel on CUDA (``kernel`` forces or avoids it; the block table's rows must
    be contiguous), tensor ops elsewhere."""
    if not (use_kernels(positions) if kernel is None else kernel):
        block_index = torch.div(positions, block_size, rounding_mode="floor")
        block = block_table[token_request, block_index].long()
        slots = block * block_size + positions % block_size
        out.copy_(torch.where(is_real_token, slots, torch.full_like(slots, PAD_SLOT)))
        return
    n = positions.shape[0]
    if n:
        _slot_mapping_kernel[(triton.cdiv(n, _SLOT_BLOCK),)](
            positions, token_request, block_table, is_real_token, out, block_table.stride(0),
            n, block_size, PAD_SLOT, BLOCK=_SLOT_BLOCK)
