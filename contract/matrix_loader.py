"""Load ``matrix.yaml`` into validated :class:`Matrix` models, with file:line errors.

Every problem in a file is collected (YAML syntax, duplicate keys, unknown fields, wrong
types, bad conditions, cross-field contradictions, unknown backend references) and raised
together as one :class:`MatrixError`. Each problem renders as one line::

    PATH:LINE: backend 'NAME', field 'FIELD': what is wrong

where the backend and field parts are left out when they do not apply (a syntax error, a
problem at the top level) and ``:LINE`` when no line is known (a missing file).

Nothing but :class:`MatrixError` ever leaves :func:`load_matrix` and :func:`parse_matrix`,
whatever the input, and the work is bounded: only regular files are read (no FIFO, device or
directory), at most :data:`MAX_MATRIX_BYTES` of them, checked before reading and enforced by
the read itself; the YAML loader bounds nesting, scalar lengths and alias and merge-key
expansion and refuses unusual tags and out-of-range integers, each with its line (see
:mod:`speccheck.contract.yaml_positions`). Lines are counted at ``\n``, ``\r\n`` and
``\r``, as editors do.
"""

from __future__ import annotations

import difflib
import importlib.resources
import json
import logging
import re
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from speccheck.contract.bounded_read import UnreadableFile, printable_path, read_regular_file
from speccheck.contract.matrix_model import CONSISTENCY_ERROR_TYPE, Matrix
from speccheck.contract.yaml_positions import (
    LoadedYaml,
    NodePosition,
    RejectedYaml,
    line_at,
    load_yaml_with_positions,
)

logger = logging.getLogger(__name__)

DEFAULT_MATRIX_RESOURCE = "matrix.yaml"
"""Name of the packaged default matrix inside the ``speccheck`` package."""

MAX_MATRIX_BYTES = 1 << 20
"""Largest matrix file (or text given to :func:`parse_matrix`) accepted: 1 MiB."""

MAX_PROBLEMS = 100
"""Most problems a :class:`MatrixError` lists one by one; one more line counts the rest."""

_MAX_SHOWN_INPUT = 60
_BACKEND_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
_REWORDED = {
    "tuple_type": "should be a list",
    "list_type": "should be a list",
    "model_type": "should be a mapping",
    "model_attributes_type": "should be a mapping",
    "dict_type": "should be a mapping",
    "bool_type": "should be true or false",
}


@dataclass(frozen=True)
class MatrixProblem:
    """One thing wrong with a matrix file.

    ``path`` is the file as given; ``line`` is 1-based (``None`` when unknown); ``backend``
    is the entry's name when the problem is inside a named backend entry; ``field`` is the
    dotted path of the offending field (relative to the entry when ``backend`` is set).
    """

    path: str
    line: int | None
    backend: str | None
    field: str | None
    message: str

    def render(self) -> str:
        """``PATH:LINE: backend 'NAME', field 'FIELD': message`` (absent parts left out)."""
        location = self.path if self.line is None else f"{self.path}:{self.line}"
        subject = []
        if self.backend is not None:
            subject.append(f"backend '{self.backend}'")
        if self.field is not None:
            subject.append(f"field '{self.field}'")
        prefix = f"{', '.join(subject)}: " if subject else ""
        return f"{location}: {prefix}{self.message}"


class MatrixError(Exception):
    """A matrix file could not be loaded; ``problems`` lists everything that is wrong.

    ``str()`` gives one rendered line per problem.
    """

    def __init__(self, problems: Sequence[MatrixProblem]) -> None:
        if not problems:
            raise ValueError("MatrixError needs at least one problem")
        self.problems: tuple[MatrixProblem, ...] = tuple(problems)
        super().__init__(self.render())

    def render(self) -> str:
        """All problems, one line each."""
        return "\n".join(problem.render() for problem in self.problems)


@dataclass(frozen=True)
class LocatedMatrix:
    """A validated matrix and where it came from: ``path`` as problems name it, and the
    1-based line of each backend entry's ``name`` (for problems that span files) and of
    every value (``positions``, for problems found after loading: :meth:`problem`)."""

    matrix: Matrix
    path: str
    name_lines: Mapping[str, int]
    positions: Mapping[tuple[object, ...], NodePosition]

    def problem(self, name: str, field: tuple[object, ...], message: str) -> MatrixProblem:
        """``message`` about entry ``name``'s ``field`` (a path inside the entry, such as
        ``("draft_decode", "refreshed_fields", 1)``), at the line of its value (of its
        nearest written ancestor where the field is absent), as a loading problem is."""
        loc = ("backends", self.matrix.names.index(name), *field)
        return MatrixProblem(self.path, _line_of(self.positions, loc, key=False), name,
                             _render_field(field) if field else None, message)


