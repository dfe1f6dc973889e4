"""``speccheck mutate`` (issue 44, item 7): the operators on small sources, mutant generation
on ``backends/reference``, the shadow copy reaching verify's worker processes (a real run of
a mutant verify kills and of one that survives), the report's JSON, and bad input."""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from speccheck.checks.mutate import line_tracer
from speccheck.checks.mutate.coverage_run import CodePhase, CoverageRun, run_unmutated
from speccheck.checks.mutate.equivalents import (
    EQUIVALENTS_FILE,
    EquivalentsError,
    argument_for,
    load_equivalents,
)
from speccheck.checks.mutate.fingerprint import (
    VERIFY_INDEPENDENT,
    code_fingerprint,
    verify_fingerprint,
)
from speccheck.checks.mutate.gate_file import (
    GateFileError,
    load_gate,
    save_gate,
)
from speccheck.checks.mutate.mutants import (
    Mutant,
    Shard,
    generate_mutants,
    sample_mutants,
    unbound_attributes,
    unbound_names,
)
from speccheck.checks.mutate.operators import OPERATORS, Operator, apply_edit
from speccheck.checks.mutate.report import (
    MutationReport,
    Resumption,
    SurvivorClass,
    metadata_kills_line,
    summary_line,
)
from speccheck.checks.mutate.rescore import (
    RescoreError,
    arguments_changed,
    merged_shards,
    read_report,
    rescored,
    saved_resumptions,
)
from speccheck.checks.mutate.resume import combined_runs, stale_survivors
from speccheck.checks.mutate.runner import (
    UNREACHED_DETAIL,
    KillKind,
    MutantResult,
    Outcome,
    RunSettings,
    judge,
    run_mutants,
)
from speccheck.checks.mutate.shadow import VerifyOutcome, run_verify
from speccheck.checks.mutate.targets import Role, TargetModule, backend_targets, chosen_targets
from speccheck.checks.status.record import MutationRecord

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = "speccheck.backends.reference.builder:ReferenceMetadataBuilder"


def mutated(operator: Operator, source: str) -> list[str]:
    """Every mutant ``operator`` makes of ``source`` (dedented), each checked to parse."""
    source = textwrap.dedent(source)
    results = [apply_edit(source, edit) for edit in OPERATORS[operator](ast.parse(source), source)]
    for result in results:
        ast.parse(result)
    return results


def test_statement_deleted_replaces_assignments_and_expressions_by_pass() -> None:
    source = '''
    X = 1
    def stub(a): ...
    def f(a, out):
        """Doc."""
        b = a + 1
        b += 2
        out.copy_(b)
        return b
    '''
    results = mutated(Operator.STATEMENT_DELETED, source)
    assert [r.split("\n")[5:8] for r in results] == [
        ["    pass", "    b += 2", "    out.copy_(b)"],
        ["    b = a + 1", "    pass", "    out.copy_(b)"],
        ["    b = a + 1", "    b += 2", "    pass"],
    ]
    assert all("X = 1" in r and '"""Doc."""' in r and "return b" in r for r in results)


def test_off_by_one_moves_integer_constants_both_ways_inside_functions_only() -> None:
    source = '''
    LIMIT = 8
    def f(x, flag=True):
        y = x[:n] + 1
        raise ValueError(f"{x} at 3")
    '''
    assert [r.split("\n")[3] for r in mutated(Operator.OFF_BY_ONE, source)] == [
        "    y = x[:n] + 2", "    y = x[:n] + 0"]
    negative = mutated(Operator.OFF_BY_ONE, "def f(x):\n    return x.sum(0)\n")
    assert negative == ["def f(x):\n    return x.sum(1)\n", "def f(x):\n    return x.sum((-1))\n"]


def test_comparison_flipped_rewrites_the_operator_only() -> None:
    source = "def f(a, b):\n    return (a  <  b, a >= b, a == b, a != b, a is b)\n"
    assert mutated(Operator.COMPARISON_FLIPPED, source) == [
        "def f(a, b):\n    return (a  <=  b, a >= b, a == b, a != b, a is b)\n",
        "def f(a, b):\n    return (a  <  b, a > b, a == b, a != b, a is b)\n",
        "def f(a, b):\n    return (a  <  b, a >= b, a != b, a != b, a is b)\n",
        "def f(a, b):\n    return (a  <  b, a >= b, a == b, a == b, a is b)\n",
    ]


def test_slice_bound_moves_non_constant_bounds() -> None:
    source = "def f(x, n, m):\n    return x[:n], x[m + 1:], x[:4]\n"
    assert mutated(Operator.SLICE_BOUND, source) == [
        "def f(x, n, m):\n    return x[:n - 1], x[m + 1:], x[:4]\n",
        "def f(x, n, m):\n    return x[:n + 1], x[m + 1:], x[:4]\n",
        "def f(x, n, m):\n    return x[:n], x[(m + 1) - 1:], x[:4]\n",
        "def f(x, n, m):\n    return x[:n], x[(m + 1) + 1:], x[:4]\n",
    ]


def test_in_place_target_redirects_writes_to_a_fresh_tensor() -> None:
    source = '''
    def f(x, y, out):
        x.copy_(y)
        x[:2] = y
        torch.sub(y, 1, out=out)
        z = x.add_(1)
    '''
    results = mutated(Operator.IN_PLACE_TARGET, source)
    assert [r.split("\n")[2:5] for r in results] == [
        ["    x.clone().copy_(y)", "    x[:2] = y", "    torch.sub(y, 1, out=out)"],
        ["    x.copy_(y)", "    x.clone()[:2] = y", "    torch.sub(y, 1, out=out)"],
        ["    x.copy_(y)", "    x[:2] = y", "    torch.sub(y, 1, out=out.clone())"],
    ]


def test_view_snapshot_clones_views_of_persistent_buffers_handed_to_metadata() -> None:
    source = '''
    def build(self, common, n):
        lens, slots = self.lens[:n], self.slots.view(-1)
        local = common.positions[:n]
        return Meta(table=common.table, num_reqs=common.num_reqs, causal=True)
    '''
    results = mutated(Operator.VIEW_SNAPSHOT, source)
    record = "    return Meta(table=common.table, num_reqs=common.num_reqs, causal=True)"
    local = "    local = common.positions[:n]"
    assert [r.split("\n")[2:5] for r in results] == [
        ["    lens, slots = self.lens[:n].clone(), self.slots.view(-1)", local, record],
        ["    lens, slots = self.lens[:n], self.slots.view(-1).clone()", local, record],
        ["    lens, slots = self.lens[:n], self.slots.view(-1)", local,
         record.replace("common.table", "common.table.clone()")],
    ]


