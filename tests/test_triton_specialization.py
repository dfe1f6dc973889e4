"""Every Triton kernel a propose call launches compiles once, whatever the batch.

Triton compiles a kernel again for each new specialization of its arguments: an integer
equal to 1 or divisible by 16, a pointer 16-byte aligned or not, each constexpr value. A
size that follows the batch (requests, tokens, block-table width) or a staged input at an
odd offset therefore compiles a kernel up to three (or two) times per such argument, and
the combinations multiply: a verifier run on a fresh GPU machine spent most of its first
examples compiling. The kernels mark batch sizes and staged-input offsets
``do_not_specialize`` (the scatter reads staged inputs from the one staging buffer); this
test runs the triton_attn drafter (the speculator's own kernels and the backend's) over
batches that vary every size, on both paths, and counts the distinct compilations of each
kernel. A constexpr may vary only where it is a tile size chosen on
purpose (:data:`TILE_CONSTEXPRS`); then one compilation per value.

Without CUDA the kernels run in Triton's interpreter on CPU tensors and the test computes
each launch's key with Triton's own specialization rule; on CUDA it counts real
compilations through Triton's JIT hook.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import triton

from speccheck.backends.triton_attn import kernels as triton_attn_kernels
from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator import decode_inputs, kv_cache, model_kernels, pass_inputs, sampling
from speccheck.speculator.autoregressive import AutoregressiveSpeculator, DecodePath
from speccheck.speculator.base import SpeculatorOptions
from speccheck.speculator.batch import DraftBatch
from speccheck.speculator.factory import create_speculator
from speccheck.speculator.model import DrafterConfig

TILE_CONSTEXPRS = {"paged_attention_split_kernel": frozenset({"BLOCK_M"}),
                   "_decode_step_finish_kernel": frozenset({"SPLITS", "ONE_LANE"})}
"""Constexprs chosen per batch on purpose: the query tile follows the longest query; the
decode step's count of sampling partials, whether the LM head samples in its epilogue (on
CUDA, up to ``SKINNY_ROWS`` lanes: one partial per tile) or not (one per chunk), and
whether one lane moves the step on alone."""

DRAFTER = DrafterConfig(vocab_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                        head_size=16, intermediate_size=64, seed=5)
BLOCK_SIZE = 4

Key = tuple[Any, frozenset[tuple[str, Any]]]
"""A compilation: (everything but the tile constexprs, the tile constexprs' values)."""


def _batch(context: list[int], widths: list[int]) -> DraftBatch:
    """Requests with ``context`` cached tokens each bringing ``widths`` new tokens, each in
    blocks of its own (block 0 is the sink)."""
    rows, next_block = [], 1
    for ctx, width in zip(context, widths, strict=True):
        blocks = (ctx + width + 8) // BLOCK_SIZE + 1
        rows.append(tuple(range(next_block, next_block + blocks)))
        next_block += blocks
    new = tuple(tuple((7 * r + j) % DRAFTER.vocab_size for j in range(w))
                for r, w in enumerate(widths))
    return DraftBatch(tuple(context), new, tuple(rows), tuple(range(len(context))))


BATCHES = (
    _batch([5], [1]),
    _batch([3, 9, 14], [2, 2, 2]),
    _batch([4 + r for r in range(16)], [1] * 16),
    _batch([6, 1, 11, 3, 8], [1, 3, 2, 1, 2]),
    _batch([2 + r % 7 for r in range(17)], [3] * 17),
)
"""Request counts 1, 3, 5, 16, 17; uniform and mixed widths (padded graph-shaped and eager
first passes); block-table widths from 2 to 6."""


def _speculator(device: torch.device) -> AutoregressiveSpeculator:
    config = RuntimeConfig(platform=device.type, cudagraph_mode="none", num_speculative_steps=3,
                           block_size=BLOCK_SIZE, max_model_len=40,
                           dtype="float32" if device.type == "cpu" else "bfloat16",
                           head_size=16, num_heads=2, num_kv_heads=1)
    options = SpeculatorOptions(capture_sizes=(1, 2, 4, 8, 16, 32), num_blocks=160,
                                max_num_prefill_tokens=64)
    spec = create_speculator("autoregressive", ["triton_attn"] * 2, config, DRAFTER, device,
                             options, matrix=load_matrix())
    assert isinstance(spec, AutoregressiveSpeculator)
    return spec


def _propose_all(spec: AutoregressiveSpeculator) -> None:
    for batch in BATCHES:
        for path in (DecodePath.PER_STEP, DecodePath.FUSED):
            spec.propose(batch, path, use_graphs=False)


def _split(name: str, constexprs: dict[str, Any], rest: Any) -> Key:
    tiles = TILE_CONSTEXPRS.get(name, frozenset())
    return ((rest, frozenset((k, v) for k, v in constexprs.items() if k not in tiles)),
            frozenset((k, v) for k, v in constexprs.items() if k in tiles))


def _assert_one_compilation_each(compilations: dict[str, set[Key]]) -> None:
    assert {"_scatter_pass_inputs_kernel", "_prepare_decode_lanes_kernel",
            "paged_attention_split_kernel", "_rotary_qkv_kernel"} <= compilations.keys()
    for name, keys in compilations.items():
        per_tile: dict[frozenset[tuple[str, Any]], set[Any]] = defaultdict(set)
        for rest, tiles in keys:
            per_tile[tiles].add(rest)
        extra = {tiles: rests for tiles, rests in per_tile.items() if len(rests) > 1}
        assert not extra, f"{name} compiles more than once per tile choice: {extra}"


@pytest.fixture
def kernels_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The speculator's Triton forms on CPU tensors (its tensor-op forms run there by
    default)."""
    for module in (model_kernels, sampling, decode_inputs, pass_inputs, kv_cache):
        monkeypatch.setattr(module, "use_kernels", lambda x: True)


def _interpreter_launches(monkeypatch: pytest.MonkeyPatch) -> dict[str, set[Key]]:
    """Record each interpreted launch's compilation key, as Triton's JIT computes it
    (``native_specialize_impl`` on every argument, honouring ``do_not_specialize``)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime.interpreter import InterpretedFunction

    seen: dict[str, set[Key]] = defaultdict(set)
    launch = InterpretedFunction.run

    def recording(self: InterpretedFunction, *args: Any, grid: Any, warmup: bool,
                  **kwargs: Any) -> Any:
        params = inspect.signature(self.fn).parameters
        bound = dict(zip(params, args, strict=False))
        bound.update({k: v for k, v in kwargs.items() if k in params})
        unspecialized = set(self.kwargs.get("do_not_specialize") or ())
        constexprs, specialized = {}, []
        for name, param in params.items():
            value = bound.get(name, param.default)
            if "constexpr" in str(param.annotation):
                constexprs[name] = value
            else:
                specialized.append(native_specialize_impl(
                    BaseBackend, value, False, name not in unspecialized, True))
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in params))
        seen[self.fn.__name__].add(_split(self.fn.__name__, constexprs,
                                          (tuple(specialized), options)))
        return launch(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    return seen


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="interpreted only without CUDA; the CUDA twin counts real compilations")
def test_kernels_compile_once_across_batches_interpreted(
        monkeypatch: pytest.MonkeyPatch, kernels_on_cpu: None) -> None:
    seen = _interpreter_launches(monkeypatch)
    _propose_all(_speculator(torch.device("cpu")))
    _assert_one_compilation_each(seen)


