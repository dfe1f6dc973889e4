"""Load ``matrix.yaml`` into validated :class:`Matrix` models, with file:line errors.

Every problem in a file is collected (YAML syntax, duplicate keys, unknown fields, wrong
types, bad conditions, cross-field contradictions, unknown backend references) and raised
together as one :class:`MatrixError`. Each problem renders as one line::

    PATH:LINE: backend 'NAME', field 'FIELD': what is wrong

where the backend and field parts are left out when they do not apply (a syntax error, a
problem at the top level) and ``:LINE`` when no line is known (a missing file).
"""

from __future__ import annotations

import difflib
import importlib.resources
import logging
import re
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from speccheck.contract.matrix_model import CONSISTENCY_ERROR_TYPE, Matrix
from speccheck.contract.yaml_positions import LoadedYaml, NodePosition, load_yaml_with_positions

logger = logging.getLogger(__name__)

DEFAULT_MATRIX_RESOURCE = "matrix.yaml"
"""Name of the packaged default matrix inside the ``speccheck`` package."""

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


def load_matrix(path: str | Path | None = None) -> Matrix:
    """Load and validate a matrix file; ``None`` loads the packaged ``matrix.yaml``.

    Raises :class:`MatrixError` listing every problem, including an unreadable file.
    """
    if path is None:
        resource = importlib.resources.files("speccheck") / DEFAULT_MATRIX_RESOURCE
        label = str(resource)
        try:
            raw = resource.read_bytes()
        except OSError as exc:
            raise MatrixError([_file_problem(label, exc)]) from None
    else:
        label = str(path)
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise MatrixError([_file_problem(label, exc)]) from None
    logger.debug("loading capability matrix from %s", label)
    return parse_matrix(raw, path=label)


def _file_problem(label: str, exc: OSError) -> MatrixProblem:
    reason = exc.strerror or str(exc)
    return MatrixProblem(label, None, None, None, f"cannot read the matrix file: {reason}")


def parse_matrix(source: str | bytes, *, path: str = "<matrix>") -> Matrix:
    """Validate matrix text (``bytes`` must be UTF-8); ``path`` names it in problems.

    Raises :class:`MatrixError` listing every problem found.
    """
    if isinstance(source, bytes):
        try:
            text = source.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = source[: exc.start].count(b"\n") + 1
            raise MatrixError(
                [MatrixProblem(path, line, None, None, f"the file is not valid UTF-8 ({exc.reason} "
                               f"at byte {exc.start})")]
            ) from None
    else:
        text = source
    try:
        loaded = load_yaml_with_positions(text)
    except yaml.YAMLError as exc:
        raise MatrixError([_yaml_problem(path, text, exc)]) from None
    except RecursionError:
        raise MatrixError(
            [MatrixProblem(path, None, None, None, "the YAML document is nested too deeply")]
        ) from None
    return _validate(loaded, path)


def _yaml_problem(path: str, text: str, exc: yaml.YAMLError) -> MatrixProblem:
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
        line = text[: exc.position].count("\n") + 1
        return MatrixProblem(
            path, line, None, None,
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
    except RecursionError:
        problems.append(MatrixProblem(path, None, None, None,
                                      "the YAML document is nested too deeply or is recursive"))
    if problems:
        raise MatrixError(sorted(problems, key=lambda problem: problem.line or 0))
    return matrix


class _Locator:
    """Maps pydantic error locations to lines, backend names and field paths."""

    def __init__(self, path: str, loaded: LoadedYaml) -> None:
        self.path = path
        self.data = loaded.data
        self.positions = loaded.positions

    def problems_for(self, error: ErrorDetails) -> Iterable[MatrixProblem]:
        loc = _data_loc(error["loc"])
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
        """Line of ``loc``, or of its nearest recorded ancestor (a missing field points at its
        parent; an empty document at line 1). ``key`` prefers the key's line over the
        value's."""
        for end in range(len(loc), -1, -1):
            position: NodePosition | None = self.positions.get(tuple(loc[:end]))
            if position is not None:
                if end < len(loc) or key:
                    return position.line
                return position.value_line
        return 1

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
    a key that is not an identifier is shown as ``[repr]`` so the line stays one line."""
    text = ""
    for part in loc:
        if isinstance(part, str) and part.isidentifier():
            text += f".{part}" if text else part
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