def test_edits_keep_every_other_line_and_count_utf8_columns() -> None:
    source = "def f(x):\n    s = 'é'; return x[:1]\n    # end\n"
    (first, second) = mutated(Operator.OFF_BY_ONE, source)
    assert first == "def f(x):\n    s = 'é'; return x[:2]\n    # end\n"
    assert second == "def f(x):\n    s = 'é'; return x[:0]\n    # end\n"


@pytest.fixture(scope="module")
def reference_mutants() -> list[Mutant]:
    return generate_mutants(backend_targets(REFERENCE), list(Operator))


def test_targets_of_reference_are_its_package_and_the_dcp_share() -> None:
    targets = {t.path.relative_to(ROOT).as_posix(): t.role for t in backend_targets(REFERENCE)}
    assert targets == {
        "backends/reference/builder.py": Role.BUILDER,
        "backends/dcp.py": Role.REFRESH,
        "backends/reference/__init__.py": Role.HELPER,
        "backends/reference/attention.py": Role.HELPER,
    }
    (chosen,) = chosen_targets([ROOT / "backends" / "dcp.py"], backend_targets(REFERENCE))
    assert (chosen.package, chosen.package_dir, chosen.role) == ("speccheck", ROOT, Role.CHOSEN)


def test_a_deleted_only_binding_makes_a_stillborn_mutant_not_run() -> None:
    """A statement deletion that leaves a name read but bound nowhere (here ``total``, in a
    function, and the module-level ``LIMIT``) is invalid, as a name checker would reject
    it; deleting a statement whose name is bound again elsewhere, or a call, is not."""
    source = (
        "LIMIT = 4\n"
        "def f(xs):\n"
        "    total = sum(xs)\n"
        "    other = 1\n"
        "    other = 2\n"
        "    print(other)\n"
        "    return min(total, LIMIT)\n"
    )
    assert unbound_names(source, "m.py") == frozenset()
    assert unbound_names(source.replace("    total = sum(xs)", "    pass"), "m.py") == {"total"}
    assert unbound_names(source.replace("LIMIT = 4", "pass"), "m.py") == {"LIMIT"}
    assert unbound_names(source.replace("    other = 1", "    pass"), "m.py") == frozenset()
    assert unbound_names(source.replace("    print(other)", "    pass"), "m.py") == frozenset()


def test_a_deleted_only_binding_of_an_attribute_makes_a_stillborn_mutant() -> None:
    """An attribute a method reads from ``self`` whose only binding the edit deleted, in a
    class whose bases are all known; a class with a base from elsewhere is not judged."""
    source = (
        "class Base:\n"
        "    def __init__(self):\n"
        "        self.kept = 1\n"
        "class Share(Base):\n"
        "    limit: int\n"
        "    def __init__(self, n):\n"
        "        super().__init__()\n"
        "        self.n = n\n"
        "    def total(self):\n"
        "        return self.n + self.kept + self.limit\n"
        "class Elsewhere(Exception):\n"
        "    def f(self):\n"
        "        return self.args\n"
    )
    assert unbound_attributes(source) == frozenset()
    assert unbound_attributes(source.replace("        self.n = n", "        pass")) == {
        "Share.self.n"}
    assert unbound_attributes(source.replace("        self.kept = 1", "        pass")) == {
        "Share.self.kept"}
    assert unbound_attributes(source.replace("    limit: int\n", "")) == {"Share.self.limit"}


def test_stillborn_mutants_are_invalid_and_their_reason_names_the_names(
    reference_mutants: list[Mutant],
) -> None:
    stillborn = [m for m in reference_mutants if m.unbound]
    assert stillborn and all(m.operator is Operator.STATEMENT_DELETED for m in stillborn)
    assert all(not m.valid and m.compiles for m in stillborn)
    assert all(", ".join(m.unbound) in m.invalid_reason for m in stillborn)
    assert all(m.valid for m in reference_mutants if not m.unbound)


def test_mutants_of_reference_cover_every_operator_and_compile(
    reference_mutants: list[Mutant],
) -> None:
    assert {m.operator for m in reference_mutants} == set(Operator)
    files = {m.target.path.name for m in reference_mutants}
    assert files == {"builder.py", "attention.py", "dcp.py"}
    assert all(m.compiles for m in reference_mutants)
    assert len({(m.target, m.source) for m in reference_mutants}) == len(reference_mutants)
    for mutant in reference_mutants:
        original = mutant.target.path.read_text().splitlines()
        assert mutant.original_line == original[mutant.line - 1].strip()
        assert mutant.mutated_line != mutant.original_line or mutant.end_line > mutant.line
    sample = sample_mutants(reference_mutants, 10, seed=3)
    assert sample == sample_mutants(reference_mutants, 10, seed=3)
    assert len(sample) == 10 and sample == sorted(sample, key=lambda m: m.number)


def _pick(mutants: list[Mutant], file: str, operator: Operator, line_text: str,
          description: str | None = None) -> Mutant:
    (mutant,) = [m for m in mutants if m.target.path.name == file and m.operator is operator
                 and m.original_line == line_text
                 and (description is None or m.description == description)]
    return mutant


