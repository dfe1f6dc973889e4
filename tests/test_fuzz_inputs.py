"""Fuzzing every way bad input gets in (issue 13): YAML text and matrix structure, the
condition grammar, ``--reproduce`` blobs, and paths given on the command line.

Each case must end in the one clean error of its boundary (a :class:`MatrixError` whose
every problem is one ``PATH:LINE: ...`` line, a :class:`ConditionError`, a one-line
``ValueError`` starting ``--reproduce:``, a one-line path problem) or succeed, within a time
limit per case (a hard deadline turns a hang into a failure) and, in the fast runs, a
memory limit per case (traced allocations). Calls are made in-process for speed;
``test_bad_input.py`` runs the real command line on a handful of cases.

Every property runs twice: a fast run of a few dozen cases always, and a run of several
hundred cases marked ``slow`` (over 1,000 cases in all).
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speccheck.checks.cli.paths import output_path_problem
from speccheck.checks.docgen.capabilities import render_capability_docs
from speccheck.checks.verify.examples import decode_example
from speccheck.contract.conditions import (
    Condition,
    ConditionError,
    condition_vocabulary,
    describe_condition,
    evaluate_condition,
    explain_unmet,
    parse_condition,
)
from speccheck.contract.matrix_loader import MatrixError, load_matrix, parse_matrix
from speccheck.contract.matrix_model import Matrix
from speccheck.contract.resolution import resolve_matrix
from speccheck.contract.runtime_config import RuntimeConfig

ROOT = Path(__file__).resolve().parents[1]
REAL_MATRIX = (ROOT / "matrix.yaml").read_text(encoding="utf-8")
MINIMAL = (ROOT / "tests" / "fixtures" / "matrix" / "valid" / "minimal.yaml").read_text()
PROBLEM = re.compile(r"^fuzz\.yaml:(?P<line>\d+): ((backend '[a-z][a-z0-9_]*', )?"
                     r"field '[^'\n]+': )?[^\n]+$")
SECONDS_PER_CASE = 10.0
MEGABYTES_PER_CASE = 200
T = TypeVar("T")


# --- bounds -----------------------------------------------------------------------------

@contextmanager
def bounded(*, traced: bool) -> Iterator[None]:
    """At most ``SECONDS_PER_CASE`` (three times that is a hard stop: a hang fails instead
    of stalling the suite) and, when ``traced``, ``MEGABYTES_PER_CASE`` of allocations."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"a case ran past {3 * SECONDS_PER_CASE} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, 3 * SECONDS_PER_CASE)
    if traced:
        tracemalloc.start()
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        peak = tracemalloc.get_traced_memory()[1] if traced else 0
        if traced:
            tracemalloc.stop()
    limit = SECONDS_PER_CASE * (4 if traced else 1)  # tracing slows allocation-heavy code
    assert elapsed < limit, f"a case took {elapsed:.1f} s"
    assert peak < MEGABYTES_PER_CASE << 20, f"a case allocated {peak >> 20} MiB"


def fuzz(strategy: st.SearchStrategy[T], fast: int, slow: int) -> Callable[
    [Callable[[T], None]], tuple[Callable[..., None], Callable[..., None]]
]:
    """Turn ``check(case)`` into a fast test (``fast`` cases, memory traced) and a
    ``slow``-marked one (``slow`` cases)."""

    def tests(check: Callable[[T], None]) -> tuple[Callable[..., None], Callable[..., None]]:
        def run(case: T, traced: bool) -> None:
            with bounded(traced=traced):
                check(case)

        @settings(max_examples=fast, suppress_health_check=list(HealthCheck))
        @given(strategy)
        def fast_test(case: T) -> None:
            run(case, traced=True)

        @pytest.mark.slow
        @settings(max_examples=slow, suppress_health_check=list(HealthCheck))
        @given(strategy)
        def slow_test(case: T) -> None:
            run(case, traced=False)

        return fast_test, slow_test

    return tests


# --- matrix text: checks ----------------------------------------------------------------

