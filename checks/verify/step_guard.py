"""Each eagerly run step's metadata checked: on a GPU before the step's kernels run, on the
CPU once a run raised.

The checks of a run's metadata (``field_meanings``, ``step_metadata``) read the snapshots
the :class:`~speccheck.checks.verify.step_recorder.StepMetadataRecorder` took, after the run.
A builder whose metadata is wrong enough often never gets there: the step's attention reads
a block table row, a slot or a length it should not, and the run ends in an index error on
the CPU or an illegal memory access on a GPU, which takes the worker's CUDA context with
it. The report then says "crashed" where the cause was a field the verifier knows.

A :class:`StepGuard` is the speculator's step observer: it records each step as the recorder
does and checks the eagerly observed steps of a run armed with :meth:`StepGuard.arm`: for a
candidate, every field and host value against the oracle's same step first (a stale field is
named as stale), then every declared field against its meaning for the batch. Steps inside
a replayed graph run no Python; they are checked after the run, as every step also is. When
the checks run depends on the device:

- on a GPU, each step as it is recorded, before its forward (one host read-back per step),
  and the run stops at the first failure (:class:`StepCheckFailed`): a kernel launched with
  metadata known to be wrong may fault, and an illegal memory access takes the worker's
  CUDA context with it, so the run's outputs are not compared;
- on the CPU, only if the run raises: the steps it recorded are checked then, and the
  exception becomes :class:`StepCheckFailed` with the first failure, which names the field
  instead of a crash. A run that does not raise pays nothing, and its outputs are compared
  and its failures reported with their consequences by the after-run checks, the eager
  first pass's comparison with the oracle's included
  (:func:`~speccheck.checks.verify.comparisons.first_pass_metadata`).

Under DCP every rank runs the same steps in lockstep and the attention all-gathers across
ranks, so on a GPU one rank may not stop alone: the ranks agree at each checked step (one
all-reduce) and all stop when any failed; a rank that did not fail stops with no outcome.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from speccheck.checks.verify.comparisons import Outcome, compare_first_pass, compare_step
from speccheck.checks.verify.field_meanings import DeclaredMeanings
from speccheck.checks.verify.one_line import exception_line
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
    oracle_first_pass: StepSnapshots | None = None
    """The oracle's padded first pass (step 0), for a candidate whose first pass is padded
    too: a candidate that rebuilds its metadata in place (``refresh_rebuilds``) runs the
    pass on metadata built before its inputs existed, then refreshed, and a refresh that
    leaves a field of that build (or the verifier's poison in it) would launch the pass's
    kernels on it. Compared by
    :func:`~speccheck.checks.verify.comparisons.compare_first_pass`."""


class StepGuard:
    """The step observer of one speculator (or, with ``first_pass``, its first-pass
    observer): records every step into ``recorder`` and checks
    the eagerly observed steps of an armed run (see the module docstring): each as it comes,
    stopping at the first failure, with ``stop`` (a GPU); otherwise (the CPU) only once the
    run raised, over the steps it recorded, so a run that does not raise pays nothing.
    ``agree``, under DCP with ``stop``, tells whether any rank's step failed (called at
    every checked step, by every rank)."""

    def __init__(
        self, recorder: StepMetadataRecorder, *, stop: bool,
        agree: Callable[[bool], bool] | None = None, first_pass: bool = False,
    ) -> None:
        self.recorder = recorder
        self.stop = stop
        self.first_pass = first_pass
        """Whether this guard observes the padded first pass (checked against the run's
        :attr:`GuardedRun.oracle_first_pass`) rather than the decode steps."""
        self.agree = agree if stop else None
        self._run: GuardedRun | None = None
        self._observed: list[tuple[int, int]] = []
        """(lanes, step) of each step the armed run recorded eagerly, in order."""

    @contextmanager
    def arm(self, run: GuardedRun) -> Iterator[None]:
        """Check the steps observed within the block against ``run``; an exception raised
        in the block, where one of the steps recorded before it fails its check, becomes
        :class:`StepCheckFailed` with that failure (the first)."""
        self._run, self._observed = run, []
        try:
            yield
        except StepCheckFailed:
            raise
        except Exception as exc:
            failed = None if self.stop else self._first_failure(run)
            if failed is None:
                raise
            raised = exception_line(exc)[:200]
            outcome = dataclasses.replace(
                failed, diagnosis=f"{failed.diagnosis}; the run then raised {raised}")
            raise StepCheckFailed(outcome) from exc
        finally:
            self._run, self._observed = None, []

    def __call__(
        self, lanes: int, step: int, group_metadata: Sequence[Any],
        launched_with: Sequence[Any] | None = None,
    ) -> None:
        self.recorder(lanes, step, group_metadata, launched_with)
        run = self._run
        if run is None or capturing():
            return
        self._observed.append((lanes, step))
        if not self.stop:
            return
        tensors, host = self.recorder.latest()
        failed = self._check(run, step, tensors, host)
        if self.agree is not None:
            if self.agree(failed is not None):
                raise StepCheckFailed(failed)
        elif failed is not None:
            raise StepCheckFailed(failed)

    def _first_failure(self, run: GuardedRun) -> Outcome | None:
        """The first failure among the steps the armed run recorded, in order."""
        recorded = {lanes: self.recorder.collect(lanes)
                    for lanes in dict.fromkeys(lanes for lanes, _ in self._observed)}
        for lanes, step in self._observed:
            steps = recorded[lanes]
            failed = self._check(run, step, steps[step], steps.host.get(step, {}))
            if failed is not None:
                return failed
        return None

    def _check(
        self, run: GuardedRun, step: int, tensors: Mapping[str, torch.Tensor],
        host: Mapping[str, np.ndarray],
    ) -> Outcome | None:
        """The first failure of ``run``'s step ``step`` (``tensors`` and ``host``: what it
        held), or ``None``."""
        failed = None
        if self.first_pass and run.oracle_first_pass is not None:
            failed = compare_first_pass(run.oracle_first_pass, tensors, host, run.name,
                                        metadata_only=run.metadata_only)
        elif not self.first_pass and run.oracle is not None and step in run.oracle:
            failed = compare_step(run.oracle, step, tensors, host, run.name,
                                  metadata_only=run.metadata_only)
        return failed or run.meanings.check_step(run.batch, step, tensors, run.name)