def test_a_run_shadows_the_installed_package_in_verify_workers_and_reports_each_outcome(
    reference_mutants: list[Mutant], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Real verify runs (a few examples each): the unmutated copy's lines are recorded in
    the worker (only workers call the builder), a mutant whose metadata snapshots
    ``seq_lens`` is killed by a check naming the field, and an equivalent mutant (a larger
    minimum chunk of the fp32 gather, executed at the defaults) survives, reported at its
    ``file:line`` as a candidate for equivalence."""
    monkeypatch.chdir(ROOT)
    killed = _pick(reference_mutants, "builder.py", Operator.VIEW_SNAPSHOT,
                   "seq_lens=common.seq_lens,")
    survivor = _pick(reference_mutants, "attention.py", Operator.OFF_BY_ONE,
                     "per_chunk = max(1, GATHER_BYTES // (columns * block_size * num_kv_heads "
                     "* head_size * 4))", "1 -> 2")
    targets = [killed.target, survivor.target]
    coverage = run_unmutated(targets, "reference", examples=3, timeout=300)
    assert coverage.outcome.report is not None and coverage.outcome.report["status"] == "passed"
    assert coverage.processes >= 2 and coverage.ran_function_bodies(targets)
    assert coverage.ran(killed.target, killed.line, killed.end_line)
    settings = RunSettings(backend="reference", examples=3, jobs=2, budget=600, timeout=300)
    results = run_mutants([killed, survivor], settings)
    assert [r.outcome for r in results] == [Outcome.KILLED, Outcome.SURVIVED]
    assert results[0].kill_kind is KillKind.NAMED_FIELD
    assert any(field.endswith("seq_lens") for field in results[0].named_fields)
    report = MutationReport("reference", 3, targets, ["view_snapshot", "off_by_one"], 2,
                            results, coverage, 1.0)
    payload = json.loads(json.dumps(report.to_json()))
    assert payload["score"] == 0.5
    assert payload["counts"]["killed"] == 1 and payload["counts"]["survived"] == 1
    assert set(payload["kills_by_kind"]) == {kind.value for kind in KillKind}
    assert payload["kills_by_role"]["builder"]["named_field_check"] == 1
    assert sum(payload["kills_by_role"]["helper"].values()) == 0  # attention.py
    # ReferenceMetadataBuilder.build ran it; the survivor's line ran in the impl's forward
    assert payload["kills_by_phase"]["metadata"]["named_field_check"] == 1
    assert [m["phase"] for m in payload["mutants"]] == ["metadata", "attention"]
    assert "named field 1 of 1 metadata-code kills" in (metadata_kills_line(report) or "")
    entry = payload["mutants"][1]
    assert (entry["file"], entry["line"], entry["outcome"], entry["survivor"], entry["executed"]) \
        == ("backends/reference/attention.py", survivor.line, "survived",
            SurvivorClass.EQUIVALENCE_CANDIDATE.value, True)
    assert entry["diff"] == {"-": survivor.original_line, "+": survivor.mutated_line}
    assert "backends/reference/attention.py" in payload["never_executed"]
    assert "mutation score 50%" in summary_line(report)


def test_a_plug_in_adapter_installed_in_site_packages_is_shadowed_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The template adapter, installed (not editable) into a folder on ``PYTHONPATH`` as a
    plug-in: its package's copy comes first in verify's workers, so deleting its refresh is
    killed by the check naming ``kv_lens``."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(site),
                    str(ROOT / "examples" / "adapter_template")],
                   check=True, capture_output=True, timeout=120)
    monkeypatch.setenv("PYTHONPATH", str(site))
    (target,) = chosen_targets([site / "speccheck_adapter_template" / "attention.py"], [])
    assert (target.package, target.package_dir) == ("speccheck_adapter_template",
                                                     site / "speccheck_adapter_template")
    refresh = _pick(generate_mutants([target], [Operator.STATEMENT_DELETED]), "attention.py",
                    Operator.STATEMENT_DELETED,
                    "metadata.kv_lens.copy_(metadata.seq_lens)  # the in-graph refresh")
    # Two examples in each of the template's four configuration cells, so that every cell
    # runs the refresh on more than its first draw.
    examples = 8
    coverage = run_unmutated([target], "template_attn", examples=examples, timeout=300)
    assert coverage.outcome.report is not None and coverage.outcome.report["status"] == "passed"
    assert coverage.ran(target, refresh.line, refresh.line)
    settings = RunSettings(backend="template_attn", examples=examples, jobs=1, budget=600,
                           timeout=300)
    (result,) = run_mutants([refresh], settings)
    assert result.outcome is Outcome.KILLED, result
    assert any(field.endswith("kv_lens") for field in result.named_fields)


def test_shipped_equivalence_arguments_match_mutants_and_leave_the_score(
    reference_mutants: list[Mutant],
) -> None:
    """The arguments shipped beside the reference's modules each match a generated mutant;
    an argued survivor is classed so, carries its argument and leaves the denominator; an
    argued mutant that is killed refutes the argument."""
    targets = backend_targets(REFERENCE)
    arguments = load_equivalents(targets)
    argued = [m for m in reference_mutants if argument_for(m, arguments) is not None]
    assert len(argued) == len(arguments) >= 2
    check_group = _pick(reference_mutants, "dcp.py", Operator.STATEMENT_DELETED,
                        "dcp.check_group()")
    other = next(m for m in reference_mutants if m.valid and m not in argued)
    survived = [MutantResult(check_group, Outcome.SURVIVED),
                MutantResult(other, Outcome.KILLED, failed_checks=("logits",))]
    coverage = CoverageRun(VerifyOutcome(0, None, 1.0, []), {}, 1)
    report = MutationReport("reference", None, targets, ["statement_deleted"], 2, survived,
                            coverage, 1.0, arguments)
    assert report.score == 1.0 and report.scored == 1 and report.argued_survivors == 1
    (entry, _) = report.to_json()["mutants"]
    assert entry["survivor"] == SurvivorClass.ARGUED_EQUIVALENT.value
    assert "never raises" in entry["argument"]
    refuted = MutationReport("reference", None, targets, ["statement_deleted"], 1,
                             [MutantResult(check_group, Outcome.KILLED_BY_CRASH)], coverage,
                             1.0, arguments)
    assert refuted.score == 1.0 and refuted.to_json()["refuted_equivalence"] == [
        check_group.location]


@pytest.mark.parametrize("backend", ["reference", "sparse_swa", "triton_attn", "triton_mla"])
def test_every_shipped_argument_names_a_mutant_the_checkout_generates(backend: str) -> None:
    """An argument whose function, operator or lines no longer match a generated mutant
    would argue nothing (the code moved under it): each matches exactly one."""
    from speccheck.contract.plugins import load_matrix_with_plugins

    implementation = load_matrix_with_plugins(None).backend(backend).implementation
    assert implementation is not None
    targets = backend_targets(implementation)
    arguments = load_equivalents(targets)
    argued = [m for m in generate_mutants(targets, list(Operator))
              if argument_for(m, arguments) is not None]
    assert len(argued) == len(arguments) > 0


def test_a_saved_run_is_rescored_with_the_arguments_of_the_checkout(
    reference_mutants: list[Mutant], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--rescore``: a saved report's survivor argued after the run leaves the score, its
    kills stay the run's, and a report whose mutant this checkout does not generate (the
    code under test changed) is refused in one line."""
    monkeypatch.chdir(ROOT)
    targets = backend_targets(REFERENCE)
    arguments = load_equivalents(targets)
    check_group = _pick(reference_mutants, "dcp.py", Operator.STATEMENT_DELETED,
                        "dcp.check_group()")
    other = next(m for m in reference_mutants if m.valid and argument_for(m, arguments) is None)
    results = [MutantResult(check_group, Outcome.SURVIVED, seconds=2.0),
               MutantResult(other, Outcome.KILLED, ("field_meanings",), ("seq_lens",), 3.0)]
    coverage = CoverageRun(VerifyOutcome(0, None, 9.0, []),
                           {check_group.target.path: frozenset({check_group.line})}, 2)
    run = MutationReport("reference", None, targets, [o.value for o in Operator],
                         len(reference_mutants), results, coverage, 5.0, {},
                         "speccheck mutate --backend reference", "abc123")
    assert run.score == 0.5
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(run.to_json()))
    again = rescored(saved, read_report(saved), "reference", targets, arguments)
    assert again.score == 1.0 and again.argued_survivors == 1
    assert arguments_changed(read_report(saved), again)  # the record names who scored it
    saved_again = tmp_path / "again.json"
    saved_again.write_text(json.dumps(again.to_json()))
    same = rescored(saved_again, read_report(saved_again), "reference", targets, arguments)
    assert not arguments_changed(read_report(saved_again), same)  # scored as the run was
    assert again.to_json()["kills_by_kind"] == run.to_json()["kills_by_kind"]
    assert (again.command, again.commit, again.coverage.processes) == (
        run.command, "abc123", 2)
    assert again.survivor_class(again.results[0]) is SurvivorClass.ARGUED_EQUIVALENT
    changed = run.to_json()
    changed["mutants"][0]["diff"]["-"] = "dcp.check_group(again)"
    saved.write_text(json.dumps(changed))
    with pytest.raises(RescoreError, match=rf"mutant #{check_group.number} \(backends/dcp.py:"
                       rf"{check_group.line}\) is not the one this checkout generates"):
        rescored(saved, read_report(saved), "reference", targets, arguments)
    del changed["executed_lines"]
    saved.write_text(json.dumps(changed))
    with pytest.raises(RescoreError, match="executed_lines: Field required"):
        rescored(saved, read_report(saved), "reference", targets, arguments)


