"""The ``triton_mla`` backend against the fp32 reference, through the impl's ``forward``.

On CPU the kernel runs in the Triton interpreter (conftest sets ``TRITON_INTERPRET=1``), in
fp32 at tiny shapes; a subprocess compiles it for sm_90 to catch what the interpreter
accepts but compiled Triton rejects. Tests marked ``cuda`` run the compiled kernel in bf16
and fp16 at DeepSeek's latent sizes (512 + 64).
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.backends.dcp import dcp_local_length_table
from speccheck.backends.reference.attention import paged_attention_reference
from speccheck.backends.triton_mla.builder import (
    TritonMLAMetadata,
    TritonMLAMetadataBuilder,
)
from speccheck.contract.builder import AttentionLayerSpec, BuilderLimits
from speccheck.contract.matrix_model import KvLayout
from speccheck.contract.metadata import AttentionInputBuffers
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.kv_cache import PAD_SLOT
from tests.fixtures.kernel_batches import batch_metadata, refresh_token_slots, shuffled_inputs
from tests.fixtures.sm90_compile import run_without_interpreter

TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
"""atol = rtol per dtype, for outputs of order one."""
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Block 0 is never in a block table: padding tokens and negative positions write there."""


@dataclass
class Batch:
    """One attention call: persistent buffers, the latent cache, the builder's metadata."""

    builder: TritonMLAMetadataBuilder
    buffers: AttentionInputBuffers
    latent_cache: torch.Tensor
    metadata: TritonMLAMetadata
    query_lens: list[int]
    scale: float


def make_batch(
    *,
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    num_heads: int,
    rank: int,
    rope: int,
    dtype: torch.dtype,
    causal: bool = True,
    max_model_len: int,
    dcp: int = 1,
    pad_reqs: int = 0,
    pad_tokens: int = 0,
    seed: int = 0,
    device: str = DEVICE,
) -> Batch:
    """A batch with a shuffled block table over a random latent cache; ``pad_reqs`` /
    ``pad_tokens`` > 0 make it a FULL graph batch (padded request lanes and tokens)."""
    num_reqs = len(seq_lens)
    layer = AttentionLayerSpec(
        num_heads=num_heads, num_kv_heads=1, head_size=16, dtype=dtype, block_size=block_size,
        max_model_len=max_model_len, kv_layout=KvLayout.LATENT, kv_lora_rank=rank,
        qk_rope_head_dim=rope,
    )
    limits = BuilderLimits(
        max_num_reqs=num_reqs + pad_reqs, max_num_tokens=sum(query_lens) + pad_tokens
    )
    dev = torch.device(device)
    builder = TritonMLAMetadataBuilder(layer, RuntimeConfig(dcp_world_size=dcp), dev, limits)
    gen = torch.Generator().manual_seed(seed)
    buffers, num_blocks = shuffled_inputs(layer, limits, seq_lens, gen, dev)
    latent_shape, _ = layer.kv_cache_shapes(num_blocks)
    latent_cache = torch.randn(latent_shape, generator=gen).to(dev, dtype)
    common = batch_metadata(buffers, seq_lens, query_lens, max_model_len=max_model_len,
                            pad_reqs=pad_reqs, pad_tokens=pad_tokens, causal=causal)
    batch = Batch(builder, buffers, latent_cache, builder.build(common), list(query_lens),
                  1 / math.sqrt(16 + rope))
    refresh_slots(batch)
    return batch


def refresh_slots(batch: Batch) -> None:
    refresh_token_slots(batch.buffers, batch.query_lens, batch.latent_cache.shape[1])


def run_and_check(batch: Batch, seed: int) -> None:
    """One forward with poisoned scratch and output; checks the latent write and the output
    against the fp32 reference (keys: whole latent entries, values: their kv_c part)."""
    md = batch.metadata
    n = md.num_actual_tokens
    layer = batch.builder.layer
    rank, width, dtype = layer.kv_lora_rank, layer.latent_size, batch.latent_cache.dtype
    dev = batch.latent_cache.device
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(n, layer.num_heads, width, generator=gen).to(dev, dtype)
    latent = torch.randn(n, 1, width, generator=gen).to(dev, dtype)
    for buf in batch.builder.workspace_buffers().values():
        buf.fill_(float("nan"))
    output = torch.full((n, layer.num_heads, rank), float("nan"), dtype=dtype, device=dev)
    empty = batch.latent_cache[..., :0]

    impl = batch.builder.make_impl(batch.scale)
    impl.forward(query, latent, latent[..., :rank], batch.latent_cache, empty, md, output)

    real = (md.slot_mapping != PAD_SLOT).nonzero().squeeze(1)
    flat = batch.latent_cache.view(-1, 1, width)
    assert torch.equal(flat[md.slot_mapping[real]], latent[real]), "new entries not in the cache"
    want = paged_attention_reference(
        query, batch.latent_cache, batch.latent_cache[..., :rank], md.query_start_loc,
        md.seq_lens, md.block_table, batch.scale, md.causal,
    )
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(output.float(), want.float(), atol=tol, rtol=tol)
    assert torch.count_nonzero(output[sum(batch.query_lens):]) == 0, "padding rows must be zero"


