"""The condition language: whitelist, type checks, evaluation, rendering in words."""

from __future__ import annotations

import builtins
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from speccheck.contract.conditions import (
    Condition,
    ConditionError,
    condition_vocabulary,
    describe_condition,
    evaluate_condition,
    explain_unmet,
    parse_condition,
)
from speccheck.contract.runtime_config import RuntimeConfig

CUDA_DCP2 = RuntimeConfig(platform="cuda", dcp_world_size=2, block_size=16, max_model_len=4096)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("dcp_world_size == 1", False),
        ("dcp_world_size != 1", True),
        ("dcp_world_size >= 2 and dcp_world_size <= 2", True),
        ("1 <= dcp_world_size < 2", False),
        ("1 < dcp_world_size < 3 <= block_size", True),
        ("platform == 'cuda' and (dp_size > 1 or dcp_world_size == 2)", True),
        ('platform in ["cuda", "rocm"]', True),
        ("platform not in ('cpu',)", True),
        ("block_size in [8, 32]", False),
        ("not advance_draft_positions", False),
        ("advance_draft_positions == True", True),
        ("block_size == max_model_len", False),
        ("block_size > -1", True),
        ("advance_draft_positions != False", True),
        ("not (platform == 'cuda')", False),
    ],
)
def test_evaluates_like_python(source: str, expected: bool) -> None:
    assert evaluate_condition(parse_condition(source), CUDA_DCP2) is expected
    assert evaluate_condition(source, CUDA_DCP2) is expected


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        ("__import__('os').system('x')", "a function call is not allowed"),
        ("config.dcp_world_size == 1", "attribute access is not allowed"),
        ("platform.upper() == 'CUDA'", "a function call is not allowed"),
        ("[1, 2][0] == 1", "subscripting is not allowed"),
        ("(lambda: True)()", "a function call is not allowed"),
        ("lambda: True", "a lambda is not allowed"),
        ("f'{platform}' == 'cuda'", "an f-string is not allowed"),
        ("dcp_world_size in [x for x in [1, 2]]", "must be a list or tuple literal"),
        ("dcp_world_size in [dp_size]", "may only hold literals"),
        ("[x for x in [1]] == [1]", "a comprehension is not allowed"),
        ("any(x for x in [1])", "a function call is not allowed"),
        ("dcp_world_size + 1 == 2", "arithmetic is not allowed"),
        ("(dcp_world_size := 2) == 2", "an assignment expression is not allowed"),
        ("True if platform else False", "a conditional expression is not allowed"),
        ("{1: 2} == {1: 2}", "a dict is not allowed"),
        ("dcp_world_size in {1, 2}", "must be a list or tuple literal"),
        ("dcp_world_size is 1", "comparison operator Is is not allowed"),
        ("~dcp_world_size == 1", "unary operator other than 'not'"),
        ("dcp_size == 1", "unknown name 'dcp_size'"),
        ("__builtins__ == 1", "unknown name '__builtins__'"),
        ("platform == 'tpu'", "'tpu' is not a possible value of platform"),
        ("platform in ['cuda', 'tpu']", "'tpu' is not a possible value of platform"),
        ("block_size < 'a'", "'<' compares integers"),
        ("platform < 'cuda'", "'<' compares integers"),
        ("advance_draft_positions == 1", "cannot compare advance_draft_positions (a boolean)"),
        ("dcp_world_size == 'one'", "cannot compare dcp_world_size (an integer)"),
        ("dcp_world_size in ['a']", "cannot be compared with dcp_world_size"),
        ("dcp_world_size", "must be true or false, but this is an integer"),
        ("not dcp_world_size", "the operand of 'not' must be true or false"),
        ("dcp_world_size and True", "the operand of 'and' must be true or false"),
        ("dcp_world_size in dp_size", "must be a list or tuple literal"),
        ("dcp_world_size in []", "is empty"),
        ("dcp_world_size in [1] == True", "cannot be compared further"),
        ("1.5 < block_size", "literal 1.5 is not allowed"),
        ("None == None", "literal None is not allowed"),
        ("b'x' == b'x'", "literal b'x' is not allowed"),
        ("dcp_world_size ==", "syntax error"),
        ("dcp_world_size = 1", "syntax error"),
        ("import os", "syntax error"),
        ("", "the condition is empty"),
        ("dcp_world_size == 1\nor True", "single line"),
        ("x" * 1001, "at most 1000"),
        ("a\x00", "cannot"),
        ("ｄｃｐ_world_size == 1", "name 'ｄｃｐ_world_size' is not ASCII"),
        ("dcp_world_size == 1 or ｂlock_size == 2", "is not ASCII"),
        ("Ｔｒｕｅ", "is not ASCII"),
        ("1 == 1", "1 == 1 compares literals only"),
        ("'cuda' != 'rocm'", "compares literals only"),
        ("1 < 2 < dcp_world_size", "1 < 2 compares literals only"),
        ("dcp_world_size == 1 or 1 == 1", "compares literals only"),
        ("1 in [1, 2]", "the left side of 'in' must read a runtime-config field"),
        ("(1 == 1) == (dcp_world_size == 1)", "1 == 1 compares literals only"),
        ("True", "True on its own is a constant"),
        ("not False", "False on its own is a constant"),
        ("dcp_world_size == 1 and True", "True on its own is a constant"),
    ],
)
def test_rejects_everything_off_the_whitelist(source: str, fragment: str) -> None:
    with pytest.raises(ConditionError) as excinfo:
        parse_condition(source)
    assert fragment in str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)