def test_the_shards_of_a_run_merge_into_the_whole_run(
    reference_mutants: list[Mutant], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--shard I/N`` parts are disjoint and cover the run; ``--rescore`` with every part
    scores the whole run (the command without the shard, coverage united), and refuses a
    missing part, a part twice and parts of different runs in one line."""
    monkeypatch.chdir(ROOT)
    targets = backend_targets(REFERENCE)
    valid = [m for m in reference_mutants if m.valid][:5]
    parts = [Shard.parse(f"{i}/2") for i in (1, 2)]
    assert sorted(m.number for p in parts for m in p.of(valid)) == [m.number for m in valid]
    with pytest.raises(ValueError, match="INDEX must be 1 to COUNT"):
        Shard.parse("3/2")
    paths = []
    for part in parts:
        mine = part.of(valid)
        coverage = CoverageRun(VerifyOutcome(0, None, 9.0, []),
                               {mine[0].target.path: frozenset({mine[0].line})}, 1)
        run = MutationReport("reference", None, targets, [o.value for o in Operator],
                             len(reference_mutants),
                             [MutantResult(m, Outcome.KILLED, ("step_metadata",), ("seq_lens",),
                                           1.0) for m in mine],
                             coverage, 10.0, {}, f"speccheck mutate --backend reference --shard "
                             f"{part}", "abc123")
        paths.append(tmp_path / f"part{part.index}.json")
        paths[-1].write_text(json.dumps(run.to_json()))
    data = [read_report(path) for path in paths]
    whole = rescored(paths[0], merged_shards(paths, data), "reference", targets, {})
    assert [r.mutant.number for r in whole.results] == [m.number for m in valid]
    assert whole.command == "speccheck mutate --backend reference"
    assert (whole.seconds, whole.coverage.processes, whole.score) == (20.0, 2, 1.0)
    assert all(whole.coverage.ran(m.target, m.line, m.end_line) for m in
               (p.of(valid)[0] for p in parts))
    with pytest.raises(RescoreError, match="missing --shard 2/2"):
        merged_shards(paths[:1], data[:1])
    with pytest.raises(RescoreError, match="shard 1/2 again"):
        merged_shards([paths[0], paths[0]], [data[0], data[0]])
    split = []  # part 2/2 run later as 2/4 and 4/4
    for index in (2, 4):
        numbers = {m.number for m in Shard(index, 4).of(valid)}
        split.append({**data[1],
                      "command": f"speccheck mutate --backend reference --shard {index}/4",
                      "mutants": [m for m in data[1]["mutants"] if m["number"] in numbers]})
    again = merged_shards([paths[0], tmp_path / "b", tmp_path / "c"], [data[0], *split])
    assert [m["number"] for m in again["mutants"]] == [m.number for m in valid]
    with pytest.raises(RescoreError, match="missing --shard 4/4"):
        merged_shards([paths[0], tmp_path / "b"], [data[0], split[0]])
    with pytest.raises(RescoreError, match="shard 2/4 overlaps shard 2/2"):
        merged_shards([*paths, tmp_path / "b"], [*data, split[0]])
    garbled = {**data[1], "command": "speccheck mutate --backend reference --shard 3/2"}
    with pytest.raises(RescoreError, match=r"--shard '3/2': INDEX must be 1 to COUNT"):
        merged_shards(paths, [data[0], garbled])
    other = {**data[1], "commit": "def456"}
    with pytest.raises(RescoreError, match="not a part of the run of"):
        merged_shards(paths, [data[0], other])


def _cut_run(mutants: list[Mutant], unrun: set[int], targets: list[TargetModule],
             examples: int | None = None) -> MutationReport:
    """A run of ``mutants`` whose budget left ``unrun`` (mutant numbers) unrun, the others
    killed by a field check; its gate traced every mutated line."""
    results = [MutantResult(m, Outcome.NOT_RUN) if m.number in unrun
               else MutantResult(m, Outcome.KILLED, ("step_metadata",), ("seq_lens",), 1.0)
               for m in mutants]
    lines: dict[Path, set[int]] = {}
    for m in mutants:
        lines.setdefault(m.target.path, set()).update(range(m.line, m.end_line + 1))
    coverage = CoverageRun(VerifyOutcome(0, None, 9.0, []),
                           {path: frozenset(found) for path, found in lines.items()}, 2)
    return MutationReport("reference", examples, targets, [o.value for o in Operator],
                          len(mutants), results, coverage, 30.0, {},
                          "speccheck mutate --backend reference", "abc123")


def test_the_continuations_of_a_run_combine_into_the_whole_run(
    reference_mutants: list[Mutant], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--resume``: each part resuming a cut run holds the whole run, the mutants it judged
    and a resumption naming its commit; the parts combine, each mutant from the part that
    judged it (a survivor judged again by a newer gate: the newer result), each resumption
    once; its record names them. A part of another run, or two parts that judged one
    mutant otherwise, is refused in one line."""
    monkeypatch.chdir(ROOT)
    targets = backend_targets(REFERENCE)
    numbers = [m.number for m in reference_mutants]
    unrun = set(numbers[-4:])
    run = _cut_run(reference_mutants, unrun, targets)
    paths = [tmp_path / "run.json"]
    paths[0].write_text(json.dumps(run.to_json()))
    for index, judged in ((1, numbers[-4:-2]), (2, numbers[-2:])):
        part = replace(
            run, results=[MutantResult(r.mutant, Outcome.SURVIVED, seconds=2.0,
                                       judged_by="v2")
                          if r.mutant.number in judged else r for r in run.results],
            seconds=run.seconds + 5.0, resumed=(Resumption("def456", 2, 5.0, f"{index}/2"),))
        paths.append(tmp_path / f"part{index}.json")
        paths[-1].write_text(json.dumps(part.to_json()))
    data = [read_report(path) for path in paths]
    whole = rescored(paths[0], combined_runs(paths, data), "reference", targets, {})
    assert whole.count(Outcome.NOT_RUN) == 0 and whole.count(Outcome.SURVIVED) == 4
    assert whole.resumed == (Resumption("def456", 2, 5.0, "1/2"),
                             Resumption("def456", 2, 5.0, "2/2"))
    assert (whole.commit, whole.seconds) == ("abc123", 40.0)
    again = combined_runs([paths[1], paths[1], paths[0]], [data[1], data[1], data[0]])
    assert again["resumed"] == [whole.resumed[0].to_json()]
    assert sum(m["outcome"] == "not_run" for m in again["mutants"]) == 2
    record = MutationRecord.from_report(whole.to_json(), command=whole.command,
                                        commit=whole.commit, date="2026-12-07")
    assert [(p.commit, p.ran, p.shard) for p in record.resumed] == [
        ("def456", 2, "1/2"), ("def456", 2, "2/2")]
    assert record.not_run == 0 and record.valid == len(reference_mutants)
    twice = json.loads(paths[2].read_text())
    twice["mutants"][-1]["outcome"] = "killed"
    with pytest.raises(RescoreError, match=rf"mutant #{numbers[-1]} was judged in two parts"):
        combined_runs([paths[2], tmp_path / "twice.json"], [data[2], twice])
    newer = json.loads(paths[2].read_text())  # another verify judged part 2's survivor again
    newer["mutants"][-1].update(outcome="killed", judged_by="v3")
    newer["resumed"] = [{**newer["resumed"][0], "ran": 1, "rejudged": 1, "commit": "fed789"}]
    for order in ([data[2], newer], [newer, data[2]]):
        kept = combined_runs([paths[2], tmp_path / "newer.json"], order)
        assert kept["mutants"][-1]["outcome"] == "killed"  # a kill is never judged again
    newer["mutants"][-1].update(outcome="survived", seconds=3.0)
    for order in ([data[2], newer], [newer, data[2]]):  # both survived: the checkout's verify
        kept = combined_runs([paths[2], tmp_path / "newer.json"], order, "v3")
        assert kept["mutants"][-1]["judged_by"] == "v3"
    other = {**data[1], "commit": "fff000"}
    with pytest.raises(RescoreError, match="not a part of the run of .*its commit differs"):
        combined_runs([paths[0], tmp_path / "other.json"], [data[0], other])
    with pytest.raises(RescoreError, match=r"resumed\[0\]: ran: "):
        saved_resumptions(paths[1], {**data[1], "resumed": [{"commit": "x", "ran": "many",
                                                             "seconds": 1.0}]})


def test_a_continuation_judges_again_only_survivors_another_verify_judged(
    reference_mutants: list[Mutant], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A survivor is stale where another verify, or one not recorded, judged it; a kill,
    and a survivor this verify judged, are not judged again."""
    monkeypatch.chdir(ROOT)
    run = _cut_run(reference_mutants, set(), backend_targets(REFERENCE))
    verdicts = {0: None, 1: "v2", 2: "v3"}
    run = replace(run, results=[
        MutantResult(r.mutant, Outcome.SURVIVED, judged_by=verdicts[index])
        if index in verdicts else r for index, r in enumerate(run.results)])
    assert run.survivor_class(run.results[0]) is SurvivorClass.UNCAUGHT
    assert stale_survivors(run, "v3") == [r.mutant for r in run.results[:2]]
    assert stale_survivors(run, None) == [r.mutant for r in run.results[:3]]


def test_the_verify_fingerprint_follows_only_the_code_that_judges(tmp_path: Path) -> None:
    """A judgement stands across a change of the equivalence arguments or a file verify
    never reads, not across one of the adapter's code; the paths verify never calls are
    speccheck's own."""
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "builder.py").write_text("x = 1\n")
    (target,) = chosen_targets([tmp_path / "builder.py"], [])
    first = verify_fingerprint([target])
    (tmp_path / EQUIVALENTS_FILE).write_text("{}\n")
    (tmp_path / "NOTES.md").write_text("read by people\n")
    assert verify_fingerprint([target]) == first
    (tmp_path / "helpers.py").write_text("y = 2\n")
    assert verify_fingerprint([target]) != first
    assert all((ROOT / path).exists() for path in VERIFY_INDEPENDENT)


def test_a_resumed_run_judges_its_unrun_mutants_at_this_commit(tmp_path: Path) -> None:
    """``speccheck mutate --resume`` for real: a run of the reference builder's mutants
    cut with two left unrun (one a field check kills, one stillborn) and one survivor an
    unrecorded verify let through resumes at this checkout: the gate runs first (another
    commit), the survivor is judged again (killed now, by this verify), the two unrun are
    judged, the rest copied, and the resumption names this commit; resuming the run with
    that part combines them (the newer judgement kept), runs nothing and adds no
    resumption."""
    targets = chosen_targets([ROOT / "backends/reference/builder.py"],
                             backend_targets(REFERENCE))
    mutants = generate_mutants(targets, list(Operator))
    killed = _pick(mutants, "builder.py", Operator.VIEW_SNAPSHOT, "seq_lens=common.seq_lens,")
    stillborn = next(m for m in mutants if not m.valid)
    older = _pick(mutants, "builder.py", Operator.VIEW_SNAPSHOT,
                  "block_table=common.block_table,")
    run = _cut_run(mutants, {killed.number, stillborn.number}, targets, examples=3)
    run = replace(run, results=[MutantResult(r.mutant, Outcome.SURVIVED, seconds=1.0)
                                if r.mutant is older else r for r in run.results])
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(run.to_json()))
    resumed = tmp_path / "resumed.json"
    module = ["--backend", "reference", "--module", str(ROOT / "backends/reference/builder.py")]
    proc = speccheck("mutate", *module, "--resume", str(saved), "--json", str(resumed),
                     "--jobs", "1", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 of its" in proc.stderr and "first the unmutated gate at" in proc.stderr
    assert "(1 survivors another verify judged first)" in proc.stderr, proc.stderr
    report = json.loads(resumed.read_text())
    outcomes = {m["number"]: m for m in report["mutants"]}
    assert outcomes[killed.number]["outcome"] == "killed"
    assert outcomes[older.number]["outcome"] == "killed"  # the newer gate catches it
    assert outcomes[older.number]["judged_by"] == verify_fingerprint(targets)
    assert any(f.endswith("seq_lens") for f in outcomes[killed.number]["named_fields"])
    assert outcomes[stillborn.number]["outcome"] == "invalid"
    assert report["counts"]["not_run"] == 0 and report["commit"] == "abc123"
    (part,) = report["resumed"]
    assert (part["ran"], part["rejudged"], part["shard"]) == (3, 1, None)
    assert part["commit"] not in ("", "abc123")
    again = speccheck("mutate", *module, "--resume", str(saved), "--resume", str(resumed),
                      "--json", "-")
    assert again.returncode == 0, again.stderr
    assert "0 of its" in again.stderr and "gate" not in again.stderr.splitlines()[0]
    assert json.loads(again.stdout)["resumed"] == report["resumed"]


@pytest.mark.parametrize(("text", "message"), [
    ("builder.py: [1]", "builder.py[0]: Input should be a valid dictionary"),
    ("nope.py: []", "'nope.py' is not a module in"),
    ("builder.py:\n  - {function: f, operator: bogus, original: a, mutated: b, argument: c}",
     "builder.py[0].operator: Input should be"),
    ("builder.py:\n  - {function: f, operator: off_by_one, original: a, mutated: b}",
     "builder.py[0].argument: Field required"),
    ("[unclosed", "not YAML"),
])
def test_a_bad_equivalents_file_is_one_line_naming_file_and_entry(
    tmp_path: Path, text: str, message: str,
) -> None:
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "builder.py").write_text("x = 1\n")
    (tmp_path / EQUIVALENTS_FILE).write_text(text + "\n")
    (target,) = chosen_targets([tmp_path / "builder.py"], [])
    with pytest.raises(EquivalentsError) as caught:
        load_equivalents([target])
    line = str(caught.value)
    assert "\n" not in line and line.startswith(str(tmp_path / EQUIVALENTS_FILE))
    assert message in line, line


