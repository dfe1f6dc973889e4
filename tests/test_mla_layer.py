"""The drafter's MLA layer and the fp32 reference over a latent cache: the absorbed form
(what every MLA backend computes) equals naive, non-absorbed MLA; sliding windows; the
latent cache layout; and the matrix refusing a backend for a layer it cannot read."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from speccheck.backends.reference.builder import ReferenceMetadataBuilder
from speccheck.contract.builder import BuilderLimits
from speccheck.contract.constraints import ConstraintViolation
from speccheck.contract.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.matrix_model import KvLayout
from speccheck.contract.metadata import AttentionInputBuffers
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.contract.token_count import build_attention_metadata
from speccheck.speculator.attention_setup import build_attention_groups
from speccheck.speculator.kv_cache import PagedKVCache
from speccheck.speculator.model import DrafterConfig, DraftModel, MLAAttention

MATRIX = load_matrix(None)
CONFIG = RuntimeConfig(platform="cpu", cudagraph_mode="none", block_size=4, max_model_len=24,
                       dtype="float32", head_size=16, num_heads=3, num_kv_heads=1,
                       kv_lora_rank=32, qk_rope_head_dim=8)
CONTEXT_LENS = (9, 0, 5)
NEW_TOKENS = (3, 2, 1)
"""Three requests: a context crossing blocks, an empty one, one decode-like token."""


def _naive_mla(
    attn: MLAAttention, x: torch.Tensor, positions: torch.Tensor, latent: list[torch.Tensor],
    window: int,
) -> torch.Tensor:
    """Textbook MLA, token by token: decompress every visible latent entry into per-head
    keys (``W_UK kv_c`` with the shared rope key) and values (``W_UV kv_c``), attend with
    scale ``1/sqrt(head_size + rope)``, project. ``latent[t]`` holds the entries token
    ``t`` may see, oldest first (its own last)."""
    cfg = attn.cfg
    q_nope, q_pe, _, _ = attn.project(x, positions)
    scale = 1 / math.sqrt(cfg.head_size + cfg.qk_rope_head_dim)
    rows = []
    for t, entries in enumerate(latent):
        entries = entries[-window:] if window else entries
        kv_c, k_pe = entries.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        k_nope = torch.einsum("lr,hdr->lhd", kv_c, attn.w_uk())
        value = torch.einsum("lr,hdr->lhd", kv_c, attn.w_uv())
        scores = (torch.einsum("hd,lhd->hl", q_nope[t], k_nope)
                  + torch.einsum("hd,ld->hl", q_pe[t], k_pe)) * scale
        rows.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), value).reshape(-1))
    return attn.o_proj(torch.stack(rows))


@pytest.mark.parametrize("window", [0, 1, 4])
def test_absorbed_layer_on_the_reference_equals_naive_mla(window: int) -> None:
    """One MLA layer through the reference backend (absorbed query, attention over the
    latent cache) against textbook MLA over the entries the cache holds."""
    config = CONFIG.model_copy(update={"sliding_window": window})
    cfg = DrafterConfig.for_runtime(config, kv_layout=KvLayout.LATENT, num_layers=1)
    model = DraftModel(cfg, torch.device("cpu"))
    attn = model.layers[0].attn
    assert isinstance(attn, MLAAttention)
    assert cfg.softmax_scale == pytest.approx(1 / math.sqrt(16 + 8))
    layer = cfg.layer_spec(config.block_size, config.max_model_len)
    num_reqs, bs = len(CONTEXT_LENS), config.block_size
    limits = BuilderLimits(max_num_reqs=num_reqs, max_num_tokens=sum(NEW_TOKENS))
    builder = ReferenceMetadataBuilder(layer, config, torch.device("cpu"), limits)
    buffers = AttentionInputBuffers.allocate(num_reqs, limits.max_num_tokens,
                                             layer.max_blocks_per_req, torch.device("cpu"))
    table = torch.arange(num_reqs * layer.max_blocks_per_req).flip(0).view(num_reqs, -1) + 1
    buffers.block_table.copy_(table)
    seq_lens = [c + q for c, q in zip(CONTEXT_LENS, NEW_TOKENS, strict=True)]
    buffers.seq_lens.copy_(torch.tensor(seq_lens))
    positions = torch.tensor([c + i for c, q in zip(CONTEXT_LENS, NEW_TOKENS, strict=True)
                              for i in range(q)])
    request = torch.repeat_interleave(torch.arange(num_reqs), torch.tensor(NEW_TOKENS))
    buffers.positions.copy_(positions)
    buffers.slot_mapping.copy_(table[request, positions // bs] * bs + positions % bs)
    qsl = np.concatenate([[0], np.cumsum(NEW_TOKENS)])
    common = build_attention_metadata(
        buffers=buffers, batch_desc=BatchExecutionDescriptor(CUDAGraphMode.NONE, int(qsl[-1])),
        num_reqs=num_reqs, query_start_loc_np=qsl, base_seq_lens_np=np.array(seq_lens),
        step=0, max_model_len=config.max_model_len,
    )
    cache = PagedKVCache.allocate([layer], num_blocks=num_reqs * layer.max_blocks_per_req + 1,
                                  device=torch.device("cpu"))
    cache.fill_random_(0)
    x = torch.randn(len(positions), cfg.hidden_size, generator=torch.Generator().manual_seed(1))

    absorbed = attn.attend(x, positions, builder.make_impl(cfg.softmax_scale), builder.build(common),
                    cache.layers[0])

    latent = cache.layers[0][0]
    visible = [latent[table[r, torch.arange(p + 1) // bs], torch.arange(p + 1) % bs, 0]
               for r, p in zip(request.tolist(), positions.tolist(), strict=True)]
    torch.testing.assert_close(absorbed, _naive_mla(attn, x, positions, visible, window),
                               atol=1e-5, rtol=1e-5)


def test_latent_cache_pairs_a_latent_with_an_empty_tensor() -> None:
    cfg = DrafterConfig.for_runtime(CONFIG, kv_layout=KvLayout.LATENT)
    layer = cfg.layer_spec(block_size=4, max_model_len=24)
    assert (layer.num_kv_heads, layer.latent_size) == (1, 40)
    cache = PagedKVCache.allocate([layer] * 2, num_blocks=5, device=torch.device("cpu"))
    assert [tuple(t.shape) for t in cache.layers[1]] == [(5, 4, 1, 40), (5, 4, 1, 0)]
    gqa = DrafterConfig.for_runtime(CONFIG).layer_spec(block_size=4, max_model_len=24)
    assert gqa.kv_cache_shapes(5) == ((5, 4, 1, 16), (5, 4, 1, 16))


@pytest.mark.parametrize(("backend", "layout", "window", "refusal"), [
    ("triton_attn", KvLayout.LATENT, 0, "requires kv_layout NHD, but the layer's KV cache is latent"),
    ("triton_mla", KvLayout.NHD, 0, "requires kv_layout latent, but the layer's KV cache is NHD"),
    ("triton_attn", KvLayout.NHD, 4, "requires sliding_window == 0, but sliding_window is 4"),
    ("triton_mla", KvLayout.LATENT, 4, "requires sliding_window == 0, but sliding_window is 4"),
])
def test_a_backend_refuses_a_layer_it_cannot_read(
    backend: str, layout: KvLayout, window: int, refusal: str,
) -> None:
    config = CONFIG.model_copy(update={"sliding_window": window})
    layer = DrafterConfig.for_runtime(config, kv_layout=layout).layer_spec(4, 24)
    with pytest.raises(ConstraintViolation, match=refusal):
        build_attention_groups([backend], layer, config, torch.device("cpu"),
                               BuilderLimits(2, 8), matrix=MATRIX)


@pytest.mark.parametrize("layout", [KvLayout.NHD, KvLayout.LATENT])
def test_the_reference_reads_every_layout_and_window(layout: KvLayout) -> None:
    config = CONFIG.model_copy(update={"sliding_window": 3})
    layer = DrafterConfig.for_runtime(config, kv_layout=layout).layer_spec(4, 24)
    (group,) = build_attention_groups(["reference"], layer, config, torch.device("cpu"),
                                      BuilderLimits(2, 8), matrix=MATRIX)
    assert group.builder.layer.kv_layout is layout


def test_mla_kernel_sizes_are_matrix_constraints() -> None:
    config = CONFIG.model_copy(update={"kv_lora_rank": 48})
    layer = DrafterConfig.for_runtime(config, kv_layout=KvLayout.LATENT).layer_spec(4, 24)
    with pytest.raises(ConstraintViolation, match="kv_lora_rank is 48"):
        build_attention_groups(["triton_mla"], layer, config, torch.device("cpu"),
                               BuilderLimits(2, 8), matrix=MATRIX)