@pytest.fixture
def compilations() -> Iterator[dict[str, set[Key]]]:
    """Every real compilation in the test, through ``triton.knobs.runtime.jit_cache_hook``
    (called before each one), with the kernels' in-memory caches emptied first: a variant
    compiled by an earlier test would otherwise go unseen."""
    for module in (model_kernels, sampling, decode_inputs, pass_inputs, kv_cache,
                   triton_attn_kernels):
        for value in vars(module).values():
            if isinstance(value, triton.runtime.JITFunction):
                value.device_caches.clear()
    seen: dict[str, set[Key]] = defaultdict(set)
    previous: Callable[..., Any] | None = triton.knobs.runtime.jit_cache_hook

    def hook(*, key: Any, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        names = fn.jit_function.arg_names
        constexprs = {names[path[0]]: value for path, value in compile["constants"].items()
                      if len(path) == 1}
        seen[fn.name].add(_split(fn.name, constexprs, key))
        return False

    triton.knobs.runtime.jit_cache_hook = hook
    try:
        yield seen
    finally:
        triton.knobs.runtime.jit_cache_hook = previous


@pytest.mark.cuda
def test_kernels_compile_once_across_batches_cuda(
        compilations: dict[str, set[Key]]) -> None:
    _propose_all(_speculator(torch.device("cuda")))
    _assert_one_compilation_each(compilations)
