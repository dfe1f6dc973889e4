"""Real decode context parallelism in the ``reference`` and ``triton_attn`` backends.

Two gloo ranks each hold an interleaved share of every request's KV cache (token ``t`` on
rank ``t % 2``, at local position ``t // 2`` of the request's block-table row) and run the
fused draft-decode loop the speculator runs: build once, then per draft step a forward
(write the new tokens this rank owns, attend the share, all-gather and merge the partials)
and, between steps, the speculator's in-place advance of ``positions`` / ``seq_lens`` /
``slot_mapping`` followed by the builder's refresh. The merged outputs must equal the same
backend on one rank holding the whole cache; after every refresh the metadata must equal a
fresh build (the local lengths advanced in place), and the ranks' caches must hold exactly
their shares. The known-bad builders of :mod:`speccheck.checks.selftest.dcp_mutants` keep
step 1's local lengths: a fresh build names ``dcp_local_seq_lens`` and the merge goes wrong.

The batch is a FULL-graph one (a padding lane), crosses block boundaries during the steps
(of the global and of the local layout), and one request runs into the ``max_model_len``
clamp. The rank function runs in spawned processes, which import it from this module by
name (the repository root goes on ``sys.path`` while they start); the Triton kernels run in
the interpreter there, as ``TRITON_INTERPRET`` is inherited.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from speccheck.backends.dcp import (
    DcpLocalShare,
    write_dcp_local_lengths,
    write_dcp_slot_mapping,
)
from speccheck.backends.kv_cache_write import SINK_SLOT
from speccheck.backends.reference.builder import ReferenceMetadataBuilder
from speccheck.backends.triton_attn.builder import TritonAttnMetadataBuilder
from speccheck.checks.probes import HostSyncRecorder, IdentityGuard, check_zero_tail
from speccheck.checks.probes.state_walk import walk_tensors
from speccheck.checks.selftest.dcp_mutants import DCP_LOCAL_FIELD, STALE_DCP_BUILDERS
from speccheck.contract.builder import AttentionLayerSpec, AttentionMetadataBuilder, BuilderLimits
from speccheck.contract.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from speccheck.contract.dcp import DcpRank
from speccheck.contract.metadata import AttentionInputBuffers, CommonAttentionMetadata
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.contract.token_count import (
    build_attention_metadata,
    build_uniform_attention_metadata,
)
from speccheck.speculator.dp_launch import run_ranks
from speccheck.speculator.kv_cache import PAD_SLOT, SINK_BLOCK, compute_slot_mapping
from tests.fixtures.dcp_lengths import held_positions
from tests.fixtures.kernel_batches import shuffled_inputs

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2

CONTEXTS = (6, 11, 30)
"""KV positions of each request before draft step 1; the last one reaches the clamp."""
FIRST_PASS = (3, 1, 2)
"""New tokens of each request in the eager first pass (the last of ``CONTEXTS``)."""
PAD_REQS = 1
STEPS = 3
BLOCK_SIZE, MAX_MODEL_LEN, KV_HEADS, GROUP, HEAD_SIZE = 4, 32, 2, 2, 16
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
"""atol = rtol per dtype, as the backends' own tests use."""
DTYPES = (torch.float32, torch.bfloat16)


class Backend(enum.StrEnum):
    REFERENCE = ReferenceMetadataBuilder.backend_name
    TRITON_ATTN = TritonAttnMetadataBuilder.backend_name


class Variant(enum.StrEnum):
    SHIPPED = "shipped"
    STALE = "stale_dcp_local_lens"


SHIPPED: dict[Backend, type[AttentionMetadataBuilder[Any]]] = {
    Backend.REFERENCE: ReferenceMetadataBuilder,
    Backend.TRITON_ATTN: TritonAttnMetadataBuilder,
}


def _builder_class(backend: Backend, variant: Variant) -> type[AttentionMetadataBuilder[Any]]:
    return SHIPPED[backend] if variant is Variant.SHIPPED else STALE_DCP_BUILDERS[backend]


