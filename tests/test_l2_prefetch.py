"""The L2 prefetch a layer issues while its attention runs
(:mod:`speccheck.speculator.l2_prefetch`): what it asks for, where it applies, that it
compiles for Hopper with the bulk prefetch in it, and, on a GPU, that a step with it
computes what a step without it computes, captured or not."""

from __future__ import annotations

import pytest
import torch

from speccheck.speculator import l2_prefetch
from speccheck.speculator.l2_prefetch import _spans, weights_warmed_during
from tests.fixtures.sm90_compile import run_without_interpreter


def test_spans_follow_the_weights_in_order_until_the_budget() -> None:
    first, second, third = torch.empty(64, 64), torch.empty(128, 64), torch.empty(8, 8)
    spans = list(_spans((first, second, third), budget=16384 + 100))
    assert [(w is first, w is second, n) for w, n in spans] == [
        (True, False, 16384), (False, True, 96)]


def test_spans_skip_weights_the_instruction_cannot_address() -> None:
    base = torch.empty(1024)
    unaligned = base[1:513]  # 4-byte offset: not 16-byte aligned
    strided = torch.empty(64, 64).t()
    aligned = base[4:260]
    spans = list(_spans((unaligned, strided, aligned), budget=1 << 20))
    assert [(w is aligned, n) for w, n in spans] == [(True, 1024)]


def test_block_runs_alone_on_the_cpu() -> None:
    """Without a CUDA device the block runs unchanged and no stream is made."""
    ran = []
    with weights_warmed_during(torch.ones(1, 4), (torch.ones(8, 8),)):
        ran.append(True)
    assert ran == [True]
    assert l2_prefetch._side_stream.cache_info().currsize == 0


_COMPILE = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from speccheck.speculator import l2_prefetch

compiled = compile(ASTSource(l2_prefetch._prefetch_l2_kernel, {"base_ptr": "*bf16",
    "nbytes": "i64", "SPAN": "constexpr", "LANES": "constexpr"},
    {"SPAN": l2_prefetch.SPAN_BYTES, "LANES": l2_prefetch.LANES}),
    target=GPUTarget("cuda", 90, 32))
assert compiled.asm["cubin"]
print(compiled.asm["ptx"].count("cp.async.bulk.prefetch.L2.global"))
"""


def test_prefetch_kernel_compiles_for_sm90_with_the_bulk_prefetch() -> None:
    """``triton.compile`` for Hopper on any machine keeps the side-effecting prefetch (its
    result is never used) and ``ptxas`` accepts it."""
    out = run_without_interpreter(_COMPILE)
    assert int(out.split()[-1]) >= 1, out


def _layer_step(x: torch.Tensor, w_next: torch.Tensor, prefetch: bool) -> torch.Tensor:
    """A stand-in for a layer around its attention: work on the current stream inside the
    block, the next projection after it."""
    with weights_warmed_during(x, (w_next,), enabled=prefetch):
        y = torch.softmax(x.float() @ x.float().T, dim=-1) @ x.float()
    return y.to(x.dtype) @ w_next.T


@pytest.mark.cuda
def test_cuda_prefetch_changes_no_number_eager_or_captured() -> None:
    """With the prefetch, eager and under a replayed CUDA graph, the step gives what it
    gives without it, bit for bit (the prefetch writes nothing)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    w_next = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    want = _layer_step(x, w_next, prefetch=False)
    assert torch.equal(_layer_step(x, w_next, prefetch=True), want)
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _layer_step(static_x, w_next, prefetch=True)  # warm-up (compiles) off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _layer_step(static_x, w_next, prefetch=True)
    static_x.copy_(x * 2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, _layer_step(x * 2, w_next, prefetch=False))