def check_matrix_text(text: str | bytes) -> None:
    """Loads, and then resolves and renders docs; or raises MatrixError, every problem one
    ``fuzz.yaml:LINE:`` line with LINE inside the file."""
    try:
        matrix = parse_matrix(text, path="fuzz.yaml")
    except MatrixError as exc:
        assert exc.problems
        lines = (text if isinstance(text, str) else text.decode("utf-8", "replace"))
        last_line = len(re.split("\r\n|\r|\n", lines))
        for problem in exc.problems:
            rendered = problem.render()
            assert PROBLEM.match(rendered), rendered
            assert problem.line is not None and 1 <= problem.line <= last_line, rendered
        return
    assert isinstance(matrix, Matrix)
    resolve_matrix(matrix, RuntimeConfig())
    assert render_capability_docs(matrix)


# --- matrix text: strategies ------------------------------------------------------------

SCALARS = [
    "1", "-1", "0", "90", "true", "False", "null", "~", "yes", "cuda", "always", "'x'", '"y"',
    "dcp_world_size == 1", "none_needed", "in_graph", "[]", "{}", "''", "bfloat16", "NHD",
    "!!int abc", "!!int ''", "!!int 0b", "!!float abc", "!!float ._", "!!bool maybe",
    "!!null x", "!!timestamp garbage", "!!timestamp 2001-02-30", "!!binary aGk=",
    "!!set {a: null}", "!!omap [a: 1]", "!!pairs [a: 1]", "!!python/object:os.system x",
    "!!python/name:os.system ''", "!foo x", "! x", "!!str 1", "!!int '7'", "!!seq x",
    "!!map [1]", "!!str [1]", "0b_", "0x_", "0o17", "017", "1:2:3", "-1:30", "1_000", ".inf",
    "-.inf", ".nan", "1e400", "-1e400", "2001-02-30", "2001-12-14t21:59:43.10-05:00", "=",
    "<<", "*undefined", "&", "*", "!", "@x", "`x", "%x", "|", ">", "- x", "? x", ": x",
    "'unterminated", '"unterminated', '"\\x85\\u2028"', '"\\uD800"', "'\t'", "\"\\\"",
    "9223372036854775807", "9223372036854775808", "-9223372036854775808",
    "0x7fffffffffffffff", "0x8000000000000000", "0b" + "1" * 64, "1" + ":59" * 11,
    "ｄｃｐ_world_size == 1", "'1 == 1'", "'True'", "\"platform == 'ｃｕｄａ'\"",
    "'dcp_world_size == 1 or 1 == 1'", "'dcp_world_size in []'", "'(((((((('",
    "'x' # comment", "\ufeff", "\x00", "\x7f", "\U0001f600",
]


