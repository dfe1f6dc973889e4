"""The condition language of ``matrix.yaml``.

A condition is a tiny boolean expression over the fields of :class:`RuntimeConfig`, written
in Python syntax, for example ``dcp_world_size == 1`` or
``platform == "cuda" and block_size in [16, 32]``. It is parsed with :mod:`ast` and accepted
only if every node is on a whitelist:

- comparisons ``==``, ``!=``, ``<``, ``<=``, ``>``, ``>=``, also chained (``1 <= x < 8``);
- ``in`` / ``not in`` whose right operand is a list or tuple literal;
- ``and``, ``or``, ``not`` and parentheses;
- literals: integers (optionally negative), strings, ``True``/``False``;
- names, each of which must be a field of the runtime configuration.

Conditions are type-checked when they are parsed: ``<`` and friends need integers, ``==``
needs operands of one type, a string compared with a ``Literal`` field must be one of that
field's allowed values, and the whole condition must be boolean. Nothing is ever passed to
``eval`` or ``exec``; evaluation walks the checked tree.

Two rules go beyond Python's own reading, and both are errors, not warnings (a matrix that
loads is one whose conditions mean what they say):

- Names are ASCII. Python reads identifiers through Unicode NFKC normalisation, so
  ``ｄｃｐ_world_size == 1`` (full-width letters) would silently mean
  ``dcp_world_size == 1``; a field must be written exactly as it is named. String literals
  may hold any character (they are compared as written).
- Nothing is constant. Every comparison, and each link of a chained one, must read a
  runtime-config field (``1 == 1``, ``'a' in ['a']`` and the ``1 < 2`` of ``1 < 2 < x`` are
  refused), and ``True`` or ``False`` may only be compared with a field, never stand as a
  condition or an operand of ``and``/``or``/``not``. A constant part is always true or
  always false, so it either hides the rest of the condition or is dead; to allow something
  unconditionally, the matrix says ``true`` rather than a condition.
"""

from __future__ import annotations

import ast
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel

from speccheck.contract.runtime_config import RuntimeConfig

MAX_CONDITION_LENGTH = 1000
"""Longest condition source accepted, in characters (keeps parsing and checking shallow)."""

ValueKind = Literal["int", "str", "bool"]
Value = int | str | bool


class ConditionError(ValueError):
    """A condition is not valid: syntax, a name outside the vocabulary, or a type error.

    ``message`` says what is wrong; ``column`` is the 1-based column in the condition source
    where the problem starts, or ``None`` when it concerns the whole condition.
    """

    def __init__(self, source: str, message: str, column: int | None = None) -> None:
        self.source = source
        self.message = message
        self.column = column
        where = f" at column {column}" if column is not None else ""
        super().__init__(f"invalid condition {source!r}{where}: {message}")


@dataclass(frozen=True)
class ValueType:
    """The static type of a condition operand: a kind, plus the allowed values of a
    ``Literal`` field (``None`` when any value of the kind is allowed)."""

    kind: ValueKind
    allowed: tuple[Value, ...] | None = None


@dataclass(frozen=True)
class Condition:
    """A parsed, type-checked condition. Build it with :func:`parse_condition`.

    ``source`` is the text as written; ``names`` are the runtime-config fields it reads.
    """

    source: str
    names: tuple[str, ...]
    tree: ast.expr = field(compare=False, repr=False)


_COMPARE_SYMBOLS: dict[type[ast.cmpop], str] = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.In: "in",
    ast.NotIn: "not in",
}
_ORDERING_OPS = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
_KIND_WORDS: dict[ValueKind, str] = {"int": "an integer", "str": "a string", "bool": "a boolean"}
_MIRRORED: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Eq: ast.Eq,
    ast.NotEq: ast.NotEq,
    ast.Lt: ast.Gt,
    ast.LtE: ast.GtE,
    ast.Gt: ast.Lt,
    ast.GtE: ast.LtE,
}
_MEMBERSHIP_OPS = (ast.In, ast.NotIn)
_COMPARE_WORDS: dict[type[ast.cmpop], str] = {
    ast.Eq: "is",
    ast.NotEq: "is not",
    ast.Lt: "is less than",
    ast.LtE: "is at most",
    ast.Gt: "is greater than",
    ast.GtE: "is at least",
    ast.In: "is one of",
    ast.NotIn: "is none of",
}