@settings(max_examples=25)
@given(
    data=st.data(),
    num_reqs=st.integers(1, 3),
    block_size=st.sampled_from([1, 4, 16]),
    num_heads=st.sampled_from([1, 3, 17]),
    rank=st.sampled_from([16, 32]),
    rope=st.sampled_from([16]),
    causal=st.booleans(),
    dcp=st.sampled_from([1, 2, 3]),
)
def test_matches_reference(data, num_reqs, block_size, num_heads, rank, rope, causal, dcp):
    """fp32 on the interpreter (fp16/bf16 on a GPU: the cuda tests); lengths from 0 (an
    empty request) across block boundaries, multi-token queries, padded lanes."""
    seq_lens = [data.draw(st.integers(0, 40), label="seq_len") for _ in range(num_reqs)]
    query_lens = [data.draw(st.integers(1, 5), label="query_len") for _ in range(num_reqs)]
    padded = data.draw(st.booleans(), label="full_graph_padding")
    batch = make_batch(
        seq_lens=seq_lens, query_lens=query_lens, block_size=block_size, num_heads=num_heads,
        rank=rank, rope=rope, dtype=torch.float32, causal=causal, max_model_len=40, dcp=dcp,
        pad_reqs=data.draw(st.integers(0, 2), label="pad_reqs") if padded else 0,
        pad_tokens=data.draw(st.integers(1, 3), label="pad_tokens") if padded else 0,
        seed=data.draw(st.integers(0, 2**16), label="seed"),
    )
    run_and_check(batch, seed=1)


def test_a_long_prefill_is_causal_within_its_request():
    """Sixteen new tokens of one request next to a decode token of another (the drafter's
    first pass), over several splits and blocks."""
    batch = make_batch(seq_lens=[37, 9], query_lens=[16, 1], block_size=4, num_heads=2,
                       rank=32, rope=16, dtype=torch.float32, max_model_len=1100)
    assert batch.metadata.scratch.num_splits == 3
    run_and_check(batch, seed=2)


def test_dcp_local_lengths_put_token_t_on_rank_t_mod_n():
    lens = torch.tensor([0, 1, 2, 5, 6], dtype=torch.int32)
    assert dcp_local_length_table(lens, 1).tolist() == [[0], [1], [2], [5], [6]]
    assert dcp_local_length_table(lens, 2).tolist() == [[0, 0], [1, 0], [1, 1], [3, 2], [3, 3]]
    assert dcp_local_length_table(lens, 4)[:, 0].tolist() == [0, 1, 1, 2, 2]  # ceil(len / 4)


def test_dcp_builder_derives_local_lengths_into_a_buffer_with_a_zeroed_tail():
    batch = make_batch(seq_lens=[7, 2], query_lens=[1, 1], block_size=4, num_heads=2, rank=16,
                       rope=16, dtype=torch.float32, max_model_len=16, dcp=2, pad_reqs=2,
                       pad_tokens=2)
    builder, md = batch.builder, batch.metadata
    buffer = builder.persistent_buffers()["dcp_local_seq_lens"]
    assert md.dcp_local_seq_lens.data_ptr() == buffer.data_ptr()
    assert buffer.tolist() == [[4, 3], [1, 1], [0, 0], [0, 0]]
    assert builder.persistent_buffer_extents(md) == {"dcp_local_seq_lens": 4}
    assert builder.workspace_buffers()["part_acc"].shape == (4, 2, 2, 16)
    run_and_check(batch, seed=3)
    with pytest.raises(NotImplementedError, match="dcp_local_seq_lens"):
        builder.update_draft_decode_metadata(md)


def test_draft_steps_need_no_refresh_without_dcp():
    """Built once, advanced in place across block boundaries like a fused draft loop: each
    step's forward sees the new lengths through the same metadata object."""
    batch = make_batch(seq_lens=[3, 7, 15], query_lens=[1, 1, 1], block_size=4, num_heads=4,
                       rank=16, rope=16, dtype=torch.float32, max_model_len=32, pad_reqs=1,
                       pad_tokens=1)
    md = batch.metadata
    assert md.dcp_local_seq_lens.data_ptr() == batch.buffers.seq_lens.data_ptr()
    assert batch.builder.persistent_buffers() == {}
    for step in range(3):
        run_and_check(batch, seed=10 + step)
        batch.buffers.seq_lens[:3] += 1
        refresh_slots(batch)
        batch.builder.update_draft_decode_metadata(md)


