"""A split-KV tile schedule checked against its meaning (``kv_split_schedule``,
``kv_split_offsets``): a rule over the batch's attended tiles, not one value.

- Two different cuts of one batch's tiles both pass; the offsets follow the cut.
- A tile run twice, a gap, a missing tail, a run past a token's tiles or the step's tokens,
  a wrong first partial and wrong offsets each fail, naming the field, the part or entry and
  what breaks.
- The matrix requires ``kv_split_tile`` with the meanings (and only with them), and the
  offsets only beside a schedule.
- A sparse_swa builder whose schedule writes its partials one slot off is caught at the
  defaults by ``field_meanings`` on the schedule.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from speccheck.checks.verify.field_meanings import DeclaredMeanings, MeaningGeometry
from speccheck.checks.verify.kv_share import WHOLE_CACHE
from speccheck.checks.verify.step_recorder import StepSnapshots
from speccheck.checks.verify.vocabulary import Result
from speccheck.contract.matrix_loader import MatrixError, load_matrix
from speccheck.contract.matrix_model import FieldMeaning
from speccheck.speculator.batch import DraftBatch

BATCH = DraftBatch(context_lens=(5, 9), new_tokens=((7, 8), (3,)),
                   block_table=((3, 6), (4, 2, 5)), seeds=(0, 0))
"""Before draft step 1 the two tokens query positions 7 and 10: 8 and 11 causal positions,
2 and 3 tiles of 4."""

SCHEDULE = "sparse_swa.metadata.tile_scheduler_metadata"
OFFSETS = "sparse_swa.metadata.split_offsets"

DEAD = [0, 0, -1, 0, 0]
TWO_PARTS = [[0, 0, 1, 1, 0], [1, 1, 1, 3, 2], DEAD]
"""Part 0: token 0's tiles 0..1 and token 1's tile 0; part 1: token 1's tiles 1..2."""


def _meanings(window: int = 0) -> DeclaredMeanings:
    geometry = MeaningGeometry(block_size=4, max_model_len=64, advance=True,
                               share=WHOLE_CACHE, dcp_world_size=1, sliding_window=window)
    return DeclaredMeanings({SCHEDULE: FieldMeaning.KV_SPLIT_SCHEDULE,
                             OFFSETS: FieldMeaning.KV_SPLIT_OFFSETS},
                            geometry, {SCHEDULE: 4, OFFSETS: 4})


def _check(schedule: list[list[int]], offsets: list[int], window: int = 0) -> str | None:
    snapshot = {SCHEDULE: torch.tensor(schedule, dtype=torch.int32),
                OFFSETS: torch.tensor(offsets, dtype=torch.int32)}
    (outcome,) = _meanings(window).check(BATCH, StepSnapshots({1: snapshot}), "oracle")
    return None if outcome.result is Result.PASSED else outcome.diagnosis


def test_two_cuts_of_the_same_tiles_both_pass() -> None:
    assert _check(TWO_PARTS, [0, 1, 3, 3]) is None
    assert _check([[0, 0, 1, 3, 0], DEAD, DEAD], [0, 1, 2, 2]) is None
    # a window of 5 leaves 5 positions each: 2 tiles per token
    assert _check([[0, 0, 0, 2, 0], [1, 0, 1, 2, 1]], [0, 1, 2], window=5) is None


@pytest.mark.parametrize(("schedule", "offsets", "problem"), [
    ([[0, 0, 1, 2, 0], [1, 1, 1, 3, 2]], [0, 1, 3],
     "part 1 runs token 1 from tile 1 again"),
    ([[0, 0, 1, 1, 0], [1, 2, 1, 3, 2]], [0, 1, 3],
     "part 1 runs token 1 from tile 2 skipping tiles 1..1"),
    ([[0, 0, 1, 1, 0], [1, 1, 1, 2, 2]], [0, 1, 3],
     "no part runs tiles 2..2 of token 1 (it has 3 tile(s))"),
    ([[0, 0, 1, 4, 0]], [0, 1, 2],
     "part 0 runs tiles 0..3 of token 1, which has 3 tile(s)"),
    ([[0, 0, 3, 0, 0]], [0, 1, 2],
     "part 0 runs tokens 0..3, outside the step's 2 tokens"),
])
def test_a_schedule_breaking_the_rule_fails_naming_the_field_and_what_breaks(
    schedule: list[list[int]], offsets: list[int], problem: str,
) -> None:
    diagnosis = _check(schedule, offsets)
    assert diagnosis == (f"oracle: before draft step 1, {SCHEDULE} (kv_split_schedule) breaks "
                         f"its rule: {problem}")


def test_a_wrong_first_partial_or_offset_names_the_part_or_entry_and_both_values() -> None:
    wrong_partial = [[0, 0, 1, 1, 0], [1, 1, 1, 3, 1], DEAD]
    assert _check(wrong_partial, [0, 1, 3, 3]) == (
        f"oracle: before draft step 1, {SCHEDULE} (kv_split_schedule) at part 1 (first "
        "partial) is 1, its meaning gives 2")
    assert _check(TWO_PARTS, [0, 1, 2, 3]) == (
        f"oracle: before draft step 1, {OFFSETS} (kv_split_offsets) at entry 2 (the partials "
        "before token 2) is 2, its meaning gives 3")


def _entry_with(tile: int | None, meanings: dict[str, str]) -> str:
    matrix = load_matrix(None).model_dump(mode="json")
    (entry,) = [b for b in matrix["backends"] if b["name"] == "sparse_swa"]
    draft = entry["draft_decode"]
    draft["field_meanings"] = {**{k: v for k, v in draft["field_meanings"].items()
                                  if not v.startswith("kv_split")}, **meanings}
    draft["kv_split_tile"] = tile
    if tile is None:
        del draft["kv_split_tile"]
    return yaml.safe_dump(matrix)


@pytest.mark.parametrize(("tile", "meanings", "message"), [
    (None, {"tile_scheduler_metadata": "kv_split_schedule"},
     "field 'draft_decode.kv_split_tile': is required when field_meanings declares"),
    (16, {}, "field 'draft_decode.kv_split_tile': must not be set"),
    (16, {"split_offsets": "kv_split_offsets"},
     "field 'draft_decode.field_meanings': declares kv_split_offsets without a"),
])
def test_the_matrix_ties_the_tile_to_the_split_meanings(
    tmp_path: Path, tile: int | None, meanings: dict[str, str], message: str,
) -> None:
    path = tmp_path / "matrix.yaml"
    path.write_text(_entry_with(tile, meanings))
    with pytest.raises(MatrixError, match=message):
        load_matrix(path)
