"""Each eagerly run step's metadata checked before the step's kernels run.

The checks of a run's metadata (``field_meanings``, ``step_metadata``) read the snapshots
the :class:`~speccheck.checks.verify.step_recorder.StepMetadataRecorder` took, after the run.
A builder whose metadata is wrong enough often never gets there: the step's attention reads
a block table row, a slot or a length it should not, and the run ends in an index error on
the CPU or an illegal memory access on a GPU, which takes the worker's CUDA context with
it. The report then says "crashed" where the cause was a field the verifier knows.

A :class:`StepGuard` is the speculator's step observer: it records each step as the recorder
does and, for a run armed with :meth:`StepGuard.arm`, checks the step right away, on the
host, before the speculator runs the step's forward: for a candidate, every field and host
value against the oracle's same step first (a stale field is named as stale), then every
declared field against its meaning for the batch. Only steps observed outside a capture are
checked (a captured body runs no Python at replay; its steps are checked after the run as
before); an eager run pays one host read-back per step. What a failure does depends on the
device:

- on a GPU the run stops there (:class:`StepCheckFailed`): a kernel launched with metadata
  known to be wrong may fault, and an illegal memory access takes the worker's CUDA context
  with it, so the run's outputs are not compared;
- on the CPU the run goes on, so its outputs are compared and the after-run checks report
  the failure with its consequences as before; only where the run then raises is the
  exception replaced by :class:`StepCheckFailed` with the first failure, which names the
  field instead of a crash.

Under DCP every rank runs the same steps in lockstep and the attention all-gathers across
ranks, so on a GPU one rank may not stop alone: the ranks agree at each checked step (one
all-reduce) and all stop when any failed; a rank that did not fail stops with no outcome.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from speccheck.checks.verify.comparisons import Outcome, compare_step
from speccheck.checks.verify.field_meanings import DeclaredMeanings
from speccheck.checks.verify.step_recorder import StepMetadataRecorder, StepSnapshots, capturing
from speccheck.speculator.batch import DraftBatch


class StepCheckFailed(Exception):
    """An armed run ended at a step that failed its check: on a GPU before the step ran, on
    the CPU when the run then raised (the outcome says what was raised). ``outcome`` is that
    failure, ``None`` on a DCP rank stopped because another rank's step failed."""

    def __init__(self, outcome: Outcome | None) -> None:
        super().__init__(outcome.diagnosis if outcome is not None else "another rank failed")
        self.outcome = outcome

    @property
    def outcomes(self) -> list[Outcome]:
        """The failure to report (none on a rank stopped for another's)."""
        return [] if self.outcome is None else [self.outcome]


@dataclass(frozen=True)
class GuardedRun:
    """What the steps of one run are checked against."""

    batch: DraftBatch
    name: str
    """The run's name in outcomes (``oracle`` or a candidate's)."""
    meanings: DeclaredMeanings
    oracle: StepSnapshots | None = None
    """The oracle's steps, for a candidate (``None``: the oracle's own run)."""
    metadata_only: bool = False
    """As :func:`~speccheck.checks.verify.comparisons.compare_steps`' (a host_preplanned
    candidate)."""


class StepGuard:
    """The step observer of one speculator: records every step into ``recorder`` and checks
    the eagerly observed steps of an armed run (see the module docstring): ``stop`` at the
    first failure (a GPU) or keep it for an exception that follows (the CPU). ``agree``,
    under DCP with ``stop``, tells whether any rank's step failed (called at every checked
    step, by every rank)."""

    def __init__(
        self, recorder: StepMetadataRecorder, *, stop: bool,
        agree: Callable[[bool], bool] | None = None,
    ) -> None:
        self.recorder = recorder
        self.stop = stop
        self.agree = agree if stop else None
        self._run: GuardedRun | None = None
        self._failed: Outcome | None = None

    @contextmanager
    def arm(self, run: GuardedRun) -> Iterator[None]:
        """Check the steps observed within the block against ``run``; an exception raised
        in the block after a step failed its check becomes :class:`StepCheckFailed` with
        that failure."""
        self._run, self._failed = run, None
        try:
            yield
        except StepCheckFailed:
            raise
        except Exception as exc:
            failed = self._failed
            if failed is None:
                raise
            raised = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            outcome = dataclasses.replace(
                failed, diagnosis=f"{failed.diagnosis}; the run then raised {raised}")
            raise StepCheckFailed(outcome) from exc
        finally:
            self._run, self._failed = None, None

    def __call__(
        self, lanes: int, step: int, group_metadata: Sequence[Any],
        launched_with: Sequence[Any] | None = None,
    ) -> None:
        self.recorder(lanes, step, group_metadata, launched_with)
        run = self._run
        if run is None or capturing() or (self._failed is not None and not self.stop):
            return
        failed = self._check(run, step)
        if self.agree is not None:
            if self.agree(failed is not None):
                raise StepCheckFailed(failed)
        elif failed is not None:
            if self.stop:
                raise StepCheckFailed(failed)
            self._failed = failed

    def _check(self, run: GuardedRun, step: int) -> Outcome | None:
        """The first failure of the step the recorder just recorded, or ``None``."""
        tensors, host = self.recorder.latest()
        if run.oracle is not None and step in run.oracle:
            failed = compare_step(run.oracle, step, tensors, host, run.name,
                                  metadata_only=run.metadata_only)
            if failed is not None:
                return failed
        return run.meanings.check_step(run.batch, step, tensors, run.name)
