"""Does a backend's matrix entry admit a runtime configuration, and if not, why?

``matrix.yaml`` states every requirement a backend has of its configuration as data; this
module is the one place that checks them:

- :func:`platform_failures`: ``platforms`` and ``min_compute_capability``;
- :func:`constraint_failures`: the ``constraints:`` section (activation and KV-cache dtypes,
  head and block sizes, conditions), each failure ending with the matrix's reason;
- :func:`enforce_constraints`: both, raising :class:`ConstraintViolation`;
- :func:`enforce_layer_constraints`: the same for one layer's values, plus its KV-cache
  layout (:func:`layout_failures`) and, for a drafter with non-causal passes, causality
  (:func:`causality_failures`). Whoever constructs a builder calls it first
  (``build_attention_groups``), so builders never re-declare these rules and cannot drift
  from the matrix.

Resolution (:mod:`speccheck.contract.resolution`) reports the same failures when it decides
whether fused draft decode may run, so ``speccheck matrix`` refuses exactly what building
the backend refuses. ``kv_layout`` is a property of the model's layers, not of the runtime
configuration: resolution cannot judge it, and :func:`enforce_layer_constraints` refuses a
layer whose cache layout differs from the one the entry reads
(:func:`layout_failures`). Causality is the drafter's (a DFlash block attends non-causally),
not the configuration's, and is judged the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from speccheck.contract.conditions import evaluate_condition, explain_unmet, parse_condition
from speccheck.contract.matrix_model import BackendEntry, MultipleOf
from speccheck.contract.runtime_config import RuntimeConfig

if TYPE_CHECKING:
    from speccheck.contract.builder import AttentionLayerSpec


class ConstraintViolation(ValueError):
    """A backend was asked to serve a configuration its matrix entry does not admit.

    ``backend`` is the entry's name; ``failures`` lists every unmet requirement in words,
    with the actual values and, where the matrix gives one, its reason in parentheses (the
    same text ``speccheck matrix`` reports).
    """

    def __init__(self, backend: str, failures: tuple[str, ...]) -> None:
        if not failures:
            raise ValueError("a ConstraintViolation needs at least one failure")
        self.backend = backend
        self.failures = failures
        super().__init__(
            f"{backend} backend cannot serve this configuration (matrix.yaml): "
            + "; ".join(failures)
        )


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


def _with_reason(failure: str, reason: str | None) -> str:
    return failure if reason is None else f"{failure} ({reason})"


def platform_failures(entry: BackendEntry, config: RuntimeConfig) -> tuple[str, ...]:
    """Why ``entry`` cannot run on ``config``'s platform: the platform is not listed, or
    (on cuda only) the compute capability is below ``min_compute_capability``. Empty when
    both hold."""
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
    return tuple(failures)


def constraint_failures(entry: BackendEntry, config: RuntimeConfig) -> tuple[str, ...]:
    """Every constraint of ``entry.constraints`` that ``config`` violates, in declaration
    order (dtypes, KV-cache dtypes, head sizes, block sizes, then the conditions), each as
    "requires FIELD ..., but FIELD is VALUE" followed by the matrix's reason in
    parentheses when it gives one. Empty when every constraint holds."""
    constraints = entry.constraints
    failures: list[str] = []
    for name, field, allowed in (
        ("dtypes", "dtype", constraints.dtypes),
        ("kv_cache_dtypes", "kv_cache_dtype", constraints.kv_cache_dtypes),
    ):
        value = getattr(config, field)
        if allowed is not None and value not in allowed:
            failures.append(_with_reason(
                f"requires {field} in {list(allowed)!r}, but {field} is {value!r}",
                constraints.reason_for(name),
            ))
    for name, field, spec in (
        ("head_sizes", "head_size", constraints.head_sizes),
        ("block_sizes", "block_size", constraints.block_sizes),
    ):
        value = getattr(config, field)
        if spec is not None and not sizes_allow(spec, value):
            if isinstance(spec, MultipleOf):
                wanted = f"to be {describe_sizes(spec)}"
            else:
                wanted = f"in {list(spec)}"
            failures.append(_with_reason(
                f"requires {field} {wanted}, but {field} is {value}",
                constraints.reason_for(name),
            ))
    for constraint in constraints.conditions:
        condition = parse_condition(constraint.condition)
        if not evaluate_condition(condition, config):
            failures.append(_with_reason(explain_unmet(condition, config), constraint.reason))
    return tuple(failures)


def enforce_constraints(entry: BackendEntry, config: RuntimeConfig) -> None:
    """Raise :class:`ConstraintViolation` listing every platform, compute-capability and
    ``constraints:`` failure of ``entry`` under ``config``; return when there is none.

    Call it before constructing the entry's builder: it needs neither the kernel package
    nor a device, so a refused configuration is refused the same way on every machine.
    """
    failures = platform_failures(entry, config) + constraint_failures(entry, config)
    if failures:
        raise ConstraintViolation(entry.name, failures)


def layer_config(config: RuntimeConfig, layer: AttentionLayerSpec) -> RuntimeConfig:
    """``config`` with ``layer``'s own dtype, head layout, block size, ``max_model_len``,
    MLA sizes and sliding window: the values a builder constructed for ``layer`` actually
    runs with, which is what :func:`enforce_constraints` must judge. A layer dtype outside
    the matrix's vocabulary (``DtypeName``) raises pydantic's ``ValidationError``, a
    ``ValueError``."""
    return RuntimeConfig.model_validate({
        **config.model_dump(),
        "dtype": str(layer.dtype).removeprefix("torch."),
        "head_size": layer.head_size,
        "num_heads": layer.num_heads,
        "num_kv_heads": layer.num_kv_heads,
        "block_size": layer.block_size,
        "max_model_len": layer.max_model_len,
        "kv_lora_rank": layer.kv_lora_rank,
        "qk_rope_head_dim": layer.qk_rope_head_dim,
        "sliding_window": layer.sliding_window,
    })


def layout_failures(entry: BackendEntry, layer: AttentionLayerSpec) -> tuple[str, ...]:
    """Why ``entry`` cannot read ``layer``'s KV cache: its ``constraints.kv_layout`` is set
    and differs from the layer's (a GQA backend handed a latent MLA cache, or the reverse),
    followed by the matrix's reason. Empty when the entry states no layout or the same."""
    wanted = entry.constraints.kv_layout
    if wanted is None or wanted is layer.kv_layout:
        return ()
    return (_with_reason(
        f"requires kv_layout {wanted.value}, but the layer's KV cache is "
        f"{layer.kv_layout.value}",
        entry.constraints.reason_for("kv_layout"),
    ),)


