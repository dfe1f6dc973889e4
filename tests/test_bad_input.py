"""Issue 13, one regression test per class of bad input: it ends in one clear line (a
``PATH:LINE:`` problem, exit 2 on the command line), never in a traceback, a hang or an
unbounded read."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TypeVar

import pytest
from rich.console import Console
from rich.progress import Progress

from speccheck.checks.cli.paths import output_path_problem
from speccheck.checks.verify import runner, worker_process
from speccheck.checks.verify.examples import (
    MAX_ARGUMENT_CHARS,
    MAX_BLOB_CHARS,
    REPRODUCE_DIR,
    decode_example,
    encode_example,
    example_from_json,
    example_json,
    read_reproduce,
    reproduce_blob,
    reproduce_command,
)
from speccheck.checks.verify.run import VerifyRun, WorkerTask
from speccheck.checks.verify.vocabulary import Status, Tier
from speccheck.contract.matrix_loader import (
    MAX_MATRIX_BYTES,
    MAX_PROBLEMS,
    MatrixError,
    MatrixProblem,
    load_matrix,
    parse_matrix,
)
from speccheck.contract.yaml_positions import MAX_DEPTH, MAX_SCALAR_LENGTH
from speccheck.speculator.batch import DraftBatch

ROOT = Path(__file__).resolve().parents[1]
MINIMAL = (ROOT / "tests" / "fixtures" / "matrix" / "valid" / "minimal.yaml").read_text()
T = TypeVar("T")


@contextmanager
def hard_deadline(seconds: float) -> Iterator[None]:
    """Fail (rather than hang the suite) when the block runs longer than ``seconds``."""
    import signal

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def timed(call: Callable[[], T], seconds: float = 5.0) -> T:
    start = time.perf_counter()
    with hard_deadline(3 * seconds):
        result = call()
    assert time.perf_counter() - start < seconds
    return result


def problems_of(text: str | bytes, path: str = "m.yaml") -> tuple[MatrixProblem, ...]:
    with pytest.raises(MatrixError) as excinfo:
        timed(lambda: parse_matrix(text, path=path))
    return excinfo.value.problems


def only_problem(text: str | bytes) -> MatrixProblem:
    (problem,) = problems_of(text)
    return problem


def with_value(value: str) -> str:
    """The minimal matrix with ``min_compute_capability: VALUE`` on line 9."""
    text = MINIMAL.replace("    platforms: [cuda]\n",
                           f"    platforms: [cuda]\n    min_compute_capability: {value}\n")
    assert text.splitlines()[8] == f"    min_compute_capability: {value}"
    return text


# --- YAML scalars whose construction used to raise outside yaml.YAMLError ----------------

@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("!!int abc", "'abc' is not an integer, as its tag !!int requires"),
        ("!!int ''", "'' is not an integer, as its tag !!int requires"),
        ("!!int 0b", "'0b' is not an integer"),
        ("!!float abc", "'abc' is not a number, as its tag !!float requires"),
        ("!!bool maybe", "'maybe' is not true or false, as its tag !!bool requires"),
        ("!!null x", "'x' is not null"),
        ("!!timestamp garbage", "tag !!timestamp is not allowed; use no tag or one of !!str"),
        ("!!timestamp 2001-02-30", "tag !!timestamp is not allowed"),
        ("!!binary aGk=", "tag !!binary is not allowed"),
        ("!!set {a: null}", "tag !!set is not allowed"),
        ("!!python/object/apply:os.system [x]", "tag !!python/object/apply:os.system is not"),
        ("!local x", "tag !local is not allowed"),
        ("0b_", "cannot read '0b_' as !!int"),
        ("<<", "'<<' is a merge key; it cannot be used as a value"),
        ("9" * 5000, f"5000 characters long; at most {MAX_SCALAR_LENGTH} are allowed"),
        ("9" * 4300, "4300 characters long"),
        ("9" * 4000, "is out of range: integers must lie within ±9223372036854775807"),
        ("0x" + "f" * 4000, "is out of range"),
        ("0x" + "f" * 17, "is out of range"),
        (":".join(["59"] * 1300), "is out of range"),
        ("1" + ":59" * 12, "is out of range"),
        ("9223372036854775808", "is out of range"),
        ("-9223372036854775808", "is out of range"),
    ],
)
def test_bad_scalars_are_problems_at_their_line(value: str, message: str) -> None:
    problem = only_problem(with_value(value))
    assert (problem.line, problem.backend, problem.field) == (9, None, None)
    assert message in problem.message, problem.message


def test_values_in_range_still_load() -> None:
    matrix = timed(lambda: parse_matrix(with_value("!!int 0x5A"), path="m.yaml"))
    assert matrix.backends[0].min_compute_capability == 90
    assert parse_matrix(with_value("1:30"), path="m.yaml").backends[0].min_compute_capability == 90


# --- locators ---------------------------------------------------------------------------

def test_nesting_too_deep_names_its_line() -> None:
    for nested in ("[" * 100_000, "[" * 2000 + "]" * 2000, "{a: " * 50 + "1" + "}" * 50):
        problem = only_problem(with_value(nested))
        assert problem.line == 9
        assert f"nests more than {MAX_DEPTH} levels deep" in problem.message


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85"])
def test_unicode_line_separators_are_refused_at_the_line_editors_show(separator: str) -> None:
    text = MINIMAL.replace("# The smallest", f"# The{separator} smallest")
    problem = only_problem(text)
    assert problem.line == 1 and "YAML reads it as a line break, editors do not" in problem.message
    text = with_value("!!int x").replace("    display_name",
                                         f"    # a{separator}b\n    display_name")
    assert only_problem(text).line == 5


@pytest.mark.parametrize("newline", ["\r\n", "\r"])
def test_lines_count_crlf_and_cr_like_editors(newline: str) -> None:
    assert only_problem(with_value("!!int x").replace("\n", newline)).line == 9


def test_invalid_utf8_names_its_line() -> None:
    problem = only_problem(with_value("x").encode().replace(b": x\n", b": \xff\n"))
    assert problem.line == 9 and "not valid UTF-8" in problem.message


def test_unknown_keys_that_are_not_identifiers_keep_their_line_and_name() -> None:
    (problem,) = problems_of(MINIMAL.replace("version: 1\n", "version: 1\n'it''s: x': 1\n"))
    assert problem.line == 3
    assert problem.render() == (
        "m.yaml:3: field '[\"it\\u0027s: x\"]': unknown field \"it's: x\" "
        "(allowed: version, backends)"
    )


def test_problems_are_capped_with_a_count_of_the_rest() -> None:
    problems = problems_of("version: 1\nbackends: [" + "1, " * 500 + "]\n")
    assert len(problems) == MAX_PROBLEMS + 1
    assert problems[-1].render() == (
        f"m.yaml:2: {500 - MAX_PROBLEMS} more problems from here on are not shown "
        f"(at most {MAX_PROBLEMS} are listed)"
    )


# --- size and time ----------------------------------------------------------------------

def merge_chain(length: int) -> str:
    lines = ["a0: &a0 {k0: 1}"]
    lines += [f"a{i}: &a{i} {{<<: *a{i - 1}, k{i}: 1}}" for i in range(1, length)]
    return "\n".join(lines) + "\n"


def test_long_merge_chains_are_refused_quickly_at_the_line_that_goes_too_deep() -> None:
    problem = only_problem(merge_chain(2000))
    assert problem.line == MAX_DEPTH - 1 and "through this alias" in problem.message


def test_alias_fan_out_is_refused_at_the_line_that_exceeds_the_limit() -> None:
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 12)]
    problem = only_problem("\n".join(lines) + "\n")
    assert problem.line == 5 and "more than 20000 values" in problem.message


def test_recursive_aliases_are_refused_at_the_alias() -> None:
    problem = only_problem("version: 1\nbackends: &a\n  - *a\n")
    assert problem.line == 3 and "recursive structures are not allowed" in problem.message


def test_a_long_reason_is_refused_at_its_line() -> None:
    def with_reason(length: int) -> str:
        return MINIMAL.replace("supported: true\n",
                               "supported: false\n      reason: " + "x" * length + "\n")

    assert timed(lambda: parse_matrix(with_reason(MAX_SCALAR_LENGTH), path="m.yaml"), 2.0)
    problem = only_problem(with_reason(MAX_SCALAR_LENGTH + 1))
    assert problem.line == 13 and "characters long" in problem.message
    (problem,) = problems_of(with_reason(1_500_000))
    assert problem.line is None and "larger than 1048576 bytes" in problem.message


def test_only_regular_files_of_bounded_size_are_read(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    big = tmp_path / "big.yaml"
    big.write_text("#" * (MAX_MATRIX_BYTES + 1))
    expected = {
        fifo: "cannot read the matrix file: it is a FIFO, not a regular file",
        Path("/dev/zero"): "cannot read the matrix file: it is a character device, not a "
                           "regular file",
        tmp_path: "cannot read the matrix file: ",
        big: f"the matrix is larger than {MAX_MATRIX_BYTES} bytes",
    }
    for path, message in expected.items():
        with pytest.raises(MatrixError) as excinfo:
            timed(lambda: load_matrix(path), 2.0)
        (problem,) = excinfo.value.problems
        assert problem.path == str(path) and problem.line is None
        assert message in problem.message


def test_unprintable_paths_are_escaped_in_problems(tmp_path: Path) -> None:
    with pytest.raises(MatrixError) as excinfo:
        load_matrix(tmp_path / "a\nb\udcff.yaml")
    assert str(excinfo.value).startswith(f"{tmp_path}/a\\nb\\udcff.yaml: cannot read")


# --- conditions -------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("condition", "message"),
    [
        ("ｄｃｐ_world_size == 1", "name 'ｄｃｐ_world_size' is not ASCII"),
        ("1 == 1", "1 == 1 compares literals only"),
        ("True", "True on its own is a constant"),
    ],
)
def test_normalised_names_and_constant_conditions_are_problems(
    condition: str, message: str
) -> None:
    text = MINIMAL.replace("supported: true", f"supported: {json.dumps(condition)}")
    problem = only_problem(text)
    assert (problem.line, problem.backend) == (12, "alpha")
    assert message in problem.message


# --- --reproduce blobs ------------------------------------------------------------------

GOOD = example_json((3, DraftBatch((5,), ((1, 2),), ((1, 2, 3),), (7,))))


def blob_of(data: object = None, raw: bytes | None = None) -> str:
    payload = raw if raw is not None else json.dumps(data).encode()
    return base64.urlsafe_b64encode(zlib.compress(payload)).decode()


def replaced(old: str, new: str) -> str:
    return blob_of(raw=json.dumps(GOOD).replace(old, new).encode())


@pytest.mark.parametrize(
    ("blob", "why"),
    [
        (replaced("[5]", "[Infinity]"), "context_lens[0]: Input should be a valid integer"),
        (replaced("[5]", "[1e400]"), "context_lens[0]: Input should be a valid integer"),
        (replaced("[5]", "[NaN]"), "context_lens[0]: Input should be a valid integer"),
        (replaced("[5]", "[5.0]"), "context_lens[0]: Input should be a valid integer"),
        (replaced("[5]", "[true]"), "context_lens[0]: Input should be a valid integer"),
        (replaced("[5]", "[" + "9" * 5000 + "]"), "Invalid JSON: number out of range"),
        (replaced("[5]", '"ab"'), "context_lens: Input should be a valid array"),
        (replaced("[5]", "[-1]"), "context_lens[0]: Input should be greater than or equal to 0"),
        (blob_of(raw=b"[" * 100_000), "Invalid JSON: recursion limit exceeded"),
        (blob_of({**GOOD, "seeds": [1, 2]}), "seeds has 2 rows but context_lens has 1"),
        (blob_of({**GOOD, "block_table": [[1, 1]]}), "block_table rows share physical blocks"),
        (blob_of({**GOOD, "block_table": [[0]]}), "block_table[0][0]: Input should be greater"),
        (blob_of({**GOOD, "new_tokens": [[]]}), "new_tokens[0]: List should have at least 1"),
        (blob_of({**GOOD, "extra": 1}), "extra: Extra inputs are not permitted"),
        (blob_of({"num_speculative_steps": 3}), "context_lens: Field required (and 3 more"),
        (base64.urlsafe_b64encode(zlib.compress(b" " * (64 << 20))).decode(),
         "it inflates to more than 1048576 bytes"),
        (blob_of(GOOD)[:-8], "not "),
        ("é", "not URL-safe base64"),
        ("A" * (MAX_BLOB_CHARS + 1), f"at most {MAX_BLOB_CHARS} are accepted"),
    ],
)
def test_bad_reproduce_blobs_are_one_line_value_errors(blob: str, why: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        timed(lambda: decode_example(blob), 2.0)
    message = str(excinfo.value)
    assert message.startswith("--reproduce: not an example blob (") and "\n" not in message
    assert why in message, message


def test_blobs_round_trip_and_reports_are_validated_too() -> None:
    example = (3, DraftBatch((5,), ((1, 2),), ((1, 2, 3),), (7,)))
    assert decode_example(encode_example(example)) == example
    assert example_from_json(GOOD) == example
    with pytest.raises(ValueError, match="^not an example: context_lens: Input should be a "
                                         "valid list$"):
        example_from_json({**GOOD, "context_lens": "ab"})


# --- output paths -----------------------------------------------------------------------

def test_output_paths_are_checked_before_any_work(tmp_path: Path) -> None:
    existing = tmp_path / "r.json"
    existing.write_text("{}")
    fine = [existing, tmp_path / "new.json", Path("/dev/null"),
            tmp_path / "new" / "deeper" / "r.md"]
    assert [output_path_problem(p, create_parents=p.parent.name == "deeper") for p in fine] == [
        None, None, None, None]
    assert output_path_problem(Path("/nonexistent/r.json")) == (
        "cannot write /nonexistent/r.json: directory /nonexistent does not exist")
    assert output_path_problem(tmp_path) == f"cannot write {tmp_path}: it is a directory"
    assert output_path_problem(existing / "x.json") == (
        f"cannot write {existing}/x.json: Not a directory")
    assert output_path_problem(existing / "a" / "x.json", create_parents=True) == (
        f"cannot write {existing}/a/x.json: Not a directory")
    assert output_path_problem(tmp_path / ("x" * 300)) == (
        f"cannot write {tmp_path}/{'x' * 300}: File name too long")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_output_paths_are_problems(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    (tmp_path / "ro.json").write_text("")
    (tmp_path / "ro.json").chmod(0o400)
    assert output_path_problem(locked / "r.json") == (
        f"cannot write {locked}/r.json: permission denied to create files in {locked}")
    assert output_path_problem(tmp_path / "ro.json") == (
        f"cannot write {tmp_path}/ro.json: permission denied")


# --- the verify runner ------------------------------------------------------------------

def _chatty_worker(folder: str, tasks: Connection, output: Connection,
                   environ: dict[str, str]) -> None:
    """A worker body that reports example 1, writes 16 MiB to each of its output streams
    and exits 3."""
    worker_process.attach_streams(tasks, output, environ)
    with open(os.path.join(folder, "progress-1.jsonl"), "a") as progress:
        progress.write(json.dumps({"index": 1, "example": "BLOB"}) + "\n")
    chunk = "x" * 1023 + "\n"
    for _ in range(8 * 1024):
        sys.stdout.write(chunk)
        sys.stderr.write(chunk)
    print("last words")
    sys.exit(3)


def test_a_chatty_worker_never_blocks_on_its_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """16 MiB of output, far past a pipe buffer: drained while the worker runs, so it ends
    on its own and the crash report quotes its last line."""
    monkeypatch.setattr(worker_process, "serve_tasks", _chatty_worker)
    task = WorkerTask(run=VerifyRun(backend="chatty", example_timeout=30.0), backend="chatty",
                      examples=2, seed=0)
    with Progress(console=Console(file=io.StringIO())) as progress:
        report = timed(lambda: runner.run_worker(task, progress, Tier.CPU), 20.0)
    assert report.status is Status.CRASHED
    assert report.detail.startswith("worker exited with status 3: ")
    assert report.detail.endswith("last words (during example 1)")
    assert report.reproduce == "speccheck verify --backend chatty --seed 0 --reproduce BLOB"


# --- the command line -------------------------------------------------------------------

def speccheck(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-c", "from speccheck.checks.cli.app import main; main()", *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )


def test_bad_matrices_exit_2_with_one_located_line_each(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    bad = tmp_path / "bad.yaml"
    bad.write_text(with_value("!!int abc"))
    deep = tmp_path / "deep.yaml"
    deep.write_text("version: " + "[" * 100_000)
    for path, located in ((fifo, f"{fifo}: cannot read the matrix file: it is a FIFO"),
                          (Path("/dev/zero"), "/dev/zero: cannot read the matrix file"),
                          (bad, f"{bad}:9: 'abc' is not an integer"),
                          (deep, f"{deep}:1: the document nests more than")):
        proc = speccheck("matrix", "--matrix", str(path))
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stdout == ""
        (line,) = proc.stderr.splitlines()
        assert line.startswith(located), line


@pytest.mark.parametrize("args", [
    ["verify", "--json", "/nonexistent/r.json"],
    ["verify", "--junit", "/tmp"],
    ["schema", "--output", "/nonexistent/schema.json"],
    ["docs", "--output", "/proc/no/such/dir/capabilities.md"],
])
def test_bad_output_paths_are_one_line_errors_before_any_work(args: list[str]) -> None:
    from typer.testing import CliRunner

    from speccheck.checks.cli.app import app

    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(
        result.exception, SystemExit)
    assert "cannot write" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(("args", "option"), [
    (["verify", "--examples", "-3"], "--examples"),
    (["verify", "--examples", "abc"], "--examples"),
    (["verify", "--no-such-option"], "--no-such-option"),
    (["bench", "--backend", "reference", "--repeats", "x"], "--repeats"),
    (["verify", "--shrink-seconds", "-1"], "--shrink-seconds"),
    (["selftest", "--shrink-seconds", "-1"], "--shrink-seconds"),
    (["selftest", "--shrink-seconds", "nan"], "--shrink-seconds"),
    (["selftest", "--only", "no_such_mutant"], "--only"),
    (["verify", "--shrink-seconds", "nan"], "--shrink-seconds"),
])
def test_options_the_parser_rejects_are_one_line_and_exit_2(args: list[str], option: str) -> None:
    proc = speccheck(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"speccheck {args[0]}: ") and option in lines[0], lines[0]
    assert proc.stdout == ""


# --- reproduce blobs in files ----------------------------------------------------------

def test_a_blob_too_long_for_one_argument_goes_to_a_file_that_reproduce_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    rows = tuple(tuple(range(1 + 4000 * r, 4001 + 4000 * r)) for r in range(16))
    example = (4, DraftBatch((60_000,) * 16, ((1,),) * 16, rows, tuple(range(16))))
    blob = encode_example(example)
    assert MAX_ARGUMENT_CHARS < len(blob) < MAX_BLOB_CHARS
    command = reproduce_command("speccheck verify --backend reference", blob)
    assert command.startswith("speccheck verify --backend reference --reproduce @")
    assert len(command) < 200
    path = Path(command.rsplit("@", 1)[1])
    assert path.parent == REPRODUCE_DIR and path.read_text() == blob + "\n"
    assert reproduce_blob(command) == blob and read_reproduce(f"@{path}") == blob
    assert decode_example(read_reproduce(f"@{path}")) == example
    short = encode_example((3, DraftBatch((5,), ((1, 2),), ((1, 2, 3),), (7,))))
    assert reproduce_command("speccheck verify", short) == f"speccheck verify --reproduce {short}"
    assert read_reproduce(short) == short


def test_a_reproduce_file_that_cannot_be_a_blob_is_one_line_naming_it(tmp_path: Path) -> None:
    binary, huge, fifo = tmp_path / "binary.blob", tmp_path / "huge.blob", tmp_path / "fifo"
    binary.write_bytes(b"\xff\xfe" * 10)
    os.mkfifo(fifo)  # opened for reading, it would wait for a writer
    with huge.open("w") as handle:  # far more than a blob may be: the read stops early
        handle.truncate(64 << 20)
    cases = [
        (f"@{tmp_path}/missing.blob",
         f"--reproduce: cannot read {tmp_path}/missing.blob: No such file or directory"),
        (f"@{tmp_path}", f"--reproduce: cannot read {tmp_path}: Is a directory"),
        (f"@{fifo}", f"--reproduce: cannot read {fifo}: it is a FIFO, not a regular file"),
        ("@", "--reproduce: @ names no file (give @FILE)"),
        ("@/dev/zero", "--reproduce: cannot read /dev/zero: it is a character device"),
        (f"@{binary}", f"--reproduce: {binary} is not an example blob (not ASCII text)"),
        (f"@{huge}", f"--reproduce: {huge} holds more than {MAX_BLOB_CHARS} characters"),
    ]
    for argument, message in cases:
        with pytest.raises(ValueError) as excinfo:
            timed(lambda argument=argument: read_reproduce(argument), 2.0)
        assert str(excinfo.value).startswith(message) and "\n" not in str(excinfo.value)
