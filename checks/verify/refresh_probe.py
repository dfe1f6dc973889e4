"""The probed refresh: one :class:`RefreshProbe` per probed candidate run, installed as the
speculator's ``refresh_hook``, traces every in-graph refresh call (host synchronisations,
replaced tensors, exceptions) and hands its outcomes back once, as a value."""

from __future__ import annotations

import traceback
from typing import Any

from speccheck.checks.probes import HostSyncRecorder, IdentityGuard, poison_
from speccheck.checks.verify.comparisons import Outcome
from speccheck.checks.verify.vocabulary import Check, Result
from speccheck.contract.groups import AttentionGroup


REFRESH_POISON_BYTE = 0xC3
"""The byte integer zero-tail buffers are poisoned with before a metadata object's first
refresh: negative in int32 and int64, and not :data:`~speccheck.checks.probes.buffers.
POISON_BYTE`, which every example starts with."""


class RefreshRaised(Exception):
    """The traced refresh raised; the probe recorded it as a ``refresh_error`` outcome."""


class RefreshProbe:
    """The refresh hook of one candidate run (``candidate`` names it in the outcomes).

    Each call runs the group's refresh traced: host synchronisations (``cuda_sync_debug``
    on a GPU) and replaced tensors are findings; an exception is a finding of its own and
    is re-raised as :class:`RefreshRaised`, which ends the candidate.

    With ``poison_before_first_refresh`` (where the matrix says the refresh rebuilds the
    metadata, ``refresh_rebuilds``), the group's zero-tail buffers are poisoned whole before
    the first refresh of each metadata object: the run built it before the call's inputs
    existed, as a replay's was built for capture, and whatever of them the refresh does not
    rewrite (a field only the build writes, a tail) then fails the step's step_metadata, the
    zero_tails check, or the outputs. Integer buffers get a poison of their own
    (:data:`REFRESH_POISON_BYTE`), not the one every example starts with: rows that neither
    the oracle's builds nor this refresh write (a metadata field copied out of its
    persistent buffer, then built and refreshed in the copy) differ from the oracle's.

    Create one per run; read its findings once, after the run, with :meth:`outcomes`.
    """

    def __init__(self, candidate: str, *, poison_before_first_refresh: bool,
                 cuda_sync_debug: bool) -> None:
        self.candidate = candidate
        self.poison_before_first_refresh = poison_before_first_refresh
        self.cuda_sync_debug = cuda_sync_debug
        self._refreshed: set[tuple[int, int]] = set()
        """(group, metadata) pairs (by id) refreshed so far."""
        self._outcomes: list[Outcome] | None = []

    def __call__(self, group: AttentionGroup, metadata: Any) -> None:
        """Refresh ``metadata`` through ``group``, traced (see the class docstring)."""
        if self._outcomes is None:
            raise RuntimeError("this probe's outcomes were read: create a probe per run")
        pair = (id(group), id(metadata))
        if self.poison_before_first_refresh and pair not in self._refreshed:
            self._refreshed.add(pair)
            buffers = group.builder.persistent_buffers()
            for name in group.builder.persistent_buffer_extents(metadata):
                poison_(buffers[name], byte=REFRESH_POISON_BYTE)
        roots = {"metadata": metadata, "builder": group.builder}
        try:
            with (HostSyncRecorder(cuda_sync_debug=self.cuda_sync_debug) as syncs,
                  IdentityGuard(roots) as ident):
                group.update_draft_decode_metadata(metadata)
        except Exception as exc:
            frames = traceback.format_exception(exc)
            tail = " | ".join(line.strip() for line in "".join(frames[-3:]).splitlines()[-4:])
            self._outcomes.append(Outcome(
                Check.REFRESH_ERROR, Result.FAILED,
                f"{group.backend_name}: the refresh raised {type(exc).__name__}: {exc} "
                f"[{tail}]", self.candidate))
            raise RefreshRaised from exc
        self._outcomes.append(
            Outcome(Check.REFRESH_ERROR, Result.PASSED, candidate=self.candidate))
        for check, findings in ((Check.HOST_SYNC, syncs.findings()),
                                (Check.IN_PLACE, ident.findings())):
            if findings:
                self._outcomes.append(Outcome(check, Result.FAILED,
                                              f"{group.backend_name}: {findings[0]}",
                                              self.candidate))
            else:
                self._outcomes.append(Outcome(check, Result.PASSED, candidate=self.candidate))

    def outcomes(self) -> list[Outcome]:
        """Every refresh call's outcomes, in call order. Read once: the probe takes no
        further calls afterwards (``RuntimeError`` on a second read or a later call)."""
        if self._outcomes is None:
            raise RuntimeError("this probe's outcomes were read already")
        outcomes, self._outcomes = self._outcomes, None
        return outcomes
