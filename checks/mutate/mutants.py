"""Mutant generation: every edit of every chosen operator on every target module, as a
whole mutated module with its location and a short description, deduplicated; and the
deterministic sample a run takes when it may not run them all."""

from __future__ import annotations

import ast
import random
from collections.abc import Iterable
from dataclasses import dataclass

from speccheck.checks.mutate.operators import OPERATORS, Edit, Operator, apply_edit
from speccheck.checks.mutate.targets import TargetModule


@dataclass(frozen=True)
class Mutant:
    """One mutated module."""

    number: int
    """1-based, in generation order (stable for a given source tree and operators)."""
    operator: Operator
    target: TargetModule
    line: int
    end_line: int
    """The last line of the original span the edit replaced."""
    description: str
    original_line: str
    """The original source line at ``line``, stripped."""
    mutated_line: str
    """The mutated module's line at ``line``, stripped."""
    source: str
    """The whole mutated module."""
    clipped: bool
    """The edit changes an argument of ``min``/``max``/``clamp`` (an equivalence hint)."""
    compiles: bool
    """Whether the mutated module compiles (one that does not is an invalid mutant)."""

    @property
    def location(self) -> str:
        """``file:line``."""
        return f"{self.target.shown}:{self.line}"


def generate_mutants(
    targets: Iterable[TargetModule], operators: Iterable[Operator],
) -> list[Mutant]:
    """Every mutant of ``targets`` under ``operators``, numbered in order of target, then
    operator, then position; two edits that give the same module give one mutant."""
    chosen = list(operators)
    mutants: list[Mutant] = []
    seen: set[tuple[TargetModule, str]] = set()
    for target in targets:
        source = target.path.read_text(encoding="utf-8")
        tree = ast.parse(source, filename=str(target.path))
        for operator in chosen:
            for edit in OPERATORS[operator](tree, source):
                mutated = apply_edit(source, edit)
                if mutated == source or (target, mutated) in seen:
                    continue
                seen.add((target, mutated))
                mutants.append(_mutant(len(mutants) + 1, operator, target, source, mutated, edit))
    return mutants


def _mutant(number: int, operator: Operator, target: TargetModule, source: str, mutated: str,
            edit: Edit) -> Mutant:
    try:
        compile(mutated, str(target.path), "exec", dont_inherit=True)
        compiles = True
    except (SyntaxError, ValueError):
        compiles = False
    return Mutant(
        number=number, operator=operator, target=target, line=edit.line,
        end_line=edit.end_line, description=edit.description,
        original_line=source.splitlines()[edit.line - 1].strip(),
        mutated_line=mutated.splitlines()[edit.line - 1].strip(), source=mutated,
        clipped=edit.clipped, compiles=compiles,
    )


def sample_mutants(mutants: list[Mutant], limit: int | None, seed: int) -> list[Mutant]:
    """At most ``limit`` of ``mutants`` (all for ``None``): a random sample drawn with
    ``seed``, so every module and operator is represented in proportion, back in generation
    order."""
    if limit is None or limit >= len(mutants):
        return list(mutants)
    picked = random.Random(seed).sample(mutants, limit)
    return sorted(picked, key=lambda mutant: mutant.number)