def test_judge_names_each_kill_kind(reference_mutants: list[Mutant]) -> None:
    mutant = reference_mutants[0]

    def ran(report: dict[str, object] | None, returncode: int | None = 1) -> VerifyOutcome:
        return VerifyOutcome(returncode, report, 1.0, ["last line"])

    def failed(*checks: str, field: str | None = None) -> dict[str, object]:
        return {"status": "failed", "detail": "",
                "checks": {c: {"failed": int(c in checks)}
                           for c in ("logits", "vs_fp32_reference")},
                "failures": [{"check": checks[0], "field": field}]}

    named = judge(mutant, ran(failed("logits", field="x.seq_lens")))
    assert named.kill_kind is KillKind.NAMED_FIELD
    assert judge(mutant, ran(failed("logits"))).kill_kind is KillKind.OTHER_CHECK
    only_fp32 = judge(mutant, ran(failed("vs_fp32_reference")))
    assert only_fp32.kill_kind is KillKind.FP32_REFERENCE_ONLY
    crash = judge(mutant, ran({"status": "crashed", "detail": "worker died"}))
    assert (crash.outcome, crash.kill_kind, crash.detail) == (
        Outcome.KILLED_BY_CRASH, KillKind.CRASH, "crashed: worker died")
    assert judge(mutant, ran(None)).detail == "no report: last line"
    assert judge(mutant, ran(None, returncode=None)).outcome is Outcome.KILLED_BY_TIMEOUT
    assert judge(mutant, ran({"status": "passed"}, 0)).outcome is Outcome.SURVIVED
    # a kernel Triton's front end rejects cannot run on any input: non-viable, not a kill
    front_end_site = ("at triton/language/semantic.py:589, from "
                      "speccheck/backends/sparse_swa/index_kernels.py:40")
    front_end = judge(mutant, ran({"status": "crashed", "raised_at": front_end_site, "detail": (
        "worker exited with status 1: triton.runtime.errors.InterpreterError: ValueError("
        f"\"arange's range must be a power of 2\") ({front_end_site})")}))
    assert front_end.outcome is Outcome.INVALID and "front end" in front_end.detail
    adapter_site = "at speccheck/backends/sparse_swa/impl.py:97"
    adapter = judge(mutant, ran({"status": "crashed", "raised_at": adapter_site, "detail": (
        f"worker exited with status 1: builtins.ValueError: bad ({adapter_site})")}))
    assert adapter.outcome is Outcome.KILLED_BY_CRASH
    # the site is read from its field: a message that quotes a front-end path is no site
    quoted = judge(mutant, ran({"status": "crashed", "raised_at": adapter_site, "detail": (
        "worker exited with status 1: builtins.ValueError: see (at triton/language/x.py:1) "
        f"({adapter_site})")}))
    assert quoted.outcome is Outcome.KILLED_BY_CRASH


