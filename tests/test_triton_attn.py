"""The ``triton_attn`` backend against the fp32 reference, through the impl's ``forward``.

On CPU the kernels run in the Triton interpreter (conftest sets ``TRITON_INTERPRET=1``), so
shapes stay tiny; a subprocess compiles each kernel for sm_90 to catch what the interpreter
accepts but compiled Triton rejects. Tests marked ``cuda`` run the compiled kernels on a GPU
at serving-like shapes, and under CUDA-graph replay.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.backends.reference.attention import paged_attention_reference
from speccheck.backends.triton_attn.builder import (
    MAX_KV_SPLITS,
    TritonAttnMetadata,
    TritonAttnMetadataBuilder,
    default_num_kv_splits,
)
from speccheck.contract.builder import AttentionLayerSpec, BuilderLimits
from speccheck.contract.metadata import AttentionInputBuffers
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.kv_cache import PAD_SLOT
from tests.fixtures.kernel_batches import batch_metadata, refresh_token_slots, shuffled_inputs
from tests.fixtures.sm90_compile import run_without_interpreter

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
"""atol = rtol per dtype (bf16: the interpreter's fp32->bf16 store truncates, ~1 ulp)."""
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the small-shape tests run: the interpreter on CPU, compiled kernels on a GPU."""
"""Block 0 is never in a block table: padding tokens and tokens at negative positions
write there."""


@dataclass
class Batch:
    """One attention call: persistent buffers, caches, inputs, and the builder's metadata."""

    builder: TritonAttnMetadataBuilder
    buffers: AttentionInputBuffers
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    metadata: TritonAttnMetadata
    query_lens: list[int]
    scale: float


def make_batch(
    *,
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    kv_heads: int,
    group: int,
    head_size: int,
    dtype: torch.dtype,
    causal: bool,
    max_model_len: int,
    pad_reqs: int = 0,
    pad_tokens: int = 0,
    num_kv_splits: int | None = None,
    seed: int = 0,
    device: str = DEVICE,
) -> Batch:
    """A batch with a shuffled block table; ``pad_reqs``/``pad_tokens`` > 0 make it a FULL
    graph batch (padded request lanes and tokens), else an eager one."""
    num_reqs = len(seq_lens)
    layer = AttentionLayerSpec(
        num_heads=kv_heads * group,
        num_kv_heads=kv_heads,
        head_size=head_size,
        dtype=dtype,
        block_size=block_size,
        max_model_len=max_model_len,
    )
    limits = BuilderLimits(
        max_num_reqs=num_reqs + pad_reqs, max_num_tokens=sum(query_lens) + pad_tokens
    )
    dev = torch.device(device)
    builder = TritonAttnMetadataBuilder(
        layer, RuntimeConfig(), dev, limits, num_kv_splits=num_kv_splits
    )
    gen = torch.Generator().manual_seed(seed)
    buffers, num_blocks = shuffled_inputs(layer, limits, seq_lens, gen, dev)
    cache_shape = (num_blocks, block_size, kv_heads, head_size)
    key_cache = torch.randn(cache_shape, generator=gen).to(dev, dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(dev, dtype)
    common = batch_metadata(buffers, seq_lens, query_lens, max_model_len=max_model_len,
                            pad_reqs=pad_reqs, pad_tokens=pad_tokens, causal=causal)
    batch = Batch(
        builder, buffers, key_cache, value_cache, builder.build(common), list(query_lens),
        1 / math.sqrt(head_size),
    )
    refresh_slots(batch)
    return batch


def refresh_slots(batch: Batch) -> None:
    refresh_token_slots(batch.buffers, batch.query_lens, batch.key_cache.shape[1])


def run_and_check(batch: Batch, seed: int, max_query_block: int | None = None) -> None:
    """One forward with poisoned scratch and output; checks the KV write and the output
    against the reference. ``max_query_block`` lowers the impl's query-block cap, so that
    one request's tokens spread over several programs."""
    md = batch.metadata
    n = md.num_actual_tokens
    num_heads, kv_heads = batch.builder.layer.num_heads, batch.builder.layer.num_kv_heads
    head_size, dtype = batch.builder.layer.head_size, batch.key_cache.dtype
    dev = batch.key_cache.device
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(n, num_heads, head_size, generator=gen).to(dev, dtype)
    key = torch.randn(n, kv_heads, head_size, generator=gen).to(dev, dtype)
    value = torch.randn(n, kv_heads, head_size, generator=gen).to(dev, dtype)
    for buf in batch.builder.workspace_buffers().values():
        buf.fill_(float("nan"))
    output = torch.full_like(query, float("nan"))

    impl = batch.builder.make_impl(batch.scale)
    if max_query_block is not None:
        impl.max_query_block = max_query_block
    impl.forward(query, key, value, batch.key_cache, batch.value_cache, md, output)

    real = (md.slot_mapping != PAD_SLOT).nonzero().squeeze(1)
    flat_k = batch.key_cache.view(-1, kv_heads, head_size)
    assert torch.equal(flat_k[md.slot_mapping[real]], key[real]), "new keys not in the cache"
    want = paged_attention_reference(
        query, batch.key_cache, batch.value_cache, md.query_start_loc, md.seq_lens,
        md.block_table, batch.scale, md.causal,
    )
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(output.float(), want.float(), atol=tol, rtol=tol)
    num_real = sum(batch.query_lens)
    assert torch.count_nonzero(output[num_real:]) == 0, "padding tokens must produce zeros"
    if md.split_arrivals is not None:
        assert torch.count_nonzero(md.split_arrivals) == 0, "split counters must end at zero"


@settings(max_examples=30)
@given(
    data=st.data(),
    num_reqs=st.integers(1, 4),
    block_size=st.sampled_from([1, 4, 16]),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    head_size=st.sampled_from([16, 32]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    causal=st.booleans(),
    num_kv_splits=st.sampled_from([1, 3]),
    max_query_block=st.sampled_from([1, 2, 16]),
)
def test_matches_reference(
    data, num_reqs, block_size, kv_heads, group, head_size, dtype, causal, num_kv_splits,
    max_query_block,
):
    seq_lens = [data.draw(st.integers(0, 48), label="seq_len") for _ in range(num_reqs)]
    query_lens = [data.draw(st.integers(1, 4), label="query_len") for _ in range(num_reqs)]
    padded = data.draw(st.booleans(), label="full_graph_padding")
    batch = make_batch(
        seq_lens=seq_lens,
        query_lens=query_lens,
        block_size=block_size,
        kv_heads=kv_heads,
        group=group,
        head_size=head_size,
        dtype=dtype,
        causal=causal,
        max_model_len=48,
        pad_reqs=data.draw(st.integers(0, 2), label="pad_reqs") if padded else 0,
        pad_tokens=data.draw(st.integers(1, 3), label="pad_tokens") if padded else 0,
        num_kv_splits=num_kv_splits,
        seed=data.draw(st.integers(0, 2**16), label="seed"),
    )
    run_and_check(batch, seed=1, max_query_block=max_query_block)


def test_several_splits_each_hold_a_share():
    """Four splits over a 130-token sequence: three hold partials, one is empty, and the
    merge equals the single-pass reference."""
    batch = make_batch(
        seq_lens=[130, 33, 0, 7],
        query_lens=[2, 1, 1, 3],
        block_size=4,
        kv_heads=1,
        group=2,
        head_size=16,
        dtype=torch.float32,
        causal=True,
        max_model_len=160,
        num_kv_splits=4,
    )
    run_and_check(batch, seed=2)
    scratch = batch.metadata.scratch
    assert scratch.num_splits == 4
    last_token_of_long_request = 1
    holding = scratch.part_sum[last_token_of_long_request, 0] > 0
    assert holding.tolist() == [True, True, True, False]
    assert scratch.part_max[last_token_of_long_request, 0, 3] == float("-inf")


def test_draft_steps_need_no_refresh():
    """Built once, then advanced in place across block boundaries like a fused draft loop:
    each step's forward sees the new lengths through the same metadata object."""
    batch = make_batch(
        seq_lens=[3, 7, 15],
        query_lens=[1, 1, 1],
        block_size=4,
        kv_heads=2,
        group=2,
        head_size=16,
        dtype=torch.float16,
        causal=True,
        max_model_len=32,
        pad_reqs=1,
        pad_tokens=1,
        num_kv_splits=2,
    )
    md = batch.metadata
    views = {
        "seq_lens": batch.buffers.seq_lens,
        "query_start_loc": batch.buffers.query_start_loc,
        "block_table": batch.buffers.block_table,
        "slot_mapping": batch.buffers.slot_mapping,
    }
    for step in range(3):
        run_and_check(batch, seed=10 + step)
        batch.buffers.seq_lens[:3] += 1
        refresh_slots(batch)
        batch.builder.update_draft_decode_metadata(md)
        for name, buffer in views.items():
            assert getattr(md, name).data_ptr() == buffer.data_ptr(), name


def test_builder_contract():
    layer = AttentionLayerSpec(8, 2, 128, torch.bfloat16, 16, 4096)
    limits = BuilderLimits(max_num_reqs=64, max_num_tokens=256)
    builder = TritonAttnMetadataBuilder(layer, RuntimeConfig(), torch.device("cpu"), limits)
    assert builder.backend_name == "triton_attn"
    assert builder.supports_draft_decode_metadata_update is False
    bufs = builder.workspace_buffers()
    assert bufs["part_max"].shape == (256, 8, 8)
    assert bufs["part_sum"].shape == (256, 8, 8)
    assert bufs["part_acc"].shape == (256, 8, 8, 128)

    assert default_num_kv_splits(layer, limits) == 8
    long = AttentionLayerSpec(8, 2, 128, torch.bfloat16, 16, 1 << 20)
    assert default_num_kv_splits(long, limits) == MAX_KV_SPLITS
    short = AttentionLayerSpec(8, 2, 128, torch.bfloat16, 16, 48)
    assert default_num_kv_splits(short, limits) == 1
    huge_batch = BuilderLimits(max_num_reqs=8192, max_num_tokens=65536)
    assert 1 <= default_num_kv_splits(long, huge_batch) < MAX_KV_SPLITS


def test_forward_rejects_more_tokens_than_the_scratch_holds():
    batch = make_batch(
        seq_lens=[5], query_lens=[2], block_size=4, kv_heads=1, group=1, head_size=16,
        dtype=torch.float32, causal=True, max_model_len=16,
    )
    md = batch.metadata
    md.num_actual_tokens = 3
    q = torch.zeros(3, 1, 16)
    kv = torch.zeros(3, 1, 16)
    with pytest.raises(ValueError, match="scratch"):
        batch.builder.make_impl(1.0).forward(
            q, kv, kv, batch.key_cache, batch.value_cache, md, torch.empty_like(q)
        )


_AOT_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from speccheck.backends.triton_attn import kernels
    from tests.fixtures.sm90_compile import signature

    def compile_sm90(fn, pointer_types, constexprs):
        src = ASTSource(fn, signature(fn, constexprs, pointer_types, "*fp32"), constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], fn.__name__
        print(fn.__name__, "ok", flush=True)

    index = {n: "*i32" for n in ("block_table_ptr", "seq_lens_ptr", "local_lens_ptr",
                                 "query_start_loc_ptr", "arrivals_ptr")}
    for dtype, extra in [
        ("bf16", dict(NUM_HEADS=32, GROUP=4, GROUP_P=4, HEAD_SIZE=128, BLOCK_SIZE=16,
                      BLOCK_M=1, NUM_SPLITS=8, CAUSAL=True, UPCAST=False, REDUCE=True, PDL=True)),
        ("fp16", dict(NUM_HEADS=6, GROUP=3, GROUP_P=4, HEAD_SIZE=256, BLOCK_SIZE=1,
                      BLOCK_M=4, NUM_SPLITS=3, CAUSAL=False, UPCAST=False, REDUCE=True, PDL=True)),
        ("fp32", dict(NUM_HEADS=1, GROUP=1, GROUP_P=1, HEAD_SIZE=16, BLOCK_SIZE=5,
                      BLOCK_M=2, NUM_SPLITS=1, CAUSAL=True, UPCAST=True, REDUCE=False, PDL=False,
                      num_reqs=1)),
    ]:
        data = {n: "*" + dtype for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
        compile_sm90(kernels.paged_attention_split_kernel, {**data, **index},
                     dict(BLOCK_N=32, **extra))
    for dtype, extra in [
        ("bf16", dict(NUM_HEADS=32, HEAD_SIZE=128, NUM_SPLITS=8, SPLITS_P=8, WRITE_LSE=False)),
        ("fp32", dict(NUM_HEADS=6, HEAD_SIZE=16, NUM_SPLITS=3, SPLITS_P=4, WRITE_LSE=True)),
    ]:
        compile_sm90(kernels.paged_attention_reduce_kernel,
                     {"out_ptr": "*" + dtype, "query_start_loc_ptr": "*i32"}, extra)
    """
)


def test_kernels_compile_for_sm90():
    """``triton.compile`` for Hopper on any machine (the wheel ships ptxas); runs in a
    subprocess because kernels decorated under ``TRITON_INTERPRET=1`` cannot be compiled."""
    out = run_without_interpreter(_AOT_SCRIPT)
    assert out.count(" ok") == 5, out


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("max_query_len", [1, 4])
def test_cuda_matches_reference_at_scale(dtype, causal, max_query_len):
    """Compiled kernels, batches up to 64 requests and sequences up to 4096 tokens."""
    num_reqs = 64 if max_query_len == 1 else 16
    gen = torch.Generator().manual_seed(max_query_len)
    seq_lens = torch.randint(0, 4097, (num_reqs,), generator=gen).tolist()
    seq_lens[:3] = [0, 1, 4096]
    query_lens = torch.randint(1, max_query_len + 1, (num_reqs,), generator=gen).tolist()
    batch = make_batch(
        seq_lens=seq_lens,
        query_lens=query_lens,
        block_size=16,
        kv_heads=2,
        group=4,
        head_size=128,
        dtype=dtype,
        causal=causal,
        max_model_len=4096,
        pad_reqs=3,
        pad_tokens=5,
        device="cuda",
    )
    assert batch.metadata.scratch.num_splits == 8
    run_and_check(batch, seed=3)


@pytest.mark.cuda
def test_cuda_graph_replay_sees_new_lengths():
    """Capture one forward, then advance lengths and slots in place and replay: the output
    follows the new lengths (the grid and every address are value independent)."""
    batch = make_batch(
        seq_lens=[15, 100, 1023, 4000],
        query_lens=[1, 1, 1, 1],
        block_size=16,
        kv_heads=2,
        group=4,
        head_size=128,
        dtype=torch.bfloat16,
        causal=True,
        max_model_len=4096,
        pad_reqs=2,
        pad_tokens=2,
        device="cuda",
    )
    md, layer = batch.metadata, batch.builder.layer
    n = md.num_actual_tokens
    query = torch.randn(n, layer.num_heads, layer.head_size, device="cuda", dtype=torch.bfloat16)
    key = torch.randn(n, layer.num_kv_heads, layer.head_size, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    output = torch.zeros_like(query)
    impl = batch.builder.make_impl(batch.scale)
    impl.forward(query, key, value, batch.key_cache, batch.value_cache, md, output)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(query, key, value, batch.key_cache, batch.value_cache, md, output)
    for _ in range(3):
        batch.buffers.seq_lens[:4] += 1
        refresh_slots(batch)
        batch.builder.update_draft_decode_metadata(md)
        query.normal_()
        key.normal_()
        graph.replay()
        want = paged_attention_reference(
            query, batch.key_cache, batch.value_cache, md.query_start_loc, md.seq_lens,
            md.block_table, batch.scale, md.causal,
        )
        torch.testing.assert_close(output.float(), want.float(), atol=2e-2, rtol=2e-2)
        assert torch.count_nonzero(output[4:]) == 0
