"""Resolve the capability matrix against a runtime configuration.

Two questions, two functions:

- :func:`resolve_backend` / :func:`resolve_matrix`: may *this backend* run fused multi-step
  draft decoding under *this config*, and why (not)? Used to derive each builder's
  ``supports_draft_decode_metadata_update`` and for reports.
- :func:`decide_fused_multi_step`: given the attention groups of a model (backend name and
  whether its builder supports the refresh), does the speculator fuse the draft loop?
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from speccheck.contract.adapter_status import AdapterStatus, adapter_status

from speccheck.contract.conditions import evaluate_condition, explain_unmet, parse_condition
from speccheck.contract.constraints import constraint_failures, platform_failures
from speccheck.contract.matrix_model import (
    BackendEntry,
    CudaGraphSupport,
    Matrix,
    RefreshStrategy,
)
from speccheck.contract.runtime_config import RuntimeConfig

logger = logging.getLogger(__name__)


class FusedVerdict(enum.Enum):
    """May a backend run fused multi-step draft decoding under a config?"""

    YES = "yes"
    NO = "no"
    DECLARED_UNVERIFIED = "declared, unverified"
    """The declaration allows it, but no adapter stands behind the entry (none shipped, or
    its module is not found), so nothing has ever verified the claim."""


@dataclass(frozen=True)
class BackendResolution:
    """The verdict for one backend under one runtime config.

    ``verdict`` is ``yes`` only if every check passed and an adapter stands behind the
    entry; ``failures`` lists each failed check in words with the actual values (e.g.
    "requires dcp_world_size == 1, but dcp_world_size is 2"), and ``reason`` joins them
    (or says why fusing is allowed, or why the claim is unverified). ``refresh_strategy``
    is the declared strategy whatever the verdict.
    """

    name: str
    verdict: FusedVerdict
    refresh_strategy: RefreshStrategy
    reason: str
    failures: tuple[str, ...] = ()
    cudagraph_support: CudaGraphSupport | None = None
    implementation: str | None = None
    adapter: AdapterStatus = AdapterStatus.FOUND

    @property
    def fused_multi_step(self) -> bool:
        """Whether the fused path may run: the verdict is ``yes``."""
        return self.verdict is FusedVerdict.YES

    def to_json(self) -> dict[str, Any]:
        """JSON-ready fields, enums by value, plus ``fused_multi_step``."""
        return {
            "name": self.name,
            "fused_multi_step": self.fused_multi_step,
            "verdict": self.verdict.value,
            "refresh_strategy": self.refresh_strategy.value,
            "reason": self.reason,
            "failures": list(self.failures),
            "cudagraph_support": (
                self.cudagraph_support.value if self.cudagraph_support is not None else None
            ),
            "implementation": self.implementation,
            "adapter": self.adapter.value,
        }


@dataclass(frozen=True)
class FusedDecision:
    """Whether the speculator runs the draft loop fused, why, and which attention
    backends (sorted, unique) forced the per-step fallback."""

    enabled: bool
    reason: str
    blocking_backends: tuple[str, ...] = ()


def backend_failures(entry: BackendEntry, config: RuntimeConfig) -> tuple[str, ...]:
    """Every reason why ``entry`` cannot run fused multi-step draft decode under
    ``config``, in check order: platform, compute capability, constraints, CUDA-graph
    support, then the draft-decode declaration. Empty when fusing is allowed."""
    failures = [*platform_failures(entry, config), *constraint_failures(entry, config)]
    if config.cudagraph_mode == "full" and entry.cudagraph_support is CudaGraphSupport.NEVER:
        failures.append(
            "requires CUDA-graph support for cudagraph_mode 'full', but cudagraph_support is "
            "'never'"
        )
    draft = entry.draft_decode
    if draft.supported is False:
        failures.append(f"draft_decode.supported is false: {draft.reason}")
    elif isinstance(draft.supported, str):
        condition = parse_condition(draft.supported)
        if not evaluate_condition(condition, config):
            failures.append(f"{explain_unmet(condition, config)} ({draft.reason})")
    return tuple(failures)


def resolve_backend(
    entry: BackendEntry, config: RuntimeConfig, adapter: AdapterStatus | None = None
) -> BackendResolution:
    """Resolve one matrix entry against ``config`` (see :class:`BackendResolution`).

    The verdict is ``no`` if the platform does not match, the compute capability is too
    low, a constraint fails, a full CUDA graph is requested from a backend that supports
    none, or the draft-decode declaration is false for ``config``; else ``declared,
    unverified`` when no adapter stands behind the entry (``adapter``, looked up when not
    given); else ``yes``.
    """
    adapter = adapter_status(entry) if adapter is None else adapter
    failures = backend_failures(entry, config)
    strategy = entry.draft_decode.refresh_strategy
    verdict = FusedVerdict.YES
    if failures:
        verdict, reason = FusedVerdict.NO, "; ".join(failures)
    elif adapter is not AdapterStatus.FOUND:
        what = {AdapterStatus.NOT_SHIPPED: "no adapter is shipped (implementation: null)",
                AdapterStatus.NOT_FOUND:
                    f"its implementation module ({entry.implementation}) is not found",
                AdapterStatus.CLASS_NOT_FOUND:
                    f"its implementation class ({entry.implementation}) is not found"}[adapter]
        verdict = FusedVerdict.DECLARED_UNVERIFIED
        reason = f"declared fused-capable, but {what}: nothing has verified the claim"
    elif isinstance(entry.draft_decode.supported, str):
        reason = f"{entry.draft_decode.supported} holds; refresh strategy {strategy.value}"
    else:
        reason = f"draft_decode.supported is true; refresh strategy {strategy.value}"
    return BackendResolution(
        name=entry.name,
        verdict=verdict,
        refresh_strategy=strategy,
        reason=reason,
        failures=failures,
        cudagraph_support=entry.cudagraph_support,
        implementation=entry.implementation,
        adapter=adapter,
    )


def resolve_matrix(matrix: Matrix, config: RuntimeConfig) -> list[BackendResolution]:
    """:func:`resolve_backend` for every entry, in file order."""
    return [resolve_backend(entry, config) for entry in matrix.backends]


def decide_fused_multi_step(
    config: RuntimeConfig, group_backends: Sequence[tuple[str, bool]]
) -> FusedDecision:
    """Decide whether the speculator fuses the draft loop.

    ``group_backends`` holds, per attention group of the model, its backend name and
    whether that group supports draft-decode metadata update. Rules, in order:

    1. ``num_speculative_steps == 1``: off (a single step has nothing to fuse);
    2. ``advance_draft_positions`` is false: on (no step-dependent metadata changes);
    3. otherwise on exactly when every group supports the update (vacuously true for no
       groups); when off, the reason and ``blocking_backends`` name the sorted unique
       backends that forced the fallback.
    """
    if config.num_speculative_steps == 1:
        return FusedDecision(
            False,
            "Fused multi-step draft decode is off: num_speculative_steps is 1, so there is "
            "only one draft step.",
        )
    if not config.advance_draft_positions:
        return FusedDecision(
            True,
            "Fused multi-step draft decode is on: the drafter does not advance draft "
            "positions, so attention metadata does not change between draft steps.",
        )
    blocking = tuple(sorted({name for name, supported in group_backends if not supported}))
    if blocking:
        decision = FusedDecision(
            False,
            "Fused multi-step draft decode is not supported by attention backend(s) "
            f"{', '.join(blocking)}; falling back to rebuilding attention metadata between "
            "draft steps.",
            blocking,
        )
        logger.debug("%s", decision.reason)
        return decision
    names = ", ".join(sorted({name for name, _ in group_backends})) or "none"
    return FusedDecision(
        True,
        "Fused multi-step draft decode is on: every attention group supports draft-decode "
        f"metadata update (backends: {names}).",
    )


def graph_capture_shortfall(
    supports: Mapping[str, CudaGraphSupport], tokens_per_req: int
) -> str | None:
    """Why backends with these ``cudagraph_support`` levels (by name) cannot be captured for
    uniform batches of ``tokens_per_req`` query tokens per request, or None when all can."""
    needed = CudaGraphSupport.needed_for(tokens_per_req)
    short = [name for name, support in supports.items() if support < needed]
    if not short:
        return None
    return (f"{', '.join(short)} cannot capture batches of {tokens_per_req} query tokens per "
            f"request (cudagraph_support below {needed.value})")
