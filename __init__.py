"""speccheck: declare, gate and verify fused multi-step draft decoding of attention backends.

Layers, with dependencies pointing one way: ``contract`` <- ``backends`` <- ``speculator``
<- ``checks``. ``matrix.yaml`` (shipped inside the package) is the single source of truth
for what each backend may do; installed packages add backends to it through the
``speccheck.backends`` entry-point group (:mod:`speccheck.contract.plugins`).

The public API (``docs/api.md``) is re-exported here and loaded on first use, so
``import speccheck`` stays fast and imports no torch:

- :func:`verify` -> :class:`VerifyReport` (``speccheck verify`` as a function, given a
  :class:`VerifyRun` or its fields), with :func:`plan_verification`, :class:`VerifyPlan`,
  :class:`CheckVerdict`,
  :class:`VerifyInputError`, and the report's :class:`BackendReport`, :class:`Check`,
  :class:`Status` and :class:`Tier`;
- :func:`load_matrix` (the shipped matrix and the installed plug-ins, or one file),
  :func:`resolve` (a matrix against a :class:`RuntimeConfig`, one
  :class:`BackendResolution` per backend), :class:`Matrix`, :class:`MatrixError`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from speccheck.checks.api import (
        CheckVerdict,
        VerifyInputError,
        VerifyPlan,
        VerifyReport,
        plan_verification,
        verify,
    )
    from speccheck.checks.verify.report import BackendReport
    from speccheck.checks.verify.run import VerifyRun
    from speccheck.checks.verify.vocabulary import Check, Status, Tier
    from speccheck.contract.matrix_loader import MatrixError
    from speccheck.contract.matrix_model import Matrix
    from speccheck.contract.plugins import load_matrix_with_plugins as load_matrix
    from speccheck.contract.resolution import BackendResolution
    from speccheck.contract.resolution import resolve_matrix as resolve
    from speccheck.contract.runtime_config import RuntimeConfig

_EXPORTS: dict[str, tuple[str, str]] = {
    "verify": ("speccheck.checks.api", "verify"),
    "plan_verification": ("speccheck.checks.api", "plan_verification"),
    "VerifyPlan": ("speccheck.checks.api", "VerifyPlan"),
    "VerifyRun": ("speccheck.checks.verify.run", "VerifyRun"),
    "VerifyReport": ("speccheck.checks.api", "VerifyReport"),
    "CheckVerdict": ("speccheck.checks.api", "CheckVerdict"),
    "VerifyInputError": ("speccheck.checks.api", "VerifyInputError"),
    "BackendReport": ("speccheck.checks.verify.report", "BackendReport"),
    "Check": ("speccheck.checks.verify.vocabulary", "Check"),
    "Status": ("speccheck.checks.verify.vocabulary", "Status"),
    "Tier": ("speccheck.checks.verify.vocabulary", "Tier"),
    "load_matrix": ("speccheck.contract.plugins", "load_matrix_with_plugins"),
    "resolve": ("speccheck.contract.resolution", "resolve_matrix"),
    "BackendResolution": ("speccheck.contract.resolution", "BackendResolution"),
    "Matrix": ("speccheck.contract.matrix_model", "Matrix"),
    "MatrixError": ("speccheck.contract.matrix_loader", "MatrixError"),
    "RuntimeConfig": ("speccheck.contract.runtime_config", "RuntimeConfig"),
}
"""Public name -> (module, attribute), imported on first access."""

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    """Import a public name on first use (PEP 562) and keep it."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'speccheck' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