def condition_vocabulary(schema: type[BaseModel] = RuntimeConfig) -> Mapping[str, ValueType]:
    """The names a condition may use and their types, derived from ``schema``'s field
    annotations (``int``, ``bool``, ``str`` or a ``Literal`` of one of those).

    Raises ``TypeError`` for a field whose annotation the language cannot express.
    """
    return _vocabulary(schema)


@functools.cache
def _vocabulary(schema: type[BaseModel]) -> Mapping[str, ValueType]:
    vocabulary: dict[str, ValueType] = {}
    for name, info in schema.model_fields.items():
        vocabulary[name] = _value_type_of(name, info.annotation)
    return types.MappingProxyType(vocabulary)


def _value_type_of(name: str, annotation: object) -> ValueType:
    if annotation is bool:
        return ValueType("bool")
    if annotation is int:
        return ValueType("int")
    if annotation is str:
        return ValueType("str")
    if typing.get_origin(annotation) is Literal:
        allowed = typing.get_args(annotation)
        kinds = {_kind_of_value(value) for value in allowed}
        if len(kinds) == 1:
            (kind,) = kinds
            return ValueType(kind, tuple(allowed))
    raise TypeError(f"field {name!r} has annotation {annotation!r}, which conditions cannot use")


def _kind_of_value(value: object) -> ValueKind:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, str):
        return "str"
    raise TypeError(f"unsupported literal value {value!r}")


def parse_condition(source: str, schema: type[BaseModel] = RuntimeConfig) -> Condition:
    """Parse and type-check ``source`` against the fields of ``schema``.

    Returns a :class:`Condition`; raises :class:`ConditionError` (a ``ValueError``) for
    anything outside the whitelist, an unknown name, a type error, or a non-boolean result.
    Results are cached per ``(source, schema)``.
    """
    if not isinstance(source, str):
        raise ConditionError(repr(source), f"a condition must be a string, got {source!r}")
    return _parse_cached(source, schema)


@functools.lru_cache(maxsize=1024)
def _parse_cached(source: str, schema: type[BaseModel]) -> Condition:
    if not source.strip():
        raise ConditionError(source, "the condition is empty")
    if len(source) > MAX_CONDITION_LENGTH:
        raise ConditionError(
            source, f"the condition is {len(source)} characters long; at most "
            f"{MAX_CONDITION_LENGTH} are allowed"
        )
    if "\n" in source or "\r" in source:
        raise ConditionError(source, "a condition must be a single line")
    indent = len(source) - len(source.lstrip())
    try:
        expression = ast.parse(source.strip(), mode="eval")
    except SyntaxError as exc:
        column = exc.offset + indent if exc.offset and exc.offset > 0 else None
        raise ConditionError(source, f"syntax error: {exc.msg}", column) from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise ConditionError(source, f"cannot be parsed: {exc}") from None
    checker = _Checker(source, _vocabulary(schema), indent)
    try:
        checker.check_condition(expression.body, None)
    except RecursionError:
        raise ConditionError(source, "the condition is nested too deeply") from None
    return Condition(source=source, names=tuple(sorted(checker.names)), tree=expression.body)


