"""The draft model: embedding, decoder layers (RMSNorm, rotary, grouped-query attention
through a backend, SwiGLU MLP), final norm, LM head. Weights are drawn from a seed, so two
instances with the same config are bit-identical."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from speccheck.contract.builder import AttentionImpl, AttentionLayerSpec
from speccheck.contract.runtime_config import RuntimeConfig

DTYPES: Mapping[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


@dataclass(frozen=True)
class DrafterConfig:
    """Shape of the draft model. ``hidden_size = num_heads * head_size``."""

    vocab_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 32
    intermediate_size: int = 256
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    seed: int = 0
    dtype: str = "float32"

    @classmethod
    def for_runtime(
        cls, config: RuntimeConfig, *, vocab_size: int = 256, num_layers: int = 2, seed: int = 0,
        dtype: str | None = None,
    ) -> DrafterConfig:
        """A drafter with ``config``'s head layout (SwiGLU width twice the hidden size) and
        dtype, unless ``dtype`` overrides it."""
        return cls(
            vocab_size=vocab_size, num_layers=num_layers, num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads, head_size=config.head_size,
            intermediate_size=2 * config.num_heads * config.head_size, seed=seed,
            dtype=dtype or config.dtype,
        )

    @property
    def hidden_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def layer_spec(self, block_size: int, max_model_len: int) -> AttentionLayerSpec:
        return AttentionLayerSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=self.torch_dtype,
            block_size=block_size,
            max_model_len=max_model_len,
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX-style rotary embedding of ``x`` (``[T, heads, D]``) at ``positions`` (``[T]``)."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (
        theta ** (torch.arange(half, device=x.device, dtype=torch.float32) * 2 / x.shape[-1])
    )
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_size
        self.input_norm = RMSNorm(h, cfg.rms_eps)
        self.qkv_proj = nn.Linear(h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.post_norm = RMSNorm(h, cfg.rms_eps)
        self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        impl: AttentionImpl[Any],
        metadata: Any,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        qkv = self.qkv_proj(self.input_norm(x))
        kv_size = cfg.num_kv_heads * cfg.head_size
        q, k, v = qkv.split([cfg.num_heads * cfg.head_size, kv_size, kv_size], dim=-1)
        q = apply_rotary(q.reshape(t, cfg.num_heads, cfg.head_size), positions, cfg.rope_theta)
        k = apply_rotary(k.reshape(t, cfg.num_kv_heads, cfg.head_size), positions, cfg.rope_theta)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_size).contiguous()
        attn = torch.zeros_like(q)
        impl.forward(q.contiguous(), k.contiguous(), v, kv_cache[0], kv_cache[1], metadata, attn)
        x = x + self.o_proj(attn.reshape(t, -1))
        gate, up = self.gate_up_proj(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(nn.functional.silu(gate) * up)


class DraftModel(nn.Module):
    """A few decoder layers; layer ``i`` attends through ``impls[i]`` with the metadata of
    its attention group. Every op is capture-safe (fixed shapes, no host syncs)."""

    def __init__(self, cfg: DrafterConfig, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._init_weights()
        self.to(device=device, dtype=cfg.torch_dtype)
        self.requires_grad_(False)

    def _init_weights(self) -> None:
        gen = torch.Generator().manual_seed(self.cfg.seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.data = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
            else:
                fan_in = param.shape[-1]
                param.data = torch.randn(param.shape, generator=gen) / math.sqrt(fan_in)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        impls: Sequence[AttentionImpl[Any]],
        layer_metadata: Sequence[Any],
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of the ``T = len(input_ids)`` tokens."""
        x = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, impls[i], layer_metadata[i], kv_caches[i])
        return self.final_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[..., vocab]``."""
        return hidden.float() @ self.lm_head.weight.float().t()
