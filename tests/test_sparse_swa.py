"""The ``sparse_swa`` kernels through the builder and the impl's ``forward``: window indices
and lengths against plain-Python windows, the tile schedule against its contract, and the
attention against the fp32 oracle (the ``reference`` backend's windowed attention over the
latent cache).

On CPU the kernels run in the Triton interpreter (conftest sets ``TRITON_INTERPRET=1``) at
tiny shapes; a subprocess compiles each kernel for sm_90 to catch what the interpreter
accepts but compiled Triton rejects. Tests marked ``cuda`` run the compiled kernels at
serving-like shapes and under CUDA-graph replay.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.backends.reference.attention import paged_attention_reference
from speccheck.backends.sparse_swa.builder import INTERPRETER_PARTS, SparseSWAMetadataBuilder
from speccheck.backends.sparse_swa.metadata import KV_TILE, SparseSWAMetadata
from speccheck.contract.builder import AttentionLayerSpec, BuilderLimits
from speccheck.contract.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from speccheck.contract.matrix_model import KvLayout
from speccheck.contract.metadata import AttentionInputBuffers
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.contract.token_count import build_attention_metadata
from speccheck.speculator.kv_cache import PAD_SLOT
from tests.fixtures.kernel_batches import batch_metadata, refresh_token_slots, shuffled_inputs
from tests.fixtures.sm90_compile import run_without_interpreter

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
"""atol = rtol per dtype against the fp32 reference."""
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Block 0 is in no block table: padding tokens and tokens at negative positions write
there."""


@dataclass
class Case:
    """One attention call: persistent buffers, the latent cache, and the builder's metadata."""

    builder: SparseSWAMetadataBuilder
    buffers: AttentionInputBuffers
    latent: torch.Tensor
    empty: torch.Tensor
    metadata: SparseSWAMetadata
    query_lens: list[int]

    @property
    def layer(self) -> AttentionLayerSpec:
        return self.builder.layer

    @property
    def scale(self) -> float:
        return 1 / math.sqrt(self.layer.latent_size)


def make_case(
    *,
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    window: int,
    num_heads: int = 4,
    rank: int = 32,
    rope: int = 16,
    dtype: torch.dtype = torch.float32,
    max_model_len: int = 48,
    pad_reqs: int = 0,
    pad_tokens: int = 0,
    num_parts: int | None = None,
    seed: int = 0,
    device: str = DEVICE,
) -> Case:
    """A batch with a shuffled block table and a random latent cache; ``pad_reqs`` /
    ``pad_tokens`` > 0 make it a FULL-graph batch (padded request lanes and tokens)."""
    num_reqs = len(seq_lens)
    layer = AttentionLayerSpec(
        num_heads=num_heads, num_kv_heads=1, head_size=16, dtype=dtype, block_size=block_size,
        max_model_len=max_model_len, kv_layout=KvLayout.LATENT, kv_lora_rank=rank,
        qk_rope_head_dim=rope, sliding_window=window,
    )
    limits = BuilderLimits(max_num_reqs=num_reqs + pad_reqs,
                           max_num_tokens=sum(query_lens) + pad_tokens)
    dev = torch.device(device)
    builder = SparseSWAMetadataBuilder(layer, RuntimeConfig(), dev, limits, num_parts=num_parts)
    gen = torch.Generator().manual_seed(seed)
    buffers, num_blocks = shuffled_inputs(layer, limits, seq_lens, gen, dev)
    latent_shape, empty_shape = layer.kv_cache_shapes(num_blocks)
    latent = torch.randn(latent_shape, generator=gen).to(dev, dtype)
    common = batch_metadata(buffers, seq_lens, query_lens, max_model_len=max_model_len,
                            pad_reqs=pad_reqs, pad_tokens=pad_tokens)
    case = Case(builder, buffers, latent, torch.empty(empty_shape, dtype=dtype, device=dev),
                builder.build(common), list(query_lens))
    refresh_slots(case)
    return case


def positions(case: Case) -> list[tuple[int, int]]:
    """``(request, position)`` of every real token, in token order."""
    seq_lens = case.buffers.seq_lens.tolist()
    return [(req, seq_lens[req] - q_len + i)
            for req, q_len in enumerate(case.query_lens) for i in range(q_len)]


