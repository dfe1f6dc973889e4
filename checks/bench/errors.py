"""Why a benchmark did not run, or did not hold. ``str()`` of each is one line; the command
maps them to its exit statuses (bad input 2, cannot run here 3, tokens differ 1)."""

from __future__ import annotations


class BenchInputError(ValueError):
    """Settings a benchmark cannot run with (a K that does not fit ``max_model_len``, a
    path the backend does not allow, a config its matrix entry does not admit)."""


class BackendCannotRun(RuntimeError):
    """The backend cannot run on this machine: its platform is not this one, it has no
    adapter, or its kernel package is missing (the message says which and how to fix it)."""


class DraftTokensDiffer(AssertionError):
    """Two decode paths (or two calls of one) drafted different tokens for the same batch;
    the message names the backend, K, batch, both paths and the first differing request."""