@st.composite
def amplified(draw: st.DrawFn) -> str:
    """A scalar or fragment that is small to describe and large once written out."""
    kind = draw(st.sampled_from(["digits", "hex", "sexagesimal", "open", "nested", "long",
                                 "quoted", "mapping_nest", "block_scalar", "floats"]))
    n = draw(st.integers(1, 6000) | st.sampled_from([4095, 4096, 4097, 4300, 4301, 100_000]))
    return {
        "digits": lambda: "9" * n,
        "hex": lambda: "0x" + "f" * n,
        "sexagesimal": lambda: ":".join(["59"] * max(1, n // 3)),
        "open": lambda: "[" * n,
        "nested": lambda: "[" * min(n, 3000) + "]" * min(n, 3000),
        "long": lambda: "x" * n,
        "quoted": lambda: json.dumps("y" * n),
        "mapping_nest": lambda: "{a: " * min(n, 3000) + "1" + "}" * min(n, 3000),
        "block_scalar": lambda: "|\n" + "  line\n" * min(n, 20_000),
        "floats": lambda: "[" + ", ".join(["1e400", "-.inf", ".nan"] * min(n, 7000)) + "]",
    }[kind]()


KEYS = ["version", "backends", "name", "display_name", "description", "implementation",
        "platforms", "package", "cudagraph_support", "draft_decode", "supported", "reason",
        "refresh_strategy", "constraints", "conditions", "condition", "notes", "variant_of",
        "<<", "? x", "'a b'", "1", "null", "true", "ｎａｍｅ", "x\ty", "[a]", "{a: 1}"]


def flow_value(depth: int = 3) -> st.SearchStrategy[str]:
    leaves = st.one_of(
        st.sampled_from(SCALARS),
        st.text(max_size=12).map(json.dumps),
        st.integers().map(str),
        st.from_regex(r"&a[0-3] [a-z0-9]{1,3}|\*a[0-3]", fullmatch=True),
    )
    if depth == 0:
        return leaves
    child = flow_value(depth - 1)
    return st.one_of(
        leaves,
        st.lists(child, max_size=4).map(lambda items: "[" + ", ".join(items) + "]"),
        st.lists(st.tuples(st.sampled_from(KEYS), child), max_size=4).map(
            lambda pairs: "{" + ", ".join(f"{k}: {v}" for k, v in pairs) + "}"),
        st.tuples(st.sampled_from(["!!seq ", "!!map ", "&a0 ", "&a1 ", "!x "]), child).map(
            "".join),
    )


@st.composite
def yaml_documents(draw: st.DrawFn) -> str:
    """Block-style mappings of flow values, with amplified values, comments carrying line
    separators, odd line endings and whole-document constructs (merge chains, alias
    fan-out, recursion)."""
    lines: list[str] = []
    for _ in range(draw(st.integers(0, 6))):
        key = draw(st.sampled_from(KEYS))
        value = draw(amplified()) if draw(st.integers(0, 9)) == 0 else draw(flow_value())
        indent = " " * draw(st.sampled_from([0, 0, 0, 2, 4, 1]))
        lines.append(f"{indent}{key}: {value}")
        if draw(st.integers(0, 5)) == 0:
            separator = draw(st.sampled_from(["\u2028", "\u2029", "\x85"]))
            comment = separator if draw(st.integers(0, 9)) == 0 else draw(st.sampled_from(
                ["\t", "é", "#", "", "'", '"', ": x", "- y"]))
            lines.append(f"# comment{comment}more")
    construct = draw(st.sampled_from(["none", "none", "merge_chain", "fan_out", "recursive"]))
    size = draw(st.integers(1, 2500))
    if construct == "merge_chain":
        lines[:0] = ["m0: &m0 {k0: 1}",
                     *(f"m{i}: &m{i} {{<<: *m{i - 1}, k{i}: 1}}" for i in range(1, size))]
    elif construct == "fan_out":
        width = draw(st.integers(2, 12))
        lines[:0] = [f"f0: &f0 [{', '.join(['x'] * width)}]",
                     *(f"f{i}: &f{i} [{', '.join([f'*f{i - 1}'] * width)}]"
                       for i in range(1, min(size, 12)))]
    elif construct == "recursive":
        lines.append("r: &r [" + draw(st.sampled_from(["*r", "{a: *r}", "[[*r]]"])) + "]")
    newline = draw(st.sampled_from(["\n", "\n", "\r\n", "\r"]))
    return newline.join(lines) + draw(st.sampled_from([newline, ""]))


# --- matrix structure: strategies -------------------------------------------------------

REAL_DATA = yaml.safe_load(REAL_MATRIX)
NASTY_DATA: list[object] = [
    None, True, False, 0, -1, 2**63, -(2**63) - 1, 2**200, 1.5, float("inf"), float("nan"),
    "", " ", "x" * 5000, "ｄｃｐ_world_size == 1", "1 == 1", "True", "dcp_world_size == 1",
    "platform == 'cuda'", "(" * 500, "\u2028", "a\nb", [], {}, [[[[[[]]]]]], {"x": 1},
    {1: 2}, {None: 1}, ["cuda", "cuda"], {"multiple_of": 0}, {"multiple_of": 16},
    "none_needed", "in_graph", "host_preplanned", "always", "never", "NHD", "latent",
]


def _paths(data: object, prefix: tuple[object, ...] = ()) -> Iterator[tuple[object, ...]]:
    yield prefix
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            yield from _paths(value, (*prefix, index))


def _replace(data: Any, path: tuple[object, ...], value: object) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(data, dict):
        return {**data, head: _replace(data[head], rest, value)}
    copy = list(data)
    copy[head] = _replace(copy[head], rest, value)  # type: ignore[index]
    return copy


@st.composite
def matrix_structures(draw: st.DrawFn) -> str:
    """The real matrix with 1-3 subtrees replaced by hostile values, dumped as YAML in a
    random style (or as JSON, which is YAML too)."""
    data = REAL_DATA
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(_paths(data))))
        data = _replace(data, path, draw(st.sampled_from(NASTY_DATA)))
    style = draw(st.sampled_from(["block", "flow", "json"]))
    if style == "json":
        return json.dumps(data, ensure_ascii=draw(st.booleans()))
    return yaml.safe_dump(data, default_flow_style=style == "flow", sort_keys=False,
                          allow_unicode=draw(st.booleans()), width=draw(st.integers(20, 200)))


