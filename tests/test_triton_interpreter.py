"""Triton's interpreter patched to walk ``triton.language`` once per launch: same results,
the language restored after each launch, and the walk's cost independent of how many
nested ``@triton.jit`` calls a kernel makes."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from speccheck.checks.triton_interpreter import patch_language_once_per_launch

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
    patch_language_once_per_launch()
    patch_language_once_per_launch()  # idempotent
    for calls in (1, 5):
        assert _launch(calls).tolist() == [_expected(calls)] * 8
    assert tl.core.is_builtin(tl.program_id)  # the launch's patches were undone


def test_the_language_is_walked_as_often_for_twenty_nested_calls_as_for_one(
    builtin_walks: list[str],
) -> None:
    patch_language_once_per_launch()
    _launch(1)
    one = len(builtin_walks)
    builtin_walks.clear()
    _launch(20)
    assert one > 0
    assert len(builtin_walks) == one
