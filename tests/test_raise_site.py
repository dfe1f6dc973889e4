"""Where a report says an error was raised: the innermost frame of its deepest cause, and
the caller's line where that frame lies in a library."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from speccheck.checks.verify.raise_site import TRITON_FRONT_END, raised_at
from speccheck.checks.verify.one_line import RaisedError

THIS_FILE = Path(__file__).name


def _raise_here() -> None:
    raise ValueError("own")


def test_an_error_of_the_code_under_verification_names_its_line() -> None:
    with pytest.raises(ValueError) as caught:
        _raise_here()
    site = raised_at(caught.value)
    line = _raise_here.__code__.co_firstlineno + 1
    assert site.startswith("at ") and site.endswith(f"{THIS_FILE}:{line}"), site
    assert ", from " not in site


def test_an_error_inside_a_library_names_the_caller_too() -> None:
    with pytest.raises(RuntimeError) as caught:
        torch.split(torch.zeros(2), [5])
    site = raised_at(caught.value)
    assert site.startswith("at torch/") and f", from " in site and THIS_FILE in site, site
    assert RaisedError.of(caught.value).summary.endswith(f"({site})")


def test_an_error_without_a_traceback_has_no_site() -> None:
    assert raised_at(ValueError("never raised")) == ""
    assert RaisedError.of(ValueError("never raised")).summary == "builtins.ValueError: never raised"


def test_triton_front_end_errors_are_told_from_a_kernels_own_lines(tmp_path: Path) -> None:
    """Under the interpreter every error of a kernel's body is re-raised as an
    ``InterpreterError``: the site follows the cause into Triton's language front end (a
    kernel that would not compile) and names the kernel's line it came from."""
    script = tmp_path / "kernel.py"
    script.write_text(textwrap.dedent("""
        import torch, triton, triton.language as tl
        from speccheck.checks.verify.one_line import RaisedError

        @triton.jit
        def kernel(out, N: tl.constexpr):
            offsets = tl.arange(0, N)
            tl.store(out + offsets, offsets)

        try:
            kernel[(1,)](torch.zeros(4, dtype=torch.int32), 3)
        except Exception as error:
            print(RaisedError.of(error).summary)
    """))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert "InterpreterError" in summary and f"(at {TRITON_FRONT_END}" in summary, summary
    assert summary.endswith("kernel.py:7)"), summary