def load_matrix(path: str | Path | None = None) -> Matrix:
    """Load and validate a matrix file; ``None`` loads the packaged ``matrix.yaml``.

    ``path`` must name a regular file of at most :data:`MAX_MATRIX_BYTES`. Raises
    :class:`MatrixError` listing every problem, including an unreadable file.
    """
    return load_located_matrix(path).matrix


def load_located_matrix(path: str | Path | None = None) -> LocatedMatrix:
    """:func:`load_matrix`, keeping the file's name and the line of each entry's name."""
    if path is None:
        resource = importlib.resources.files("speccheck") / DEFAULT_MATRIX_RESOURCE
        label = str(resource)
        try:
            raw = resource.read_bytes()
        except OSError as exc:
            raise MatrixError([_file_problem(label, exc.strerror or str(exc))]) from None
    else:
        label = printable_path(path)
        raw = _read_regular_file(Path(path), label)
    logger.debug("loading capability matrix from %s", label)
    return _parse(raw, label)


def merge_matrices(parts: Sequence[LocatedMatrix]) -> Matrix:
    """One matrix holding the entries of every part, in order (the shipped matrix first,
    then plug-in fragments). A backend name declared by two parts is a :class:`MatrixError`
    with one problem per clash, at the later declaration, naming the earlier one's file and
    line."""
    first: dict[str, LocatedMatrix] = {}
    problems = []
    for part in parts:
        for name in part.matrix.names:
            earlier = first.setdefault(name, part)
            if earlier is not part:
                problems.append(MatrixProblem(
                    part.path, part.name_lines[name], name, "name",
                    f"{name!r} is already declared by {earlier.path}:{earlier.name_lines[name]}; "
                    "backend names must be unique across the matrix and its plug-ins"))
    if problems:
        raise MatrixError(problems)
    return Matrix(version=1, backends=tuple(e for part in parts for e in part.matrix.backends))


def _read_regular_file(path: Path, label: str) -> bytes:
    """The bytes of ``path``: a regular file of at most :data:`MAX_MATRIX_BYTES`
    (:func:`~speccheck.contract.bounded_read.read_regular_file`)."""
    try:
        raw = read_regular_file(path, MAX_MATRIX_BYTES)
    except UnreadableFile as exc:
        raise MatrixError([_file_problem(label, str(exc))]) from None
    if len(raw) > MAX_MATRIX_BYTES:
        raise MatrixError([_too_large(label)])
    return raw


def _file_problem(label: str, reason: str) -> MatrixProblem:
    return MatrixProblem(label, None, None, None, f"cannot read the matrix file: {reason}")


def _too_large(label: str) -> MatrixProblem:
    return MatrixProblem(label, None, None, None, f"the matrix is larger than {MAX_MATRIX_BYTES} "
                         "bytes (1 MiB), the most accepted")


def parse_matrix(source: str | bytes, *, path: str = "<matrix>") -> Matrix:
    """Validate matrix text (``bytes`` must be UTF-8) of at most :data:`MAX_MATRIX_BYTES`
    bytes (characters, for ``str``); ``path`` names it in problems.

    Raises :class:`MatrixError` listing every problem found, and nothing else.
    """
    return _parse(source, path).matrix


def _parse(source: str | bytes, path: str) -> LocatedMatrix:
    if len(source) > MAX_MATRIX_BYTES:
        raise MatrixError([_too_large(path)])
    if isinstance(source, bytes):
        try:
            text = source.decode("utf-8")
        except UnicodeDecodeError as exc:
            before = source[: exc.start].decode("utf-8")
            raise MatrixError(
                [MatrixProblem(path, line_at(before, len(before)), None, None,
                               f"the file is not valid UTF-8 ({exc.reason} at byte {exc.start})")]
            ) from None
    else:
        text = source
    try:
        loaded = load_yaml_with_positions(text)
    except yaml.YAMLError as exc:
        raise MatrixError([_yaml_problem(path, text, exc)]) from None
    matrix = _validate(loaded, path)
    lines = {entry.name: loaded.positions[("backends", index, "name")].line
             for index, entry in enumerate(matrix.backends)}
    return LocatedMatrix(matrix, path, lines, loaded.positions)


