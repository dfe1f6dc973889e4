"""The speculator core on the reference backend: fused vs per-step equality, the seed's
counts and loop order, gating from the matrix, and graph-mode errors without CUDA."""

from __future__ import annotations

import logging
from functools import cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.backends.reference.builder import ReferenceMetadataBuilder
from speccheck.checks.verify.strategies import BatchLimits, draft_batches
from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.matrix_model import Constraints, CudaGraphSupport
from speccheck.contract.resolution import graph_capture_shortfall
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.autoregressive import AutoregressiveSpeculator, DecodePath
from speccheck.speculator.base import SpeculatorOptions
from speccheck.speculator.batch import DraftBatch
from speccheck.speculator.cudagraph_manager import CudaGraphUnavailable
from speccheck.speculator.dflash import DFlashSpeculator
from speccheck.speculator.factory import create_speculator
from speccheck.speculator.kv_cache import SINK_BLOCK
from speccheck.speculator.model import DrafterConfig
from tests.fixtures.eager_graphs import EagerCapture, EagerReplay

SHIPPED = load_matrix()
MATRIX = SHIPPED.replacing(SHIPPED.backend("flashinfer").model_copy(
    update={"platforms": ("cuda", "cpu"), "constraints": Constraints()}))
"""The shipped matrix, with the flashinfer entry open to any platform and dtype: tests
stand reference attention in under its name (its refresh strategy is what matters)."""

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DRAFTER = DrafterConfig(vocab_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_size=16,
                        intermediate_size=64, seed=3)
OPTIONS = SpeculatorOptions(capture_sizes=(1, 2, 4), num_blocks=48, max_num_prefill_tokens=32)


def _config(k: int, mode: str = "none", **kw) -> RuntimeConfig:
    platform = "cuda" if DEVICE.type == "cuda" else "cpu"
    return RuntimeConfig(platform=platform, cudagraph_mode=mode, num_speculative_steps=k,
                         block_size=4, max_model_len=40, dtype="float32", head_size=16,
                         num_heads=2, num_kv_heads=1, **kw)


@cache
def _speculator(k: int, sampling: str = "argmax") -> AutoregressiveSpeculator:
    options = SpeculatorOptions(OPTIONS.capture_sizes, OPTIONS.max_num_prefill_tokens,
                                OPTIONS.num_blocks, sampling)
    spec = create_speculator("autoregressive", ["reference"] * 2, _config(k), DRAFTER, DEVICE, options, matrix=MATRIX)
    assert isinstance(spec, AutoregressiveSpeculator)
    return spec


def _limits(k: int) -> BatchLimits:
    return BatchLimits(max_num_reqs=4, block_size=4, max_model_len=40, num_blocks=48,
                       extra_positions=k - 1, vocab_size=64)


def _run(spec: AutoregressiveSpeculator, batch: DraftBatch, path: str):
    result = spec.propose(batch, path)  # type: ignore[arg-type]
    return result, spec.kv_cache.snapshot()


@settings(max_examples=30)
@given(data=st.data(), k=st.integers(1, 8), sampling=st.sampled_from(["argmax", "gumbel"]))
def test_eager_fused_equals_eager_per_step(data, k, sampling) -> None:
    spec = _speculator(k, sampling)
    batch = data.draw(draft_batches(_limits(k)))
    spec.kv_cache.fill_random_(k)
    start = spec.kv_cache.snapshot()
    oracle, kv_oracle = _run(spec, batch, "per_step")
    spec.kv_cache.restore(start)
    fused, kv_fused = _run(spec, batch, "fused")
    assert torch.equal(oracle.draft_tokens, fused.draft_tokens)
    assert torch.equal(oracle.logits, fused.logits)
    for layer, ((ko, vo), (kf, vf)) in enumerate(zip(kv_oracle, kv_fused)):
        assert torch.equal(ko, kf) and torch.equal(vo, vf), f"layer {layer} KV differs"


def _batch() -> DraftBatch:
    return DraftBatch((3, 37), ((5, 6), (7,)), ((1, 2), tuple(range(3, 13))), (11, 12))