def test_columns_count_characters_not_bytes() -> None:
    class Labelled(BaseModel):
        label: str
        size: int

    with pytest.raises(ConditionError) as excinfo:
        parse_condition("label == 'ｃｕｄａ' or size == 'x'", Labelled)
    assert excinfo.value.column == 28  # the quote of 'x', in characters


def test_errors_point_at_the_offending_column() -> None:
    with pytest.raises(ConditionError) as excinfo:
        parse_condition("dcp_world_size == 1 and platform == 'tpu'")
    assert excinfo.value.column == 37
    assert str(excinfo.value).startswith(
        "invalid condition \"dcp_world_size == 1 and platform == 'tpu'\" at column 37: "
    )


def test_never_calls_eval_or_exec(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("eval/exec must never be called")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    condition = parse_condition("platform == 'cuda' and not (dcp_world_size > 1) or dp_size == 1")
    assert evaluate_condition(condition, CUDA_DCP2) is True


def test_vocabulary_follows_runtime_config() -> None:
    vocabulary = condition_vocabulary()
    assert set(vocabulary) == set(RuntimeConfig.model_fields)
    assert vocabulary["dcp_world_size"].kind == "int"
    assert vocabulary["advance_draft_positions"].kind == "bool"
    assert vocabulary["platform"].kind == "str"
    assert vocabulary["platform"].allowed == ("cuda", "rocm", "cpu")


def test_parsed_condition_records_names_and_source() -> None:
    condition = parse_condition("block_size == max_model_len and dcp_world_size == 1")
    assert condition.names == ("block_size", "dcp_world_size", "max_model_len")
    assert condition.source == "block_size == max_model_len and dcp_world_size == 1"
    assert condition == parse_condition(condition.source)


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("dcp_world_size == 1", "`dcp_world_size` is 1"),
        ("block_size == max_model_len", "`block_size` equals `max_model_len`"),
        ("1 <= dcp_world_size < 8", "`dcp_world_size` is at least 1 and `dcp_world_size` is "
         "less than 8"),
        ("platform in ['cuda', 'rocm']", "`platform` is one of 'cuda', 'rocm'"),
        ("not advance_draft_positions", "not `advance_draft_positions`"),
        ("dp_size == 1 or (platform != 'rocm' and block_size >= 16)",
         "`dp_size` is 1 or (`platform` is not 'rocm' and `block_size` is at least 16)"),
    ],
)
def test_describe_condition_in_words(source: str, words: str) -> None:
    assert describe_condition(source) == words