# --- matrix: tests ----------------------------------------------------------------------

test_yaml_documents, test_yaml_documents_slow = fuzz(yaml_documents(), 25, 500)(
    check_matrix_text)
test_matrix_structures, test_matrix_structures_slow = fuzz(matrix_structures(), 12, 300)(
    check_matrix_text)


# --- conditions -------------------------------------------------------------------------

VOCABULARY = sorted(condition_vocabulary())
CONDITION_TOKENS = [
    *VOCABULARY, "ｄｃｐ_world_size", "dcp_world_sizé", "Ｔｒｕｅ", "unknown", "__import__",
    "1", "-1", "0", "16", "2" * 30, "0x" + "f" * 40, "1.5", "1e400", "True", "False", "None",
    "'cuda'", "'rocm'", "'cpu'", "'ｃｕｄａ'", "'tpu'", '"full"', "b'x'", "f'x'", "...",
    "==", "!=", "<", "<=", ">", ">=", "in", "not in", "is", "is not", "and", "or", "not",
    "(", ")", "[", "]", ",", "+", "-", "~", "*", ".", ":=", "lambda:", "if", "else", "for",
    "\\", "#", ";", "\t", "\u2028", "\x00", "é",
]


@st.composite
def conditions(draw: st.DrawFn) -> str:
    """Token soup, well-formed comparisons with hostile operands, and amplified nesting."""
    kind = draw(st.sampled_from(["soup", "soup", "compare", "nested", "long"]))
    if kind == "soup":
        return " ".join(draw(st.lists(st.sampled_from(CONDITION_TOKENS), max_size=12)))
    if kind == "compare":
        operand = st.sampled_from(CONDITION_TOKENS[:40])
        parts = [draw(operand)]
        for _ in range(draw(st.integers(1, 3))):
            parts += [draw(st.sampled_from(["==", "!=", "<", ">=", "in", "not in"])),
                      draw(operand | st.lists(operand, max_size=3).map(
                          lambda items: "[" + ", ".join(items) + "]"))]
        joiner = draw(st.sampled_from([" and ", " or ", " and not "]))
        return joiner.join([" ".join(parts)] * draw(st.integers(1, 3)))
    n = draw(st.integers(1, 2000))
    if kind == "nested":
        return "(" * n + "dcp_world_size == 1" + ")" * n
    return " and ".join(["dcp_world_size == 1"] * n)


def check_condition(source: str) -> None:
    try:
        condition = parse_condition(source)
    except ConditionError as exc:
        assert isinstance(exc, ValueError) and "\n" not in str(exc)
        assert str(exc).startswith("invalid condition ")
    else:
        assert isinstance(condition, Condition) and condition.names
        assert all(name.isascii() and name in VOCABULARY for name in condition.names)
        config = RuntimeConfig()
        result = evaluate_condition(condition, config)
        assert isinstance(result, bool)
        assert describe_condition(condition)
        if not result:
            assert explain_unmet(condition, config).startswith("requires ")
    check_matrix_text(MINIMAL.replace("supported: true", f"supported: {json.dumps(source)}"))


test_conditions, test_conditions_slow = fuzz(conditions(), 40, 500)(check_condition)


# --- --reproduce blobs ------------------------------------------------------------------

GOOD_EXAMPLE = {"num_speculative_steps": 3, "context_lens": [5, 0], "new_tokens": [[1, 2], [3]],
                "block_table": [[1, 2, 3], [4]], "seeds": [7, 0]}
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats()
    | st.sampled_from([2**63, -(2**63), 2**200, 10**400]) | st.text(max_size=6),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.text(max_size=4), children, max_size=3),
    max_leaves=10,
)
RAW_JSON_NUMBERS = ["Infinity", "-Infinity", "NaN", "1e400", "-0", "1.0", "01", "9" * 5000,
                    "1" * 4301, "true", "null", '"5"', "[" * 100_000, "{" * 100_000]