@pytest.mark.parametrize("path", ["per_step", "fused"])
def test_counts_eager_k4(path: str) -> None:
    spec = _speculator(4)
    spec.counters.eager_step_calls = spec.counters.graph_replays = 0
    spec.propose(_batch(), path)  # type: ignore[arg-type]
    assert (spec.counters.eager_step_calls, spec.counters.graph_replays) == (3, 0)


@pytest.mark.parametrize("rebuilds", [True, False])
def test_fused_loop_order_and_same_metadata_object(rebuilds: bool) -> None:
    """The seed's order refreshes between steps. Where the matrix says the refresh
    rebuilds the metadata (the shipped reference entry does), step 1 is refreshed too, from
    the lanes, so that a fused replay needs no host build (and the first pass's metadata
    is refreshed in its body, before these events)."""
    entry = MATRIX.backend("reference")
    draft = entry.draft_decode.model_copy(update={"refresh_rebuilds": rebuilds})
    matrix = MATRIX.replacing(entry.model_copy(update={"draft_decode": draft}))
    spec = create_speculator("autoregressive", ["reference"] * 2, _config(4), DRAFTER, DEVICE,
                             OPTIONS, matrix=matrix)
    assert isinstance(spec, AutoregressiveSpeculator)
    assert spec.refresh_rebuilds_in_graph is rebuilds
    spec.trace = []
    spec.propose(_batch(), "fused")
    events = spec.trace
    spec.trace = None
    decode = events[events.index(("slots", 1)) + 1 :]
    names = [e for e, _ in decode]
    between = ["generate", "slots", "refresh", "generate", "slots", "refresh", "generate"]
    assert names == (["refresh", *between] if rebuilds else between)
    refreshed = {v for e, v in decode if e == "refresh"}
    assert len(refreshed) == 1, "every refresh must receive the same metadata object"


def test_per_step_path_never_refreshes() -> None:
    spec = _speculator(4)
    spec.trace = []
    spec.propose(_batch(), "per_step")
    events, spec.trace = spec.trace, None
    assert "refresh" not in {e for e, _ in events}
    assert [e for e, _ in events].count("slots") == 1 + 3


class _Unsupported(ReferenceMetadataBuilder):
    """A backend the matrix calls 'flashinfer': no in-graph refresh for this config."""


@pytest.mark.parametrize(
    ("k", "advance", "backends", "fused"),
    [
        (1, True, ["reference", "reference"], False),
        (4, False, ["reference", "flashinfer"], True),
        (4, True, ["reference", "reference"], True),
        (4, True, ["reference", "flashinfer"], False),
    ],
)
def test_gating_truth_table(k, advance, backends, fused, caplog) -> None:
    caplog.set_level(logging.INFO, logger="speccheck.speculator.autoregressive")
    spec = create_speculator(
        "autoregressive", backends, _config(k, advance_draft_positions=advance), DRAFTER,
        DEVICE, OPTIONS, builder_overrides={"flashinfer": _Unsupported}, matrix=MATRIX)
    assert spec.use_fused_multi_step_decode is fused
    fallback_logged = "falling back" in caplog.text and "flashinfer" in caplog.text
    assert fallback_logged is (k > 1 and advance and "flashinfer" in backends)


def test_auto_path_falls_back_to_per_step_rebuilds() -> None:
    spec = create_speculator("autoregressive", ["reference", "flashinfer"], _config(4), DRAFTER,
                             DEVICE, OPTIONS, builder_overrides={"flashinfer": _Unsupported}, matrix=MATRIX)
    spec.trace = []
    spec.propose(_batch())
    names = [e for e, _ in spec.trace]
    assert "refresh" not in names and names.count("slots") == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_graph_modes_without_cuda_are_clear_errors(mode: str) -> None:
    with pytest.raises((CudaGraphUnavailable, ValueError), match=mode):
        create_speculator("autoregressive", ["reference"] * 2, _config(4, mode), DRAFTER, DEVICE, OPTIONS, matrix=MATRIX)


def test_batch_validation_names_request() -> None:
    spec = _speculator(4)
    bad = DraftBatch((38,), ((1, 2, 3),), ((1,),), (0,))
    with pytest.raises(ValueError, match="request 0"):
        spec.propose(bad)


