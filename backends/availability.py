"""Optional kernel packages: importing them lazily, and saying how to install them.

The adapters over third-party kernels (``fa3``, ``flashinfer``) must import on every machine
so that the matrix, the docs and the gate can name their builders. The kernel package itself
is imported only when a builder is constructed or an impl runs, through
:func:`require_module`; when that fails the caller gets a :class:`BackendUnavailable` that
names the distribution and the install command, not a bare ``ImportError`` from deep inside
the package (``fa3_fwd_interface`` on a CPU-only torch, for instance, fails with
``libc10_cuda.so: cannot open shared object file``).
"""

from __future__ import annotations

import importlib
from types import ModuleType


class BackendUnavailable(RuntimeError):
    """The kernel package a backend needs cannot be imported here.

    ``package`` is the distribution to install (``fa3-fwd``), ``hint`` the command and the
    requirements (``pip install 'speccheck[fa3]' (fa3-fwd, CUDA, sm90)``), ``import_name``
    the module that failed and ``reason`` why (the original exception, as text; the
    exception object itself is kept in ``error``).
    """

    def __init__(
        self,
        package: str,
        hint: str,
        *,
        import_name: str | None = None,
        reason: str | None = None,
        error: BaseException | None = None,
    ) -> None:
        self.package = package
        self.hint = hint
        self.import_name = import_name
        self.reason = reason
        self.error = error
        message = f"{package} not installed: {hint}"
        if reason:
            message += f" [{reason}]"
        super().__init__(message)


def require_module(import_name: str, package: str, hint: str) -> ModuleType:
    """Import ``import_name`` or raise :class:`BackendUnavailable` naming ``package`` and
    ``hint``.

    Any exception raised while importing counts as "unavailable": a missing module, a
    shared library that does not load (a CUDA wheel on a CPU-only torch), or a package that
    refuses to initialise without a GPU. The original exception is summarised in the
    message and kept in ``BackendUnavailable.error``; it is not chained, so the error a user
    sees is the install hint rather than a traceback from inside the package.
    """
    try:
        return importlib.import_module(import_name)
    except Exception as exc:  # noqa: BLE001 - every import failure means "unavailable"
        reason = f"import {import_name} failed: {type(exc).__name__}: {exc}"
        unavailable = BackendUnavailable(
            package, hint, import_name=import_name, reason=reason, error=exc
        )
    raise unavailable
