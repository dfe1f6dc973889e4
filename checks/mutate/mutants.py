"""Mutant generation: every edit of every chosen operator on every target module, as a
whole mutated module with its location and a short description, deduplicated; and the
deterministic sample a run takes when it may not run them all."""

from __future__ import annotations

import ast
import builtins
import random
import re
import symtable
import textwrap
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
    function: str
    """The qualified name of the innermost function holding the edit (``Class.method``)."""
    compiles: bool
    """Whether the mutated module compiles."""
    unbound: tuple[str, ...] = ()
    """Names (and ``Class.self.attr`` attributes) the mutated module reads where nothing
    binds them any more (the edit deleted their only binding): a name checker (mypy,
    pyflakes) rejects such a module before it runs, as a compiler rejects a stillborn
    mutant."""
    deleted_bindings: tuple[str, ...] = ()
    """The local names a deleted statement bound (``statement_deleted``): where the run
    then reads one before any other binding (an ``UnboundLocalError`` naming it), the
    mutant is as stillborn as :attr:`unbound` (:func:`~speccheck.checks.mutate.runner.
    judge`)."""

    @property
    def valid(self) -> bool:
        """Whether the mutant can be judged by running it: it compiles and binds every name
        it reads (an invalid one is not run and not scored)."""
        return self.compiles and not self.unbound

    @property
    def invalid_reason(self) -> str:
        """Why an invalid mutant is (empty for a valid one)."""
        if not self.compiles:
            return "does not compile"
        if self.unbound:
            return f"leaves {', '.join(self.unbound)} unbound (a name checker rejects it)"
        return ""

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
        functions = function_spans(tree)
        unbound_in_source = unbound_names(source, str(target.path)) | unbound_attributes(source)
        for operator in chosen:
            for edit in OPERATORS[operator](tree, source):
                mutated = apply_edit(source, edit)
                if mutated == source or (target, mutated) in seen:
                    continue
                seen.add((target, mutated))
                function = next((name for first, last, name in functions
                                 if first <= edit.line <= last), "")
                mutants.append(_mutant(len(mutants) + 1, operator, target, source, mutated,
                                       edit, function, unbound_in_source))
    return mutants


def function_spans(tree: ast.Module) -> list[tuple[int, int, str]]:
    """``(first line, last line, qualified name)`` of every function in ``tree``, innermost
    first (a line's first match is the function that holds it)."""
    spans: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                visit(child, f"{name}.")
                if not isinstance(child, ast.ClassDef):
                    spans.append((child.lineno, child.end_lineno or child.lineno, name))
            else:
                visit(child, prefix)

    visit(tree, "")
    return spans


def _mutant(number: int, operator: Operator, target: TargetModule, source: str, mutated: str,
            edit: Edit, function: str, unbound_before: frozenset[str]) -> Mutant:
    """One mutant of ``source``; ``unbound_before``: what ``source`` itself leaves unbound
    (:func:`unbound_names`, :func:`unbound_attributes`), computed once per module."""
    try:
        compile(mutated, str(target.path), "exec", dont_inherit=True)
        compiles = True
    except (SyntaxError, ValueError):
        compiles = False
    unbound: tuple[str, ...] = ()
    if compiles:
        after = unbound_names(mutated, str(target.path)) | unbound_attributes(mutated)
        unbound = tuple(sorted(after - unbound_before))
    return Mutant(
        number=number, operator=operator, target=target, line=edit.line,
        end_line=edit.end_line, description=edit.description,
        original_line=source.splitlines()[edit.line - 1].strip(),
        mutated_line=mutated.splitlines()[edit.line - 1].strip(), source=mutated,
        clipped=edit.clipped, function=function, compiles=compiles, unbound=unbound,
        deleted_bindings=(bound_names(source, edit) if operator is Operator.STATEMENT_DELETED
                          else ()),
    )


def bound_names(source: str, edit: Edit) -> tuple[str, ...]:
    """The plain names the statements of ``source`` that ``edit`` replaces bind
    (assignment, loop and ``with`` targets), in order; none where that span does not
    parse on its own."""
    lines = source.splitlines()[edit.line - 1:edit.end_line]
    try:
        tree = ast.parse(textwrap.dedent("\n".join(lines)))
    except SyntaxError:
        return ()
    stored = (node.id for node in ast.walk(tree)
              if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store))
    return tuple(dict.fromkeys(stored))