def _yaml_problem(path: str, text: str, exc: yaml.YAMLError) -> MatrixProblem:
    if isinstance(exc, RejectedYaml):
        return MatrixProblem(path, exc.problem_mark.line + 1, None, None, exc.problem)
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        line = None if mark is None else mark.line + 1
        message = f"YAML syntax error: {exc.problem or exc.context or 'malformed document'}"
        if exc.problem and exc.context:
            context_line = exc.context_mark.line + 1 if exc.context_mark is not None else None
            where = f" on line {context_line}" if context_line is not None else ""
            message += f" ({exc.context}{where})"
        return MatrixProblem(path, line, None, None, message)
    if isinstance(exc, yaml.reader.ReaderError):
        return MatrixProblem(
            path, line_at(text, exc.position), None, None,
            f"YAML syntax error: unacceptable character {exc.character!r}: {exc.reason}",
        )
    return MatrixProblem(path, None, None, None, f"YAML syntax error: {exc}")


def _validate(loaded: LoadedYaml, path: str) -> Matrix:
    locator = _Locator(path, loaded)
    problems = [
        locator.problem(duplicate.path, f"duplicate key {duplicate.path[-1]!r} (first on line "
                        f"{duplicate.first_line}); YAML would silently keep only the last one",
                        line=duplicate.line)
        for duplicate in loaded.duplicate_keys
    ]
    data = loaded.data
    if not isinstance(data, dict):
        got = "an empty document" if data is None else f"a {type(data).__name__}"
        problems.append(
            MatrixProblem(path, locator.line_of((), key=False), None, None,
                          f"the top level must be a mapping with 'version' and 'backends', "
                          f"got {got}")
        )
        raise MatrixError(problems)
    try:
        matrix = Matrix.model_validate(data)
    except ValidationError as exc:
        for error in exc.errors():
            problems.extend(locator.problems_for(error))
    if problems:
        raise MatrixError(_capped(sorted(problems, key=lambda problem: problem.line or 0)))
    return matrix


def _capped(problems: list[MatrixProblem]) -> list[MatrixProblem]:
    """The first :data:`MAX_PROBLEMS` problems, then one line saying how many more there
    are, at the line of the first one left out."""
    if len(problems) <= MAX_PROBLEMS:
        return problems
    first_left_out = problems[MAX_PROBLEMS]
    more = len(problems) - MAX_PROBLEMS
    return [*problems[:MAX_PROBLEMS], MatrixProblem(
        first_left_out.path, first_left_out.line, None, None,
        f"{more} more problems from here on are not shown (at most {MAX_PROBLEMS} are listed)",
    )]


class _Locator:
    """Maps pydantic error locations to lines, backend names and field paths."""

    def __init__(self, path: str, loaded: LoadedYaml) -> None:
        self.path = path
        self.data = loaded.data
        self.positions = loaded.positions

    def problems_for(self, error: ErrorDetails) -> Iterable[MatrixProblem]:
        loc = _data_loc(error["loc"])
        if error["type"] == "extra_forbidden":
            loc = (*_data_loc(error["loc"][:-1]), error["loc"][-1])  # the key as written
        if error["type"] == "too_short" and _has_enough_items(error):
            return  # the items are there but invalid; their own errors say why
        if error["type"] == CONSISTENCY_ERROR_TYPE:
            violations = (error.get("ctx") or {}).get("violations", ())
            for relative, message in violations:
                yield self.problem((*loc, *relative), message)
            return
        yield self.problem(loc, self.message(error, loc), key=error["type"] == "extra_forbidden")

    def problem(
        self, loc: tuple[object, ...], message: str, *, line: int | None = None, key: bool = True
    ) -> MatrixProblem:
        backend, field_loc = self.split_backend(loc)
        field = _render_field(field_loc) if field_loc else None
        return MatrixProblem(
            self.path, line if line is not None else self.line_of(loc, key=key), backend, field,
            message,
        )

    def split_backend(self, loc: tuple[object, ...]) -> tuple[str | None, tuple[object, ...]]:
        """(entry name, loc inside the entry) when ``loc`` is inside a named backend entry."""
        if len(loc) >= 2 and loc[0] == "backends" and isinstance(loc[1], int):
            backends = self.data.get("backends") if isinstance(self.data, dict) else None
            if isinstance(backends, list) and 0 <= loc[1] < len(backends):
                entry = backends[loc[1]]
                name = entry.get("name") if isinstance(entry, dict) else None
                if isinstance(name, str) and _BACKEND_NAME.fullmatch(name):
                    return name, loc[2:]
        return None, loc

    def line_of(self, loc: tuple[object, ...], *, key: bool) -> int:
        return _line_of(self.positions, loc, key=key)

    def message(self, error: ErrorDetails, loc: tuple[object, ...]) -> str:
        kind = error["type"]
        if kind == "missing":
            return "is required but missing"
        if kind == "extra_forbidden":
            return self.unknown_field_message(loc)
        if kind == "condition":
            return error["msg"]
        message = _REWORDED.get(kind) or re.sub(r"^(Input|String|Tuple) should", "should",
                                                error["msg"])
        if kind == "string_pattern_mismatch" and (error.get("ctx") or {}).get("pattern") == r"\S":
            message = "should not be empty"
        if kind == "too_short":
            minimum = (error.get("ctx") or {}).get("min_length", 1)
            message = f"should have at least {minimum} item{'s' if minimum != 1 else ''}"
        return f"{message}, got {_short(error.get('input'))}"

    def unknown_field_message(self, loc: tuple[object, ...]) -> str:
        allowed = _allowed_fields(loc[:-1])
        name = loc[-1] if loc else None
        message = f"unknown field {name!r}"
        if allowed:
            close = difflib.get_close_matches(str(name), allowed, n=1)
            if close:
                message += f"; did you mean {close[0]!r}?"
            message += f" (allowed: {', '.join(allowed)})"
        return message