class _Checker:
    """Walks a parsed expression, rejecting nodes outside the whitelist and computing types."""

    def __init__(self, source: str, vocabulary: Mapping[str, ValueType], indent: int) -> None:
        self.source = source
        self.parsed = source.strip()
        self.vocabulary = vocabulary
        self.indent = indent
        self.names: set[str] = set()

    def fail(self, node: ast.AST, message: str) -> typing.NoReturn:
        offset = getattr(node, "col_offset", None)  # in UTF-8 bytes of the parsed text
        where = None
        if offset is not None:
            characters = len(self.parsed.encode()[:offset].decode("utf-8", "ignore"))
            where = characters + 1 + self.indent
        raise ConditionError(self.source, message, where)

    def check_condition(self, node: ast.expr, operator: str | None) -> None:
        """``node`` is the whole condition (``operator`` is ``None``) or an operand of
        ``and``/``or``/``not``: it must be boolean and not a bare ``True``/``False``."""
        if isinstance(node, ast.Constant) and isinstance(node.value, bool):
            self.fail(node, f"{node.value} on its own is a constant; a condition must depend "
                      "on a runtime-config field")
        kind = self.check(node).kind
        if kind == "bool":
            return
        if operator is None:
            raise ConditionError(
                self.source, f"a condition must be true or false, but this is {_KIND_WORDS[kind]}"
            )
        self.fail(node, f"the operand of '{operator}' must be true or false, not "
                  f"{_KIND_WORDS[kind]}")

    def check(self, node: ast.expr) -> ValueType:
        if isinstance(node, ast.BoolOp):
            for operand in node.values:
                self.check_condition(operand, "and" if isinstance(node.op, ast.And) else "or")
            return ValueType("bool")
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            self.check_condition(node.operand, "not")
            return ValueType("bool")
        if isinstance(node, ast.Compare):
            return self.check_compare(node)
        if isinstance(node, (ast.Name, ast.Constant, ast.UnaryOp)):
            return self.check_atom(node)
        if isinstance(node, (ast.List, ast.Tuple)):
            self.fail(node, "a list or tuple may only appear on the right of 'in' or 'not in'")
        self.fail(node, f"{_describe_node(node)} is not allowed in a condition")

    def check_atom(self, node: ast.expr) -> ValueType:
        if isinstance(node, ast.Name):
            written = ast.get_source_segment(self.parsed, node) or node.id
            if not written.isascii():
                self.fail(node, f"name {written!r} is not ASCII; Python would read it as "
                          f"{node.id!r}, but names must be written exactly as the field is")
            value_type = self.vocabulary.get(node.id)
            if value_type is None:
                known = ", ".join(sorted(self.vocabulary))
                self.fail(node, f"unknown name {node.id!r}; known names are: {known}")
            self.names.add(node.id)
            return value_type
        if isinstance(node, ast.UnaryOp):
            operand = node.operand
            if (
                isinstance(node.op, ast.USub)
                and isinstance(operand, ast.Constant)
                and isinstance(operand.value, int)
                and not isinstance(operand.value, bool)
            ):
                return ValueType("int")
            self.fail(node, "a unary operator other than 'not' is only allowed as a minus sign "
                      "directly before an integer literal")
        if isinstance(node, ast.Constant):
            if isinstance(node.value, (bool, int, str)):
                return ValueType(_kind_of_value(node.value))
            self.fail(node, f"literal {node.value!r} is not allowed; use integers, strings, "
                      "True or False")
        self.fail(node, f"{_describe_node(node)} is not allowed in a condition")

    def check_compare(self, node: ast.Compare) -> ValueType:
        left = node.left
        left_type = self.check(left)
        for position, (op, right) in enumerate(zip(node.ops, node.comparators, strict=True)):
            symbol = _COMPARE_SYMBOLS.get(type(op))
            if symbol is None:
                self.fail(node, f"comparison operator {type(op).__name__} is not allowed")
            if isinstance(op, _MEMBERSHIP_OPS):
                if position != len(node.ops) - 1:
                    self.fail(right, f"the list after '{symbol}' cannot be compared further")
                self.check_membership(left, left_type, symbol, right)
                break
            right_type = self.check(right)
            self.check_pair(left, left_type, symbol, right, right_type, op)
            left, left_type = right, right_type
        return ValueType("bool")

    def check_pair(
        self,
        left: ast.expr,
        left_type: ValueType,
        symbol: str,
        right: ast.expr,
        right_type: ValueType,
        op: ast.cmpop,
    ) -> None:
        if not _reads_a_field(left) and not _reads_a_field(right):
            self.fail(left, f"{_source_of(left)} {symbol} {_source_of(right)} compares literals "
                      "only, so it is always true or always false; compare a runtime-config "
                      "field")
        if isinstance(op, _ORDERING_OPS):
            for operand, operand_type in ((left, left_type), (right, right_type)):
                if operand_type.kind != "int":
                    self.fail(operand, f"'{symbol}' compares integers, but "
                              f"{_source_of(operand)} is {_KIND_WORDS[operand_type.kind]}")
            return
        if left_type.kind != right_type.kind:
            self.fail(right, f"cannot compare {_source_of(left)} "
                      f"({_KIND_WORDS[left_type.kind]}) with {_source_of(right)} "
                      f"({_KIND_WORDS[right_type.kind]}) using '{symbol}'")
        self.check_literal_against(left, left_type, right)
        self.check_literal_against(right, right_type, left)

    def check_membership(
        self, left: ast.expr, left_type: ValueType, symbol: str, right: ast.expr
    ) -> None:
        if not isinstance(right, (ast.List, ast.Tuple)):
            self.fail(right, f"the right side of '{symbol}' must be a list or tuple literal")
        if not _reads_a_field(left):
            self.fail(left, f"the left side of '{symbol}' must read a runtime-config field; "
                      f"{_source_of(left)} {symbol} a list of literals is always true or always "
                      "false")
        if not right.elts:
            self.fail(right, f"the list after '{symbol}' is empty")
        for element in right.elts:
            if not isinstance(element, (ast.Constant, ast.UnaryOp)):
                self.fail(element, f"the list after '{symbol}' may only hold literals")
            element_type = self.check_atom(element)
            if element_type.kind != left_type.kind:
                self.fail(element, f"{_source_of(element)} ({_KIND_WORDS[element_type.kind]}) "
                          f"cannot be compared with {_source_of(left)} "
                          f"({_KIND_WORDS[left_type.kind]})")
            self.check_literal_against(left, left_type, element)

    def check_literal_against(
        self, named: ast.expr, named_type: ValueType, literal: ast.expr
    ) -> None:
        """A literal compared with a ``Literal``-typed field must be one of its values."""
        if named_type.allowed is None or not isinstance(literal, ast.Constant):
            return
        if literal.value not in named_type.allowed:
            allowed = ", ".join(repr(value) for value in named_type.allowed)
            self.fail(literal, f"{literal.value!r} is not a possible value of "
                      f"{_source_of(named)}; possible values are: {allowed}")


