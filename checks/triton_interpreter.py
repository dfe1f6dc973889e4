"""Triton on a machine without CUDA: kernels run in Triton's interpreter on CPU tensors, which
this module patches (:func:`patch_interpreter`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import wraps
from typing import Any

import torch


def interpret_triton_without_cuda() -> None:
    """Set ``TRITON_INTERPRET=1`` (unless already set) when there is no CUDA device. It must
    run before the process first imports Triton: ``triton.language`` decorates its own
    helpers (``tl.cdiv``, ...) then, and every kernel module (the speculator's, a
    backend's) is decorated when it is imported. Every command that runs kernels in its
    own process calls it first; it also :func:`patch_interpreter`."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    patch_interpreter()


def patch_interpreter() -> None:
    """Patch Triton's interpreter (:func:`_walk_language_once_per_launch`,
    :func:`_index_one_element_tensors`, :func:`_alternate_program_order`). Idempotent; does nothing unless
    ``TRITON_INTERPRET=1``, nor where the interpreter's internals differ from what these
    expect (another Triton). Any time before the first launch (a process that imported its
    kernels already, a forked rank, calls it too)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    _walk_language_once_per_launch()
    _index_one_element_tensors()
    _alternate_program_order()


def restart_program_order() -> None:
    """Make the next launch run its programs in index order again
    (:func:`_alternate_program_order`): called at the start of every example, so that each
    launch's order is a function of the example alone, the same in a fresh worker."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "interpreter_builder", None)
    if builder is not None:
        builder._speccheck_reversed = True  # the next launch flips it to index order


def _alternate_program_order() -> None:
    """Run every other launch's programs in reverse index order. The interpreter runs a
    grid's programs one after another, in index order, so a kernel whose programs race (two
    write one address, and the value that must win is the later program's in index order)
    is right on the CPU and wrong on a GPU, which promises no order. Alternating the order
    from launch to launch runs every kernel launched more than once an example (each layer,
    each step) both ways; a correct kernel's results do not depend on it (the shipped
    kernels' atomics only count arrivals)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder_type: Any = getattr(interpreter, "InterpreterBuilder", None)
    set_dim = getattr(builder_type, "set_grid_dim", None)
    set_idx = getattr(builder_type, "set_grid_idx", None)
    if set_dim is None or set_idx is None or getattr(set_dim, "_speccheck_alternating", False):
        return

    @wraps(set_dim)
    def set_grid_dim(self: Any, nx: int, ny: int, nz: int) -> None:
        self._speccheck_reversed = not getattr(self, "_speccheck_reversed", True)
        set_dim(self, nx, ny, nz)

    @wraps(set_idx)
    def set_grid_idx(self: Any, x: int, y: int, z: int) -> None:
        if getattr(self, "_speccheck_reversed", False):
            nx, ny, nz = self.grid_dim
            x, y, z = nx - 1 - x, ny - 1 - y, nz - 1 - z
        set_idx(self, x, y, z)

    set_grid_dim._speccheck_alternating = True  # type: ignore[attr-defined]
    builder_type.set_grid_dim = set_grid_dim
    builder_type.set_grid_idx = set_grid_idx


def _index_one_element_tensors() -> None:
    """Make an interpreted scalar usable as an index (``range(lo, hi)`` over values loaded
    from memory) with numpy 2.4 or later: Triton 3.6's interpreter converts its
    one-element array with ``int(array)``, which numpy 2.4 made an error ("only
    0-dimensional arrays can be converted to Python scalars", every Triton backend's first
    example on the CPU tier); Triton 3.7 squeezes the array first, as this does."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_speccheck_squeezed_index", False):
        return

    @wraps(original)
    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor._speccheck_squeezed_index = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


def _walk_language_once_per_launch() -> None:
    """Make Triton's interpreter patch ``triton.language`` once per kernel launch instead of
    at every nested ``@triton.jit`` call as well (``tl.cdiv``, ``tl.sum``, a kernel's own
    helpers): each such call re-walks the whole module with ``inspect.getmembers`` and
    re-installs the same interpreted members, a third of an interpreted kernel's time here.
    A nested call whose ``triton.language`` modules the launch has patched already skips the
    walk; one that sees a module not yet patched patches it as before, and the launch
    restores what it patched as before."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang", None)
    launch = getattr(interpreter, "GridExecutor", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or launch is None or scope_type is None:
        return
    if getattr(original, "_speccheck_once_per_launch", False):
        return
    patched: set[int] = set()
    """``id`` of each language module patched since the current launch began."""

    @wraps(original)
    def patch_lang(fn: Any) -> Any:
        langs = {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}
        if langs and langs <= patched:
            return scope_type()  # nothing changed, nothing to restore
        scope = original(fn)
        patched.update(langs)
        return scope

    def launch_call(call: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(call)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            patched.clear()
            try:
                return call(self, *args, **kwargs)
            finally:
                patched.clear()
        return run

    patch_lang._speccheck_once_per_launch = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang
    launch.__call__ = launch_call(launch.__call__)
