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
gate judged which part (:class:`~speccheck.checks.mutate.report.Resumption`). A continuation
of the whole run at a newer commit also judges the older gate's survivors again
(:func:`stale_survivors`), so its survivors are the newest gate's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from speccheck.checks.mutate.mutants import Mutant
from speccheck.checks.mutate.report import MutationReport, Resumption, SurvivorClass
from speccheck.checks.mutate.rescore import RescoreError, saved_resumptions
from speccheck.checks.mutate.runner import Outcome

RESULT_FIELDS = ("outcome", "failed_checks", "named_fields", "seconds", "detail")
"""What a saved mutant's result is: two parts that both hold a mutant agree on these (one
copied the other's result), or one of them judged an older gate's survivor again
(:func:`stale_survivors`, its result kept), or the mutant ran twice (refused)."""
NOT_RUN = Outcome.NOT_RUN.value
SURVIVED = Outcome.SURVIVED.value


def stale_survivors(report: MutationReport, here: str) -> list[Mutant]:
    """The survivors of ``report`` an older gate judged, which a continuation at commit
    ``here`` judges again: where ``here`` is not the run's commit and no continuation at
    ``here`` judged survivors yet, every survivor whose line the gate executed and that no
    argument calls equivalent (verify may have learnt to catch it since)."""
    if here == report.commit or any(r.commit == here and r.rejudged for r in report.resumed):
        return []
    return [r.mutant for r in report.results if r.outcome is Outcome.SURVIVED
            and report.survivor_class(r) in (SurvivorClass.UNCAUGHT,
                                             SurvivorClass.EQUIVALENCE_CANDIDATE)]


RUN_IDENTITY = ("backend", "commit", "command", "generated", "examples", "operators", "targets")
"""What every part of one run (its first part and every continuation) holds alike."""


def combined_runs(paths: Sequence[Path], parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The saved reports ``parts`` (read from ``paths``) of one run and its continuations,
    combined: every mutant's result from the part that judged it (a mutant no part judged
    stays unrun), the continuations of all parts, and the run's seconds with each
    continuation's counted once. :class:`RescoreError` naming the file where a part is of
    another run, holds other mutants, or judged a mutant another part judged otherwise."""
    first = parts[0]
    numbers = _numbers(paths[0], first)
    combined = {number: dict(mutant) for number, mutant in numbers.items()}
    fresh = (set(numbers) if any(r.rejudged for r in saved_resumptions(paths[0], first))
             else set())
    """Mutants whose held result comes from a part that judged survivors again."""
    resumed: dict[Resumption, None] = {}
    base_seconds = None
    for path, part in zip(paths, parts, strict=True):
        for key in RUN_IDENTITY:
            if part.get(key) != first.get(key):
                raise RescoreError(f"{path}: not a part of the run of {paths[0]} (its {key} "
                                   "differs)")
        mutants = _numbers(path, part)
        if mutants.keys() != numbers.keys():
            raise RescoreError(f"{path}: holds other mutants than {paths[0]}: not a part of "
                               "the same run")
        own = saved_resumptions(path, part)
        rejudging = any(r.rejudged for r in own)
        resumed.update(dict.fromkeys(own))
        seconds = float(part.get("seconds") or 0.0) - sum(r.seconds for r in own)
        base_seconds = seconds if base_seconds is None else min(base_seconds, seconds)
        for number, mutant in mutants.items():
            if mutant.get("outcome") == NOT_RUN:
                continue
            held = combined[number]
            if all(held.get(key) == mutant.get(key) for key in RESULT_FIELDS):
                continue
            newer = rejudging and number not in fresh and held.get("outcome") == SURVIVED
            older = not rejudging and number in fresh and mutant.get("outcome") == SURVIVED
            if held.get("outcome") == NOT_RUN or newer:
                combined[number] = dict(mutant)
                if rejudging:
                    fresh.add(number)
            elif not older:
                raise RescoreError(f"{path}: mutant #{number} was judged in two parts (also "
                                   f"in {paths[0]} or a part before it): parts resuming one "
                                   "report take disjoint --shard options")
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