def _describe_node(node: ast.AST) -> str:
    descriptions: dict[type[ast.AST], str] = {
        ast.Call: "a function call",
        ast.Attribute: "attribute access",
        ast.Subscript: "subscripting",
        ast.Lambda: "a lambda",
        ast.JoinedStr: "an f-string",
        ast.ListComp: "a comprehension",
        ast.SetComp: "a comprehension",
        ast.DictComp: "a comprehension",
        ast.GeneratorExp: "a generator expression",
        ast.BinOp: "arithmetic",
        ast.IfExp: "a conditional expression",
        ast.NamedExpr: "an assignment expression",
        ast.Starred: "unpacking",
        ast.Dict: "a dict",
        ast.Set: "a set",
        ast.Await: "await",
        ast.Yield: "yield",
        ast.YieldFrom: "yield",
        ast.Slice: "a slice",
    }
    return descriptions.get(type(node), f"syntax {type(node).__name__}")


def _source_of(node: ast.expr) -> str:
    return ast.unparse(node)


def _reads_a_field(node: ast.expr) -> bool:
    return any(isinstance(child, ast.Name) for child in ast.walk(node))


def evaluate_condition(condition: Condition | str, config: BaseModel) -> bool:
    """Evaluate ``condition`` against ``config`` by walking its checked tree.

    A string is parsed first against ``type(config)``, so a bad string raises
    :class:`ConditionError`. Never calls ``eval``.
    """
    parsed = _as_condition(condition, type(config))
    result = _evaluate(parsed.tree, config)
    if not isinstance(result, bool):
        raise TypeError(f"condition {parsed.source!r} produced {result!r}, not a bool")
    return result


def _as_condition(condition: Condition | str, schema: type[BaseModel]) -> Condition:
    if isinstance(condition, Condition):
        return condition
    return parse_condition(condition, schema)


def _evaluate(node: ast.expr, config: BaseModel) -> Value:
    if isinstance(node, ast.BoolOp):
        if isinstance(node.op, ast.And):
            return all(_evaluate(operand, config) for operand in node.values)
        return any(_evaluate(operand, config) for operand in node.values)
    if isinstance(node, ast.UnaryOp):
        if isinstance(node.op, ast.Not):
            return not _evaluate(node.operand, config)
        operand = _literal(node.operand)
        if isinstance(operand, str):
            raise TypeError(f"unchecked negation of {operand!r} reached the evaluator")
        return -operand
    if isinstance(node, ast.Compare):
        left = _evaluate(node.left, config)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            if isinstance(op, _MEMBERSHIP_OPS):
                assert isinstance(right_node, (ast.List, ast.Tuple))
                members = [_evaluate(element, config) for element in right_node.elts]
                return _compare(op, left, members)
            right = _evaluate(right_node, config)
            if not _compare(op, left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Name):
        value: Value = getattr(config, node.id)
        return value
    return _literal(node)


def _literal(node: ast.expr) -> int | str | bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, (bool, int, str)):
        return node.value
    raise TypeError(f"unchecked node {ast.dump(node)} reached the evaluator")