@dataclass
class Trace:
    """What one rank (or the single-rank oracle) saw over the draft steps."""

    first_pass: torch.Tensor | None = None
    """The attention output of the eager multi-token first pass (fp32)."""
    outputs: list[torch.Tensor] = field(default_factory=list)
    """Per step, the attention output of every token (fp32)."""
    local_lens: list[list[int]] = field(default_factory=list)
    """Per step, the metadata's ``dcp_local_seq_lens`` (after the refresh from step 2 on)."""
    stale_fields: list[list[str]] = field(default_factory=list)
    """Per refresh, the metadata tensors that differ from a fresh build of the next step."""
    in_place: bool = True
    """Whether every refresh kept the metadata's local lengths and slots at their address."""
    probe_findings: list[str] = field(default_factory=list)
    """What the capture-safety probes found in the refreshes (host synchronisations,
    rebound tensors) and in the persistent buffers after them (unzeroed tails)."""
    key_cache: torch.Tensor | None = None
    value_cache: torch.Tensor | None = None


def _layer(dtype: torch.dtype) -> AttentionLayerSpec:
    return AttentionLayerSpec(num_heads=KV_HEADS * GROUP, num_kv_heads=KV_HEADS,
                              head_size=HEAD_SIZE, dtype=dtype, block_size=BLOCK_SIZE,
                              max_model_len=MAX_MODEL_LEN)


def _lanes() -> int:
    return len(CONTEXTS) + PAD_REQS


def _limits() -> BuilderLimits:
    return BuilderLimits(max_num_reqs=_lanes(), max_num_tokens=max(_lanes(), sum(FIRST_PASS)))


def _inputs(dtype: torch.dtype) -> tuple[AttentionInputBuffers, torch.Tensor, torch.Tensor]:
    """The input buffers (a shuffled block table, the same on every rank) and the whole
    cache before step 1 (random contents, the same on every rank)."""
    gen = torch.Generator().manual_seed(7)
    buffers, num_blocks = shuffled_inputs(_layer(dtype), _limits(), list(CONTEXTS), gen,
                                          torch.device("cpu"))
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    return (buffers, torch.randn(shape, generator=gen).to(dtype),
            torch.randn(shape, generator=gen).to(dtype))