_AOT_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from speccheck.backends.triton_mla import kernels
    from tests.fixtures.sm90_compile import signature

    fn = kernels.mla_split_kernel
    index = {n: "*i32" for n in ("block_table_ptr", "seq_lens_ptr", "local_lens_ptr",
                                 "query_start_loc_ptr")}
    for dtype, extra in [
        ("bf16", dict(NUM_HEADS=16, RANK=512, ROPE=64, BLOCK_SIZE=16, NUM_SPLITS=8, DCP=1,
                      CAUSAL=True, UPCAST=False)),
        ("fp16", dict(NUM_HEADS=128, RANK=512, ROPE=64, BLOCK_SIZE=64, NUM_SPLITS=2, DCP=2,
                      CAUSAL=False, UPCAST=False)),
        ("fp32", dict(NUM_HEADS=2, RANK=16, ROPE=16, BLOCK_SIZE=5, NUM_SPLITS=1, DCP=3,
                      CAUSAL=True, UPCAST=True)),
    ]:
        constexprs = dict(BLOCK_H=16, BLOCK_N=16, **extra)
        pointers = {**index, "q_ptr": "*" + dtype, "latent_ptr": "*" + dtype}
        sig = signature(fn, constexprs, pointers, "*fp32")
        compiled = triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"] and compiled.metadata.shared <= 232448, dtype
        print(dtype, "ok", flush=True)
    """
)


def test_kernel_compiles_for_sm90():
    """``triton.compile`` for Hopper on any machine; in a subprocess because kernels
    decorated under ``TRITON_INTERPRET=1`` cannot be compiled."""
    out = run_without_interpreter(_AOT_SCRIPT)
    assert out.count(" ok") == 3, out


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("max_query_len", [1, 16])
@pytest.mark.parametrize("dcp", [1, 2])
def test_cuda_matches_reference_at_deepseek_sizes(dtype, max_query_len, dcp):
    """Compiled kernel, latent 512 + rope 64, 16 heads, up to 32 requests and 2048 tokens,
    empty requests, padded lanes."""
    num_reqs = 32 if max_query_len == 1 else 8
    gen = torch.Generator().manual_seed(max_query_len + dcp)
    seq_lens = torch.randint(16, 2049, (num_reqs,), generator=gen).tolist()
    seq_lens[:3] = [0, 17, 2048]
    query_lens = torch.randint(1, max_query_len + 1, (num_reqs,), generator=gen).tolist()
    batch = make_batch(seq_lens=seq_lens, query_lens=query_lens, block_size=16, num_heads=16,
                       rank=512, rope=64, dtype=dtype, max_model_len=2048, dcp=dcp,
                       pad_reqs=3, pad_tokens=5, device="cuda")
    run_and_check(batch, seed=4)


@pytest.mark.cuda
def test_cuda_graph_replay_sees_new_lengths():
    """A graph captured once replays correctly after ``seq_lens`` and slots advance."""
    batch = make_batch(seq_lens=[100, 31, 513], query_lens=[1, 1, 1], block_size=16,
                       num_heads=16, rank=512, rope=64, dtype=torch.bfloat16,
                       max_model_len=1024, pad_reqs=1, pad_tokens=1, device="cuda")
    layer, md = batch.builder.layer, batch.metadata
    n = md.num_actual_tokens
    query = torch.randn(n, layer.num_heads, layer.latent_size, device="cuda").bfloat16()
    latent = torch.randn(n, 1, layer.latent_size, device="cuda").bfloat16()
    output = torch.zeros(n, layer.num_heads, layer.kv_lora_rank, device="cuda").bfloat16()
    impl = batch.builder.make_impl(batch.scale)
    empty = batch.latent_cache[..., :0]

    def run() -> None:
        impl.forward(query, latent, latent, batch.latent_cache, empty, md, output)

    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(3):
        batch.buffers.seq_lens[:3] += 15
        refresh_slots(batch)
        graph.replay()
        want = paged_attention_reference(
            query, batch.latent_cache, batch.latent_cache[..., : layer.kv_lora_rank],
            md.query_start_loc, md.seq_lens, md.block_table, batch.scale, True,
        )
        torch.testing.assert_close(output.float(), want.float(), atol=2e-2, rtol=2e-2)