def _compare(op: ast.cmpop, left: Value, right: Value | list[Value]) -> bool:
    match op:
        case ast.Eq():
            return left == right
        case ast.NotEq():
            return left != right
        case ast.Lt():
            return left < right  # type: ignore[operator]
        case ast.LtE():
            return left <= right  # type: ignore[operator]
        case ast.Gt():
            return left > right  # type: ignore[operator]
        case ast.GtE():
            return left >= right  # type: ignore[operator]
        case ast.In():
            return left in right  # type: ignore[operator]
        case ast.NotIn():
            return left not in right  # type: ignore[operator]
    raise TypeError(f"unchecked operator {type(op).__name__} reached the evaluator")


def describe_condition(condition: Condition | str, schema: type[BaseModel] = RuntimeConfig) -> str:
    """Render ``condition`` in words for docs and reasons, e.g. ``dcp_world_size == 1`` ->
    "`dcp_world_size` is 1". Names are wrapped in backticks (Markdown code)."""
    return _words(_as_condition(condition, schema).tree, top=True)


def _words(node: ast.expr, *, top: bool = False) -> str:
    if isinstance(node, ast.BoolOp):
        joiner = " and " if isinstance(node.op, ast.And) else " or "
        text = joiner.join(_words(operand) for operand in node.values)
        return text if top else f"({text})"
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return f"not {_words(node.operand)}"
    if isinstance(node, ast.Compare):
        parts: list[str] = []
        left = node.left
        for op, right in zip(node.ops, node.comparators, strict=True):
            words = _COMPARE_WORDS[type(op)]
            if isinstance(op, _MEMBERSHIP_OPS):
                assert isinstance(right, (ast.List, ast.Tuple))
                members = ", ".join(_words(element) for element in right.elts)
                parts.append(f"{_words(left)} {words} {members}")
            elif isinstance(left, ast.Name) and isinstance(right, ast.Name) and type(op) in (
                ast.Eq,
                ast.NotEq,
            ):
                verb = "equals" if isinstance(op, ast.Eq) else "differs from"
                parts.append(f"{_words(left)} {verb} {_words(right)}")
            elif not isinstance(left, ast.Name) and isinstance(right, ast.Name):
                mirrored = _COMPARE_WORDS[_MIRRORED[type(op)]]
                parts.append(f"{_words(right)} {mirrored} {_words(left)}")
            else:
                parts.append(f"{_words(left)} {words} {_words(right)}")
            left = right
        text = " and ".join(parts)
        return text if top or len(parts) == 1 else f"({text})"
    if isinstance(node, ast.Name):
        return f"`{node.id}`"
    if isinstance(node, ast.UnaryOp):
        return f"-{_literal(node.operand)}"
    value = _literal(node)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"'{value}'"
    return str(value)


def explain_unmet(condition: Condition | str, config: BaseModel) -> str:
    """Say why ``condition`` does not hold for ``config``, with the actual values, e.g.
    "requires dcp_world_size == 1, but dcp_world_size is 2".

    For a top-level ``and`` only the conjuncts that fail are named. Meant for conditions
    that evaluate to false; for one that holds it still reports the values it read.
    """
    parsed = _as_condition(condition, type(config))
    tree = parsed.tree
    failing: list[ast.expr] = [tree]
    if isinstance(tree, ast.BoolOp) and isinstance(tree.op, ast.And):
        failing = [operand for operand in tree.values if not _evaluate(operand, config)] or [tree]
    clauses = " and ".join(_unparse_clause(node, len(failing) > 1) for node in failing)
    names: list[str] = []
    for node in failing:
        for name in _names_in(node):
            if name not in names:
                names.append(name)
    values = " and ".join(f"{name} is {getattr(config, name)!r}" for name in names)
    return f"requires {clauses}, but {values}"


def _unparse_clause(node: ast.expr, several: bool) -> str:
    text = ast.unparse(node)
    if several and isinstance(node, ast.BoolOp):
        return f"({text})"
    return text


def _names_in(node: ast.expr) -> list[str]:
    """Names read by ``node``, each once, in source order."""
    found = sorted(
        (child.col_offset, child.id) for child in ast.walk(node) if isinstance(child, ast.Name)
    )
    names: list[str] = []
    for _, name in found:
        if name not in names:
            names.append(name)
    return names
