"""Mutants argued equivalent, as data beside the code they mutate.

A mutant no input can tell from the original (a consistency check deleted that correct
input never trips, a branch only another platform takes) survives every gate, and a score
that counts it says less than it seems. Its author argues it once, in
``equivalent_mutants.yaml`` in the mutated module's folder, keyed by the module's file name::

    dcp.py:
      - function: DcpLocalShare.for_builder
        operator: statement_deleted
        original: dcp.check_group()
        mutated: pass
        argument: >-
          A consistency check of the process group against the rank; on correct input it
          never raises, so deleting it changes nothing a gate can observe.

An entry names the function (qualified: ``Class.method``), the operator and the original
and mutated lines (stripped), not a line number, so it holds while the code around it
moves. ``speccheck mutate`` reports a survivor
an entry matches as argued equivalent, with the argument, and leaves it out of the score's
denominator; an argued mutant that is killed is reported as a refuted argument (and scored
as killed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from speccheck.checks.mutate.mutants import Mutant
from speccheck.checks.mutate.operators import Operator
from speccheck.checks.mutate.targets import TargetModule

EQUIVALENTS_FILE = "equivalent_mutants.yaml"
"""The file, in a mutated module's folder, that argues its equivalent mutants."""

MAX_FILE_BYTES = 1 << 20
"""Largest equivalents file read (a bigger one is bad input, never read whole)."""


class EquivalentsError(ValueError):
    """An equivalents file that cannot be read or does not hold valid entries (one line)."""


class ArguedEquivalent(BaseModel):
    """One mutant argued equivalent."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    function: str = Field(min_length=1)
    """The qualified name of the function holding the line (``Class.method``)."""
    operator: Operator
    original: str = Field(min_length=1)
    """The original source line, stripped."""
    mutated: str = Field(min_length=1)
    """The mutated line, stripped."""
    argument: str = Field(min_length=1)
    """Why no input can tell the mutant from the original."""


Key = tuple[Path, str, Operator, str, str]
"""(module path, function, operator, original line, mutated line)."""


def equivalents_paths(targets: Iterable[TargetModule]) -> list[Path]:
    """Where the equivalents files of ``targets`` are (or would be): one beside each
    target's folder, in folder order."""
    return [folder / EQUIVALENTS_FILE for folder in sorted({t.path.parent for t in targets})]


def load_equivalents(targets: Iterable[TargetModule]) -> dict[Key, str]:
    """The arguments of every equivalents file beside ``targets`` (by mutant key). Raises
    :class:`EquivalentsError` naming the file and the entry for a bad one."""
    arguments: dict[Key, str] = {}
    for path in equivalents_paths(targets):
        if not path.is_file():
            continue
        for module, entry in _entries(path):
            key = (path.parent / module, entry.function, entry.operator, entry.original,
                   entry.mutated)
            arguments[key] = " ".join(entry.argument.split())
    return arguments


def _entries(path: Path) -> list[tuple[str, ArguedEquivalent]]:
    """The (module file name, entry) pairs of ``path``."""
    if path.stat().st_size > MAX_FILE_BYTES:
        raise EquivalentsError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise EquivalentsError(f"{path}: not YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise EquivalentsError(f"{path}: expected a mapping of module file names to lists")
    pairs = []
    for module, entries in data.items():
        if not isinstance(module, str) or not (path.parent / module).is_file():
            raise EquivalentsError(f"{path}: {module!r} is not a module in {path.parent}")
        if not isinstance(entries, list):
            raise EquivalentsError(f"{path}: {module}: expected a list of entries")
        for i, raw in enumerate(entries):
            try:
                pairs.append((module, ArguedEquivalent.model_validate(raw)))
            except ValidationError as exc:
                error = exc.errors()[0]
                where = "".join(f".{part}" for part in error["loc"])
                raise EquivalentsError(
                    f"{path}: {module}[{i}]{where}: {error['msg']}") from None
    return pairs


def argument_for(mutant: Mutant, arguments: Mapping[Key, str]) -> str | None:
    """The argument that ``mutant`` is equivalent, or ``None``."""
    return arguments.get((mutant.target.path, mutant.function, mutant.operator,
                          mutant.original_line, mutant.mutated_line))