def _global_slot(table: torch.Tensor, req: int, pos: int) -> int:
    return int(table[req, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE


def _share_of(cache: torch.Tensor, table: torch.Tensor, lengths: list[int], rank: int,
              base: torch.Tensor) -> torch.Tensor:
    """``base`` with rank ``rank``'s share of ``cache`` (positions ``< lengths``) written in
    the local layout of :mod:`speccheck.backends.dcp`."""
    local = base.clone().view(-1, KV_HEADS, HEAD_SIZE)
    flat = cache.view(-1, KV_HEADS, HEAD_SIZE)
    for req, length in enumerate(lengths):
        for pos in range(rank, length, WORLD):
            local[_global_slot(table, req, pos // WORLD)] = flat[_global_slot(table, req, pos)]
    return local.view_as(cache)


def _step_lengths(step: int) -> list[int]:
    """Each real request's ``seq_lens`` at draft ``step`` (clamped at ``max_model_len``)."""
    return [min(c + step, MAX_MODEL_LEN) for c in CONTEXTS]


def _common(buffers: AttentionInputBuffers, step: int) -> CommonAttentionMetadata:
    lanes = _lanes()
    desc = BatchExecutionDescriptor(CUDAGraphMode.FULL, lanes, lanes, 1)
    return build_uniform_attention_metadata(
        buffers=buffers, batch_desc=desc, num_reqs=len(CONTEXTS), num_query_per_req=1,
        base_seq_lens_np=np.array(CONTEXTS), step=step, max_model_len=MAX_MODEL_LEN)


def _first_pass(buffers: AttentionInputBuffers) -> CommonAttentionMetadata:
    """The eager first pass: request ``r`` writes and attends its last ``FIRST_PASS[r]``
    context positions (several query tokens, causal, no padding); inputs written in place
    as the speculator writes them."""
    tokens = sum(FIRST_PASS)
    request = torch.repeat_interleave(torch.arange(len(CONTEXTS)), torch.tensor(FIRST_PASS))
    positions = [c - q + i for c, q in zip(CONTEXTS, FIRST_PASS, strict=True) for i in range(q)]
    buffers.seq_lens[: len(CONTEXTS)].copy_(torch.tensor(CONTEXTS, dtype=torch.int32))
    buffers.positions[:tokens].copy_(torch.tensor(positions))
    compute_slot_mapping(buffers.positions[:tokens], request, buffers.block_table,
                         torch.ones(tokens, dtype=torch.bool), BLOCK_SIZE,
                         out=buffers.slot_mapping[:tokens])
    qsl = np.concatenate([[0], np.cumsum(FIRST_PASS)]).astype(np.int32)
    return build_attention_metadata(
        buffers=buffers, batch_desc=BatchExecutionDescriptor(CUDAGraphMode.NONE, tokens),
        num_reqs=len(CONTEXTS), query_start_loc_np=qsl, base_seq_lens_np=np.array(CONTEXTS),
        step=0, max_model_len=MAX_MODEL_LEN)


def _write_step_inputs(buffers: AttentionInputBuffers, step: int) -> None:
    """Positions, lengths and global slots of ``step`` as the speculator writes them in
    place (padding lane: length 0, position 0, the sink)."""
    lanes, real = _lanes(), len(CONTEXTS)
    lengths = _step_lengths(step) + [0] * PAD_REQS
    positions = [min(c + step - 1, MAX_MODEL_LEN - 1) for c in CONTEXTS] + [0] * PAD_REQS
    buffers.seq_lens[:lanes].copy_(torch.tensor(lengths, dtype=torch.int32))
    buffers.positions[:lanes].copy_(torch.tensor(positions))
    lane = torch.arange(lanes)
    compute_slot_mapping(buffers.positions[:lanes], lane, buffers.block_table, lane < real,
                         BLOCK_SIZE, out=buffers.slot_mapping[:lanes])


def _step_qkv(step: int, dtype: torch.dtype, tokens: int) -> tuple[torch.Tensor, ...]:
    """The step's queries, keys and values (replicated: the same on every rank)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return tuple(torch.randn(tokens, heads, HEAD_SIZE, generator=gen).to(dtype)
                 for heads in (KV_HEADS * GROUP, KV_HEADS, KV_HEADS))


def _differing(builder: AttentionMetadataBuilder[Any], md: Any, fresh: Any) -> list[str]:
    """Metadata tensors of ``md`` whose values differ from ``fresh``'s (workspace scratch,
    whose contents mean nothing between calls, left out)."""
    workspace = {t.data_ptr() for t in builder.workspace_buffers().values()}
    got, want = walk_tensors(md, "metadata"), walk_tensors(fresh, "metadata")
    return [path for path, t in got.items()
            if t.data_ptr() not in workspace and not torch.equal(t, want[path])]


def _unzeroed_tails(builder: AttentionMetadataBuilder[Any], md: Any) -> list[str]:
    buffers = builder.persistent_buffers()
    return [problem for name, used in builder.persistent_buffer_extents(md).items()
            if (problem := check_zero_tail(buffers[name], used, name=name)) is not None]


def run_steps(backend: Backend, variant: Variant, dtype: torch.dtype, rank: int,
              world: int, group: dist.ProcessGroup | None) -> Trace:
    """The eager first pass, then the fused draft-decode loop on DCP rank ``rank`` of
    ``world`` (``world == 1``: one rank with the whole cache, no DCP): build at step 1,
    then forward and refresh."""
    dcp = DcpRank(rank, world, group) if world > 1 else None
    layer, config = _layer(dtype), RuntimeConfig(platform="cpu", dcp_world_size=world)
    limits = _limits()
    cpu = torch.device("cpu")
    builder = _builder_class(backend, variant)(layer, config, cpu, limits, dcp=dcp)
    fresh_builder = SHIPPED[backend](layer, config, cpu, limits, dcp=dcp)
    buffers, keys, values = _inputs(dtype)
    if dcp is not None:
        noise = torch.Generator().manual_seed(100 + rank)
        before = [c - q for c, q in zip(CONTEXTS, FIRST_PASS, strict=True)]
        keys = _share_of(keys, buffers.block_table, before, rank,
                         torch.randn(keys.shape, generator=noise).to(dtype))
        values = _share_of(values, buffers.block_table, before, rank,
                           torch.randn(values.shape, generator=noise).to(dtype))
    impl = builder.make_impl(1 / math.sqrt(HEAD_SIZE))
    trace = Trace()
    query, key, value = _step_qkv(0, dtype, sum(FIRST_PASS))
    trace.first_pass = torch.full_like(query, float("nan"))
    impl.forward(query, key, value, keys, values, builder.build(_first_pass(buffers)),
                 trace.first_pass)
    trace.first_pass = trace.first_pass.float()

    _write_step_inputs(buffers, 1)
    md = builder.build(_common(buffers, 1))
    address = (md.dcp_local_seq_lens.data_ptr(), md.slot_mapping.data_ptr())
    for step in range(1, STEPS + 1):
        query, key, value = _step_qkv(step, dtype, _lanes())
        output = torch.full_like(query, float("nan"))
        impl.forward(query, key, value, keys, values, md, output)
        trace.outputs.append(output.float())
        trace.local_lens.append(md.dcp_local_seq_lens.tolist())
        if step == STEPS:
            break
        _write_step_inputs(buffers, step + 1)
        with HostSyncRecorder() as syncs, IdentityGuard({"metadata": md,
                                                         "builder": builder}) as identity:
            builder.update_draft_decode_metadata(md)
        trace.probe_findings += [f.message for f in syncs.findings() + identity.findings()]
        trace.probe_findings += _unzeroed_tails(builder, md)
        trace.in_place &= address == (md.dcp_local_seq_lens.data_ptr(),
                                      md.slot_mapping.data_ptr())
        fresh = fresh_builder.build(_common(buffers, step + 1))
        trace.stale_fields.append(_differing(builder, md, fresh))
    trace.key_cache, trace.value_cache = keys, values
    return trace


RUNS = [(Variant.SHIPPED, dtype) for dtype in DTYPES] + [(Variant.STALE, torch.float32)]
"""What the ranks run: the shipped builder in every dtype, the known-bad one in fp32."""


def _dcp_rank(rank: int, world: int, backend: Backend) -> dict[tuple[Variant, str], Trace]:
    """On a real gloo rank: every run of :data:`RUNS` with ``backend``."""
    return {(variant, str(dtype)): run_steps(backend, variant, dtype, rank, world,
                                             dist.group.WORLD)
            for variant, dtype in RUNS}


@pytest.fixture(scope="module", params=list(Backend))
def two_ranks(request: pytest.FixtureRequest) -> tuple[Backend, list[dict[Any, Trace]]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT))
        ranks = run_ranks(_dcp_rank, WORLD, (request.param,), timeout_s=120,
                          threads_per_rank=1)
    return request.param, ranks


@functools.cache
def _oracle(backend: Backend, dtype: torch.dtype) -> Trace:
    """``backend`` on one rank holding the whole cache."""
    return run_steps(backend, Variant.SHIPPED, dtype, 0, 1, None)


# ---------------------------------------------------------------- two gloo ranks


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merged_decode_equals_the_single_rank_oracle(two_ranks, dtype) -> None:
    """The first pass (several causal query tokens per request) and every draft step."""
    backend, ranks = two_ranks
    oracle = _oracle(backend, dtype)
    tol = TOLERANCE[dtype]
    for rank in ranks:
        trace = rank[Variant.SHIPPED, str(dtype)]
        torch.testing.assert_close(trace.first_pass, oracle.first_pass, atol=tol, rtol=tol,
                                   msg=lambda m: f"{backend} first pass: {m}")
        for step, (got, want) in enumerate(zip(trace.outputs, oracle.outputs, strict=True), 1):
            torch.testing.assert_close(got, want, atol=tol, rtol=tol,
                                       msg=lambda m, s=step: f"{backend} step {s}: {m}")
            assert torch.count_nonzero(got[len(CONTEXTS):]) == 0, "padding must be zeros"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_refresh_advances_the_local_lengths_in_place(two_ranks, dtype) -> None:
    """Equal to a fresh build after every refresh, at the same addresses; the probes find
    no host synchronisation, no rebound tensor and no unzeroed tail."""
    backend, ranks = two_ranks
    for rank, result in enumerate(ranks):
        trace = result[Variant.SHIPPED, str(dtype)]
        assert trace.in_place, f"{backend} rank {rank}: a refresh rebound a DCP buffer"
        assert trace.probe_findings == [], trace.probe_findings
        assert trace.stale_fields == [[]] * (STEPS - 1), trace.stale_fields
        for step, lens in enumerate(trace.local_lens, 1):
            want = held_positions(torch.tensor(_step_lengths(step) + [0] * PAD_REQS),
                                  rank, WORLD).tolist()
            assert lens == want, f"{backend} rank {rank} step {step}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_rank_cache_holds_exactly_its_share(two_ranks, dtype) -> None:
    """After the steps every rank's cache is its share of the oracle's whole cache (the new
    tokens included) and nothing else changed, except the sink block."""
    backend, ranks = two_ranks
    oracle = _oracle(backend, dtype)
    buffers, _, _ = _inputs(dtype)
    final = _step_lengths(STEPS)
    live = torch.ones(oracle.key_cache.shape[0], dtype=torch.bool)
    live[SINK_BLOCK] = False
    for rank, result in enumerate(ranks):
        trace = result[Variant.SHIPPED, str(dtype)]
        noise = torch.Generator().manual_seed(100 + rank)
        for got, whole in ((trace.key_cache, oracle.key_cache),
                           (trace.value_cache, oracle.value_cache)):
            base = torch.randn(got.shape, generator=noise).to(dtype)
            want = _share_of(whole, buffers.block_table, final, rank, base)
            assert torch.equal(got[live], want[live]), f"{backend} rank {rank}"


def test_stale_local_lengths_are_named_and_merge_wrong(two_ranks) -> None:
    """The known-bad builder: after every refresh a fresh build disagrees on
    ``dcp_local_seq_lens`` alone, and from step 2 on the merge misses each request's newest
    key (the clamped request, whose lengths stop moving, excepted)."""
    backend, ranks = two_ranks
    dtype = torch.float32
    oracle = _oracle(backend, dtype)
    for rank in ranks:
        trace = rank[Variant.STALE, str(dtype)]
        assert trace.stale_fields == [[f"metadata.{DCP_LOCAL_FIELD}"]] * (STEPS - 1)
        assert trace.local_lens == [trace.local_lens[0]] * STEPS
        for step in range(2, STEPS + 1):
            moving = [r for r, c in enumerate(CONTEXTS) if c + step <= MAX_MODEL_LEN]
            for req in moving:
                diff = (trace.outputs[step - 1][req] - oracle.outputs[step - 1][req]).abs()
                assert diff.max() > 1e-3, f"{backend} step {step} request {req} unaffected"


# ---------------------------------------------------------------- one process


def test_the_sink_slot_is_the_speculators() -> None:
    assert SINK_SLOT == PAD_SLOT


def test_local_slots_and_lengths_follow_the_interleaved_layout() -> None:
    """Every token, position and rank against the layout written out by hand, in place."""
    gen = torch.Generator().manual_seed(3)
    num_reqs, width, world, block_size = 3, 5, 3, 2
    table = torch.randperm(40, generator=gen)[: num_reqs * width].view(num_reqs, width).int() + 1
    qsl = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    positions = torch.tensor([7, 8, 0, 1, 2, 0, 0])  # two padding tokens at the end
    owner = [0, 0, 2, 2, 2, None, None]
    for rank in range(world):
        out = torch.full((7,), -5, dtype=torch.int64)
        ptr = out.data_ptr()
        write_dcp_slot_mapping(positions, qsl, table, block_size, rank, world, out)
        want = []
        for pos, req in zip(positions.tolist(), owner, strict=True):
            if req is None or pos % world != rank:
                want.append(SINK_SLOT)
            else:
                j = pos // world
                want.append(int(table[req, j // block_size]) * block_size + j % block_size)
        assert out.tolist() == want and out.data_ptr() == ptr
        lens = torch.tensor([0, 1, 2, 3, 31], dtype=torch.int32)
        local = torch.full_like(lens, -1)
        write_dcp_local_lengths(lens, rank, world, local)
        assert torch.equal(local, held_positions(lens, rank, world))


def test_a_dcp_rank_must_match_the_config() -> None:
    layer, limits = _layer(torch.float32), BuilderLimits(max_num_reqs=2, max_num_tokens=2)
    with pytest.raises(ValueError, match="needs a process group"):
        DcpRank(0, 2)
    with pytest.raises(ValueError, match="dcp rank 2 is not in"):
        DcpRank(2, 2, dist.group.WORLD)
    with pytest.raises(ValueError, match="dcp_world_size=1"):
        ReferenceMetadataBuilder(layer, RuntimeConfig(), torch.device("cpu"), limits,
                                 dcp=DcpRank(0, 2, object()))  # type: ignore[arg-type]
    one = TritonAttnMetadataBuilder(layer, RuntimeConfig(), torch.device("cpu"), limits,
                                    dcp=DcpRank(0, 1))
    assert one.dcp_share is None and set(one.persistent_buffers()) == {"split_arrivals"}
    assert DcpLocalShare.LENGTHS == DCP_LOCAL_FIELD
