"""The mutation operators: each finds, in a module's AST, the places it can change and says
how, as :class:`Edit` records (a source span and its replacement text), never touching the
rest of the file, so a mutant's line numbers are the original's.

Only code inside function bodies is mutated (module- and class-level statements build the
module; changing them breaks imports, not behaviour), never docstrings, annotations, ``raise``
statements or f-strings (messages, not values).
"""

from __future__ import annotations

import ast
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass

_STATEMENT_LISTS = ("body", "orelse", "finalbody", "handlers", "cases")
"""Fields of a compound statement that hold statements (walked as statements, not as
expressions of the compound statement)."""

_CLIPPING_CALLS = frozenset({"min", "max", "clamp", "clamp_", "clip", "clip_"})
"""Calls that bound their argument: an off-by-one inside one may be clipped away."""

_VIEW_METHODS = frozenset({
    "view", "narrow", "unsqueeze", "squeeze", "expand", "transpose", "permute", "select",
    "flatten", "unflatten", "as_strided", "t", "view_as", "expand_as", "unbind",
})
"""Tensor methods that return views of their receiver's storage."""

_ATOMIC = (ast.Name, ast.Attribute, ast.Call, ast.Subscript)
"""Expressions that take a method call or an operator without parentheses."""

_HOST_VALUE_PREFIXES = ("num_", "max_", "min_", "is_", "use_", "has_", "causal")
"""Keyword names that, by convention, carry host values (counts, flags), not tensors: a
snapshot of them is not a view replaced by a snapshot (and ``.clone()`` on one would only
crash)."""

_COMPARISON_FLIPS: dict[type[ast.cmpop], tuple[str, str]] = {
    ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
    ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="),
}
"""Each flipped comparison: its source text and the text it becomes."""


class Operator(enum.StrEnum):
    """The mutation operators (issue 44's list)."""

    STATEMENT_DELETED = "statement_deleted"
    """An assignment, augmented assignment or expression statement replaced by ``pass``."""
    OFF_BY_ONE = "off_by_one"
    """An integer constant ``c`` made ``c + 1`` and ``c - 1`` (so ``x + 1`` becomes ``x + 2``
    and ``x + 0``)."""
    COMPARISON_FLIPPED = "comparison_flipped"
    """``<`` and ``<=``, ``>`` and ``>=``, ``==`` and ``!=`` swapped."""
    SLICE_BOUND = "slice_bound"
    """A non-constant slice bound ``n`` made ``n - 1`` and ``n + 1``."""
    IN_PLACE_TARGET = "in_place_target"
    """An in-place write redirected to a fresh tensor: ``x.copy_(y)`` (any in-place method
    whose result is dropped) becomes ``x.clone().copy_(y)``, ``x[i] = y`` becomes
    ``x.clone()[i] = y``, ``out=x`` becomes ``out=x.clone()``."""
    VIEW_SNAPSHOT = "view_snapshot"
    """A view replaced by a snapshot: a slice or view method assigned to a name, or a field
    handed to a record's constructor (``Metadata(block_table=common.block_table)``), gets
    ``.clone()``."""


@dataclass(frozen=True)
class Edit:
    """One change to a module's source: the span from ``line:col`` to ``end_line:end_col``
    (1-based lines, 0-based UTF-8 byte columns, as the AST gives them) becomes
    ``replacement``."""

    line: int
    col: int
    end_line: int
    end_col: int
    replacement: str
    description: str
    """What changed, in a few words (``'<' -> '<='``)."""
    clipped: bool = False
    """The changed value is an argument of ``min``/``max``/``clamp`` (a hint that the
    mutant may be equivalent: the bound can be clipped away)."""


