"""FA3 and FlashInfer adapters against the fp32 reference, on a CUDA device.

Every test is marked ``cuda`` (skipped without a device by conftest) and imports its kernel
package through ``pytest.importorskip``. Outputs are bf16 and compared with
:func:`paged_attention_reference` at 2e-2; KV-cache writes are compared exactly (the sink
block 0, where padding tokens write in an undefined order, excepted).

What is checked beyond plain outputs:
- FA3: the refresh writes the persistent scheduler-metadata buffer in place, zeroes its
  tail and reproduces a fresh ``get_scheduler_metadata``; without AOT metadata it does
  nothing; two draft steps with an in-graph refresh captured in one CUDA graph and replayed
  with other lengths match the reference. (Stale FA3 metadata gives the same outputs, so
  the metadata itself is compared, not only the outputs.)
- FlashInfer: decode and prefill wrappers; the prefill wrapper raises FlashInfer's own
  ``q.shape[0] (…) does not match qo_indptr[-1] (…)`` on a padded token count (seed 004);
  a captured decode replayed after a re-plan; ``plan_draft_steps`` with every step in one
  graph; in-graph refresh is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from speccheck.backends.flashinfer.page_indices import paged_kv_layout
from speccheck.backends.kv_cache_write import write_kv_cache
from speccheck.backends.reference.attention import paged_attention_reference
from speccheck.contract.builder import AttentionLayerSpec, BuilderLimits
from speccheck.contract.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from speccheck.contract.metadata import AttentionInputBuffers, CommonAttentionMetadata
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.contract.token_count import build_attention_metadata

pytestmark = pytest.mark.cuda

ATOL = RTOL = 2e-2
LIMITS = BuilderLimits(max_num_reqs=8, max_num_tokens=64)


def _importorskip(name: str) -> ModuleType:
    """``pytest.importorskip`` that also skips on a package that is present but fails to
    load (a CUDA extension built for another torch)."""
    try:
        return pytest.importorskip(name, exc_type=ImportError)
    except TypeError:  # pytest < 8.2 has no exc_type
        return pytest.importorskip(name)


@pytest.fixture
def fa3() -> ModuleType:
    module = _importorskip("fa3_fwd_interface")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("fa3-fwd needs an sm90 GPU")
    return module


@pytest.fixture
def flashinfer() -> ModuleType:
    return _importorskip("flashinfer")


# -- batches -------------------------------------------------------------------------------


@dataclass
class Case:
    """One attention call: persistent buffers, common metadata, inputs and caches."""

    layer: AttentionLayerSpec
    buffers: AttentionInputBuffers
    common: CommonAttentionMetadata
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    table: np.ndarray
    seq_lens: np.ndarray
    query_lens: np.ndarray

    @property
    def scale(self) -> float:
        return self.layer.head_size**-0.5

    @property
    def num_tokens(self) -> int:
        return self.common.num_actual_tokens


def _slots(
    table: np.ndarray,
    block_size: int,
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    num_tokens: int,
) -> np.ndarray:
    """Slot of every token (``pos = seq_len - query_len + i``); padding tokens -> slot 0 of
    the sink block 0."""
    slots = np.zeros(num_tokens, dtype=np.int64)
    t = 0
    for r, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        for i in range(q):
            pos = s - q + i
            slots[t] = int(table[r, pos // block_size]) * block_size + pos % block_size
            t += 1
    return slots


def make_case(
    layer: AttentionLayerSpec,
    *,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    num_reqs_padded: int | None = None,
    causal: bool = True,
    seed: int = 0,
    limits: BuilderLimits = LIMITS,
) -> Case:
    """A batch in eager mode, or in FULL mode padded to ``num_reqs_padded`` requests (uniform
    query lengths), built through the contract's token-count rule."""
    device = torch.device("cuda")
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    num_reqs = len(query_lens)
    ql = np.asarray(query_lens, dtype=np.int32)
    sl = np.asarray(seq_lens, dtype=np.int32)
    assert (sl >= ql).all() and (sl <= layer.max_model_len).all()
    mb = layer.max_blocks_per_req
    num_blocks = 1 + limits.max_num_reqs * mb  # block 0 is the sink
    table = np.zeros((limits.max_num_reqs, mb), dtype=np.int32)
    perm = rng.permutation(np.arange(1, num_blocks, dtype=np.int32))
    for r in range(num_reqs):
        table[r] = perm[r * mb : (r + 1) * mb]
    qsl = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(ql, out=qsl[1:])
    if num_reqs_padded is None:
        desc = BatchExecutionDescriptor(CUDAGraphMode.NONE, num_tokens=int(qsl[-1]))
    else:
        uniform = int(ql[0])
        assert (ql == uniform).all()
        desc = BatchExecutionDescriptor(
            CUDAGraphMode.FULL,
            num_tokens=num_reqs_padded * uniform,
            num_reqs=num_reqs_padded,
            uniform_token_count=uniform,
        )
    num_tokens = desc.num_tokens
    buffers = AttentionInputBuffers.allocate(limits.max_num_reqs, limits.max_num_tokens, mb, device)
    buffers.block_table.copy_(torch.from_numpy(table))
    buffers.seq_lens.zero_()
    buffers.seq_lens[:num_reqs].copy_(torch.from_numpy(sl))
    slots = _slots(table, layer.block_size, sl.tolist(), ql.tolist(), num_tokens)
    buffers.slot_mapping[:num_tokens].copy_(torch.from_numpy(slots))
    common = build_attention_metadata(
        buffers=buffers,
        batch_desc=desc,
        num_reqs=num_reqs,
        query_start_loc_np=qsl,
        base_seq_lens_np=sl,
        step=0,
        max_model_len=layer.max_model_len,
        causal=causal,
    )
    h, kvh, d = layer.num_heads, layer.num_kv_heads, layer.head_size

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=layer.dtype)

    return Case(
        layer=layer,
        buffers=buffers,
        common=common,
        query=randn(num_tokens, h, d),
        key=randn(num_tokens, kvh, d),
        value=randn(num_tokens, kvh, d),
        key_cache=randn(num_blocks, layer.block_size, kvh, d),
        value_cache=randn(num_blocks, layer.block_size, kvh, d),
        table=table,
        seq_lens=sl,
        query_lens=ql,
    )


