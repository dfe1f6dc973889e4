"""The vocabulary the autoregressive speculator's parts share: its decode paths, the
callbacks a verifier installs, and the keys of its CUDA graphs."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

from speccheck.contract.groups import AttentionGroup


class DecodePath(enum.StrEnum):
    """How :meth:`~speccheck.speculator.autoregressive.AutoregressiveSpeculator.propose`
    runs the K - 1 decode steps."""

    AUTO = "auto"
    """The path the matrix allows: :attr:`~speccheck.speculator.autoregressive.
    AutoregressiveSpeculator.auto_path`."""
    FUSED = "fused"
    """Build once, refresh in-graph between steps; one replay in FULL mode."""
    PER_STEP = "per_step"
    """Rebuild metadata on the host before every step (the verifier's oracle)."""
    HOST_PREPLANNED = "host_preplanned"
    """The matrix's ``host_preplanned`` strategy: plan every step on the host first, then
    one body."""


RefreshHook = Callable[[AttentionGroup, Any], None]
"""Stands in for ``group.update_draft_decode_metadata(metadata)`` and must call it; the
verifier wraps the call in capture-safety probes."""
StepObserver = Callable[[int, int, Sequence[Any], Sequence[Any] | None], None]
"""Called with (decode lanes, draft step, metadata of every group, the metadata whose host
values the step's launches use when that is another object) right before that step's
forward. The last is the single-step graph's captured metadata before a per-step replay
(the replay re-issues launches recorded with the capture's host values), else ``None``.
In the fused body it runs inside the captured graph, so it may only emit capture-safe
in-place GPU work (the verifier copies metadata into snapshot buffers there)."""

GraphKey = tuple[str, int] | tuple[str, int, int]
"""A captured graph's key: what it runs, its bucket and, for a first pass, its width."""
SINGLE_STEP = "step"
"""Graph key prefix of one decode step: ``(SINGLE_STEP, bucket)``; the fused and
host_preplanned bodies are keyed by their :class:`DecodePath`."""
FIRST_PASS = "first_pass"
"""Graph key prefix of the padded first pass: ``(FIRST_PASS, bucket, query_len)``."""
FUSED_PROPOSE = "fused_propose"
"""Graph key prefix of a whole fused propose, the padded first pass and every decode step:
``(FUSED_PROPOSE, bucket, query_len)`` (only where :attr:`~speccheck.speculator.
autoregressive.AutoregressiveSpeculator.refresh_rebuilds_in_graph`)."""
