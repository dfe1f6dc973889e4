"""The drafters a speculator runs, by name. Torch-free: the command line parses a drafter
before it imports the engine."""

from __future__ import annotations

import enum


class DrafterKind(enum.StrEnum):
    """A drafter (the value is :func:`~speccheck.speculator.factory.create_speculator`'s
    ``kind`` and ``speccheck verify --drafter``'s argument)."""

    AUTOREGRESSIVE = "autoregressive"
    """One token per request per draft step, causal attention, K steps (fused or per
    step)."""
    DFLASH = "dflash"
    """One pass per request of a block of ``1 + K`` positions attended non-causally."""