def _line_of(
    positions: Mapping[tuple[object, ...], NodePosition], loc: tuple[object, ...], *, key: bool
) -> int:
    """Line of ``loc``, or of its nearest recorded ancestor (a missing field points at its
    parent; an empty document at line 1). ``key`` prefers the key's line over the
    value's."""
    for end in range(len(loc), -1, -1):
        position = positions.get(tuple(loc[:end]))
        if position is not None:
            if end < len(loc) or key:
                return position.line
            return position.value_line
    return 1


def _has_enough_items(error: ErrorDetails) -> bool:
    """pydantic counts only valid items against ``min_length``; a list that is long enough
    but holds invalid items is not "too short"."""
    value = error.get("input")
    minimum = (error.get("ctx") or {}).get("min_length", 1)
    return isinstance(value, (list, tuple)) and len(value) >= minimum


def _short(value: object) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "an empty list" if not value else "a list"
    text = repr(value)
    if len(text) > _MAX_SHOWN_INPUT:
        text = text[: _MAX_SHOWN_INPUT - 3] + "..."
    return text


def _data_loc(loc: Sequence[int | str]) -> tuple[object, ...]:
    """Drop union tags (``"size-list"``, ...): they are never identifiers, fields always are."""
    return tuple(part for part in loc if not isinstance(part, str) or part.isidentifier())


def _render_field(loc: Sequence[object]) -> str:
    """``("draft_decode", "refreshed_fields", 0)`` -> ``draft_decode.refreshed_fields[0]``;
    a key that is not an identifier is shown as ``["key"]`` (JSON, with ``'`` escaped too),
    so the line stays one line and the field stays inside its quotes."""
    text = ""
    for part in loc:
        if isinstance(part, str) and part.isidentifier():
            text += f".{part}" if text else part
        elif isinstance(part, str):
            text += f"[{json.dumps(part)}]".replace("'", "\\u0027")
        else:
            text += f"[{part!r}]"
    return text


def _allowed_fields(loc: Sequence[object]) -> list[str]:
    """Field names of the model found at ``loc`` below :class:`Matrix` ([] if none)."""
    annotation: object = Matrix
    for part in loc:
        model = _model_in(annotation)
        if isinstance(part, str):
            if model is None or part not in model.model_fields:
                return []
            annotation = model.model_fields[part].annotation
        else:
            annotation = _item_type(annotation)
    model = _model_in(annotation)
    return list(model.model_fields) if model is not None else []


def _model_in(annotation: object) -> type[BaseModel] | None:
    """The one model class inside ``annotation`` (through Optional/Annotated/Union)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    models = [
        found for arg in typing.get_args(annotation) if (found := _model_in(arg)) is not None
    ]
    return models[0] if len(models) == 1 else None


def _item_type(annotation: object) -> object:
    """The item type of the sequence inside ``annotation`` (through Optional/Annotated)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (tuple, list) and args:
        return args[0]
    for arg in args:
        item = _item_type(arg)
        if item is not None:
            return item
    return None