def test_a_spent_budget_starts_nothing_and_invalid_mutants_never_run(
    reference_mutants: list[Mutant],
) -> None:
    first, second = reference_mutants[:2]
    spent = RunSettings(backend="reference", examples=1, jobs=1, budget=1, timeout=60,
                        started=time.monotonic() - 10)
    seen: list[Outcome] = []
    results = run_mutants([replace(first, compiles=False), second], spent,
                          on_result=lambda result: seen.append(result.outcome))
    assert [r.outcome for r in results] == [Outcome.INVALID, Outcome.NOT_RUN]
    assert seen == [Outcome.INVALID]


def test_stop_after_stops_the_runs_under_way_and_reports_them_not_run(
    reference_mutants: list[Mutant], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--stop-after``: a verify run still going then is killed and its mutant is not run
    (not killed by a timeout), and the call returns at once rather than at the run's end."""
    monkeypatch.chdir(ROOT)
    mutant = _pick(reference_mutants, "attention.py", Operator.OFF_BY_ONE,  # a survivor
                   "per_chunk = max(1, GATHER_BYTES // (columns * block_size * num_kv_heads "
                   "* head_size * 4))", "1 -> 2")
    settings = RunSettings(backend="reference", examples=50, jobs=1, budget=600, timeout=600,
                           stop_after=3.0)
    began = time.monotonic()
    [result] = run_mutants([mutant], settings)
    assert result.outcome is Outcome.NOT_RUN, result
    assert time.monotonic() - began < 30


def test_sigterm_stops_the_runs_under_way_and_the_results_return(
    reference_mutants: list[Mutant], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An outside limit's ``SIGTERM`` acts as ``--stop-after`` does: the run under way is
    killed, its mutant not run, and the results return (so the report is written); the
    previous handler is back afterwards."""
    monkeypatch.chdir(ROOT)
    mutant = _pick(reference_mutants, "attention.py", Operator.OFF_BY_ONE,  # a survivor
                   "per_chunk = max(1, GATHER_BYTES // (columns * block_size * num_kv_heads "
                   "* head_size * 4))", "1 -> 2")
    settings = RunSettings(backend="reference", examples=50, jobs=1, budget=600, timeout=600)
    before = signal.getsignal(signal.SIGTERM)
    sender = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGTERM))
    began = time.monotonic()
    sender.start()
    try:
        [result] = run_mutants([mutant], settings)
    finally:
        sender.cancel()
    assert result.outcome is Outcome.NOT_RUN, result
    assert time.monotonic() - began < 30
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_mutant_whose_lines_never_ran_survives_without_a_run(
    reference_mutants: list[Mutant],
) -> None:
    """Only an edit starting at a function-body statement the unmutated gate never executed
    is unreached; an executed one, or one on a ``def`` line (defaults run at import, which
    the tracer does not see), is run."""
    mutant = next(m for m in reference_mutants if m.valid and m.line == m.end_line)
    target = mutant.target
    unrun = CoverageRun(VerifyOutcome(0, None, 1.0, []), {}, 2)
    assert unrun.never_reached(target, mutant.line, mutant.end_line)
    ran = CoverageRun(VerifyOutcome(0, None, 1.0, []), {target.path: frozenset({mutant.line})}, 2)
    assert not ran.never_reached(target, mutant.line, mutant.end_line)
    tree = ast.parse(target.path.read_text(encoding="utf-8"))
    def_line = next(node.lineno for node in ast.walk(tree) if isinstance(node, ast.FunctionDef))
    assert not unrun.never_reached(target, def_line, def_line)
    settings = RunSettings(backend="reference", examples=1, jobs=1, budget=1, timeout=60,
                           started=time.monotonic() - 10, unreached=frozenset({mutant.number}))
    [result] = run_mutants([mutant], settings)
    assert (result.outcome, result.detail) == (Outcome.SURVIVED, UNREACHED_DETAIL)


def test_a_saved_gate_serves_only_the_same_backend_examples_and_code(tmp_path: Path) -> None:
    """``--gate FILE``: a passing gate read back gives the lines and phases it ran and its
    wall time; another ``--examples`` or other code (any file the shadow copies, compiled
    files aside) is refused with one line naming the file."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("", encoding="utf-8")
    (package / "sub" / "__init__.py").write_text("", encoding="utf-8")
    module = package / "sub" / "mod.py"
    module.write_text("def f():\n    return 1\n", encoding="utf-8")
    (target,) = chosen_targets([module], [])
    phases = {target.path: {CodePhase.METADATA: frozenset({2})}}
    passed = VerifyOutcome(0, {"status": "passed"}, 12.5, [])
    gate = tmp_path / "gate.json"
    fingerprint = code_fingerprint([target])
    save_gate(gate, CoverageRun(passed, {target.path: frozenset({2})}, 3, phases), [target],
              backend="b", examples=None, fingerprint=fingerprint)
    loaded = load_gate(gate, [target], backend="b", examples=None, fingerprint=fingerprint)
    assert (loaded.executed, loaded.phases, loaded.processes, loaded.outcome.seconds) \
        == ({target.path: frozenset({2})}, phases, 3, 12.5)
    (package / "sub" / "__pycache__").mkdir()
    (package / "sub" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"x")
    assert code_fingerprint([target]) == fingerprint
    with pytest.raises(GateFileError, match="not of this run's"):
        load_gate(gate, [target], backend="b", examples=5, fingerprint=fingerprint)
    (package / "helper.py").write_text("X = 1\n", encoding="utf-8")
    with pytest.raises(GateFileError, match=r"gate.json: saved from other code"):
        load_gate(gate, [target], backend="b", examples=None,
                  fingerprint=code_fingerprint([target]))
    failed = CoverageRun(VerifyOutcome(1, {"status": "failed"}, 1.0, []), {}, 1)
    with pytest.raises(ValueError, match="only a passing gate"):
        save_gate(gate, failed, [target], backend="b", examples=None, fingerprint=fingerprint)


def test_a_stopped_verify_run_ends_at_once_as_timed_out(tmp_path: Path) -> None:
    stop = threading.Event()
    timer = threading.Timer(2.0, stop.set)
    timer.start()
    started = time.monotonic()
    outcome = run_verify(tmp_path, "reference", examples=1, timeout=300, fail_fast=False,
                         stop=stop)
    assert outcome.timed_out and outcome.report is None
    assert time.monotonic() - started < 30


def test_the_line_tracer_records_every_process_it_reaches(tmp_path: Path) -> None:
    """The tracer, as ``sitecustomize`` on ``PYTHONPATH``, records the traced file's lines
    in the process and in a child it starts, and nothing of other files."""
    (tmp_path / "sitecustomize.py").write_text(Path(line_tracer.__file__).read_text())
    traced = tmp_path / "traced.py"
    traced.write_text("def f():\n    x = 1\n    return x\n\n\ndef g():\n    return 2\n")
    records = tmp_path / "records"
    records.mkdir()
    child = "import traced; traced.g()"
    script = ("import subprocess, sys, traced; traced.f(); "
              f"subprocess.run([sys.executable, '-c', {child!r}], check=True)")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), line_tracer.TRACE_DIR_ENV: str(records),
           line_tracer.TRACE_FILES_ENV: str(traced)}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=tmp_path, timeout=60)
    recorded = [json.loads(p.read_text()) for p in sorted(records.glob("*.json"))]
    assert len(recorded) == 2
    lines = sorted(tuple(r[str(traced)]["other"]) for r in recorded)
    assert lines == sorted([(1, 2, 3, 6), (1, 6, 7)])


