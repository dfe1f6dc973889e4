"""The CI gate: speccheck verifies template_attn, and every check is a test item of its
own (`pytest -v` lists them: run[template_attn], capture[template_attn], ...). Without a
GPU the CPU tier runs; with CUDA, real CUDA graphs."""

import pytest


@pytest.mark.speccheck(backend="template_attn", examples=20)
def test_speccheck() -> None:
    """Collected by speccheck's pytest plugin as one item per check; this body never runs."""