def function_statements(tree: ast.Module) -> Iterator[ast.stmt]:
    """Every statement inside a function body of ``tree`` (nested blocks included, nested
    functions' statements once each), docstrings left out."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _block(node.body)


def _block(statements: list[ast.stmt]) -> Iterator[ast.stmt]:
    for index, statement in enumerate(statements):
        if index == 0 and _is_docstring(statement):
            continue
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        yield statement
        for field in _STATEMENT_LISTS:
            for child in getattr(statement, field, None) or []:
                if isinstance(child, ast.ExceptHandler | ast.match_case):
                    yield from _block(child.body)
                elif isinstance(child, ast.stmt):
                    yield from _block([child])


def _is_docstring(statement: ast.stmt) -> bool:
    return (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
            and isinstance(statement.value.value, str))


def _expressions(statement: ast.stmt) -> Iterator[tuple[ast.expr, list[ast.AST]]]:
    """The expressions of ``statement`` itself (not of the statements it holds), each with
    its ancestors within the statement (outermost first); none inside f-strings, lambdas,
    annotations or ``raise`` statements."""
    if isinstance(statement, ast.Raise):
        return
    for field, value in ast.iter_fields(statement):
        if field in _STATEMENT_LISTS or field in ("annotation", "returns", "type_comment"):
            continue
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, ast.expr | ast.keyword | ast.withitem | ast.comprehension):
                yield from _walk(child, [statement])


def _walk(node: ast.AST, ancestors: list[ast.AST]) -> Iterator[tuple[ast.expr, list[ast.AST]]]:
    if isinstance(node, ast.JoinedStr | ast.Lambda):
        return
    if isinstance(node, ast.expr):
        yield node, ancestors
    for child in ast.iter_child_nodes(node):
        yield from _walk(child, [*ancestors, node])


def _span(node: ast.AST, replacement: str, description: str, *, clipped: bool = False) -> Edit:
    end_line, end_col = node.end_lineno, node.end_col_offset  # type: ignore[attr-defined]
    assert end_line is not None and end_col is not None
    return Edit(node.lineno, node.col_offset, end_line, end_col,  # type: ignore[attr-defined]
                replacement, description, clipped)


def _text(node: ast.AST, source: str) -> str:
    segment = ast.get_source_segment(source, node)
    return segment if segment is not None else ast.unparse(node)


def _call_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else ""


def _clipped(ancestors: list[ast.AST]) -> bool:
    return any(isinstance(a, ast.Call) and _call_name(a) in _CLIPPING_CALLS for a in ancestors)


def statement_deleted(tree: ast.Module, source: str) -> Iterator[Edit]:
    """Assignments, augmented assignments, annotated assignments with a value and expression
    statements replaced by ``pass``; not a bare constant (``...`` of a protocol's stub, a
    string), which does nothing to delete."""
    for statement in function_statements(tree):
        if isinstance(statement, ast.AnnAssign) and statement.value is None:
            continue
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue
        if isinstance(statement, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Expr):
            first_line = _text(statement, source).splitlines()[0]
            yield _span(statement, "pass", f"deleted `{first_line.strip()}`")


def off_by_one(tree: ast.Module, source: str) -> Iterator[Edit]:
    """Every integer constant ``c`` (not a bool) as ``c + 1`` and as ``c - 1``."""
    for statement in function_statements(tree):
        for node, ancestors in _expressions(statement):
            if not (isinstance(node, ast.Constant) and type(node.value) is int):
                continue
            for changed in (node.value + 1, node.value - 1):
                text = str(changed) if changed >= 0 else f"({changed})"
                yield _span(node, text, f"{node.value} -> {changed}", clipped=_clipped(ancestors))


def comparison_flipped(tree: ast.Module, source: str) -> Iterator[Edit]:
    """Each ``<``, ``<=``, ``>``, ``>=``, ``==``, ``!=`` of a comparison flipped: the text
    between its two operands is rewritten, nothing else."""
    for statement in function_statements(tree):
        for node, _ in _expressions(statement):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, operands, operands[1:], strict=False):
                flip = _COMPARISON_FLIPS.get(type(op))
                if flip is None:
                    continue
                gap = _gap(source, left, right)
                if gap is None or gap.count(flip[0]) != 1 or (flip[0] in "<>" and "=" in gap):
                    continue
                yield Edit(left.end_lineno, left.end_col_offset,  # type: ignore[arg-type]
                           right.lineno, right.col_offset, gap.replace(flip[0], flip[1]),
                           f"'{flip[0]}' -> '{flip[1]}'")


def _gap(source: str, left: ast.expr, right: ast.expr) -> str | None:
    """The source text between two operands (the operator, spaces, parentheses), or
    ``None`` when it spans lines (a comment could hide an operator there)."""
    if left.end_lineno != right.lineno or left.end_col_offset is None:
        return None
    line = source.splitlines()[right.lineno - 1].encode("utf-8")
    return line[left.end_col_offset:right.col_offset].decode("utf-8")


def slice_bound(tree: ast.Module, source: str) -> Iterator[Edit]:
    """Each non-constant bound ``n`` of a slice (``[:n]``, ``[n:]``) as ``n - 1`` and
    ``n + 1`` (constant bounds are :func:`off_by_one`'s)."""
    for statement in function_statements(tree):
        for node, ancestors in _expressions(statement):
            if not isinstance(node, ast.Slice):
                continue
            for bound in (node.lower, node.upper):
                if bound is None or _is_integer_literal(bound):
                    continue
                text = _text(bound, source)
                operand = text if isinstance(bound, _ATOMIC) else f"({text})"
                for sign in ("-", "+"):
                    yield _span(bound, f"{operand} {sign} 1", f"slice bound {text} {sign} 1",
                                clipped=_clipped(ancestors))


def _is_integer_literal(node: ast.expr) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) is int