TRIVIAL_BASES = frozenset({"object", "Protocol", "Generic"})
"""Base classes that bind no instance attribute."""


def unbound_attributes(source: str) -> frozenset[str]:
    """``Class.self.attr`` for each attribute a method of ``Class`` reads from ``self`` that
    nothing binds: no method of the class or of its bases in ``source`` stores it, and no
    class body assigns, annotates or defines it. Only classes whose bases are all in
    ``source`` (or bind nothing: ``object``, ``Protocol``, ``Generic``) are judged: a base
    from elsewhere may bind anything."""
    tree = ast.parse(source)
    classes = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}

    def base_names(cls: ast.ClassDef) -> list[str] | None:
        names = []
        for base in cls.bases:
            node = base.value if isinstance(base, ast.Subscript) else base
            if not isinstance(node, ast.Name):
                return None
            names.append(node.id)
        return names

    def bound(cls: ast.ClassDef, seen: frozenset[str] = frozenset()) -> set[str] | None:
        bases = base_names(cls)
        if bases is None or cls.name in seen:
            return None
        names: set[str] = set()
        for base in bases:
            if base in TRIVIAL_BASES:
                continue
            if base not in classes:
                return None
            inherited = bound(classes[base], seen | {cls.name})
            if inherited is None:
                return None
            names |= inherited
        for statement in cls.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(statement.name)
            elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                names.add(statement.target.id)
            elif isinstance(statement, ast.Assign):
                names |= {t.id for t in statement.targets if isinstance(t, ast.Name)}
        for node in ast.walk(cls):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del))
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
        return names

    found: set[str] = set()
    for cls in classes.values():
        names = bound(cls)
        if names is None:
            continue
        for node in ast.walk(cls):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"
                    and node.attr not in names):
                found.add(f"{cls.name}.self.{node.attr}")
    return frozenset(found)


def unbound_names(source: str, filename: str) -> frozenset[str]:
    """The names ``source`` reads, in any scope, that no scope it can see binds: not the
    reading scope itself, an enclosing function, the module (an assignment, import, ``def``
    or ``class`` anywhere at its top level) nor the builtins. What the compiler's symbol
    table tells (:mod:`symtable`), as a name checker reads it; ``source`` must compile."""
    top = symtable.symtable(source, filename, "exec")
    module = {sym.get_name() for sym in top.get_symbols()
              if sym.is_assigned() or sym.is_imported() or sym.is_namespace()}
    known = module | set(dir(builtins)) | {"__file__", "__name__", "__doc__", "__spec__",
                                           "__package__", "__loader__", "__builtins__"}
    found: set[str] = set()

    def visit(table: symtable.SymbolTable) -> None:
        for sym in table.get_symbols():
            if not sym.is_referenced() or sym.get_name() in known:
                continue
            if table is top or sym.is_global():
                found.add(sym.get_name())
        for child in table.get_children():
            visit(child)

    visit(top)
    return frozenset(found)


def sample_mutants(mutants: list[Mutant], limit: int | None, seed: int) -> list[Mutant]:
    """At most ``limit`` of ``mutants`` (all for ``None``): a random sample drawn with
    ``seed``, so every module and operator is represented in proportion, back in generation
    order."""
    if limit is None or limit >= len(mutants):
        return list(mutants)
    picked = random.Random(seed).sample(mutants, limit)
    return sorted(picked, key=lambda mutant: mutant.number)


@dataclass(frozen=True)
class Shard:
    """One of ``count`` disjoint parts of a run's mutants (``--shard INDEX/COUNT``): every
    ``count``-th of them in generation order, from the ``index``-th (1-based), so that runs
    of all parts on several machines together cover the run once."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        """``"2/4"`` as a shard; :class:`ValueError` (one line) for anything else."""
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if match is None:
            raise ValueError(f"{text!r} is not INDEX/COUNT (e.g. 1/4)")
        index, count = int(match[1]), int(match[2])
        if not 1 <= index <= count:
            raise ValueError(f"{text!r}: INDEX must be 1 to COUNT")
        return cls(index, count)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def of(self, mutants: list[Mutant]) -> list[Mutant]:
        """This shard's part of ``mutants``."""
        return mutants[self.index - 1::self.count]