def causality_failures(entry: BackendEntry, non_causal: bool) -> tuple[str, ...]:
    """Why ``entry`` cannot serve a drafter with non-causal passes (``non_causal``: a DFlash
    drafter's blocks): its ``constraints.causal_only`` is set, followed by the matrix's
    reason. Empty otherwise."""
    if not (non_causal and entry.constraints.causal_only):
        return ()
    return (_with_reason(
        "requires causal attention (causal_only), but the drafter attends non-causally "
        "(a DFlash block)",
        entry.constraints.reason_for("causal_only"),
    ),)


def enforce_layer_constraints(
    entry: BackendEntry, config: RuntimeConfig, layer: AttentionLayerSpec,
    non_causal: bool = False,
) -> None:
    """:func:`enforce_constraints` for a builder of ``layer`` under ``config`` (judged as
    :func:`layer_config`), plus :func:`layout_failures` and, for a drafter with non-causal
    passes (``non_causal``), :func:`causality_failures`: every failure in one
    :class:`ConstraintViolation`. Whoever constructs a builder calls this first."""
    judged = layer_config(config, layer)
    failures = (platform_failures(entry, judged) + constraint_failures(entry, judged)
                + layout_failures(entry, layer) + causality_failures(entry, non_causal))
    if failures:
        raise ConstraintViolation(entry.name, failures)
