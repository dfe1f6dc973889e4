"""A template speccheck adapter package: one attention backend (``template_attn``), its
matrix fragment (``matrix.yaml``, registered through the ``speccheck.backends`` entry
point) and a CI gate (``tests/test_speccheck_gate.py``).

This module imports nothing: speccheck finds the matrix fragment without running it, and
imports ``speccheck_adapter_template.attention`` (and torch) only to verify or run the
backend.
"""