def in_place_target(tree: ast.Module, source: str) -> Iterator[Edit]:
    """In-place writes redirected to a fresh tensor: the receiver of an in-place method
    (``name_``) whose result is dropped, the target of a subscript assignment, and an
    ``out=`` argument, each followed by ``.clone()``."""
    for statement in function_statements(tree):
        targets: list[ast.expr] = []
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call):
            func = statement.value.func
            if (isinstance(func, ast.Attribute) and func.attr.endswith("_")
                    and not func.attr.startswith("_")):
                targets.append(func.value)
        if isinstance(statement, ast.Assign | ast.AugAssign):
            written = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            targets += [t.value for t in written if isinstance(t, ast.Subscript)]
        for node, _ in _expressions(statement):
            if isinstance(node, ast.Call):
                targets += [k.value for k in node.keywords if k.arg == "out"]
        for target in targets:
            if isinstance(target, _ATOMIC):
                text = _text(target, source)
                yield _span(target, f"{text}.clone()", f"writes into {text}.clone()")


def view_snapshot(tree: ast.Module, source: str) -> Iterator[Edit]:
    """Views of persistent buffers replaced by snapshots (``.clone()``): a slice or
    view-method result of an attribute of ``self`` (a buffer the object keeps) assigned to
    a name or an attribute (each element of a tuple assigned at once), and a name,
    attribute, slice or view handed as a keyword to a record constructor (a call of a
    capitalised name: the metadata), except keywords named like host values (``num_*``,
    ``max_*``, …). Slices of local tensors are left alone: a snapshot of a temporary
    changes nothing."""
    for statement in function_statements(tree):
        values: list[ast.expr] = []
        if isinstance(statement, ast.Assign | ast.AnnAssign) and statement.value is not None:
            value = statement.value
            elements = value.elts if isinstance(value, ast.Tuple) else [value]
            values += [e for e in elements if _is_view(e) and _root_name(e) == "self"]
        for node, _ in _expressions(statement):
            if isinstance(node, ast.Call) and _call_name(node)[:1].isupper():
                values += [k.value for k in node.keywords
                           if k.arg is not None and not k.arg.startswith(_HOST_VALUE_PREFIXES)
                           and (isinstance(k.value, ast.Name | ast.Attribute) or _is_view(k.value))]
        for value in values:
            text = _text(value, source)
            yield _span(value, f"{text}.clone()", f"{text} snapshotted (.clone())")


def _root_name(node: ast.expr) -> str | None:
    """The name an attribute, subscript or method-call chain starts from (``self`` for
    ``self.buf[:n].view(-1)``)."""
    while True:
        if isinstance(node, ast.Attribute | ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        else:
            return node.id if isinstance(node, ast.Name) else None


def _is_view(node: ast.expr) -> bool:
    if isinstance(node, ast.Subscript):
        index = node.slice
        parts = index.elts if isinstance(index, ast.Tuple) else [index]
        return any(isinstance(part, ast.Slice) for part in parts)
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
        and node.func.attr in _VIEW_METHODS


OPERATORS: dict[Operator, Callable[[ast.Module, str], Iterator[Edit]]] = {
    Operator.STATEMENT_DELETED: statement_deleted,
    Operator.OFF_BY_ONE: off_by_one,
    Operator.COMPARISON_FLIPPED: comparison_flipped,
    Operator.SLICE_BOUND: slice_bound,
    Operator.IN_PLACE_TARGET: in_place_target,
    Operator.VIEW_SNAPSHOT: view_snapshot,
}
"""Each operator's edit finder: ``(tree, source) -> edits``."""


def apply_edit(source: str, edit: Edit) -> str:
    """``source`` with ``edit``'s span replaced (columns are UTF-8 byte offsets)."""
    data = source.encode("utf-8")
    starts = [0]
    for line in data.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    begin = starts[edit.line - 1] + edit.col
    end = starts[edit.end_line - 1] + edit.end_col
    return (data[:begin] + edit.replacement.encode("utf-8") + data[end:]).decode("utf-8")