@st.composite
def blobs(draw: st.DrawFn) -> str:
    """Blobs of mutated examples (values replaced, keys added or dropped, raw JSON tokens
    spliced in), of arbitrary JSON, of arbitrary bytes, or not base64 at all."""
    kind = draw(st.sampled_from(["mutated", "mutated", "raw_token", "json", "bytes", "text",
                                 "bomb"]))
    if kind == "text":
        return draw(st.text(max_size=60))
    if kind == "bomb":
        payload = b"[" + b"0," * draw(st.integers(1, 1 << 21)) + b"0]"
    elif kind == "bytes":
        payload = draw(st.binary(max_size=200))
        if draw(st.booleans()):
            return base64.urlsafe_b64encode(payload).decode()
    elif kind == "json":
        payload = json.dumps(draw(JSON_VALUES)).encode()
    else:
        data: dict[str, Any] = json.loads(json.dumps(GOOD_EXAMPLE))
        path = draw(st.sampled_from(REPRO_PATHS))
        if kind == "raw_token":
            token = draw(st.sampled_from(RAW_JSON_NUMBERS))
            data = _replace(data, path, "@@TOKEN@@")
            payload = json.dumps(data).replace('"@@TOKEN@@"', token).encode()
        else:
            if draw(st.booleans()):
                data = _replace(data, path, draw(JSON_VALUES))
            if draw(st.integers(0, 4)) == 0:
                data.pop(draw(st.sampled_from(sorted(GOOD_EXAMPLE))), None)
            if draw(st.integers(0, 4)) == 0:
                data[draw(st.text(max_size=5))] = draw(JSON_VALUES)
            payload = json.dumps(data).encode()
    compressed = zlib.compress(payload)
    if draw(st.integers(0, 5)) == 0:
        compressed = compressed[: draw(st.integers(0, len(compressed)))]
    return base64.urlsafe_b64encode(compressed).decode()


REPRO_PATHS = [path for path in _paths(GOOD_EXAMPLE) if path]


def check_blob(blob: str) -> None:
    try:
        k, batch = decode_example(blob)
    except ValueError as exc:
        message = str(exc)
        assert message.startswith("--reproduce: not an example blob (") and "\n" not in message
        return
    assert 1 <= k and batch.num_reqs >= 1
    assert len(batch.new_tokens) == len(batch.block_table) == len(batch.seeds) == batch.num_reqs
    assert all(len(row) >= 1 for row in batch.new_tokens)
    assert all(ctx >= 0 for ctx in batch.context_lens)
    blocks = [block for row in batch.block_table for block in row]
    assert len(blocks) == len(set(blocks)) and min(blocks) >= 1


test_blobs, test_blobs_slow = fuzz(blobs(), 40, 400)(check_blob)


# --- paths ------------------------------------------------------------------------------

PATH_PARTS = ["file.yaml", "dir", "fifo", "missing", "link_to_dir", "link_to_missing",
              "x" * 300, "a\nb", "\udcff", ".", "..", "", "sub"]


@pytest.fixture(scope="module")
def playground(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with one of each kind of entry the path parts name."""
    root = tmp_path_factory.mktemp("paths")
    (root / "file.yaml").write_text(MINIMAL)
    (root / "dir" / "sub").mkdir(parents=True)
    (root / "dir" / "file.yaml").write_text("version: [")
    os.mkfifo(root / "fifo")
    (root / "link_to_dir").symlink_to(root / "dir")
    (root / "link_to_missing").symlink_to(root / "missing")
    return root


path_parts = st.lists(st.sampled_from(PATH_PARTS), min_size=1, max_size=4)


def check_paths(root: Path, parts: list[str]) -> None:
    path = root.joinpath(*parts)
    with bounded(traced=False):
        try:
            load_matrix(path)
        except MatrixError as exc:
            for problem in exc.problems:
                rendered = problem.render()
                assert "\n" not in rendered and rendered.isprintable(), rendered
        problem = output_path_problem(path, create_parents=parts[0] == "sub")
        assert problem is None or (problem.startswith("cannot write ") and problem.isprintable())


@settings(max_examples=40, suppress_health_check=list(HealthCheck))
@given(parts=path_parts)
def test_paths(playground: Path, parts: list[str]) -> None:
    check_paths(playground, parts)


@pytest.mark.slow
@settings(max_examples=200, suppress_health_check=list(HealthCheck))
@given(parts=path_parts)
def test_paths_slow(playground: Path, parts: list[str]) -> None:
    check_paths(playground, parts)
