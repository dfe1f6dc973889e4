"""Common fields checked against their meaning (``field_meanings``), computed from the batch
alone, and the CPU tier's early build from reset index buffers.

- The definitions, on a hand-made batch: lengths and positions advance and clamp, padding
  lanes are empty, slots and local lengths follow the DCP share.
- A mismatch names the field, the step, the request and both values.
- The four mutants of ``write_dcp_local_lengths`` (no output shows them) are caught at the
  defaults with ``--dcp-world-size 2``, field named.
- A builder that snapshots ``block_table`` at build is caught at the defaults on the CPU
  tier (without the reset before the eager fused candidate's early build it passed); the
  shipped builder passes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from speccheck.checks.selftest.mutants import naming_matrix
from speccheck.checks.verify.field_meanings import (
    DEFINITIONS,
    SPLIT_RULES,
    DeclaredMeanings,
    MeaningGeometry,
    PassState,
)
from speccheck.checks.verify.kv_share import WHOLE_CACHE, KvShare
from speccheck.checks.verify.step_recorder import StepSnapshots
from speccheck.checks.verify.vocabulary import Check, Result
from speccheck.contract.builder import AttentionMetadataBuilder
from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.matrix_model import FieldMeaning
from speccheck.speculator.batch import DraftBatch
from tests.fixtures.adapters.field_meaning_mutants import (
    DCP_LENGTH_MUTANTS,
    DcpLengthsCopied,
    DcpLengthsShortView,
    DcpSlotsCopied,
    SnapshotBlockTable,
    SnapshotQueryStartLoc,
)
from tests.fixtures.catch import CATCH_ARGS
from tests.fixtures.reference_at_defaults import VerifyCommandRun

ROOT = Path(__file__).resolve().parents[1]
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU tier")

BATCH = DraftBatch(context_lens=(5, 9), new_tokens=((7, 8), (3,)),
                   block_table=((3, 6), (4, 2, 5)), seeds=(0, 0))
"""Request 0: 7 tokens after the first pass, request 1: 10; block size 4."""


def _geometry(share: KvShare = WHOLE_CACHE, max_model_len: int = 64,
              advance: bool = True, window: int = 0) -> MeaningGeometry:
    return MeaningGeometry(block_size=4, max_model_len=max_model_len, advance=advance,
                           share=share, dcp_world_size=share.world, sliding_window=window)


def _expected(meaning: FieldMeaning, step: int, shape: tuple[int, ...],
              geometry: MeaningGeometry) -> list[int] | list[list[int]]:
    decode = PassState.of(BATCH, step, max_model_len=geometry.max_model_len,
                           advance=geometry.advance)
    value = DEFINITIONS[meaning](decode, geometry, torch.Size(shape))
    assert value is not None
    return value.tolist()


def test_every_meaning_has_one_definition_or_rule() -> None:
    assert set(DEFINITIONS) | set(SPLIT_RULES) == set(FieldMeaning)
    assert not set(DEFINITIONS) & set(SPLIT_RULES)


def test_lengths_positions_and_offsets_advance_clamp_and_leave_padding_lanes_empty() -> None:
    g = _geometry()
    assert _expected(FieldMeaning.SEQ_LENS, 1, (3,), g) == [8, 11, 0]
    assert _expected(FieldMeaning.SEQ_LENS, 3, (3,), g) == [10, 13, 0]
    assert _expected(FieldMeaning.POSITIONS, 3, (3,), g) == [9, 12, 0]
    assert _expected(FieldMeaning.QUERY_START_LOC, 2, (4,), g) == [0, 1, 2, 2]
    clamped = _geometry(max_model_len=11)
    assert _expected(FieldMeaning.SEQ_LENS, 3, (2,), clamped) == [10, 11]
    assert _expected(FieldMeaning.POSITIONS, 3, (2,), clamped) == [9, 10]
    still = _geometry(advance=False)
    assert _expected(FieldMeaning.SEQ_LENS, 3, (2,), still) == [8, 11]
    assert _expected(FieldMeaning.BLOCK_TABLE, 1, (3, 4), g) == [
        [3, 6, 0, 0], [4, 2, 5, 0], [0, 0, 0, 0]]


def test_a_padded_first_pass_queries_each_request_s_new_tokens() -> None:
    uniform = DraftBatch(context_lens=(5, 9), new_tokens=((7, 8), (3, 4)),
                         block_table=((3, 6), (4, 2, 5)), seeds=(0, 0))
    state = PassState.of(uniform, 0, max_model_len=64, advance=True)
    g = _geometry()

    def expected(meaning: FieldMeaning, shape: tuple[int, ...]) -> list[int]:
        value = DEFINITIONS[meaning](state, g, torch.Size(shape))
        assert value is not None
        return value.tolist()

    assert expected(FieldMeaning.QUERY_START_LOC, (4,)) == [0, 2, 4, 4]
    assert expected(FieldMeaning.SEQ_LENS, (3,)) == [7, 11, 0]
    assert expected(FieldMeaning.POSITIONS, (6,)) == [5, 6, 9, 10, 0, 0]
    assert expected(FieldMeaning.KV_SLOTS, (4,)) == [6 * 4 + 1, 6 * 4 + 2, 5 * 4 + 1, 5 * 4 + 2]


def test_slots_and_local_lengths_follow_the_dcp_share() -> None:
    whole = _geometry()
    # step 1: positions 7 (block 6, offset 3) and 10 (block 5, offset 2)
    assert _expected(FieldMeaning.KV_SLOTS, 1, (3,), whole) == [6 * 4 + 3, 5 * 4 + 2, 0]
    assert _expected(FieldMeaning.LOCAL_SEQ_LENS, 1, (2,), whole) == [8, 11]
    rank1 = _geometry(KvShare(1, 2))
    # rank 1 of 2 holds odd positions densely: position 7 is its local position 3
    assert _expected(FieldMeaning.KV_SLOTS, 1, (2,), rank1) == [3 * 4 + 3, 0]
    assert _expected(FieldMeaning.LOCAL_SEQ_LENS, 1, (3,), rank1) == [4, 5, 0]
    assert _expected(FieldMeaning.LOCAL_SEQ_LENS, 1, (2,), _geometry(KvShare(0, 2))) == [4, 6]
    table = _geometry(KvShare(0, 3))
    assert _expected(FieldMeaning.LOCAL_SEQ_LEN_TABLE, 1, (2, 3), table) == [[3, 3, 2],
                                                                             [4, 4, 3]]


def test_windows_hold_the_last_positions_up_to_the_window_oldest_first() -> None:
    g = _geometry(window=3)
    # step 1: positions 5..7 (request 0, block 6) and 8..10 (request 1, block 5)
    assert _expected(FieldMeaning.WINDOW_LENGTHS, 1, (3,), g) == [3, 3, 0]
    assert _expected(FieldMeaning.WINDOW_SLOTS, 1, (3, 3), g) == [
        [6 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3], [5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2], [-1, -1, -1]]
    wide = _geometry(window=12)
    assert _expected(FieldMeaning.WINDOW_LENGTHS, 1, (2,), wide) == [8, 11]
    assert _expected(FieldMeaning.WINDOW_SLOTS, 1, (2, 12), wide)[0][7:] == [6 * 4 + 3, -1, -1,
                                                                               -1, -1]


def _snapshots(**fields: list[int]) -> StepSnapshots:
    return StepSnapshots({1: {f"reference.metadata.{name}": torch.tensor(values, dtype=torch.int32)
                              for name, values in fields.items()}})


def test_a_mismatch_names_the_field_the_step_the_request_and_both_values() -> None:
    meanings = DeclaredMeanings({"reference.metadata.seq_lens": FieldMeaning.SEQ_LENS,
                                 "reference.metadata.positions": FieldMeaning.POSITIONS},
                                _geometry())
    (ok,) = meanings.check(BATCH, _snapshots(seq_lens=[8, 11], positions=[7, 10]), "oracle")
    assert ok.result is Result.PASSED
    (bad,) = meanings.check(BATCH, _snapshots(seq_lens=[8, 12], positions=[7, 10]), "fused_eager")
    assert (bad.check, bad.result, bad.step, bad.field) == (
        Check.FIELD_MEANINGS, Result.FAILED, 1, "reference.metadata.seq_lens")
    assert bad.diagnosis == ("fused_eager: before draft step 1, reference.metadata.seq_lens "
                             "(seq_lens) at request 1 is 12, its meaning gives 11")
    (missing,) = meanings.check(BATCH, _snapshots(seq_lens=[8, 11]), "oracle")
    assert "reference.metadata.positions (positions) is not in the metadata" in missing.diagnosis
    (short,) = meanings.check(BATCH, _snapshots(seq_lens=[8], positions=[7, 10]), "oracle")
    assert "has shape (1,), which cannot hold its meaning for 2 request(s)" in short.diagnosis


def test_the_shipped_matrix_declares_the_meanings_of_the_dcp_backends() -> None:
    shipped = load_matrix(None)
    for name in ("reference", "triton_attn"):
        meanings = shipped.backend(name).draft_decode.field_meanings
        assert meanings["dcp_local_seq_lens"] is FieldMeaning.LOCAL_SEQ_LENS
        assert meanings["slot_mapping"] is FieldMeaning.KV_SLOTS


def _verify_mutant(
    tmp_path: Path, builder: type[AttentionMetadataBuilder], *args: str,  # type: ignore[type-arg]
) -> tuple[subprocess.CompletedProcess[str], dict]:  # type: ignore[type-arg]
    """``speccheck verify --backend reference`` of ``builder`` under the matrix its author
    would ship (the shipped entry naming it), at the defaults plus ``args``."""
    matrix = tmp_path / f"{builder.__name__}.yaml"
    claimed = naming_matrix(load_matrix(None), builder)
    matrix.write_text(yaml.safe_dump(claimed.model_dump(mode="json")))
    out = tmp_path / f"{builder.__name__}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-c", "from speccheck.checks.cli.app import main; main()", "verify",
         "--backend", "reference", "--matrix", str(matrix), "--json", str(out), *args],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    (backend,) = json.loads(out.read_text())["backends"]
    return proc, backend


@CPU_ONLY
@pytest.mark.slow
@pytest.mark.parametrize("builder", DCP_LENGTH_MUTANTS, ids=lambda b: b.__name__)
def test_dcp_local_length_mutants_are_caught_at_the_defaults_field_named(
    tmp_path: Path, builder: type[AttentionMetadataBuilder],  # type: ignore[type-arg]
) -> None:
    proc, backend = _verify_mutant(tmp_path, builder, "--dcp-world-size", "2", *CATCH_ARGS)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert backend["status"] == "failed"
    named = [f for f in backend["failures"] if f["check"] == "field_meanings"]
    assert named and named[0]["field"] == "reference.metadata.dcp_local_seq_lens"
    assert "its meaning gives" in named[0]["diagnosis"]


@CPU_ONLY
@pytest.mark.slow
def test_a_local_lengths_view_a_row_short_raises_at_the_defaults(tmp_path: Path) -> None:
    """No value is wrong (``out=`` resizes the short view), but the defaults' DCP 2 cell
    turns PyTorch's deprecated resize into an error."""
    proc, backend = _verify_mutant(tmp_path, DcpLengthsShortView, *CATCH_ARGS)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert backend["status"] in ("failed", "crashed")
    assert "An output with one or more elements was resized" in json.dumps(backend)


