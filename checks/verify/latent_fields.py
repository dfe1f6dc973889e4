"""Declared refreshed fields whose value reaches no output (``latent_fields``).

Once per run, on the first example whose eager fused candidate refreshes between draft
steps, each field a matrix entry lists in ``draft_decode.refreshed_fields`` is perturbed
right after every refresh of that candidate (:class:`StaleAfterRefresh`): it gets back the
value it held before the refresh (the previous step's, as a refresh that forgot it would
leave it), or, where the refresh left it unchanged, that value plus one. The run is then
compared with an unperturbed run of the same candidate from the same start state. A field
whose perturbation changes no draft token and no logit is *latent*: no output of this
backend depends on it, so no output comparison can catch a wrong value in it, and only its
meaning (:mod:`~speccheck.checks.verify.field_meanings`) does. That is a finding to read,
not a failure: a consumer that trusts the field later would see the error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from speccheck.checks.verify.comparisons import Outcome
from speccheck.checks.verify.vocabulary import Check, Result
from speccheck.contract.groups import AttentionGroup
from speccheck.contract.matrix_model import Matrix
from speccheck.speculator.autoregressive import AutoregressiveSpeculator, DecodePath
from speccheck.speculator.batch import DraftBatch, DraftResult
from speccheck.speculator.decode_steps import refresh_directly

logger = logging.getLogger(__name__)


def _resolve(metadata: Any, dotted: str) -> torch.Tensor | None:
    """The tensor at ``dotted`` (attribute names) below ``metadata``, or ``None``."""
    value = metadata
    for name in dotted.split("."):
        value = getattr(value, name, None)
    return value if isinstance(value, torch.Tensor) else None


def perturbed(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """A plausible wrong value of a field that a refresh turned from ``before`` into
    ``after``: ``before`` where the refresh changed it, else ``after`` plus one (negated,
    for a boolean field)."""
    if not torch.equal(before, after):
        return before
    if after.dtype == torch.bool:
        return ~after
    return after + 1


@dataclass
class StaleAfterRefresh:
    """A refresh hook: the group's own refresh, then field ``path`` of the metadata of
    group ``backend`` overwritten in place with :func:`perturbed` values. ``applied``:
    whether the field was found and written at least once."""

    backend: str
    path: str
    applied: bool = False

    def __call__(self, group: AttentionGroup, metadata: Any) -> None:
        tensor = _resolve(metadata, self.path) if group.backend_name == self.backend else None
        before = None if tensor is None else tensor.clone()
        refresh_directly(group, metadata)
        if tensor is None or before is None:
            return
        tensor.copy_(perturbed(before, tensor))
        self.applied = True


def _outputs_differ(a: DraftResult, b: DraftResult, tol: float) -> bool:
    return (not torch.equal(a.draft_tokens, b.draft_tokens)
            or not torch.allclose(a.logits, b.logits, atol=tol, rtol=0.0))


@dataclass
class LatentFields:
    """The once-per-run probe; :attr:`latent` lists ``backend.metadata.field`` of every
    latent field found, :attr:`probed` whether the probe has run."""

    probed: bool = False
    latent: list[str] = field(default_factory=list)

    def probe_once(
        self, spec: AutoregressiveSpeculator, matrix: Matrix, batch: DraftBatch, k: int,
        restore_start: Callable[[], None], tol: float,
    ) -> list[Outcome]:
        """Probe every declared refreshed field of ``spec``'s groups on ``batch`` (``k``
        draft steps; ``restore_start`` puts the example's start state back before each
        run), unless the probe has run or this example cannot show it (fewer than three
        draft steps: no refresh between steps); one outcome per field, latent or not."""
        if self.probed or k < 3:
            return []
        self.probed = True
        fields = [(group.backend_name, name) for group in spec.groups
                  for name in matrix.backend(group.backend_name).draft_decode.refreshed_fields]
        if not fields:
            return []
        observers = spec.step_observer, spec.first_pass_observer
        spec.step_observer = spec.first_pass_observer = None
        try:
            restore_start()
            baseline = spec.propose(batch, DecodePath.FUSED, use_graphs=False)
            return [self._probe(spec, batch, backend, name, baseline, restore_start, tol)
                    for backend, name in fields]
        finally:
            spec.step_observer, spec.first_pass_observer = observers
            spec.refresh_hook = None

    def _probe(
        self, spec: AutoregressiveSpeculator, batch: DraftBatch, backend: str, name: str,
        baseline: DraftResult, restore_start: Callable[[], None], tol: float,
    ) -> Outcome:
        path = f"{backend}.metadata.{name}"
        hook = StaleAfterRefresh(backend, name)
        restore_start()
        spec.refresh_hook = hook
        try:
            result = spec.propose(batch, DecodePath.FUSED, use_graphs=False)
        except Exception as error:  # noqa: BLE001 - a run the perturbation breaks sees it
            logger.info("perturbing %s made the eager fused run raise: %s", path, error)
            return Outcome(Check.LATENT_FIELDS, Result.PASSED,
                           f"perturbing {path} makes the run raise", field=path)
        finally:
            spec.refresh_hook = None
        if not hook.applied:
            return Outcome(Check.LATENT_FIELDS, Result.SKIPPED,
                           f"{path} is not a tensor of the refreshed metadata", field=path)
        if _outputs_differ(baseline, result, tol):
            return Outcome(Check.LATENT_FIELDS, Result.PASSED,
                           f"{path} reaches the outputs", field=path)
        self.latent.append(path)
        return Outcome(Check.LATENT_FIELDS, Result.PASSED,
                       f"{path} is latent: perturbed after every refresh, it changes no draft "
                       "token and no logit (field_meanings checks its value)", field=path)

