"""The pre-flight of one matrix entry's fragment, before any worker starts: the mistakes a
loader cannot see because they need the adapter's code, each pointing at the field of the
entry to change.

- ``implementation`` imports, down to the class, and names an
  :class:`~speccheck.contract.builder.AttentionMetadataBuilder` subclass (a typo in the class
  part gets "did you mean");
- the builder's ``backend_name`` is the entry's name, where the adapter names its builder
  itself (a builder that inherits a shipped backend's name, as the self-test's known-bad
  variants do, may be declared under any entry);
- every ``draft_decode.refreshed_fields`` item names a field of the metadata type, where
  ``build()``'s return annotation states it as a dataclass (the first part of a dotted
  path; "did you mean" for a typo).

Importing the adapter runs its module, which may fail in any way: every failure is a
mistake of the fragment, never a crash of the check.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import typing
from dataclasses import dataclass

from speccheck.checks.verify.one_line import exception_line
from speccheck.contract.adapter_status import missing_class
from speccheck.contract.builder import AttentionMetadataBuilder
from speccheck.contract.matrix_model import BackendEntry, Matrix
from speccheck.speculator.attention_setup import builder_class

logger = logging.getLogger(__name__)

SHIPPED_PACKAGE = "speccheck."
"""Modules of speccheck itself: a ``backend_name`` declared there is a shipped backend's."""


@dataclass(frozen=True)
class FragmentMistake:
    """One mistake of an entry: ``field`` is its path inside the entry
    (``("draft_decode", "refreshed_fields", 1)``); ``message`` says what is wrong and what
    to write instead."""

    field: tuple[object, ...]
    message: str


def fragment_mistake(entry: BackendEntry, matrix: Matrix) -> FragmentMistake | None:
    """The first mistake of ``entry`` (declared in ``matrix``), in the order of the module
    docstring, or ``None``; an entry without an implementation has none here (its worker
    reports it skipped)."""
    declared = entry.implementation
    if declared is None:
        return None
    try:
        found: object = builder_class(entry.name, matrix)
    except Exception as exc:  # the adapter's own import: any failure is the fragment's
        logger.debug("importing %s failed", declared, exc_info=True)
        missing = missing_class(declared) if isinstance(exc, AttributeError) else None
        if missing is not None:  # the module imports; the class part is a typo
            return FragmentMistake(("implementation",), f"{declared!r}: {missing}")
        return FragmentMistake(("implementation",), f"{declared!r} cannot be imported: "
                               f"{exception_line(exc)}")
    if not (isinstance(found, type) and issubclass(found, AttentionMetadataBuilder)):
        return FragmentMistake(("implementation",),
                               f"{declared!r} is not an AttentionMetadataBuilder subclass")
    return _name_mistake(entry, found) or _refreshed_field_mistake(entry, found)


def _name_mistake(entry: BackendEntry,
                  cls: type[AttentionMetadataBuilder[typing.Any]]) -> FragmentMistake | None:
    """The adapter's own ``backend_name`` differs from the entry's name."""
    name = getattr(cls, "backend_name", None)
    owner = next((base for base in cls.__mro__ if "backend_name" in vars(base)), None)
    if name == entry.name or owner is None or owner.__module__.startswith(SHIPPED_PACKAGE):
        return None
    return FragmentMistake(("name",), f"{owner.__qualname__}.backend_name is {name!r}, not the "
                           f"entry's name {entry.name!r}: name the entry {name!r} or set "
                           f"backend_name = {entry.name!r}")


def metadata_type(cls: type[AttentionMetadataBuilder[typing.Any]]) -> type | None:
    """The metadata type ``cls.build`` states in its return annotation, where that is a
    dataclass (whose fields are declared); ``None`` where it states none, another kind of
    type, or an annotation that does not resolve."""
    try:
        returned = typing.get_type_hints(cls.build).get("return")
    except Exception:  # an annotation naming what the module does not define at run time
        logger.debug("the return annotation of %s.build does not resolve", cls.__qualname__,
                     exc_info=True)
        return None
    if isinstance(returned, type) and dataclasses.is_dataclass(returned):
        return returned
    return None


def _refreshed_field_mistake(
    entry: BackendEntry, cls: type[AttentionMetadataBuilder[typing.Any]]
) -> FragmentMistake | None:
    """A refreshed field (its first part) that the metadata type does not have."""
    stated = metadata_type(cls)
    if stated is None:
        return None
    fields = tuple(field.name for field in dataclasses.fields(stated))
    for index, dotted in enumerate(entry.draft_decode.refreshed_fields):
        first = dotted.split(".")[0]
        if first in fields:
            continue
        close = difflib.get_close_matches(first, fields, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return FragmentMistake(
            ("draft_decode", "refreshed_fields", index),
            f"{first!r} is not a field of {stated.__qualname__}, the metadata type "
            f"{cls.__qualname__}.build() returns{hint} (fields: {', '.join(fields)}; where "
            "build() returns a subclass, annotate it with that class)")
    return None
