"""The draft model: embedding, decoder layers (RMSNorm, rotary, attention through a backend,
SwiGLU MLP), final norm, LM head. Weights are drawn from a seed, so two instances with the
same config are bit-identical.

A layer's attention is grouped-query attention over keys and values (``KvLayout.NHD``) or
DeepSeek-style multi-head latent attention over a latent cache (``KvLayout.LATENT``), in
the absorbed form MLA decode kernels run (:class:`MLAAttention`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, cast

import torch
from torch import nn

from speccheck.contract.builder import AttentionImpl, AttentionLayerSpec
from speccheck.contract.matrix_model import KvLayout
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.model_kernels import (
    add_rms_norm,
    rms_norm,
    rotary,
    rotary_inv_freq,
)
from speccheck.speculator.projection_kernels import (
    EmbeddedTokens,
    UnprojectedLogits,
    linear,
    norm_linear,
    norm_qkv,
    silu_linear,
)

DTYPES: Mapping[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


@dataclass(frozen=True)
class DrafterConfig:
    """Shape of the draft model. ``hidden_size = num_heads * head_size``.

    ``kv_layout`` picks the attention of every layer: ``NHD``, grouped-query attention with
    ``num_kv_heads`` KV heads; ``latent``, multi-head latent attention (MLA) whose cache
    holds one ``kv_lora_rank + qk_rope_head_dim`` entry per token, with no-rope query and
    value heads of ``head_size`` (``num_kv_heads`` is then unused). ``sliding_window`` W > 0
    limits every query to the last W positions (0: full attention).
    """

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
    kv_layout: KvLayout = KvLayout.NHD
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    sliding_window: int = 0
    kernels: bool = True
    """Run the layers, the sampling and the speculator's index-buffer updates as their
    one-kernel Triton forms on CUDA (:mod:`~speccheck.speculator.model_kernels`); ``False``:
    their tensor-op forms everywhere. The verifier's fp32 reference drafter sets ``False``,
    so it shares no Triton kernel with the drafter under test and a wrong kernel shows up
    as a difference from it."""

    def __post_init__(self) -> None:
        if self.kv_layout not in (KvLayout.NHD, KvLayout.LATENT):
            raise ValueError(f"kv_layout={self.kv_layout.value}: the drafter has GQA (NHD) "
                             "and MLA (latent) layers only")
        if self.kv_layout is KvLayout.LATENT and self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotary "
                             "pairs channels)")

    @classmethod
    def for_runtime(
        cls, config: RuntimeConfig, *, vocab_size: int = 256, num_layers: int = 2, seed: int = 0,
        dtype: str | None = None, kv_layout: KvLayout = KvLayout.NHD,
    ) -> DrafterConfig:
        """A drafter with ``config``'s head layout, MLA sizes and sliding window (SwiGLU
        width twice the hidden size) and dtype, unless ``dtype`` overrides it; ``kv_layout``
        picks GQA or MLA layers."""
        return cls(
            vocab_size=vocab_size, num_layers=num_layers, num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads, head_size=config.head_size,
            intermediate_size=2 * config.num_heads * config.head_size, seed=seed,
            dtype=dtype or config.dtype, kv_layout=kv_layout,
            kv_lora_rank=config.kv_lora_rank, qk_rope_head_dim=config.qk_rope_head_dim,
            sliding_window=config.sliding_window,
        )

    @property
    def hidden_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def softmax_scale(self) -> float:
        """``1 / sqrt(query-key width)``: ``head_size`` for GQA, ``head_size +
        qk_rope_head_dim`` for MLA (the no-rope and rope parts of a head, before
        absorption)."""
        width = self.head_size
        if self.kv_layout is KvLayout.LATENT:
            width += self.qk_rope_head_dim
        return float(width**-0.5)

    @property
    def kernel_choice(self) -> bool | None:
        """The ``kernel`` argument of the one-kernel functions: ``None`` (Triton on CUDA)
        when :attr:`kernels`, else ``False`` (tensor ops)."""
        return None if self.kernels else False

    def layer_spec(self, block_size: int, max_model_len: int) -> AttentionLayerSpec:
        latent = self.kv_layout is KvLayout.LATENT
        return AttentionLayerSpec(
            num_heads=self.num_heads,
            num_kv_heads=1 if latent else self.num_kv_heads,
            head_size=self.head_size,
            dtype=self.torch_dtype,
            block_size=block_size,
            max_model_len=max_model_len,
            kv_layout=self.kv_layout,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            sliding_window=self.sliding_window,
        )


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension (one kernel on CUDA: :func:`rms_norm`; ``kernel``
    as for :func:`rms_norm`)."""

    def __init__(self, size: int, eps: float, kernel: bool | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps,
                        kernel=self.kernel).view(x.shape)

    def add_and_norm(self, x: torch.Tensor,
                     delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(x + delta), x + delta)`` for 2-D ``x`` and ``delta`` (``(self(x), x)``
        when ``delta`` is ``None``): one kernel on CUDA (:func:`add_rms_norm`)."""
        if delta is None:
            return self(x), x
        return add_rms_norm(x, delta, self.weight, self.eps, kernel=self.kernel)

    def then_project(self, x: torch.Tensor, delta: torch.Tensor | None,
                     weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(x + delta) @ weight.T, x + delta)``, as :meth:`add_and_norm`: one kernel
        with the projection on CUDA at decode batch sizes
        (:func:`~speccheck.speculator.projection_kernels.norm_linear`)."""
        return norm_linear(x, delta, self.weight, self.eps, weight, kernel=self.kernel)


