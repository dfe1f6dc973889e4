"""The drafter's paged KV cache and slot-mapping computation.

Block 0 is reserved as the *sink*: padding lanes write there and nothing reads it, so a
padding lane can never overwrite a live slot. Live blocks are ``1 .. num_blocks - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SINK_BLOCK = 0
PAD_SLOT = SINK_BLOCK  # first slot of the sink block


@dataclass
class PagedKVCache:
    """Per layer, a (keys, values) pair ``[num_blocks, block_size, num_kv_heads, head_size]``.

    The tensors are allocated once; captured graphs hold their addresses, so snapshots are
    restored with in-place copies, never by rebinding.
    """

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    block_size: int

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> PagedKVCache:
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        return cls(
            layers=[
                (
                    torch.zeros(shape, dtype=dtype, device=device),
                    torch.zeros(shape, dtype=dtype, device=device),
                )
                for _ in range(num_layers)
            ],
            block_size=block_size,
        )

    @property
    def num_blocks(self) -> int:
        return self.layers[0][0].shape[0]

    def snapshot(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k.clone(), v.clone()) for k, v in self.layers]

    def restore(self, snapshot: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for (k, v), (ks, vs) in zip(self.layers, snapshot, strict=True):
            k.copy_(ks)
            v.copy_(vs)

    def fill_random_(self, generator: torch.Generator) -> None:
        """Fill every layer with deterministic noise (stands for earlier context KV)."""
        for k, v in self.layers:
            k.copy_(torch.randn(k.shape, generator=generator).to(k.dtype))
            v.copy_(torch.randn(v.shape, generator=generator).to(v.dtype))


def compute_slot_mapping(
    positions: torch.Tensor,
    token_request: torch.Tensor,
    block_table: torch.Tensor,
    is_real_token: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
) -> None:
    """``out[t] = block_table[req, pos // bs] * bs + pos % bs`` for real tokens, the sink
    slot for padding tokens. Capture-safe: gathers and an in-place copy, no host values."""
    block_index = torch.div(positions, block_size, rounding_mode="floor")
    block = block_table[token_request, block_index].long()
    slots = block * block_size + positions % block_size
    out.copy_(torch.where(is_real_token, slots, torch.full_like(slots, PAD_SLOT)))