def reference_output(
    case: Case,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    c = case.common
    q = case.query if query is None else query
    return paged_attention_reference(
        q[: c.num_actual_tokens],
        key_cache,
        value_cache,
        c.query_start_loc,
        c.seq_lens if seq_lens is None else seq_lens,
        c.block_table,
        case.scale,
        c.causal,
    )


def run_and_compare(builder: Any, case: Case) -> tuple[Any, torch.Tensor]:
    """Build, run the impl eagerly, and compare output and KV writes with the reference.
    The output arrives as the contract says: the rows of requests NaN (the impl must write
    every one), the rows past them zero (the impl must leave them so)."""
    impl = builder.make_impl(case.scale)
    md = builder.build(case.common)
    n = case.num_tokens
    kc, vc = case.key_cache.clone(), case.value_cache.clone()
    kc_ref, vc_ref = case.key_cache.clone(), case.value_cache.clone()
    write_kv_cache(case.key[:n], case.value[:n], kc_ref, vc_ref, case.common.slot_mapping)
    out = torch.full_like(case.query, float("nan"))
    requests_rows = int(case.common.query_start_loc[case.common.num_reqs])
    out[requests_rows:].zero_()
    impl.forward(case.query, case.key, case.value, kc, vc, md, out)
    torch.cuda.synchronize()
    ref = reference_output(case, kc_ref, vc_ref)
    assert torch.equal(kc[1:], kc_ref[1:]) and torch.equal(vc[1:], vc_ref[1:])
    torch.testing.assert_close(out[:n].float(), ref.float(), atol=ATOL, rtol=RTOL)
    assert torch.count_nonzero(out[requests_rows:]) == 0, "a padding row was written"
    return md, out


def capture(body: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """Warm ``body`` up once on a side stream, then capture it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    torch.cuda.synchronize()
    return graph


# -- FA3 -----------------------------------------------------------------------------------

FA3_SHAPES = [(16, 4, 128), (8, 2, 64)]
FA3_CASES = {
    "decode": dict(query_lens=[1, 1, 1, 1, 1], seq_lens=[1, 17, 300, 512, 64]),
    "varlen": dict(query_lens=[3, 1, 5, 2], seq_lens=[3, 40, 260, 511]),
    "noncausal": dict(query_lens=[4, 4, 4], seq_lens=[4, 100, 400], causal=False),
}


def fa3_layer(
    shape: tuple[int, int, int] = (16, 4, 128), max_model_len: int = 512
) -> AttentionLayerSpec:
    h, kvh, d = shape
    return AttentionLayerSpec(
        num_heads=h,
        num_kv_heads=kvh,
        head_size=d,
        dtype=torch.bfloat16,
        block_size=max_model_len,
        max_model_len=max_model_len,
    )


def fa3_builder(layer: AttentionLayerSpec, cudagraph_mode: str = "full") -> Any:
    from speccheck.backends.fa3.builder import FA3MetadataBuilder

    return FA3MetadataBuilder(
        layer,
        RuntimeConfig(cudagraph_mode=cudagraph_mode),  # type: ignore[arg-type]
        torch.device("cuda"),
        LIMITS,
        supports_draft_decode_metadata_update=True,
    )


@pytest.mark.parametrize("aot", [True, False], ids=["aot", "inline_schedule"])
@pytest.mark.parametrize("cudagraph_mode", ["full", "none"])
@pytest.mark.parametrize("case_name", sorted(FA3_CASES))
@pytest.mark.parametrize("shape", FA3_SHAPES, ids=lambda s: "h{}kv{}d{}".format(*s))
def test_fa3_matches_reference(
    fa3: ModuleType, shape: tuple[int, int, int], case_name: str, cudagraph_mode: str, aot: bool
) -> None:
    layer = fa3_layer(shape)
    builder = fa3_builder(layer, cudagraph_mode)
    builder.aot_schedule = aot
    md, _ = run_and_compare(builder, make_case(layer, **FA3_CASES[case_name]))
    assert (md.scheduler_metadata is not None) == aot
    assert md.num_splits == (
        builder.max_num_splits_for_cuda_graph if cudagraph_mode == "full" else 0
    )


def test_fa3_full_mode_padding_lanes_are_zero(fa3: ModuleType) -> None:
    layer = fa3_layer()
    builder = fa3_builder(layer)
    case = make_case(layer, query_lens=[1] * 5, seq_lens=[9, 1, 511, 128, 300], num_reqs_padded=8)
    assert case.common.num_actual_tokens == 8 and case.common.num_reqs == 8
    _, out = run_and_compare(builder, case)
    assert torch.count_nonzero(out[5:8]) == 0


def _fresh_scheduler_metadata(fa3: ModuleType, layer: AttentionLayerSpec, md: Any) -> torch.Tensor:
    return fa3.get_scheduler_metadata(
        md.num_reqs,
        md.max_query_len,
        md.max_seqlen_k,
        layer.num_heads,
        layer.num_kv_heads,
        layer.head_size,
        md.seq_lens,
        qkv_dtype=torch.bfloat16,
        cu_seqlens_q=md.query_start_loc,
        causal=md.causal,
        num_splits=md.num_splits,
    )


def test_fa3_refresh_writes_persistent_buffer_in_place(fa3: ModuleType) -> None:
    layer = fa3_layer()
    builder = fa3_builder(layer)
    case = make_case(layer, query_lens=[1] * 4, seq_lens=[5, 60, 17, 200])
    md = builder.build(case.common)
    buffer = builder.persistent_buffers()["scheduler_metadata"]
    view = md.scheduler_metadata
    assert view is not None and view.dtype == torch.int32
    n = view.numel()
    assert view.data_ptr() == buffer.data_ptr() and n < buffer.numel()
    assert torch.count_nonzero(buffer[n:]) == 0, "build must zero the tail"
    torch.testing.assert_close(view, _fresh_scheduler_metadata(fa3, layer, md), rtol=0, atol=0)

    # Poison head and tail, advance the lengths in place as the speculator does, refresh.
    buffer[n:].fill_(-1)
    view.fill_(-7)
    case.buffers.seq_lens[:4] += torch.tensor([300, 1, 400, 250], dtype=torch.int32, device="cuda")
    builder.update_draft_decode_metadata(md)
    torch.cuda.synchronize()
    assert md.scheduler_metadata is view
    assert view.data_ptr() == buffer.data_ptr()
    assert torch.count_nonzero(buffer[n:]) == 0, "refresh must zero the tail"
    torch.testing.assert_close(view, _fresh_scheduler_metadata(fa3, layer, md), rtol=0, atol=0)


def test_fa3_refresh_zeroes_the_padding_entries_of_each_vector(fa3: ModuleType) -> None:
    """Three requests: FA3's per-request vectors have four entries each and FA3 leaves the
    fourth unwritten. Build and refresh store FA3's entries and zero the fourth of each
    vector (poisoned before the refresh), whatever FA3's allocation held there."""
    layer = fa3_layer()
    builder = fa3_builder(layer)
    case = make_case(layer, query_lens=[1] * 3, seq_lens=[5, 60, 200])
    md = builder.build(case.common)
    view = md.scheduler_metadata
    assert view is not None
    n = view.numel()
    padding = torch.zeros(n, dtype=torch.bool, device="cuda")
    padding[3:n - n % 4:4] = True
    view.fill_(-7)
    case.buffers.seq_lens[:3] += torch.tensor([300, 1, 400], dtype=torch.int32, device="cuda")
    builder.update_draft_decode_metadata(md)
    fresh = _fresh_scheduler_metadata(fa3, layer, md)
    torch.cuda.synchronize()
    assert torch.count_nonzero(view[padding]) == 0
    torch.testing.assert_close(view[~padding], fresh[~padding], rtol=0, atol=0)


def test_fa3_refresh_without_aot_metadata_does_nothing(fa3: ModuleType) -> None:
    layer = fa3_layer()
    builder = fa3_builder(layer)
    builder.aot_schedule = False
    case = make_case(layer, query_lens=[1] * 3, seq_lens=[5, 60, 17])
    md = builder.build(case.common)
    assert md.scheduler_metadata is None
    buffer = builder.persistent_buffers()["scheduler_metadata"]
    buffer.fill_(5)
    builder.update_draft_decode_metadata(md)
    torch.cuda.synchronize()
    assert bool((buffer == 5).all())


def test_fa3_two_draft_steps_with_refresh_in_one_graph(fa3: ModuleType) -> None:
    """A miniature fused draft loop: step 0, advance lengths and slots on the device,
    refresh, step 1 - captured once, replayed with different lengths."""
    layer = fa3_layer()
    builder = fa3_builder(layer)
    num_reqs = 4
    gen = torch.Generator(device="cpu").manual_seed(1)
    case = make_case(
        layer, query_lens=[1] * num_reqs, seq_lens=[5, 60, 300, 450], num_reqs_padded=num_reqs
    )
    impl = builder.make_impl(case.scale)
    md = builder.build(case.common)
    h, kvh, d = layer.num_heads, layer.num_kv_heads, layer.head_size

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16)

    q = [randn(num_reqs, h, d) for _ in range(2)]
    k = [randn(num_reqs, kvh, d) for _ in range(2)]
    v = [randn(num_reqs, kvh, d) for _ in range(2)]
    slots = torch.zeros(2, num_reqs, dtype=torch.int64, device="cuda")
    outs = [torch.zeros(num_reqs, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    kc, vc = case.key_cache, case.value_cache
    bufs = case.buffers

    def set_batch(seq0: np.ndarray) -> None:
        for step in range(2):
            s = _slots(
                case.table, layer.block_size, (seq0 + step).tolist(), [1] * num_reqs, num_reqs
            )
            slots[step].copy_(torch.from_numpy(s))
        bufs.seq_lens[:num_reqs].copy_(torch.from_numpy(seq0.astype(np.int32)))

    def body() -> None:
        bufs.slot_mapping[:num_reqs].copy_(slots[0])
        impl.forward(q[0], k[0], v[0], kc, vc, md, outs[0])
        bufs.seq_lens[:num_reqs].add_(1)
        bufs.slot_mapping[:num_reqs].copy_(slots[1])
        builder.update_draft_decode_metadata(md)
        impl.forward(q[1], k[1], v[1], kc, vc, md, outs[1])

    set_batch(case.seq_lens)
    graph = capture(body)

    # Replay with other lengths: reset the inputs, rebuild on the host (the schedule for
    # step 0 goes into the same buffer), replay.
    seq0 = np.array([200, 7, 33, 480], dtype=np.int64)
    set_batch(seq0)
    for t in (*q, *k, *v):
        t.copy_(randn(*t.shape))
    kc.copy_(randn(*kc.shape))
    vc.copy_(randn(*vc.shape))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    common = build_attention_metadata(
        buffers=bufs,
        batch_desc=BatchExecutionDescriptor(CUDAGraphMode.FULL, num_reqs, num_reqs, 1),
        num_reqs=num_reqs,
        query_start_loc_np=np.arange(num_reqs + 1, dtype=np.int32),
        base_seq_lens_np=seq0.astype(np.int32),
        step=0,
        max_model_len=layer.max_model_len,
    )
    md_replay = builder.build(common)
    assert md_replay.scheduler_metadata is not None and md.scheduler_metadata is not None
    assert md_replay.scheduler_metadata.data_ptr() == md.scheduler_metadata.data_ptr()
    assert md_replay.scheduler_metadata.numel() == md.scheduler_metadata.numel()
    graph.replay()
    torch.cuda.synchronize()

    for step in range(2):
        write_kv_cache(k[step], v[step], kc_ref, vc_ref, slots[step])
        lens = torch.from_numpy((seq0 + step).astype(np.int32)).cuda()
        ref = reference_output(case, kc_ref, vc_ref, query=q[step], seq_lens=lens)
        torch.testing.assert_close(outs[step].float(), ref.float(), atol=ATOL, rtol=RTOL)
    assert torch.equal(kc[1:], kc_ref[1:]) and torch.equal(vc[1:], vc_ref[1:])
    # After the replay the buffer holds the step-1 schedule, as a fresh build would.
    assert torch.equal(
        bufs.seq_lens[:num_reqs].cpu(), torch.from_numpy((seq0 + 1).astype(np.int32))
    )
    torch.testing.assert_close(
        md.scheduler_metadata, _fresh_scheduler_metadata(fa3, layer, md), rtol=0, atol=0
    )


# -- FlashInfer ----------------------------------------------------------------------------


def fi_layer(dtype: torch.dtype = torch.bfloat16) -> AttentionLayerSpec:
    return AttentionLayerSpec(
        num_heads=16,
        num_kv_heads=4,
        head_size=128,
        dtype=dtype,
        block_size=16,
        max_model_len=256,
    )


def fi_builder(layer: AttentionLayerSpec) -> Any:
    from speccheck.backends.flashinfer.builder import FlashInferMetadataBuilder

    return FlashInferMetadataBuilder(
        layer, RuntimeConfig(cudagraph_mode="full"), torch.device("cuda"), LIMITS
    )


def test_flashinfer_decode_matches_reference(flashinfer: ModuleType) -> None:
    layer = fi_layer()
    builder = fi_builder(layer)
    case = make_case(layer, query_lens=[1] * 6, seq_lens=[1, 16, 17, 100, 255, 256])
    md, _ = run_and_compare(builder, case)
    assert md.use_decode
    assert md.paged_kv_indptr.cpu().tolist() == [0, 1, 2, 4, 11, 27, 43]
    assert md.paged_kv_last_page_len.cpu().tolist() == [1, 16, 1, 4, 15, 16]


def test_flashinfer_padded_prefill_runs_on_the_rows_its_requests_own(
        flashinfer: ModuleType) -> None:
    """A FULL-mode first pass padded to its bucket (3 requests of 3 tokens in 8 lanes: 24
    rows, the padding requests owning none) runs eagerly on the 9 rows the plan gives
    requests, as its replays do; FlashInfer rejected the 24 rows (``q.shape[0] (24) does
    not match qo_indptr[-1] (9)``, measured on the H200)."""
    layer = fi_layer()
    builder = fi_builder(layer)
    case = make_case(layer, query_lens=[3, 3, 3], seq_lens=[3, 40, 200], num_reqs_padded=8)
    assert case.common.num_actual_tokens == 24
    md, _ = run_and_compare(builder, case)
    assert not md.use_decode and md.num_attended_tokens == 9


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_flashinfer_prefill_matches_reference(flashinfer: ModuleType, causal: bool) -> None:
    layer = fi_layer()
    builder = fi_builder(layer)
    case = make_case(layer, query_lens=[3, 1, 6, 2], seq_lens=[3, 20, 200, 33], causal=causal)
    md, _ = run_and_compare(builder, case)
    assert not md.use_decode
    assert md.qo_indptr is not None
    assert md.qo_indptr.cpu().tolist() == [0, 3, 4, 10, 12]


@pytest.mark.parametrize("query_lens", [[2, 2], [1, 1, 1, 1]], ids=["dflash_like", "decode"])
def test_flashinfer_prefill_raises_on_padded_token_count(
    flashinfer: ModuleType, query_lens: list[int]
) -> None:
    """Seed 004: a builder that hands attention the padded token count in eager mode must
    fail loudly. The adapter plans with query_start_loc and runs on num_actual_tokens
    exactly, so FlashInfer's own check fires."""
    layer = fi_layer()
    builder = fi_builder(layer)
    impl = builder.make_impl(layer.head_size**-0.5)
    real = sum(query_lens)
    seq_lens = [40 + 7 * i for i in range(len(query_lens))]
    case = make_case(layer, query_lens=query_lens, seq_lens=seq_lens)
    assert case.common.num_actual_tokens == real == 4
    padded = 6
    bufs = case.buffers
    bufs.slot_mapping[real:padded].zero_()  # padding tokens write the sink
    buggy = dataclasses.replace(
        case.common,
        num_actual_tokens=padded,
        slot_mapping=bufs.slot_mapping[:padded],
        positions=bufs.positions[:padded],
    )
    md = builder.build(buggy)
    assert not md.use_decode
    query = torch.randn(padded, layer.num_heads, layer.head_size, device="cuda").to(layer.dtype)
    key = torch.randn(padded, layer.num_kv_heads, layer.head_size, device="cuda").to(layer.dtype)
    out = torch.empty_like(query)
    with pytest.raises(
        ValueError, match=r"q\.shape\[0\] \(6\) does not match qo_indptr\[-1\] \(4\)"
    ):
        impl.forward(query, key, key.clone(), case.key_cache, case.value_cache, md, out)


def test_flashinfer_decode_graph_replay_after_replan(flashinfer: ModuleType) -> None:
    """FULL-mode decode with padding lanes: capture once, re-plan the same wrapper on the
    host with other lengths, replay, compare; padding rows stay zero."""
    layer = fi_layer()
    builder = fi_builder(layer)
    case = make_case(layer, query_lens=[1] * 5, seq_lens=[3, 40, 17, 200, 129], num_reqs_padded=8)
    impl = builder.make_impl(case.scale)
    md = builder.build(case.common)
    assert md.use_decode and md.num_reqs == 8
    out = torch.zeros_like(case.query)
    kc, vc = case.key_cache, case.value_cache
    graph = capture(lambda: impl.forward(case.query, case.key, case.value, kc, vc, md, out))

    gen = torch.Generator(device="cpu").manual_seed(7)
    seq_lens = np.array([256, 1, 33, 16, 100], dtype=np.int32)
    bufs = case.buffers
    bufs.seq_lens[:5].copy_(torch.from_numpy(seq_lens))
    slots = _slots(case.table, layer.block_size, seq_lens.tolist(), [1] * 5, 8)
    bufs.slot_mapping[:8].copy_(torch.from_numpy(slots))
    for t in (case.query, case.key, case.value):
        t.copy_(torch.randn(*t.shape, generator=gen).to("cuda", layer.dtype))
    common = build_attention_metadata(
        buffers=bufs,
        batch_desc=BatchExecutionDescriptor(CUDAGraphMode.FULL, 8, 8, 1),
        num_reqs=5,
        query_start_loc_np=np.arange(6, dtype=np.int32),
        base_seq_lens_np=seq_lens,
        step=0,
        max_model_len=layer.max_model_len,
    )
    md_replay = builder.build(common)
    assert md_replay.wrapper is md.wrapper
    assert md_replay.paged_kv_indptr.data_ptr() == md.paged_kv_indptr.data_ptr()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv_cache(case.key, case.value, kc_ref, vc_ref, common.slot_mapping)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference_output(dataclasses.replace(case, common=common), kc_ref, vc_ref)
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL, rtol=RTOL)
    assert torch.count_nonzero(out[5:]) == 0
    assert torch.equal(kc[1:], kc_ref[1:]) and torch.equal(vc[1:], vc_ref[1:])


def test_flashinfer_plan_draft_steps_in_one_graph(
    flashinfer: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """host_preplanned: one wrapper per draft step, all planned before one replay of a graph
    that holds every step; planned through ``plan()`` for the capture, re-planned by
    FlashInfer's decode scheduler alone (once per step) for the replay, with other page
    counts than the capture's: the replay attends to the new lengths."""
    from speccheck.backends.flashinfer import builder as fi_builder_module

    fast_plans: list[int] = []
    schedule = fi_builder_module._DecodeScheduler.__call__

    def counted(self: Any, *args: Any) -> None:
        fast_plans.append(1)
        schedule(self, *args)

    monkeypatch.setattr(fi_builder_module._DecodeScheduler, "__call__", counted)
    layer = fi_layer()
    builder = fi_builder(layer)
    num_reqs, num_steps = 4, 3
    case = make_case(
        layer, query_lens=[1] * num_reqs, seq_lens=[14, 16, 1, 100], num_reqs_padded=num_reqs
    )
    impl = builder.make_impl(case.scale)
    bufs = case.buffers
    desc = BatchExecutionDescriptor(CUDAGraphMode.FULL, num_reqs, num_reqs, 1)
    gen = torch.Generator(device="cpu").manual_seed(3)
    h, kvh, d = layer.num_heads, layer.num_kv_heads, layer.head_size

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to("cuda", layer.dtype)

    q = [randn(num_reqs, h, d) for _ in range(num_steps)]
    k = [randn(num_reqs, kvh, d) for _ in range(num_steps)]
    v = [randn(num_reqs, kvh, d) for _ in range(num_steps)]
    outs = [torch.zeros(num_reqs, h, d, dtype=layer.dtype, device="cuda") for _ in range(num_steps)]
    slots = torch.zeros(num_steps, num_reqs, dtype=torch.int64, device="cuda")
    lens = torch.zeros(num_steps, num_reqs, dtype=torch.int32, device="cuda")
    kc, vc = case.key_cache, case.value_cache

    def plan(seq0: np.ndarray) -> list[Any]:
        commons = []
        for step in range(num_steps):
            s = (seq0 + step).astype(np.int32)
            lens[step].copy_(torch.from_numpy(s))
            slots[step].copy_(
                torch.from_numpy(
                    _slots(case.table, layer.block_size, s.tolist(), [1] * num_reqs, num_reqs)
                )
            )
            commons.append(
                build_attention_metadata(
                    buffers=bufs,
                    batch_desc=desc,
                    num_reqs=num_reqs,
                    query_start_loc_np=np.arange(num_reqs + 1, dtype=np.int32),
                    base_seq_lens_np=seq0.astype(np.int32),
                    step=step,
                    max_model_len=layer.max_model_len,
                )
            )
        return builder.plan_draft_steps(commons)

    mds = plan(case.seq_lens.astype(np.int64))
    assert not fast_plans
    assert [m.draft_step for m in mds] == list(range(num_steps))
    assert len({id(m.wrapper) for m in mds}) == num_steps
    assert len({m.paged_kv_indices.data_ptr() for m in mds}) == num_steps

    def body() -> None:
        builder.finish_draft_step_plans(mds)
        for step in range(num_steps):
            bufs.seq_lens[:num_reqs].copy_(lens[step])
            bufs.slot_mapping[:num_reqs].copy_(slots[step])
            impl.forward(q[step], k[step], v[step], kc, vc, mds[step], outs[step])

    graph = capture(body)

    seq0 = np.array([31, 1, 250, 64], dtype=np.int64)
    mds_replay = plan(seq0)
    assert len(fast_plans) == num_steps
    assert all(a.wrapper is b.wrapper for a, b in zip(mds, mds_replay, strict=True))
    for t in (*q, *k, *v):
        t.copy_(randn(*t.shape))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    graph.replay()
    torch.cuda.synchronize()
    for step in range(num_steps):
        write_kv_cache(k[step], v[step], kc_ref, vc_ref, slots[step])
    for step in range(num_steps):
        ref = reference_output(case, kc_ref, vc_ref, query=q[step], seq_lens=lens[step])
        torch.testing.assert_close(outs[step].float(), ref.float(), atol=ATOL, rtol=RTOL)
    assert torch.equal(kc[1:], kc_ref[1:]) and torch.equal(vc[1:], vc_ref[1:])


def fi_fixed_plan_builder(layer: AttentionLayerSpec) -> Any:
    from speccheck.backends.flashinfer.fixed_plan import FlashInferFixedPlanMetadataBuilder

    return FlashInferFixedPlanMetadataBuilder(
        layer, RuntimeConfig(cudagraph_mode="full"), torch.device("cuda"), LIMITS,
        supports_draft_decode_metadata_update=True,
    )


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "causal"),
    [([1] * 6, [1, 16, 17, 100, 255, 256], True), ([3, 1, 6, 2], [3, 20, 200, 33], True),
     ([3, 1, 6, 2], [3, 20, 200, 33], False)],
    ids=["decode", "prefill_causal", "prefill_noncausal"],
)
def test_flashinfer_fixed_plan_matches_reference(
    flashinfer: ModuleType, query_lens: list[int], seq_lens: list[int], causal: bool
) -> None:
    """Eager builds of the fixed-plan builder: the page table its device kernel wrote is
    the host reference's, and the output is the reference attention's."""
    layer = fi_layer()
    builder = fi_fixed_plan_builder(layer)
    case = make_case(layer, query_lens=query_lens, seq_lens=seq_lens, causal=causal)
    md, _ = run_and_compare(builder, case)
    layout = paged_kv_layout(case.seq_lens, case.table[: len(seq_lens)], layer.block_size)
    assert md.paged_kv_indptr.cpu().tolist() == layout.indptr.tolist()
    assert md.paged_kv_last_page_len.cpu().tolist() == layout.last_page_len.tolist()
    assert torch.equal(md.paged_kv_indices[: layout.num_pages].cpu(), layout.indices)
    assert md.use_decode is (max(query_lens) == 1)


def _count_plans(monkeypatch: pytest.MonkeyPatch, wrapper: Any) -> list[int]:
    """Calls of ``wrapper.plan`` from now on, one entry each."""
    calls: list[int] = []
    plan = wrapper.plan

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return plan(*args, **kwargs)

    monkeypatch.setattr(wrapper, "plan", counted)
    return calls


@pytest.mark.parametrize(
    ("query_len", "first", "then"),
    [(1, [3, 40, 17, 200, 129], [256, 1, 33, 16, 100, 7, 64]),
     (2, [3, 40, 17], [256, 2, 33, 16, 100, 65])],
    ids=["decode", "uniform_prefill"],
)
def test_flashinfer_fixed_plan_refresh_replays_other_lengths(
    flashinfer: ModuleType, monkeypatch: pytest.MonkeyPatch, query_len: int,
    first: list[int], then: list[int],
) -> None:
    """The in-graph refresh: capture refresh + attention over 8 padded lanes once, then
    write another batch (other lengths, other real-lane count, other block-table rows) into
    the persistent buffers and replay: the output is the new batch's reference, padding
    rows stay zero; and a build of the new batch makes no host plan (the plan ignores the
    lengths)."""
    layer = fi_layer()
    builder = fi_fixed_plan_builder(layer)
    case = make_case(layer, query_lens=[query_len] * len(first), seq_lens=first,
                     num_reqs_padded=8)
    impl = builder.make_impl(case.scale)
    md = builder.build(case.common)
    assert md.num_reqs == 8 and md.use_decode is (query_len == 1)
    out = torch.zeros_like(case.query)
    kc, vc = case.key_cache, case.value_cache

    def body() -> None:
        builder.update_draft_decode_metadata(md)
        impl.forward(case.query, case.key, case.value, kc, vc, md, out)

    graph = capture(body)
    plans = _count_plans(monkeypatch, md.wrapper)

    gen = torch.Generator(device="cpu").manual_seed(11)
    seq_lens = np.array(then, dtype=np.int32)
    n = len(then)
    bufs = case.buffers
    blocks = np.random.default_rng(11).permutation(np.arange(1, case.key_cache.shape[0]))
    rows = torch.from_numpy(blocks.astype(np.int32).reshape(bufs.block_table.shape))
    bufs.block_table.copy_(rows)
    bufs.seq_lens.zero_()
    bufs.seq_lens[:n].copy_(torch.from_numpy(seq_lens))
    slots = _slots(rows.numpy(), layer.block_size, then, [query_len] * n, 8 * query_len)
    bufs.slot_mapping[: 8 * query_len].copy_(torch.from_numpy(slots))
    for t in (case.query, case.key, case.value):
        t.copy_(torch.randn(*t.shape, generator=gen).to("cuda", layer.dtype))
    common = build_attention_metadata(
        buffers=bufs,
        batch_desc=BatchExecutionDescriptor(CUDAGraphMode.FULL, 8 * query_len, 8, query_len),
        num_reqs=n,
        query_start_loc_np=np.arange(n + 1, dtype=np.int32) * query_len,
        base_seq_lens_np=seq_lens,
        step=0,
        max_model_len=layer.max_model_len,
    )
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv_cache(case.key, case.value, kc_ref, vc_ref, common.slot_mapping)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    real = n * query_len
    ref = reference_output(dataclasses.replace(case, common=common), kc_ref, vc_ref)
    torch.testing.assert_close(out[:real].float(), ref[:real].float(), atol=ATOL, rtol=RTOL)
    if query_len == 1:
        assert torch.count_nonzero(out[real:]) == 0
    rebuilt = builder.build(common)
    assert rebuilt.wrapper is md.wrapper and plans == []
    assert torch.equal(rebuilt.paged_kv_indptr, md.paged_kv_indptr)


def test_flashinfer_in_graph_refresh_is_unsupported(flashinfer: ModuleType) -> None:
    layer = fi_layer()
    builder = fi_builder(layer)
    assert builder.supports_draft_decode_metadata_update is False
    md = builder.build(make_case(layer, query_lens=[1, 1], seq_lens=[5, 9]).common)
    with pytest.raises(NotImplementedError):
        builder.update_draft_decode_metadata(md)