class GQAAttention(nn.Module):
    """Grouped-query attention: fused QKV projection, rotary on queries and keys, the
    backend's attention over the (keys, values) cache, output projection."""

    def __init__(self, cfg: DrafterConfig, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_size
        self.inv_freq = rotary_inv_freq(d, cfg.rope_theta, device)
        """fp32 rotary frequencies, made once (a plain attribute: ``to(dtype)`` leaves it)."""
        self.qkv_proj = nn.Linear(h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)

    def forward(
        self,
        x: torch.Tensor | EmbeddedTokens,
        delta: torch.Tensor | None,
        norm: RMSNorm,
        positions: torch.Tensor,
        impl: AttentionImpl[Any],
        metadata: Any,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(attention output, x + delta)``: the residual add (or the embedding gather),
        ``norm``, rotary and the clearing of the attention output run in the QKV
        projection's kernel at decode batch sizes
        (:func:`~speccheck.speculator.projection_kernels.norm_qkv`)."""
        cfg = self.cfg
        qkv = norm_qkv(x, delta, norm.weight, norm.eps, self.qkv_proj.weight, positions,
                       self.inv_freq, cfg.num_heads, cfg.num_kv_heads, cfg.head_size,
                       kernel=cfg.kernel_choice)
        impl.forward(qkv.q, qkv.k, qkv.v, kv_cache[0], kv_cache[1], metadata, qkv.out)
        rows = qkv.residual.shape[0]
        return (linear(qkv.out.reshape(rows, -1), self.o_proj.weight, kernel=cfg.kernel_choice),
                qkv.residual)


class MLAAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3 style, no query compression), absorbed.

    Per token: ``q = q_proj(x)`` splits per head into ``q_nope`` (``head_size``) and
    ``q_pe`` (``qk_rope_head_dim``); ``kv_a_proj(x)`` gives the compressed KV ``kv_c``
    (``kv_lora_rank``, RMS-normalised) and one shared rope key ``k_pe``. Rotary applies to
    ``q_pe`` and ``k_pe``. ``kv_b_proj`` holds the up-projections ``W_UK`` and ``W_UV``
    (:meth:`w_uk`, :meth:`w_uv`), which the non-absorbed form would apply to ``kv_c`` to get
    per-head keys and values. The absorbed form never does: the query becomes
    ``[q_nope @ W_UK, q_pe]`` (``[T, heads, kv_lora_rank + rope]``), the backend writes
    the latent entry ``[kv_c, k_pe]`` at the slot mapping and attends over the latent cache
    (scores over whole entries, values the ``kv_c`` part), and the ``[T, heads,
    kv_lora_rank]`` result goes through ``W_UV`` per head and ``o_proj``. Scores equal the
    non-absorbed ``q_nope . (W_UK kv_c) + q_pe . k_pe``; the softmax scale is
    :attr:`DrafterConfig.softmax_scale`.
    """

    def __init__(self, cfg: DrafterConfig, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        h, d, heads = cfg.hidden_size, cfg.head_size, cfg.num_heads
        rank, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.inv_freq = rotary_inv_freq(rope, cfg.rope_theta, device)
        """fp32 rotary frequencies of the rope part (a plain attribute, as for GQA)."""
        self.q_proj = nn.Linear(h, heads * (d + rope), bias=False)
        self.kv_a_proj = nn.Linear(h, rank + rope, bias=False)
        self.kv_a_norm = RMSNorm(rank, cfg.rms_eps, cfg.kernel_choice)
        self.kv_b_proj = nn.Linear(rank, heads * 2 * d, bias=False)
        self.o_proj = nn.Linear(heads * d, h, bias=False)

    def w_uk(self) -> torch.Tensor:
        """``[heads, head_size, kv_lora_rank]``: head ``h``'s no-rope key is
        ``W_UK[h] @ kv_c``."""
        cfg = self.cfg
        return self.kv_b_proj.weight.view(cfg.num_heads, 2 * cfg.head_size, -1)[:, : cfg.head_size]

    def w_uv(self) -> torch.Tensor:
        """``[heads, head_size, kv_lora_rank]``: head ``h``'s value is ``W_UV[h] @ kv_c``."""
        cfg = self.cfg
        return self.kv_b_proj.weight.view(cfg.num_heads, 2 * cfg.head_size, -1)[:, cfg.head_size :]

    def project(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q_nope [T, heads, head_size], q_pe [T, heads, rope], kv_c [T, rank],
        k_pe [T, 1, rope])``, rotary applied and ``kv_c`` normalised: what both the absorbed
        and the non-absorbed form start from."""
        cfg = self.cfg
        t = x.shape[0]
        rope = cfg.qk_rope_head_dim
        q = self.q_proj(x).view(t, cfg.num_heads, cfg.head_size + rope)
        q_nope, q_pe = q.split([cfg.head_size, rope], dim=-1)
        kv_c, k_pe = self.kv_a_proj(x).split([cfg.kv_lora_rank, rope], dim=-1)
        q_pe = rotary(q_pe, positions, self.inv_freq, kernel=cfg.kernel_choice)
        k_pe = rotary(k_pe.view(t, 1, rope), positions, self.inv_freq, kernel=cfg.kernel_choice)
        return q_nope, q_pe, self.kv_a_norm(kv_c), k_pe

    def forward(
        self,
        x: torch.Tensor | EmbeddedTokens,
        delta: torch.Tensor | None,
        norm: RMSNorm,
        positions: torch.Tensor,
        impl: AttentionImpl[Any],
        metadata: Any,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(attention output, x + delta)``: :meth:`attend` to ``norm(x + delta)``."""
        rows = x.rows() if isinstance(x, EmbeddedTokens) else x
        normed, summed = norm.add_and_norm(rows, delta)
        return self.attend(normed, positions, impl, metadata, kv_cache), summed

    def attend(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        impl: AttentionImpl[Any],
        metadata: Any,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """The attention output for the normalised rows ``x``."""
        cfg = self.cfg
        t, rank = x.shape[0], cfg.kv_lora_rank
        q_nope, q_pe, kv_c, k_pe = self.project(x, positions)
        q_latent = torch.einsum("thd,hdr->thr", q_nope.float(), self.w_uk().float())
        query = torch.cat([q_latent.to(x.dtype), q_pe], dim=-1)
        latent = torch.cat([kv_c.unsqueeze(1), k_pe], dim=-1)
        attn = x.new_zeros(t, cfg.num_heads, rank)
        impl.forward(query, latent, latent[..., :rank], kv_cache[0], kv_cache[1], metadata, attn)
        out = torch.einsum("thr,hdr->thd", attn.float(), self.w_uv().float()).to(x.dtype)
        return self.o_proj(out.reshape(t, -1))


class DecoderLayer(nn.Module):
    """Pre-norm attention (:class:`GQAAttention` or :class:`MLAAttention`, by
    ``cfg.kv_layout``) and SwiGLU MLP, each with a residual."""

    def __init__(self, cfg: DrafterConfig, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.input_norm = RMSNorm(h, cfg.rms_eps, cfg.kernel_choice)
        self.attn: GQAAttention | MLAAttention = (
            MLAAttention(cfg, device) if cfg.kv_layout is KvLayout.LATENT
            else GQAAttention(cfg, device)
        )
        self.post_norm = RMSNorm(h, cfg.rms_eps, cfg.kernel_choice)
        self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(
        self,
        x: torch.Tensor | EmbeddedTokens,
        delta: torch.Tensor | None,
        positions: torch.Tensor,
        impl: AttentionImpl[Any],
        metadata: Any,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(y, mlp)``: this layer's output is ``y + mlp`` for the residual stream ``x +
        delta`` (``x`` when ``delta`` is ``None``; the first layer's ``x`` is the embedded
        tokens, gathered in the QKV kernel). Each residual add is left to the kernel
        after it: the norm, and at decode batch sizes the projection after the norm
        (:mod:`~speccheck.speculator.projection_kernels`); the SwiGLU gate runs in the down
        projection's kernel."""
        attn, summed = self.attn(x, delta, self.input_norm, positions, impl, metadata, kv_cache)
        gate_up, summed = self.post_norm.then_project(summed, attn, self.gate_up_proj.weight)
        return summed, silu_linear(gate_up, self.down_proj.weight, kernel=self.cfg.kernel_choice)


@functools.lru_cache(maxsize=2)
def seeded_weights(layout: tuple[tuple[str, tuple[int, ...]], ...],
                   seed: int) -> Mapping[str, torch.Tensor]:
    """fp32 host weights for the parameters ``layout`` names and shapes, drawn in its order
    from ``seed``: norm weights ``1 + 0.1 N(0, 1)``, every other weight ``N(0, 1) /
    sqrt(fan_in)``. Cached, read-only (callers copy): the verifier builds a drafter per K and
    an fp32 reference beside each, all from one seed, and drawing a serving-size drafter's
    weights takes about a second on one CPU thread."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in layout:
        noise = torch.randn(shape, generator=gen)
        weights[name] = 1.0 + 0.1 * noise if name.endswith("norm.weight") else noise / math.sqrt(shape[-1])
    return MappingProxyType(weights)


class DraftModel(nn.Module):
    """A few decoder layers; layer ``i`` attends through ``impls[i]`` with the metadata of
    its attention group. Every op is capture-safe (fixed shapes, no host syncs)."""

    def __init__(self, cfg: DrafterConfig, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        # Shapes only: every parameter is then set from the seed (no default init to discard).
        # The embedding is given its (meta) table: its default init, normal_ on a meta
        # tensor, would import torch._dynamo (seconds of a verify worker's start-up).
        with torch.device("meta"):
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                      _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
            self.layers = nn.ModuleList(DecoderLayer(cfg, device) for _ in range(cfg.num_layers))
            self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.kernel_choice)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        layout = tuple((name, tuple(param.shape)) for name, param in self.named_parameters())
        self.load_state_dict({
            name: weight.to(device=device, dtype=cfg.torch_dtype, copy=True)
            for name, weight in seeded_weights(layout, cfg.seed).items()
        }, assign=True)
        self.requires_grad_(False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        impls: Sequence[AttentionImpl[Any]],
        layer_metadata: Sequence[Any],
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of the ``T = len(input_ids)`` tokens."""
        x: torch.Tensor | EmbeddedTokens = EmbeddedTokens(input_ids, self.embed.weight)
        delta: torch.Tensor | None = None
        for i, layer in enumerate(cast(list[DecoderLayer], list(self.layers))):
            x, delta = layer(x, delta, positions, impls[i], layer_metadata[i], kv_caches[i])
        rows = x.rows() if isinstance(x, EmbeddedTokens) else x
        return self.final_norm.add_and_norm(rows, delta)[0]

    def decode_weight_bytes(self) -> int:
        """Bytes of the weights one decode step reads: every parameter but the embedding
        table (of which it reads one row per token)."""
        return sum(p.numel() * p.element_size() for name, p in self.named_parameters()
                   if not name.startswith("embed."))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., vocab]`` in the model's dtype: one matmul over the LM head as
        stored (fp32 accumulation inside it), no per-call conversion of the weights. The
        verifier's fp32 reference is an fp32 drafter, whose logits are fp32. At decode batch
        sizes on CUDA, :func:`~speccheck.speculator.projection_kernels.linear`."""
        rows = hidden.reshape(-1, hidden.shape[-1])
        logits = self.unprojected_logits(rows).project(kernel=self.cfg.kernel_choice)
        return logits.view(*hidden.shape[:-1], logits.shape[-1])

    def unprojected_logits(self, hidden: torch.Tensor) -> UnprojectedLogits:
        """The logits of ``hidden`` (``[T, hidden]``), left to their consumer to project:
        the end of a decode step (:func:`~speccheck.speculator.sampling.finish_decode_step`)
        samples in the LM head's kernel. Projected with the drafter's kernel choice, they
        are what :meth:`compute_logits` returns."""
        return UnprojectedLogits(hidden, self.lm_head.weight)