def slot_of(case: Case, req: int, pos: int) -> int:
    bs = case.layer.block_size
    return int(case.buffers.block_table[req, pos // bs]) * bs + pos % bs


def refresh_slots(case: Case) -> None:
    refresh_token_slots(case.buffers, case.query_lens, case.layer.block_size)


def expected_windows(case: Case) -> list[list[int]]:
    """The KV slots each of the call's tokens must see, oldest first: positions
    ``max(0, p - W + 1) .. p`` of its request; none for padding tokens."""
    window = case.layer.sliding_window
    windows = [[slot_of(case, req, pos) for pos in range(max(0, p - window + 1), p + 1)]
               for req, p in positions(case)]
    return windows + [[] for _ in range(case.metadata.num_actual_tokens - len(windows))]


def check_indices(case: Case) -> None:
    """Indices and lengths of the live rows against :func:`expected_windows`; zero tails."""
    md, window = case.metadata, case.layer.sliding_window
    for token, slots in enumerate(expected_windows(case)):
        assert md.swa_lens[token].item() == len(slots), token
        assert md.swa_indices[token].tolist() == slots + [-1] * (window - len(slots)), token
    for name, used in case.builder.persistent_buffer_extents(md).items():
        buffer = case.builder.persistent_buffers()[name]
        assert torch.count_nonzero(buffer[used:]) == 0, name


def schedule_runs(case: Case) -> list[list[tuple[int, int, int]]]:
    """The tile schedule read back: per part, the ``(token, tile, partial)`` it runs, in
    order (``partial``: where the part writes the token's partial result)."""
    md = case.metadata
    lens = md.swa_lens.tolist()
    offsets = md.split_offsets.tolist()
    runs = []
    for first_token, first_tile, last_token, end_tile, first_partial in (
        md.tile_scheduler_metadata.tolist()
    ):
        run = []
        for token in range(first_token, last_token + 1):
            lo = first_tile if token == first_token else 0
            hi = end_tile if token == last_token else -(-lens[token] // KV_TILE)
            partial = first_partial if token == first_token else offsets[token]
            run += [(token, tile, partial) for tile in range(lo, hi)]
        runs.append(run)
    return runs


def check_schedule(case: Case) -> None:
    """Every KV tile of every token is run by exactly one part, in token order; the parts
    share the work evenly; each (part, token) pair writes a partial of its own inside the
    token's ``split_offsets`` range, and every partial of the range is written."""
    md = case.metadata
    lens = md.swa_lens.tolist()
    tiles = [(t, tile) for t, length in enumerate(lens) for tile in range(-(-length // KV_TILE))]
    runs = schedule_runs(case)
    assert [(t, tile) for run in runs for t, tile, _ in run] == tiles
    per_part = max(1, -(-len(tiles) // case.builder.num_parts))
    assert all(len(run) <= per_part for run in runs)
    offsets = md.split_offsets.tolist()
    written = {(t, partial) for run in runs for t, _, partial in run}
    for t in range(len(lens)):
        assert sorted(p for token, p in written if token == t) == list(
            range(offsets[t], offsets[t + 1])), t
    assert offsets[0] == 0 and offsets[-1] <= len(lens) + case.builder.num_parts - 1


def run_forward(case: Case, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward with poisoned scratch and output, new latent entries drawn from
    ``seed``; checks the write and returns (output, query)."""
    md, layer = case.metadata, case.layer
    n = md.num_actual_tokens
    dev, dtype = case.latent.device, case.latent.dtype
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(n, layer.num_heads, layer.latent_size, generator=gen).to(dev, dtype)
    key = torch.randn(n, 1, layer.latent_size, generator=gen).to(dev, dtype)
    for buf in case.builder.workspace_buffers().values():
        buf.fill_(float("nan"))
    output = torch.full((n, layer.num_heads, layer.kv_lora_rank), float("nan"),
                        dtype=dtype, device=dev)
    impl = case.builder.make_impl(case.scale)
    impl.forward(query, key, key[..., : layer.kv_lora_rank], case.latent, case.empty, md, output)

    real = (md.slot_mapping != PAD_SLOT).nonzero().squeeze(1)
    flat = case.latent.view(-1, layer.latent_size)
    assert torch.equal(flat[md.slot_mapping[real]], key[real, 0]), "new latents not in the cache"
    return output, query


def reference(case: Case, query: torch.Tensor) -> torch.Tensor:
    """The fp32 oracle (the ``reference`` backend's windowed attention) over the latent
    cache: keys are whole entries, values their first ``kv_lora_rank`` channels."""
    md, layer = case.metadata, case.layer
    return paged_attention_reference(
        query.float(), case.latent.float(), case.latent[..., : layer.kv_lora_rank].float(),
        md.query_start_loc, md.seq_lens, md.block_table, case.scale, causal=True,
        window=layer.sliding_window,
    )


def check_forward(case: Case, seed: int) -> None:
    output, query = run_forward(case, seed)
    tol = TOLERANCE[case.latent.dtype]
    torch.testing.assert_close(output.float(), reference(case, query), atol=tol, rtol=tol)


@settings(max_examples=25)
@given(
    data=st.data(),
    num_reqs=st.integers(1, 4),
    block_size=st.sampled_from([1, 4, 16]),
    window=st.sampled_from([1, 5, 8, 16, 40]),
    num_heads=st.sampled_from([1, 4, 20]),
    rank=st.sampled_from([16, 32]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    num_parts=st.sampled_from([1, 3, 4]),
)
def test_matches_reference(data, num_reqs, block_size, window, num_heads, rank, dtype, num_parts):
    """Windows that cross block boundaries, lengths shorter than the window (and tokens at
    negative positions, which see nothing), padded rows and lanes, several head blocks."""
    padded = data.draw(st.booleans(), label="full_graph_padding")
    case = make_case(
        seq_lens=[data.draw(st.integers(0, 48), label="seq_len") for _ in range(num_reqs)],
        query_lens=[data.draw(st.integers(1, 4), label="query_len") for _ in range(num_reqs)],
        block_size=block_size, window=window, num_heads=num_heads, rank=rank, dtype=dtype,
        pad_reqs=data.draw(st.integers(0, 2), label="pad_reqs") if padded else 0,
        pad_tokens=data.draw(st.integers(1, 3), label="pad_tokens") if padded else 0,
        num_parts=num_parts, seed=data.draw(st.integers(0, 2**16), label="seed"),
    )
    check_indices(case)
    check_schedule(case)
    check_forward(case, seed=1)


def test_long_windows_are_split_across_parts():
    """A 40-position window is three tiles; four parts over two such tokens split them, and
    one token's partials come from two parts."""
    case = make_case(seq_lens=[45, 40], query_lens=[1, 1], block_size=4, window=40,
                     num_parts=4)
    check_schedule(case)
    assert case.metadata.split_offsets.tolist() == [0, 2, 4]
    check_forward(case, seed=3)


def test_draft_steps_refresh_in_place():
    """Built once, then advanced in place across block boundaries and past the window like a
    fused draft loop: each refresh recomputes indices, lengths and schedule into the same
    tensors and clears the cache, and each forward matches the reference."""
    case = make_case(seq_lens=[3, 7, 15], query_lens=[1, 1, 1], block_size=4, window=8,
                     dtype=torch.float16, pad_reqs=1, pad_tokens=1, num_parts=2)
    md = case.metadata
    fields = {name: getattr(md, name).data_ptr() for name in (
        "swa_indices", "swa_lens", "tile_scheduler_metadata", "split_offsets",
        "sparse_index_cache", "sparse_index_cache_valid")}
    for step in range(4):
        check_forward(case, seed=10 + step)
        assert md.sparse_index_cache_valid.item() == 1
        case.buffers.seq_lens[:3] += 1
        refresh_slots(case)
        case.builder.update_draft_decode_metadata(md)
        assert md.sparse_index_cache_valid.item() == 0
        assert torch.count_nonzero(md.sparse_index_cache) == 0
        check_indices(case)
        check_schedule(case)
        assert {name: getattr(md, name).data_ptr() for name in fields} == fields


def test_index_cache_is_filled_once_and_reused():
    """The first forward converts the indices; a second layer's forward reuses the cache
    even when the indices changed meanwhile; after a clear the next forward refills it."""
    case = make_case(seq_lens=[9, 5], query_lens=[2, 1], block_size=4, window=6)
    md, latent_size = case.metadata, case.layer.latent_size
    first, _ = run_forward(case, seed=5)
    slots = md.swa_indices.long()
    offsets = torch.where(slots >= 0, slots * latent_size, -1)
    assert torch.equal(md.sparse_index_cache, offsets)

    md.swa_indices.fill_(-1)  # a second layer must not re-read the indices
    assert torch.equal(run_forward(case, seed=5)[0], first)
    assert torch.equal(md.sparse_index_cache, offsets)

    case.builder.clear_index_cache(md)
    run_forward(case, seed=5)
    assert torch.equal(md.sparse_index_cache, torch.full_like(offsets, -1))


def test_builder_contract():
    case = make_case(seq_lens=[5], query_lens=[2], block_size=4, window=8, pad_tokens=3)
    builder, md = case.builder, case.metadata
    assert builder.backend_name == "sparse_swa"
    assert builder.num_parts == INTERPRETER_PARTS or DEVICE == "cuda"
    # not a power of two, as a GPU's count: the schedule kernel masks its padded part axis
    assert INTERPRETER_PARTS & (INTERPRETER_PARTS - 1) != 0
    buffers = builder.persistent_buffers()
    assert {name: tuple(t.shape) for name, t in buffers.items()} == {
        "decode_swa_indices": (5, 8), "decode_swa_lens": (5,),
        "tile_scheduler_metadata": (builder.num_parts, 5), "split_offsets": (6,),
        "sparse_index_cache": (5, 8), "sparse_index_cache_valid": (1,),
    }
    assert builder.persistent_buffer_extents(md) == {
        "decode_swa_indices": 5, "decode_swa_lens": 5, "split_offsets": 6,
        "sparse_index_cache": 5}
    rows = 5 + builder.num_parts
    assert builder.workspace_buffers()["part_acc"].shape == (rows, 4, 32)


def test_build_zeroes_tails_left_by_a_larger_batch():
    """After a padded batch of 6 tokens and with every buffer poisoned (as the verifier
    leaves them), an eager build of the same 2 requests holds zeros past its live rows."""
    case = make_case(seq_lens=[20, 3], query_lens=[1, 1], block_size=4, window=8,
                     pad_tokens=4)
    for buffer in case.builder.persistent_buffers().values():
        buffer.fill_(-7)
    case.metadata = case.builder.build(_common_of(case))
    assert case.metadata.num_actual_tokens == 2
    check_indices(case)
    check_schedule(case)


def _common_of(case: Case):
    """The common metadata of ``case``'s batch, built again (an eager, unpadded batch)."""
    qsl = np.concatenate([[0], np.cumsum(case.query_lens)]).astype(np.int32)
    desc = BatchExecutionDescriptor(CUDAGraphMode.NONE, int(qsl[-1]), None)
    return build_attention_metadata(
        buffers=case.buffers, batch_desc=desc, num_reqs=len(case.query_lens),
        query_start_loc_np=qsl,
        base_seq_lens_np=case.buffers.seq_lens[: len(case.query_lens)].cpu().numpy(), step=0,
        max_model_len=case.layer.max_model_len,
    )


def test_non_causal_metadata_is_refused():
    case = make_case(seq_lens=[5], query_lens=[2], block_size=4, window=8)
    common = _common_of(case)
    common.causal = False
    with pytest.raises(ValueError, match="causal attention only"):
        case.builder.build(common)


_AOT_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from speccheck.backends.sparse_swa import attention_kernels, index_kernels
    from tests.fixtures.sm90_compile import signature

    SHARED_MEMORY = 232448  # bytes per block on an H200

    def compile_sm90(fn, pointer_types, constexprs, num_warps=4):
        sig = signature(fn, constexprs, pointer_types, "*i32")
        compiled = triton.compile(ASTSource(fn, sig, constexprs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": num_warps})
        assert compiled.asm["cubin"], fn.__name__
        assert compiled.metadata.shared <= SHARED_MEMORY, (fn.__name__, compiled.metadata.shared)
        print(fn.__name__, "ok", compiled.metadata.shared, flush=True)

    compile_sm90(index_kernels.swa_indices_kernel, {},
                 dict(WINDOW=2048, BLOCK_W=2048, BLOCK_SIZE=64))
    compile_sm90(index_kernels.tile_schedule_kernel, {},
                 dict(KV_TILE=16, NUM_PARTS=132, PARTS_P=256, BLOCK_T=16, FIELDS=5),
                 num_warps=8)
    compile_sm90(index_kernels.fill_index_cache_kernel, {"cache_ptr": "*i64"},
                 dict(WINDOW=100, BLOCK_W=128, BLOCK_SIZE=16))
    for dtype, extra in [
        ("bf16", dict(NUM_HEADS=128, RANK=512, ROPE=64, UPCAST=False)),
        ("fp16", dict(NUM_HEADS=16, RANK=512, ROPE=64, UPCAST=False)),
        ("fp32", dict(NUM_HEADS=4, RANK=32, ROPE=16, UPCAST=True)),
    ]:
        pointers = {"q_ptr": "*" + dtype, "latent_ptr": "*" + dtype, "cache_ptr": "*i64",
                    "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "part_acc_ptr": "*fp32"}
        compile_sm90(attention_kernels.sparse_mla_split_kernel, pointers,
                     dict(BLOCK_H=16, KV_TILE=16, FIELDS=5, **extra))
        compile_sm90(attention_kernels.sparse_mla_combine_kernel,
                     {"out_ptr": "*" + dtype, "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
                      "part_acc_ptr": "*fp32"},
                     dict(NUM_HEADS=extra["NUM_HEADS"], RANK=extra["RANK"], BLOCK_H=16))
    """
)


def test_kernels_compile_for_sm90():
    """``triton.compile`` for Hopper on any machine (the wheel ships ptxas), within an H200's
    shared memory; in a subprocess, because kernels decorated under ``TRITON_INTERPRET=1``
    cannot be compiled."""
    out = run_without_interpreter(_AOT_SCRIPT)
    assert out.count(" ok ") == 9, out


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("max_query_len", [1, 16])
def test_cuda_matches_reference_at_scale(dtype, max_query_len):
    """Compiled kernels at DeepSeek widths (latent 512 + rope 64, window 128, block size
    64), 32 requests, lengths from 0 to 4096, padded rows and lanes."""
    num_reqs = 32 if max_query_len == 1 else 8
    gen = torch.Generator().manual_seed(max_query_len)
    seq_lens = torch.randint(0, 4097, (num_reqs,), generator=gen).tolist()
    seq_lens[:4] = [0, 1, 127, 4096]
    query_lens = torch.randint(1, max_query_len + 1, (num_reqs,), generator=gen).tolist()
    case = make_case(
        seq_lens=seq_lens, query_lens=query_lens,
        block_size=64, window=128, num_heads=16, rank=512, rope=64, dtype=dtype,
        max_model_len=4096, pad_reqs=3, pad_tokens=5, device="cuda",
    )
    check_indices(case)
    check_schedule(case)
    check_forward(case, seed=3)


@pytest.mark.cuda
def test_cuda_graph_replay_follows_refreshed_metadata():
    """Capture a refresh and a forward, then advance lengths and slots in place and replay:
    the output follows the new windows (the cache is cleared and refilled in the graph)."""
    case = make_case(seq_lens=[15, 100, 1023, 4000], query_lens=[1, 1, 1, 1], block_size=64,
                     window=128, num_heads=16, rank=512, rope=64, dtype=torch.bfloat16,
                     max_model_len=4096, pad_reqs=2, pad_tokens=2, device="cuda")
    md, layer = case.metadata, case.layer
    n = md.num_actual_tokens
    query = torch.randn(n, layer.num_heads, layer.latent_size, device="cuda",
                        dtype=torch.bfloat16)
    key = torch.randn(n, 1, layer.latent_size, device="cuda", dtype=torch.bfloat16)
    output = torch.zeros(n, layer.num_heads, layer.kv_lora_rank, device="cuda",
                         dtype=torch.bfloat16)
    impl = case.builder.make_impl(case.scale)

    def body() -> None:
        case.builder.update_draft_decode_metadata(md)
        impl.forward(query, key, key, case.latent, case.empty, md, output)

    body()  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(3):
        case.buffers.seq_lens[:4] += 1
        refresh_slots(case)
        query.normal_()
        key.normal_()
        graph.replay()
        check_indices(case)
        torch.testing.assert_close(output.float(), reference(case, query), atol=2e-2,
                                   rtol=2e-2)