@pytest.mark.cuda
@pytest.mark.parametrize(("path", "expected"), [("per_step", (0, 3)), ("fused", (0, 1))])
def test_counts_full_graphs_k4(path: str, expected) -> None:
    spec = create_speculator("autoregressive", ["reference"] * 2, _config(4, "full"), DRAFTER,
                             DEVICE, OPTIONS, matrix=MATRIX)
    spec.capture()
    spec.propose(_batch(), path)  # type: ignore[arg-type]
    assert (spec.counters.eager_step_calls, spec.counters.graph_replays) == expected


@pytest.mark.cuda
@settings(max_examples=20)
@given(data=st.data(), k=st.integers(2, 6))
def test_full_graph_fused_equals_per_step(data, k) -> None:
    spec = _full_speculator(k)
    batch = data.draw(draft_batches(_limits(k)))
    spec.kv_cache.fill_random_(k)
    start = spec.kv_cache.snapshot()
    oracle, kv_oracle = _run(spec, batch, "per_step")
    spec.kv_cache.restore(start)
    fused, kv_fused = _run(spec, batch, "fused")
    assert torch.equal(oracle.draft_tokens, fused.draft_tokens)
    torch.testing.assert_close(oracle.logits, fused.logits)
    for (ko, vo), (kf, vf) in zip(kv_oracle, kv_fused):
        assert torch.equal(ko, kf) and torch.equal(vo, vf)


@cache
def _full_speculator(k: int) -> AutoregressiveSpeculator:
    spec = create_speculator("autoregressive", ["reference"] * 2, _config(k, "full"), DRAFTER,
                             DEVICE, OPTIONS, matrix=MATRIX)
    assert isinstance(spec, AutoregressiveSpeculator)
    spec.capture()
    return spec


def test_graph_capture_shortfall_follows_the_matrix_levels() -> None:
    decode_only = {"reference": CudaGraphSupport.ALWAYS,
                   "decode_only": CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE}
    assert graph_capture_shortfall(decode_only, tokens_per_req=1) is None
    note = graph_capture_shortfall(decode_only, tokens_per_req=5)
    assert note is not None and note.startswith("decode_only cannot capture batches of 5 query")
    uniform = {"flashinfer": CudaGraphSupport.UNIFORM_BATCH}
    assert graph_capture_shortfall(uniform, tokens_per_req=5) is None
    assert CudaGraphSupport.needed_for(1) is CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert CudaGraphSupport.needed_for(4) is CudaGraphSupport.UNIFORM_BATCH


def test_groups_carry_the_matrix_graph_support() -> None:
    spec = create_speculator("autoregressive", ["reference", "flashinfer"], _config(4), DRAFTER,
                             DEVICE, OPTIONS, builder_overrides={"flashinfer": _Unsupported}, matrix=MATRIX)
    support = {g.backend_name: g.cudagraph_support for g in spec.groups}
    assert support == {"reference": CudaGraphSupport.ALWAYS, "flashinfer": CudaGraphSupport.UNIFORM_BATCH}
    assert spec.graph_mode_note is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU stand-in for the graph manager")
def test_capture_bodies_run_for_every_bucket_and_path() -> None:
    auto = create_speculator("autoregressive", ["reference"] * 2, _config(3), DRAFTER, DEVICE, OPTIONS, matrix=MATRIX)
    auto.graphs = EagerCapture(OPTIONS.capture_sizes)  # type: ignore[assignment]
    auto.capture()
    assert auto.graphs.keys == [(kind, n) for n in (1, 2, 4) for kind in ("step", "fused")]  # type: ignore[union-attr]
    dflash = create_speculator("dflash", ["reference"] * 2, _config(3), DRAFTER, DEVICE, OPTIONS, matrix=MATRIX)
    assert isinstance(dflash, DFlashSpeculator)
    dflash.graphs = EagerCapture(OPTIONS.capture_sizes)  # type: ignore[assignment]
    dflash.capture()
    assert dflash.graphs.keys == [("block", n) for n in (1, 2, 4)]  # type: ignore[union-attr]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU stand-in for the graph manager")
