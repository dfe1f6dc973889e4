"""Declared refreshed fields whose value reaches no output (``latent_fields``).

On the first clean examples (every check passed so far) whose eager fused candidate
refreshes between draft steps, each field a matrix entry lists in
``draft_decode.refreshed_fields`` is made stale right after every refresh of that candidate
(:class:`StaleAfterRefresh`): it gets back the value it held a step earlier, as a refresh
that forgot it would leave it. The run is then compared with an unperturbed run of the same
candidate from the same start state. A field whose stale value changes no draft token and no
logit is *latent*: no output of this backend depends on it, so no output comparison can
catch a wrong value in it, and only its meaning (:mod:`~speccheck.checks.verify.field_meanings`)
does. That is a finding to read, not a failure: a consumer that trusts the field later would
see the error. A field no refresh changed on an example is probed again on the next one (up
to :data:`PROBE_EXAMPLES`).

The stale values are ones the field held a step earlier, never invented ones: on a GPU a value
that addresses memory out of bounds faults the device and ends the process (a field plus one
did, for a correct builder's tile schedule). The probe runs unguarded, so it never runs on an
example whose candidates already failed: a builder whose refresh left a poisoned schedule
would fault the device there before its failure could be reported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from speccheck.checks.verify.comparisons import Outcome
from speccheck.checks.verify.step_recorder import metadata_path
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


@dataclass
class StaleAfterRefresh:
    """A refresh hook: the group's own refresh, then field ``path`` of the metadata of
    group ``backend`` put back, in place, to the value it held a step earlier (after the
    previous refresh, or before the first): what a refresh that forgot the field leaves, and
    for a field that views an input the speculator advanced before the refresh, the input
    a step behind. ``changed``: whether some step's value differed from the step before."""

    backend: str
    path: str
    found: bool = False
    """Whether the field was found as a tensor of the refreshed metadata."""
    changed: bool = False
    previous: torch.Tensor | None = None
    """The field's value after the last refresh, before it was made stale."""

    def __call__(self, group: AttentionGroup, metadata: Any) -> None:
        tensor = _resolve(metadata, self.path) if group.backend_name == self.backend else None
        stale = None if tensor is None else (
            tensor.clone() if self.previous is None else self.previous)
        refresh_directly(group, metadata)
        if tensor is None or stale is None:
            return
        self.found = True
        self.previous = tensor.clone()
        if not torch.equal(stale, tensor):
            tensor.copy_(stale)
            self.changed = True


def _outputs_differ(a: DraftResult, b: DraftResult, tol: float) -> bool:
    return (not torch.equal(a.draft_tokens, b.draft_tokens)
            or not torch.allclose(a.logits, b.logits, atol=tol, rtol=0.0))


PROBE_EXAMPLES = 3
"""How many examples may probe a field that no refresh changed on the ones before."""


@dataclass
class LatentFields:
    """The per-run probe; :attr:`latent` lists ``backend.metadata.field`` of every latent
    field found. A field is probed until some refresh changed it on a probed example, or
    :data:`PROBE_EXAMPLES` examples have tried."""

    latent: list[str] = field(default_factory=list)
    settled: set[str] = field(default_factory=set)
    """Fields with a verdict (latent, reaching the outputs, making the run raise, or not a
    tensor)."""
    tries: int = 0

    def probe(
        self, spec: AutoregressiveSpeculator, matrix: Matrix, batch: DraftBatch, k: int,
        restore_start: Callable[[], None], tol: float,
    ) -> list[Outcome]:
        """Probe each declared refreshed field of ``spec``'s groups still without a verdict
        on ``batch`` (``k`` draft steps; ``restore_start`` puts the example's start state
        back before each run), unless the probe's examples are spent or this example
        cannot show it (fewer than three draft steps: no refresh between steps). The
        caller runs it only on an example whose checks all passed. One outcome per field
        settled here; on the last try, a skip for each field no refresh changed."""
        if self.tries >= PROBE_EXAMPLES or k < 3:
            return []
        fields = [(group.backend_name, name) for group in spec.groups
                  for name in matrix.backend(group.backend_name).draft_decode.refreshed_fields
                  if metadata_path(group.backend_name, name) not in self.settled]
        if not fields:
            return []
        self.tries += 1
        observers = spec.step_observer, spec.first_pass_observer
        spec.step_observer = spec.first_pass_observer = None
        try:
            restore_start()
            baseline = spec.propose(batch, DecodePath.FUSED, use_graphs=False)
            outcomes = [self._probe(spec, batch, backend, name, baseline, restore_start, tol)
                        for backend, name in fields]
        finally:
            spec.step_observer, spec.first_pass_observer = observers
            spec.refresh_hook = None
        return [outcome for outcome in outcomes if outcome is not None]

    def _probe(
        self, spec: AutoregressiveSpeculator, batch: DraftBatch, backend: str, name: str,
        baseline: DraftResult, restore_start: Callable[[], None], tol: float,
    ) -> Outcome | None:
        path = metadata_path(backend, name)
        hook = StaleAfterRefresh(backend, name)
        restore_start()
        spec.refresh_hook = hook
        try:
            result = spec.propose(batch, DecodePath.FUSED, use_graphs=False)
        except Exception as error:  # noqa: BLE001 - a run the stale value breaks sees it
            logger.info("a stale %s made the eager fused run raise: %s", path, error)
            return self._settle(path, f"a stale {path} makes the run raise")
        finally:
            spec.refresh_hook = None
        if not hook.found:
            return self._settle(path, f"{path} is not a tensor of the refreshed metadata",
                                Result.SKIPPED)
        if not hook.changed:
            if self.tries < PROBE_EXAMPLES:
                return None
            return Outcome(Check.LATENT_FIELDS, Result.SKIPPED,
                           f"no refresh changed {path} on the {PROBE_EXAMPLES} probed "
                           "examples: nothing stale to try", field=path)
        if _outputs_differ(baseline, result, tol):
            return self._settle(path, f"{path} reaches the outputs")
        self.latent.append(path)
        return self._settle(path, f"{path} is latent: left stale after every refresh, it "
                            "changes no draft token and no logit (field_meanings checks its "
                            "value)")

    def _settle(self, path: str, detail: str, result: Result = Result.PASSED) -> Outcome:
        self.settled.add(path)
        return Outcome(Check.LATENT_FIELDS, result, detail, field=path)