def test_the_line_tracer_tells_metadata_code_from_attention_code(tmp_path: Path) -> None:
    """A helper's line is metadata code when a builder's method called it, attention code
    when an impl's did (the innermost of them on the stack), other code otherwise."""
    (tmp_path / "sitecustomize.py").write_text(Path(line_tracer.__file__).read_text())
    traced = tmp_path / "traced.py"
    traced.write_text(
        "def helper():\n"
        "    return 1\n"
        "class AttentionMetadataBuilder:\n"
        "    def build(self, impl):\n"
        "        return helper() + impl.forward()\n"
        "class AttentionImpl:\n"
        "    def forward(self):\n"
        "        return helper()\n"
        "class MyBuilder(AttentionMetadataBuilder):\n"
        "    pass\n")
    records = tmp_path / "records"
    records.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path), line_tracer.TRACE_DIR_ENV: str(records),
           line_tracer.TRACE_FILES_ENV: str(traced)}
    script = "import traced; traced.helper(); traced.MyBuilder().build(traced.AttentionImpl())"
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=tmp_path, timeout=60)
    (record,) = [json.loads(p.read_text()) for p in records.glob("*.json")]
    phases = record[str(traced)]
    assert (phases["metadata"], phases["attention"]) == ([2, 5], [2, 8])
    assert 2 in phases["other"] and 5 not in phases["other"]  # the module ran the rest


