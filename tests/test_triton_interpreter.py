"""Triton's interpreter patched to walk ``triton.language`` once per launch: same results,
the language restored after each launch, and the walk's cost independent of how many
nested ``@triton.jit`` calls a kernel makes; a loop bound loaded from memory usable
whatever numpy is installed; and every other launch's programs run in reverse order, so
that programs racing for one address are seen both ways."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from speccheck.checks.triton_interpreter import patch_interpreter, restart_program_order

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton's interpreter is off (a CUDA machine)")


@triton.jit
def _halves(x):
    return tl.cdiv(x, 2)


@triton.jit
def _nested_calls_kernel(out_ptr, CALLS: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    value = offsets * 0 + 1000
    for _ in tl.static_range(CALLS):
        value = _halves(value) + 1
    tl.store(out_ptr + offsets, value)


@triton.jit
def _loaded_bound_kernel(bound_ptr, out_ptr):
    total = 0
    for i in range(0, tl.load(bound_ptr)):
        total += i
    tl.store(out_ptr, total)


def _expected(calls: int) -> int:
    value = 1000
    for _ in range(calls):
        value = -(-value // 2) + 1
    return value


@pytest.fixture
def builtin_walks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the modules the interpreter walked for builtins, in order."""
    walks: list[str] = []
    original = interpreter._patch_builtin

    def counting(pkg: object, builder: object, scope: object) -> None:
        walks.append(getattr(pkg, "__name__", type(pkg).__name__))
        original(pkg, builder, scope)

    monkeypatch.setattr(interpreter, "_patch_builtin", counting)
    yield walks


def _launch(calls: int) -> torch.Tensor:
    out = torch.zeros(8, dtype=torch.int32)
    _nested_calls_kernel[(1,)](out, CALLS=calls, BLOCK=8)
    return out


def test_nested_calls_compute_what_they_did_and_the_language_is_restored() -> None:
    patch_interpreter()
    patch_interpreter()  # idempotent
    for calls in (1, 5):
        assert _launch(calls).tolist() == [_expected(calls)] * 8
    assert tl.core.is_builtin(tl.program_id)  # the launch's patches were undone


def test_the_language_is_walked_as_often_for_twenty_nested_calls_as_for_one(
    builtin_walks: list[str],
) -> None:
    patch_interpreter()
    _launch(1)
    one = len(builtin_walks)
    builtin_walks.clear()
    _launch(20)
    assert one > 0
    assert len(builtin_walks) == one


def test_a_loop_bound_loaded_from_memory_indexes() -> None:
    """``range`` over a loaded scalar: Triton 3.6's interpreter converts it with
    ``int(one_element_array)``, an error from numpy 2.4 on, unless patched."""
    patch_interpreter()
    out = torch.zeros(1, dtype=torch.int32)
    _loaded_bound_kernel[(1,)](torch.tensor([5], dtype=torch.int32), out)
    assert out.item() == 0 + 1 + 2 + 3 + 4


@triton.jit
def _last_writer_kernel(out_ptr):
    tl.store(out_ptr, tl.program_id(0))


def test_launches_alternate_the_order_of_their_programs() -> None:
    """Every program of the grid writes one address: the last to run wins. Index order
    first after a restart (each example's), then reverse, then index order again."""
    patch_interpreter()
    restart_program_order()
    winners = []
    for _ in range(3):
        out = torch.full((1,), -1, dtype=torch.int32)
        _last_writer_kernel[(4,)](out)
        winners.append(out.item())
    assert winners == [3, 0, 3]