@CPU_ONLY
@pytest.mark.parametrize(("builder", "buffer"), [(DcpLengthsCopied, "dcp_local_seq_lens"),
                                                 (DcpSlotsCopied, "dcp_slot_mapping")])
def test_a_dcp_share_copied_out_of_its_buffer_fails_at_the_defaults(
    tmp_path: Path, builder: type[AttentionMetadataBuilder], buffer: str,  # type: ignore[type-arg]
) -> None:
    """Every value the metadata holds is right (the copy is built and refreshed); the
    persistent buffer's head is never written, which the oracle's builds (the same code)
    leave unwritten too: only the refresh's poison, other than the one every example starts
    with, tells them apart."""
    proc, backend = _verify_mutant(tmp_path, builder, *CATCH_ARGS)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    fields = {(f["check"], f["field"]) for f in backend["failures"]}
    assert ("step_metadata", f"reference.buffers['{buffer}']") in fields, fields


@CPU_ONLY
@pytest.mark.slow
def test_a_block_table_snapshot_fails_at_the_defaults_on_the_cpu_tier(tmp_path: Path) -> None:
    proc, backend = _verify_mutant(tmp_path, SnapshotBlockTable, *CATCH_ARGS)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    fields = {(f["check"], f["field"]) for f in backend["failures"]}
    assert ("step_metadata", "reference.metadata.block_table") in fields
    assert ("field_meanings", "reference.metadata.block_table") in fields


@CPU_ONLY
@pytest.mark.slow
def test_a_query_offsets_snapshot_fails_at_the_defaults_on_the_cpu_tier(tmp_path: Path) -> None:
    """No output changes (a padding lane's tokens attend a request of length 0); the
    offsets a capture built with, every lane a request, are named against their meaning."""
    proc, backend = _verify_mutant(tmp_path, SnapshotQueryStartLoc, *CATCH_ARGS)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    named = [f for f in backend["failures"] if f["check"] == "field_meanings"]
    assert named and named[0]["field"] == "reference.metadata.query_start_loc"
    assert "padding lane" in named[0]["diagnosis"], named[0]


@CPU_ONLY
@pytest.mark.slow
def test_the_shipped_reference_builder_passes_field_meanings_at_the_defaults(
    reference_at_defaults: VerifyCommandRun,
) -> None:
    run = reference_at_defaults
    assert run.exit_code == 0, run.stdout + run.stderr
    meanings = run.backend("reference")["checks"]["field_meanings"]
    assert meanings["passed"] > 0 and meanings["failed"] == 0