def speccheck(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-c", "from speccheck.checks.cli.app import main; main()", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
    )


@pytest.mark.parametrize(("args", "message"), [
    (["--backend", "nope"], "--backend: unknown backend 'nope'; valid: reference"),
    (["--operators", "bogus"], "--operators: unknown operator(s) bogus"),
    (["--json", "/nonexistent-dir/out.json"], "--json: cannot write /nonexistent-dir/out.json"),
    (["--module", "README.md"], "--module: README.md is not a Python source file"),
    (["--max-mutants", "0"], "speccheck mutate: Invalid value for '--max-mutants'"),
    (["--status", "/nonexistent-dir"],
     "--status: /nonexistent-dir/reference.json: no "),
    (["--rescore", "/nonexistent.json"], "--rescore: /nonexistent.json: cannot read it"),
    (["--rescore", "README.md"], "--rescore: README.md: not JSON"),
    (["--resume", "README.md"], "--resume: README.md: not JSON"),
    (["--resume", "/nonexistent.json"], "--resume: /nonexistent.json: cannot read it"),
    (["--resume", "README.md", "--rescore", "README.md"], "--rescore: runs nothing; --resume"),
    (["--resume", "README.md", "--max-mutants", "3"],
     "--resume: the run's own sample and operators are resumed"),
    (["--shard", "0/2"], "--shard: '0/2': INDEX must be 1 to COUNT"),
    (["--shard", "half"], "--shard: 'half' is not INDEX/COUNT"),
    (["--gate", "/nonexistent-dir/gate.json"], "--gate: cannot write /nonexistent-dir/gate.json"),
    (["--gate", "README.md"], "--gate: README.md: not a saved gate of this version"),
])
def test_bad_input_exits_2_with_one_line(args: list[str], message: str) -> None:
    proc = speccheck("mutate", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith(message), line


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_given_to_rescore_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "run.json"
    os.mkfifo(fifo)
    proc = speccheck("mutate", "--rescore", str(fifo))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line == f"--rescore: {fifo}: cannot read it: it is a FIFO, not a regular file"


def test_a_bad_equivalents_file_beside_a_module_exits_2_with_one_line(tmp_path: Path) -> None:
    package = tmp_path / "adapter"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "builder.py").write_text("def f(x):\n    return x + 1\n")
    (package / EQUIVALENTS_FILE).write_text("builder.py: {}\n")
    proc = speccheck("mutate", "--module", str(package / "builder.py"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"{package / EQUIVALENTS_FILE}: builder.py: expected a list"), line


def test_the_recorded_command_repeats_the_modules_operators_and_sample() -> None:
    """The command a status record keeps names everything that chose the mutants."""
    from speccheck.checks.cli.mutate import _command

    assert _command("reference", [Path("backends/dcp.py"), Path("my dir/b.py")], "off_by_one",
                    24, 2, 3, Shard(2, 3)) == (
        "speccheck mutate --backend reference --module backends/dcp.py --module 'my dir/b.py' "
        "--operators off_by_one --max-mutants 24 --seed 2 --examples 3 --shard 2/3")
    assert _command("reference", [], None, None, 0, None, None) == (
        "speccheck mutate --backend reference")


def test_a_crash_reading_a_deleted_binding_first_is_a_stillborn_mutant() -> None:
    """Deleting ``m_i = tl.full(...)`` in the triton_mla kernel leaves ``m_i`` bound later
    (the loop rebinds it), so no name checker of the symbol table rejects it, but the
    kernel reads it before that: the interpreter's ``UnboundLocalError`` naming it makes
    the mutant invalid (stillborn), not a kill; a crash naming another name stays a kill."""
    targets = backend_targets("speccheck.backends.triton_mla.builder:TritonMLAMetadataBuilder")
    (mutant,) = [m for m in generate_mutants(targets, [Operator.STATEMENT_DELETED])
                 if m.original_line.startswith("m_i = tl.full(")]
    assert mutant.valid and mutant.deleted_bindings == ("m_i",)

    def crashed(detail: str) -> VerifyOutcome:
        return VerifyOutcome(1, {"status": "crashed", "detail": detail}, 1.0, ["last line"])

    unbound = ("worker exited with status 1: triton.runtime.errors.InterpreterError: "
               "UnboundLocalError(\"cannot access local variable 'm_i' where it is not "
               "associated with a value\") (during example 1)")
    stillborn = judge(mutant, crashed(unbound))
    assert stillborn.outcome is Outcome.INVALID and "reads m_i before" in stillborn.detail
    other = judge(mutant, crashed(unbound.replace("'m_i'", "'l_i'")))
    assert other.outcome is Outcome.KILLED_BY_CRASH


def test_a_rescore_into_the_status_refuses_uncommitted_arguments(tmp_path: Path) -> None:
    """``--rescore --status`` writes a record naming the checkout's commit as the one whose
    arguments scored it: an equivalents file that differs from that commit (changed or
    never committed) is refused in one line before anything is read or written."""
    package = tmp_path / "adapter"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "builder.py").write_text("def f(x):\n    return x + 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True, timeout=30)
    subprocess.run([*git, "add", "."], check=True, timeout=30)
    subprocess.run([*git, "commit", "-q", "-m", "adapter"], check=True, timeout=30)
    arguments = package / EQUIVALENTS_FILE
    arguments.write_text("builder.py: []\n")
    status = tmp_path / "status"
    shutil.copytree(ROOT / "docs" / "status", status)
    before = (status / "reference.json").read_text()
    proc = speccheck("mutate", "--backend", "reference", "--module", str(package / "builder.py"),
                     "--rescore", str(tmp_path / "never-read.json"), "--status", str(status))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"--status: {arguments} differs from the commit under test"), line
    assert (status / "reference.json").read_text() == before
    subprocess.run([*git, "add", "."], check=True, timeout=30)
    subprocess.run([*git, "commit", "-q", "-m", "arguments"], check=True, timeout=30)
    proc = speccheck("mutate", "--backend", "reference", "--module", str(package / "builder.py"),
                     "--rescore", str(tmp_path / "never-read.json"), "--status", str(status))
    assert proc.returncode == 2 and "--rescore: " in proc.stderr, proc.stderr  # past the check
