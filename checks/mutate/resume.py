"""Continuing a saved run: the mutants a ``speccheck mutate --json`` report left unrun (its
budget or ``--stop-after`` was spent) run at this checkout and join its saved results
(``speccheck mutate --resume REPORT``).

A backend whose gate is slow (Triton interpreted on CPU) rarely finishes its mutants in one
budget; its run continues in parts, on one machine after another or on several at once
(each resuming the same report with its own ``--shard``), and the parts combine
(:func:`combined_runs`). The mutants must be the very ones the checkout generates (the code
under test unchanged, as :func:`~speccheck.checks.mutate.rescore.rescored` checks), but
verify itself may have changed since the run began: each part is kept as a
resumption naming its commit and how many mutants it judged, so a record says which
gate judged which part (:class:`~speccheck.checks.mutate.report.Resumption`), and each
result names the verify that judged it (its
:func:`~speccheck.checks.mutate.fingerprint.verify_fingerprint`). A continuation also judges
again the survivors another verify judged (:func:`stale_survivors`), so its survivors are
its own verify's; a change of the mutation tool, the status writer or the equivalence
arguments alone judges nothing again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from speccheck.checks.mutate.mutants import Mutant
from speccheck.checks.mutate.report import MutationReport, Resumption, SurvivorClass
from speccheck.checks.mutate.rescore import RescoreError, saved_resumptions
from speccheck.checks.mutate.runner import Outcome

RESULT_FIELDS = ("outcome", "failed_checks", "named_fields", "seconds", "detail", "judged_by")
"""What a saved mutant's result is: two parts that both hold a mutant agree on these (one
copied the other's result), or one of them judged again a survivor that another verify
judged (:func:`newer_result`), or the mutant ran twice (refused)."""
NOT_RUN = Outcome.NOT_RUN.value
SURVIVED = Outcome.SURVIVED.value


def stale_survivors(report: MutationReport, judged_by: str | None) -> list[Mutant]:
    """The survivors of ``report`` that a continuation whose verify fingerprint is
    ``judged_by`` judges again (verify may have learnt to catch them since): every survivor
    whose line the gate executed, that no argument calls equivalent, and that another
    verify, or one not recorded, judged."""
    return [r.mutant for r in report.results if r.outcome is Outcome.SURVIVED
            and report.survivor_class(r) in (SurvivorClass.UNCAUGHT,
                                             SurvivorClass.EQUIVALENCE_CANDIDATE)
            and (r.judged_by is None or r.judged_by != judged_by)]


def newer_result(held: Mapping[str, Any], other: Mapping[str, Any],
                 judged_by: str | None) -> Mapping[str, Any] | None:
    """Of two saved results of one mutant that differ, the one a combined run keeps, or
    ``None`` where they cannot both stand. An unrun one yields to the other. Otherwise one
    of them must be a survivor judged again by another verify (a continuation judges
    nothing else twice): a kill is never judged again, so where one survived it yields to
    the other; where both survived, the one ``judged_by`` judged (the checkout's verify)
    is kept, else the held one."""
    if held.get("outcome") == NOT_RUN:
        return other
    if other.get("outcome") == NOT_RUN:
        return held
    if held.get("judged_by") == other.get("judged_by"):
        return None  # one verify (or two unrecorded) judged it twice
    survived = (held.get("outcome") == SURVIVED, other.get("outcome") == SURVIVED)
    if survived == (True, True):
        return other if other.get("judged_by") == judged_by else held
    if survived == (True, False):
        return other
    if survived == (False, True):
        return held
    return None


RUN_IDENTITY = ("backend", "commit", "command", "generated", "examples", "operators", "targets")
"""What every part of one run (its first part and every continuation) holds alike."""


def combined_runs(paths: Sequence[Path], parts: Sequence[Mapping[str, Any]],
                  judged_by: str | None = None) -> dict[str, Any]:
    """The saved reports ``parts`` (read from ``paths``) of one run and its continuations,
    combined: every mutant's result as :func:`newer_result` picks it (``judged_by``: the
    checkout's verify fingerprint; a mutant no part judged stays unrun), the continuations
    of all parts, and the run's seconds with each continuation's counted once.
    :class:`RescoreError` naming the file where a part is of another run, holds other
    mutants, or judged a mutant another part judged otherwise."""
    first = parts[0]
    combined = {number: dict(mutant) for number, mutant in _numbers(paths[0], first).items()}
    resumed: dict[Resumption, None] = {}
    base_seconds = None
    for path, part in zip(paths, parts, strict=True):
        for key in RUN_IDENTITY:
            if part.get(key) != first.get(key):
                raise RescoreError(f"{path}: not a part of the run of {paths[0]} (its {key} "
                                   "differs)")
        mutants = _numbers(path, part)
        if mutants.keys() != combined.keys():
            raise RescoreError(f"{path}: holds other mutants than {paths[0]}: not a part of "
                               "the same run")
        own = saved_resumptions(path, part)
        resumed.update(dict.fromkeys(own))
        seconds = float(part.get("seconds") or 0.0) - sum(r.seconds for r in own)
        base_seconds = seconds if base_seconds is None else min(base_seconds, seconds)
        for number, mutant in mutants.items():
            held = combined[number]
            if all(held.get(key) == mutant.get(key) for key in RESULT_FIELDS):
                continue
            kept = newer_result(held, mutant, judged_by)
            if kept is None:
                raise RescoreError(f"{path}: mutant #{number} was judged in two parts (also "
                                   f"in {paths[0]} or a part before it): parts resuming one "
                                   "report take disjoint --shard options")
            combined[number] = dict(kept)
    merged = dict(first)
    merged["mutants"] = [combined[number] for number in sorted(combined)]
    merged["resumed"] = [r.to_json() for r in resumed]
    merged["seconds"] = round((base_seconds or 0.0) + sum(r.seconds for r in resumed), 1)
    return merged


def _numbers(path: Path, part: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
    mutants = part.get("mutants")
    if not isinstance(mutants, list) or not all(
            isinstance(m, Mapping) and isinstance(m.get("number"), int) for m in mutants):
        raise RescoreError(f"{path}: mutants: not a list of numbered mutants (a "
                           "`speccheck mutate --json` report is needed)")
    return {m["number"]: m for m in mutants}
