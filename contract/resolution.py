"""Resolve the capability matrix against a runtime configuration.

Two questions, two functions:

- :func:`resolve_backend` / :func:`resolve_matrix`: may *this backend* run fused multi-step
  draft decoding under *this config*, and why (not)? Used to derive each builder's
  ``supports_draft_decode_metadata_update`` and for reports.
- :func:`decide_fused_multi_step`: given the attention groups of a model (backend name and
  whether its builder supports the refresh), does the speculator fuse the draft loop?
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from speccheck.contract.conditions import evaluate_condition, explain_unmet, parse_condition
from speccheck.contract.matrix_model import (
    BackendEntry,
    CudaGraphSupport,
    Matrix,
    MultipleOf,
)
from speccheck.contract.runtime_config import RuntimeConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendResolution:
    """The verdict for one backend under one runtime config.

    ``fused_multi_step`` is true only if every check passed; ``failures`` lists each failed
    check in words with the actual values (e.g. "requires dcp_world_size == 1, but
    dcp_world_size is 2"), and ``reason`` joins them (or says why fusing is allowed).
    ``refresh_strategy`` is the declared strategy (``in_graph``, ``none_needed`` or
    ``host_preplanned``) whatever the verdict.
    """

    name: str
    fused_multi_step: bool
    refresh_strategy: str
    reason: str
    failures: tuple[str, ...] = ()
    cudagraph_support: str | None = None
    implementation: str | None = None


@dataclass(frozen=True)
class FusedDecision:
    """Whether the speculator runs the draft loop fused, why, and which attention
    backends (sorted, unique) forced the per-step fallback."""

    enabled: bool
    reason: str
    blocking_backends: tuple[str, ...] = ()


def describe_sizes(spec: tuple[int, ...] | MultipleOf) -> str:
    """A size restriction in words: "16, 32" or "a multiple of 64 (at most 256)"."""
    if isinstance(spec, MultipleOf):
        cap = f" (at most {spec.max})" if spec.max is not None else ""
        return f"a multiple of {spec.multiple_of}{cap}"
    return ", ".join(str(size) for size in spec)


def sizes_allow(spec: tuple[int, ...] | MultipleOf, size: int) -> bool:
    """Whether ``size`` satisfies the restriction ``spec``."""
    if isinstance(spec, MultipleOf):
        within = spec.max is None or size <= spec.max
        return size >= 1 and size % spec.multiple_of == 0 and within
    return size in spec


def backend_failures(entry: BackendEntry, config: RuntimeConfig) -> tuple[str, ...]:
    """Every reason why ``entry`` cannot run fused multi-step draft decode under
    ``config``, in check order: platform, compute capability, constraints, CUDA-graph
    support, then the draft-decode declaration. Empty when fusing is allowed."""
    failures: list[str] = []
    if config.platform not in entry.platforms:
        failures.append(
            f"requires platform in {list(entry.platforms)!r}, but platform is "
            f"{config.platform!r}"
        )
    minimum = entry.min_compute_capability
    if minimum is not None and config.platform == "cuda" and config.compute_capability < minimum:
        failures.append(
            f"requires compute_capability >= {minimum}, but compute_capability is "
            f"{config.compute_capability}"
        )
    failures.extend(_constraint_failures(entry, config))
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


def _constraint_failures(entry: BackendEntry, config: RuntimeConfig) -> list[str]:
    constraints = entry.constraints
    failures: list[str] = []
    for field, allowed in (
        ("dtype", constraints.dtypes),
        ("kv_cache_dtype", constraints.kv_cache_dtypes),
    ):
        value = getattr(config, field)
        if allowed is not None and value not in allowed:
            failures.append(f"requires {field} in {list(allowed)!r}, but {field} is {value!r}")
    sized = (("head_size", constraints.head_sizes), ("block_size", constraints.block_sizes))
    for field, spec in sized:
        value = getattr(config, field)
        if spec is not None and not sizes_allow(spec, value):
            if isinstance(spec, MultipleOf):
                wanted = f"to be {describe_sizes(spec)}"
            else:
                wanted = f"in {list(spec)}"
            failures.append(f"requires {field} {wanted}, but {field} is {value}")
    for constraint in constraints.conditions:
        condition = parse_condition(constraint.condition)
        if not evaluate_condition(condition, config):
            failures.append(f"{explain_unmet(condition, config)} ({constraint.reason})")
    return failures


def resolve_backend(entry: BackendEntry, config: RuntimeConfig) -> BackendResolution:
    """Resolve one matrix entry against ``config`` (see :class:`BackendResolution`).

    Fused is false if the platform does not match, the compute capability is too low, a
    constraint fails, a full CUDA graph is requested from a backend that supports none, or
    the draft-decode declaration is false for ``config``.
    """
    failures = backend_failures(entry, config)
    strategy = entry.draft_decode.refresh_strategy.value
    if failures:
        reason = "; ".join(failures)
    elif isinstance(entry.draft_decode.supported, str):
        reason = f"{entry.draft_decode.supported} holds; refresh strategy {strategy}"
    else:
        reason = f"draft_decode.supported is true; refresh strategy {strategy}"
    return BackendResolution(
        name=entry.name,
        fused_multi_step=not failures,
        refresh_strategy=strategy,
        reason=reason,
        failures=failures,
        cudagraph_support=entry.cudagraph_support.value,
        implementation=entry.implementation,
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