def test_a_whole_propose_body_scatters_what_was_staged_before_its_replay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The whole-propose body's first kernel scatters the inputs staged before the replay
    (the one-kernel scatter under the Triton interpreter, told to run in the body), with
    the sizes read from the staged header: a replay drafts what the eager per-step loop
    drafts, batch after batch of other shapes, and no scatter runs outside the body."""
    from speccheck.speculator import base

    monkeypatch.setattr(AutoregressiveSpeculator, "scatters_in_graph", property(lambda _: True))
    spec = _padded_first_pass_speculator(3, "none")
    spec.graphs = EagerReplay(OPTIONS.capture_sizes)  # type: ignore[assignment]
    spec.capture()
    assert any(key[0] == "fused_propose" for key in spec.graphs.keys)  # type: ignore[union-attr]
    batches = [DraftBatch((5, 3), ((7, 8), (9, 10)), ((1, 2, 3), (4, 5, 6)), (0, 1)),
               DraftBatch((9,), ((1, 2, 3),), ((7, 8, 9, 10),), (4,)),
               DraftBatch((0, 2, 4), ((5,), (6,), (7,)), ((11, 12), (13, 16), (14, 15)), (1, 2, 3))]
    scatter = base.scatter_pass_inputs
    for batch in batches:  # each replay follows another batch's staging (or the capture's)
        spec.kv_cache.fill_random_(3)
        start = spec.kv_cache.snapshot()
        scattered: list[object] = []
        monkeypatch.setattr(base, "scatter_pass_inputs",
                            lambda *a, _calls=scattered, **k: _calls.append(a))
        replays = spec.counters.graph_replays
        whole = spec.propose(batch, DecodePath.FUSED)
        monkeypatch.setattr(base, "scatter_pass_inputs", scatter)
        assert scattered == [] and spec.counters.graph_replays == replays + 1
        spec.kv_cache.restore(start)
        eager = spec.propose(batch, DecodePath.PER_STEP, use_graphs=False)
        assert torch.equal(whole.draft_tokens, eager.draft_tokens)
        torch.testing.assert_close(whole.logits, eager.logits)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU stand-in for the graph manager")
def test_per_step_replays_are_observed_with_the_metadata_the_graph_reads() -> None:
    """A host max_seq_len baked into the captured single-step graph (the capture's dummy
    batch: length 1) is what the step observer reports for a per-step replay, so the
    verifier compares what the replay really ran with, not the fresh build."""
    from speccheck.checks.selftest.mutants import BakedMaxSeqLen, declaring_matrix
    from speccheck.checks.verify.step_recorder import StepMetadataRecorder

    matrix = declaring_matrix(MATRIX, ("kv_lens_plus_one",))
    spec = create_speculator("autoregressive", ["reference"] * 2, _config(3), DRAFTER, DEVICE,
                             OPTIONS, matrix=matrix, builder_overrides={"reference": BakedMaxSeqLen})
    assert isinstance(spec, AutoregressiveSpeculator)
    recorder = StepMetadataRecorder(spec.groups)
    spec.step_observer = recorder
    spec.graphs = EagerReplay(OPTIONS.capture_sizes)  # type: ignore[assignment]
    spec.capture()
    batch = DraftBatch((9,), ((1, 2),), ((1, 2, 3, 4),), (0,))
    spec.propose(batch, DecodePath.PER_STEP, use_graphs=False)
    eager = recorder.collect(1).host
    spec.propose(batch, DecodePath.PER_STEP, use_graphs=True)
    replayed = recorder.collect(1).host
    path = "reference.metadata.max_seq_len"
    assert int(eager[1][path]) == 12 and int(eager[2][path]) == 13
    assert int(replayed[1][path]) == int(replayed[2][path]) == 1


def test_a_shared_kv_cache_must_match_the_layers() -> None:
    """The verifier shares one cache among its per-K speculators; a cache of another block
    count (or layout) is refused rather than silently indexed out of range."""
    from speccheck.speculator.kv_cache import PagedKVCache

    layer = DRAFTER.layer_spec(4, 40)
    cache = PagedKVCache.allocate([layer] * DRAFTER.num_layers, OPTIONS.num_blocks, DEVICE)
    spec = create_speculator("autoregressive", ["reference"] * 2, _config(3), DRAFTER, DEVICE,
                             OPTIONS, matrix=MATRIX, kv_cache=cache)
    assert spec.kv_cache is cache
    smaller = PagedKVCache.allocate([layer] * DRAFTER.num_layers, OPTIONS.num_blocks - 1, DEVICE)
    with pytest.raises(ValueError, match="does not match the layers"):
        create_speculator("autoregressive", ["reference"] * 2, _config(3), DRAFTER, DEVICE,
                          OPTIONS, matrix=MATRIX, kv_cache=smaller)


def test_a_restore_of_some_blocks_converts_them_and_leaves_the_others() -> None:
    """The verifier restores the fp32 reference's cache from the bf16 start state, only in
    the blocks the example can read."""
    from speccheck.speculator.kv_cache import PagedKVCache

    layer = DRAFTER.layer_spec(4, 40)
    cache = PagedKVCache.allocate([layer] * DRAFTER.num_layers, 6, DEVICE)
    start = [(k.bfloat16(), v.bfloat16()) for k, v in
             [(torch.randn_like(k), torch.randn_like(v)) for k, v in cache.layers]]
    for k, v in cache.layers:
        k.fill_(7.0)
        v.fill_(7.0)
    cache.restore(start, [4, SINK_BLOCK, 4, 2])
    for (k, v), (ks, vs) in zip(cache.layers, start, strict=True):
        for tensor, saved in ((k, ks), (v, vs)):
            assert torch.equal(tensor[[0, 2, 4]], saved[[0, 2, 4]].float())
            assert bool((tensor[[1, 3, 5]] == 7.0).all())
    cache.restore(start)
    assert all(torch.equal(k, ks.float()) for (k, _), (ks, _) in zip(cache.layers, start))


def _padded_first_pass_speculator(k: int, mode: str,
                                  backend: str = "reference") -> AutoregressiveSpeculator:
    options = SpeculatorOptions(OPTIONS.capture_sizes, OPTIONS.max_num_prefill_tokens,
                                OPTIONS.num_blocks, pad_to_capture_sizes=True,
                                first_pass_query_lens=(1, 2, 3))
    spec = create_speculator("autoregressive", [backend] * 2, _config(k, mode), DRAFTER,
                             DEVICE, options, matrix=MATRIX)
    assert isinstance(spec, AutoregressiveSpeculator)
    return spec


@settings(max_examples=15, deadline=None)
@given(data=st.data(), k=st.integers(1, 4), q=st.integers(1, 3))
def test_padded_first_pass_equals_the_eager_one(data, k: int, q: int) -> None:
    """A uniform batch's first pass, padded over the bucket (the body a FULL graph holds),
    drafts what the eager pass over the real tokens drafts, and writes the same KV."""
    batch = data.draw(draft_batches(_limits(k)))
    batch = DraftBatch(batch.context_lens, tuple(row[:1] * q for row in batch.new_tokens),
                       batch.block_table, batch.seeds)
    eager, padded = _speculator(k), _padded_first_pass_speculator(k, "none")
    assert padded.first_pass_width(batch) == q and eager.first_pass_width(batch) is None
    try:
        arrays = batch.validate(max_model_len=40, block_size=4, num_blocks=48,
                                extra_positions=k - 1, max_num_reqs=4)
    except ValueError:
        return  # lengthening the new tokens pushed a request past its block-table row
    for spec in (eager, padded):
        spec.kv_cache.fill_random_(7)
    expected, kv_expected = _run(eager, batch, "per_step")
    got, kv_got = _run(padded, batch, "per_step")
    assert torch.equal(expected.draft_tokens, got.draft_tokens)
    torch.testing.assert_close(expected.logits, got.logits)
    live = slice(SINK_BLOCK + 1, None)  # padding lanes write the sink block: garbage by design
    for (ke, ve), (kg, vg) in zip(kv_expected, kv_got):
        torch.testing.assert_close(ke[live], kg[live])
        torch.testing.assert_close(ve[live], vg[live])


@pytest.mark.parametrize("backend", ["reference", "triton_attn"])
@settings(max_examples=8, deadline=None)
@given(data=st.data(), k=st.integers(2, 4), q=st.integers(1, 3))
def test_the_whole_fused_propose_body_on_capture_metadata_drafts_what_the_oracle_does(
        backend: str, data, k: int, q: int) -> None:
    """What a replay of the whole-fused-propose graph runs, run eagerly (no graphs here):
    metadata built for capture on dummy inputs, decode first, then first pass; the pass's
    inputs scattered; the first pass's body refreshing its metadata, then the fused body
    refreshing before step 1. No metadata is built for the batch, yet the drafts and the KV
    written are the eager per-step run's (triton_attn's kernels interpreted on CPU)."""
    spec = _padded_first_pass_speculator(k, "none", backend)
    assert spec.refresh_rebuilds_in_graph
    batch = data.draw(draft_batches(_limits(k)))
    batch = DraftBatch(batch.context_lens, tuple(row[:1] * q for row in batch.new_tokens),
                       batch.block_table, batch.seeds)
    try:
        arrays = batch.validate(max_model_len=40, block_size=4, num_blocks=48,
                                extra_positions=k - 1, max_num_reqs=4)
    except ValueError:
        return  # lengthening the new tokens pushed a request past its block-table row
    bucket, num_reqs = spec.bucket_for(batch.num_reqs), batch.num_reqs
    decode = spec.graph_capture.decode_metadata(bucket)
    first = spec.graph_capture.first_pass_metadata(bucket, q)
    spec.kv_cache.fill_random_(5)
    start = spec.kv_cache.snapshot()
    spec.write_pass_inputs(arrays, batch.new_tokens, uniform_width=q)
    spec.first_pass.body(bucket, q, first, refresh=True)
    spec.decode_steps.fused(bucket, decode)
    tokens, logits = spec.draft_tokens[:num_reqs].clone(), spec.draft_logits[:num_reqs].clone()
    kv = spec.kv_cache.snapshot()
    spec.kv_cache.restore(start)
    expected, kv_expected = _run(spec, batch, "per_step")
    assert torch.equal(tokens, expected.draft_tokens)
    torch.testing.assert_close(logits, expected.logits)
    live = slice(SINK_BLOCK + 1, None)
    for (ke, ve), (kg, vg) in zip(kv_expected, kv, strict=True):
        torch.testing.assert_close(ke[live], kg[live])
        torch.testing.assert_close(ve[live], vg[live])


def test_first_pass_lens_the_backends_cannot_capture_are_dropped() -> None:
    spec = _padded_first_pass_speculator(2, "none")
    assert spec.first_pass_query_lens == (1, 2, 3)
    decode_only = SHIPPED.replacing(SHIPPED.backend("reference").model_copy(
        update={"cudagraph_support": CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE}))
    options = SpeculatorOptions(OPTIONS.capture_sizes, OPTIONS.max_num_prefill_tokens,
                                OPTIONS.num_blocks, pad_to_capture_sizes=True,
                                first_pass_query_lens=(1, 2, 3))
    spec = create_speculator("autoregressive", ["reference"] * 2, _config(2), DRAFTER, DEVICE,
                             options, matrix=decode_only)
    assert isinstance(spec, AutoregressiveSpeculator)
    assert spec.first_pass_query_lens == (1,)


@pytest.mark.cuda
@settings(max_examples=10, deadline=None)
@given(data=st.data(), k=st.integers(2, 4))
def test_first_pass_graph_equals_the_eager_pass(data, k: int) -> None:
    """The first-pass graph (one replay) drafts what the eager pass drafts."""
    spec = _padded_first_pass_speculator(k, "full")
    spec.capture()
    batch = data.draw(draft_batches(_limits(k)))
    batch = DraftBatch(batch.context_lens, tuple(row[:1] * 2 for row in batch.new_tokens),
                       batch.block_table, batch.seeds)
    try:
        batch.validate(max_model_len=40, block_size=4, num_blocks=48, extra_positions=k - 1,
                       max_num_reqs=4)
    except ValueError:
        return
    spec.kv_cache.fill_random_(k)
    start = spec.kv_cache.snapshot()
    replays = spec.counters.first_pass_replays
    graph, _ = _run(spec, batch, "fused")
    assert spec.counters.first_pass_replays == replays + 1
    spec.kv_cache.restore(start)
    eager = spec.propose(batch, DecodePath.PER_STEP, use_graphs=False)
    assert torch.equal(graph.draft_tokens, eager.draft_tokens)
    torch.testing.assert_close(graph.logits, eager.logits)


@pytest.mark.cuda
def test_a_whole_propose_replay_scatters_its_inputs_inside_the_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fused propose whose first pass fits the whole-propose graph stages its inputs and
    launches that one graph: no scatter runs outside it (the graph's first kernel scatters
    what was staged, sizes included), and it drafts what the eager per-step loop drafts."""
    from speccheck.speculator import base

    spec = _padded_first_pass_speculator(3, "full")
    spec.capture()
    assert spec.scatters_in_graph
    batch = DraftBatch((5, 3), ((7, 8), (9, 10)), ((1, 2, 3), (4, 5, 6)), (0, 1))
    spec.kv_cache.fill_random_(3)
    start = spec.kv_cache.snapshot()
    scattered: list[object] = []
    scatter = base.scatter_pass_inputs
    monkeypatch.setattr(base, "scatter_pass_inputs", lambda *a, **k: scattered.append(a))
    replays = spec.counters.graph_replays
    whole = spec.propose(batch, DecodePath.FUSED)  # after the capture's staging
    assert scattered == [] and spec.counters.graph_replays == replays + 1
    monkeypatch.setattr(base, "scatter_pass_inputs", scatter)
    spec.kv_cache.restore(start)
    eager = spec.propose(batch, DecodePath.PER_STEP, use_graphs=False)
    assert torch.equal(whole.draft_tokens, eager.draft_tokens)
    torch.testing.assert_close(whole.logits, eager.logits)