@pytest.mark.parametrize(
    ("source", "config", "explanation"),
    [
        ("dcp_world_size == 1", CUDA_DCP2, "requires dcp_world_size == 1, but dcp_world_size is 2"),
        (
            "block_size == max_model_len",
            CUDA_DCP2,
            "requires block_size == max_model_len, but block_size is 16 and max_model_len is 4096",
        ),
        (
            "platform == 'cuda' and dcp_world_size == 1 and block_size == 16",
            CUDA_DCP2,
            "requires dcp_world_size == 1, but dcp_world_size is 2",
        ),
        (
            "platform == 'rocm' and (dcp_world_size == 1 or dp_size > 2)",
            CUDA_DCP2,
            "requires platform == 'rocm' and (dcp_world_size == 1 or dp_size > 2), but platform "
            "is 'cuda' and dcp_world_size is 2 and dp_size is 1",
        ),
    ],
)
def test_explain_unmet_names_the_failing_part_with_values(
    source: str, config: RuntimeConfig, explanation: str
) -> None:
    assert explain_unmet(source, config) == explanation


# --- property test: the evaluator against an independent interpreter --------------------
#
# Expression trees are drawn as plain data, rendered to source text, parsed by the module
# under test, and evaluated both by `evaluate_condition` and by `interpret` below, which
# works on the tree and Python values only (no eval, no ast).

INT_FIELDS = ("dcp_world_size", "dp_size", "block_size", "num_speculative_steps")
LITERAL_FIELDS = {
    "platform": ("cuda", "rocm", "cpu"),
    "cudagraph_mode": ("none", "piecewise", "full"),
}
ORDERING = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
EQUALITY = {"==": operator.eq, "!=": operator.ne}


@dataclass(frozen=True)
class Atom:
    """A field name or a literal; ``text`` is its source, ``value`` resolves it."""

    text: str
    resolve: Callable[[dict[str, Any]], Any]


@dataclass(frozen=True)
class Chain:
    first: Atom
    rest: tuple[tuple[str, Atom], ...]


@dataclass(frozen=True)
class Member:
    subject: Atom
    negated: bool
    options: tuple[Atom, ...]
    as_tuple: bool


@dataclass(frozen=True)
class BoolOp:
    op: str
    operands: tuple[Any, ...]


@dataclass(frozen=True)
class Not:
    operand: Any


def name_atom(name: str) -> Atom:
    return Atom(name, lambda values: values[name])


def literal_atom(value: Any, quote: str = "'") -> Atom:
    text = f"{quote}{value}{quote}" if isinstance(value, str) else str(value)
    return Atom(text, lambda values: value)


int_names = st.sampled_from(INT_FIELDS).map(name_atom)
int_atoms = st.one_of(int_names, st.integers(min_value=-3, max_value=9).map(literal_atom))


@st.composite
def str_comparison(draw: st.DrawFn) -> Chain | Member:
    field = draw(st.sampled_from(sorted(LITERAL_FIELDS)))
    allowed = LITERAL_FIELDS[field]
    quote = draw(st.sampled_from(["'", '"']))
    literal = st.sampled_from(allowed).map(lambda value: literal_atom(value, quote))
    if draw(st.booleans()):
        options = tuple(draw(st.lists(literal, min_size=1, max_size=3)))
        return Member(name_atom(field), draw(st.booleans()), options, draw(st.booleans()))
    sides = [name_atom(field), draw(literal)]
    if draw(st.booleans()):
        sides.reverse()
    return Chain(sides[0], ((draw(st.sampled_from(sorted(EQUALITY))), sides[1]),))


@st.composite
def int_comparison(draw: st.DrawFn) -> Chain | Member:
    if draw(st.integers(0, 3)) == 0:
        options = tuple(draw(st.lists(st.integers(-3, 9).map(literal_atom), min_size=1,
                                      max_size=4)))
        return Member(draw(int_names), draw(st.booleans()), options, draw(st.booleans()))
    operators = sorted(ORDERING) + sorted(EQUALITY)
    atoms = [draw(int_atoms)]
    for _ in range(draw(st.integers(1, 3))):
        # every link of the chain reads a field: after a literal comes a name
        atoms.append(draw(int_atoms if atoms[-1].text in INT_FIELDS else int_names))
    return Chain(atoms[0], tuple((draw(st.sampled_from(operators)), atom) for atom in atoms[1:]))


bool_atoms = st.one_of(
    st.just(name_atom("advance_draft_positions")),
    st.builds(lambda value, op: Chain(name_atom("advance_draft_positions"),
                                      ((op, literal_atom(value)),)),
              st.booleans(), st.sampled_from(sorted(EQUALITY))),
)
leaves = st.one_of(int_comparison(), str_comparison(), bool_atoms)
expressions = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.builds(Not, children),
        st.builds(
            BoolOp,
            st.sampled_from(["and", "or"]),
            st.lists(children, min_size=2, max_size=3).map(tuple),
        ),
    ),
    max_leaves=8,
)

PRECEDENCE = {"or": 1, "and": 2, "not": 3, "compare": 4, "atom": 5}


def precedence(node: Any) -> int:
    if isinstance(node, BoolOp):
        return PRECEDENCE[node.op]
    if isinstance(node, Not):
        return PRECEDENCE["not"]
    if isinstance(node, (Chain, Member)):
        return PRECEDENCE["compare"]
    return PRECEDENCE["atom"]


def render(node: Any, extra_parens: Callable[[], bool]) -> str:
    """Source text with the fewest parentheses precedence needs, plus some redundant ones."""

    def child(sub: Any, minimum: int) -> str:
        text = render(sub, extra_parens)
        if precedence(sub) <= minimum or extra_parens():
            return f"({text})"
        return text

    if isinstance(node, Atom):
        return node.text
    if isinstance(node, Chain):
        return node.first.text + "".join(f" {op} {atom.text}" for op, atom in node.rest)
    if isinstance(node, Member):
        options = ", ".join(option.text for option in node.options)
        if node.as_tuple:
            options = f"({options},)"
        else:
            options = f"[{options}]"
        keyword = "not in" if node.negated else "in"
        return f"{node.subject.text} {keyword} {options}"
    if isinstance(node, Not):
        return "not " + child(node.operand, PRECEDENCE["not"] - 1)
    return f" {node.op} ".join(child(sub, PRECEDENCE[node.op]) for sub in node.operands)


def interpret(node: Any, values: dict[str, Any]) -> bool:
    """The reference semantics, written independently of the module under test."""
    if isinstance(node, Atom):
        return bool(node.resolve(values))
    if isinstance(node, Chain):
        left = node.first.resolve(values)
        for op, atom in node.rest:
            right = atom.resolve(values)
            if not {**ORDERING, **EQUALITY}[op](left, right):
                return False
            left = right
        return True
    if isinstance(node, Member):
        found = node.subject.resolve(values) in [option.resolve(values) for option in node.options]
        return not found if node.negated else found
    if isinstance(node, Not):
        return not interpret(node.operand, values)
    results = [interpret(sub, values) for sub in node.operands]
    return all(results) if node.op == "and" else any(results)


configs = st.builds(
    RuntimeConfig,
    platform=st.sampled_from(LITERAL_FIELDS["platform"]),
    cudagraph_mode=st.sampled_from(LITERAL_FIELDS["cudagraph_mode"]),
    dcp_world_size=st.integers(1, 8),
    dp_size=st.integers(1, 8),
    block_size=st.integers(1, 8),
    num_speculative_steps=st.integers(1, 8),
    advance_draft_positions=st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(tree=expressions, config=configs)
def test_evaluator_agrees_with_an_independent_interpreter(
    tree: Any, config: RuntimeConfig
) -> None:
    source = render(tree, lambda: False)
    condition = parse_condition(source)
    assert isinstance(condition, Condition)
    expected = interpret(tree, config.model_dump())
    assert evaluate_condition(condition, config) is expected
    assert describe_condition(condition)
    if not expected:
        assert explain_unmet(condition, config).startswith("requires ")


@settings(max_examples=100, deadline=None)
@given(tree=expressions, config=configs, parens=st.lists(st.booleans(), min_size=64, max_size=64))
def test_redundant_parentheses_do_not_change_the_result(
    tree: Any, config: RuntimeConfig, parens: list[bool]
) -> None:
    flags = iter(parens)
    source = render(tree, lambda: next(flags, False))
    assert evaluate_condition(parse_condition(source), config) is interpret(
        tree, config.model_dump()
    )