@pytest.mark.parametrize("kernels", [True, False])
def test_a_drafter_without_kernels_never_chooses_a_triton_kernel(
    kernels: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``DrafterConfig.kernels`` off (the verifier's fp32 reference) no layer, sampling
    or index-buffer update even asks whether to run its Triton kernel, on any device; with
    it on, they all ask (here answered "no", so the run stays on the tensor-op forms)."""
    from speccheck.speculator import decode_inputs, kv_cache, model_kernels, pass_inputs, sampling

    asked: set[str] = set()
    for module in (model_kernels, sampling, kv_cache, decode_inputs, pass_inputs):
        def record(x: torch.Tensor, name: str = module.__name__) -> bool:
            asked.add(name.rsplit(".", 1)[-1])
            return False
        monkeypatch.setattr(module, "use_kernels", record)
    drafter = DrafterConfig(**{**DRAFTER.__dict__, "kernels": kernels})
    spec = create_speculator("autoregressive", ["reference"] * 2, _config(3), drafter, DEVICE,
                             SpeculatorOptions(OPTIONS.capture_sizes, OPTIONS.max_num_prefill_tokens,
                                               OPTIONS.num_blocks, "gumbel"), matrix=MATRIX)
    assert isinstance(spec, AutoregressiveSpeculator)
    batch = DraftBatch((5, 3), ((7, 8), (9, 10)), ((1, 2, 3), (4, 5, 6)), (0, 1))
    for path in (DecodePath.PER_STEP, DecodePath.FUSED):
        spec.propose(batch, path)
    everything = {"model_kernels", "sampling", "kv_cache", "decode_inputs", "pass_inputs"}
    assert asked == (everything if kernels else set())


def test_the_verifiers_fp32_reference_drafter_runs_no_triton_kernel() -> None:
    from speccheck.checks.verify.context import MatrixContext
    from speccheck.checks.verify.engine import BackendVerifier, VerifySettings

    verifier = BackendVerifier(VerifySettings("triton_attn", _config(3),
                                              matrices=MatrixContext.load(None)), DEVICE)
    assert verifier.reference_drafter().kernels is False
    assert verifier.drafter("float32").kernels is True
