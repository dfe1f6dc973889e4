"""The meaning of a split-KV tile schedule, stated without any backend's scheduler.

A split-KV decode (FlashMLA's ``tile_scheduler_metadata`` and ``num_splits`` are the model)
cuts each query token's KV positions into tiles of ``tile`` positions, lays the tiles end to
end in token order and hands runs of them to a fixed number of attention programs (parts);
every (part, token) pair with tiles writes one partial result, and a merge combines each
token's partials. Many schedules of one batch are valid (how the tiles are cut into runs is
the scheduler's choice), so the meaning is a rule the recorded schedule must obey, not one
value:

- a row ``(first token, first tile, last token, end tile, first partial)`` whose last token
  precedes its first token runs nothing; any other row runs tiles ``first tile ..`` of its
  first token, every tile of the tokens in between and tiles ``.. end tile - 1`` of its
  last token, all of them tokens of the step with those tiles;
- every tile of every token is run by exactly one row, each token's tiles in row order
  (so a row can continue only its first token: its other tokens start at tile 0);
- the offsets ``[tokens + 1]`` count each token's partials cumulatively (its rows with
  tiles of it), and a row's first partial is its first token's partial (the token's offset
  plus the rows before it with tiles of that token); later tokens of a row write at their
  own offset.

Everything here is host arithmetic on plain integers and int64 tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

SCHEDULE_COLUMNS = ("first token", "first tile", "last token", "end tile", "first partial")
"""The columns of a schedule row, in order."""


@dataclass(frozen=True)
class Coverage:
    """A valid schedule read back: for each token of the step, the rows with tiles of it,
    in row order."""

    rows_of_token: tuple[tuple[int, ...], ...]

    def offsets(self) -> list[int]:
        """The cumulative partial counts ``[tokens + 1]`` the schedule implies."""
        out = [0]
        for rows in self.rows_of_token:
            out.append(out[-1] + len(rows))
        return out


def token_tiles(attended: Sequence[int], tile: int) -> list[int]:
    """Each token's tile count for ``attended`` KV positions per token."""
    return [-(-length // tile) for length in attended]


def read_schedule(rows: torch.Tensor, tiles: Sequence[int], num_tokens: int) -> Coverage | str:
    """``rows`` (``[parts, >= 5]``, host integers) read as a schedule of ``num_tokens``
    tokens whose first ``len(tiles)`` have ``tiles[t]`` tiles (the rest none), or what
    breaks the rule (see the module docstring)."""
    work = [*tiles, *[0] * max(num_tokens - len(tiles), 0)]
    runs: list[list[tuple[int, int, int]]] = [[] for _ in work]
    for part, row in enumerate(rows.tolist()):
        first, first_tile, last, end_tile = row[:4]
        if last < first:
            continue
        if first < 0 or last >= num_tokens:
            return (f"part {part} runs tokens {first}..{last}, outside the step's "
                    f"{num_tokens} tokens")
        for token in range(first, last + 1):
            lo = first_tile if token == first else 0
            hi = end_tile if token == last else work[token]
            if lo < 0 or hi > work[token]:
                return (f"part {part} runs tiles {lo}..{hi - 1} of token {token}, which has "
                        f"{work[token]} tile(s)")
            if hi > lo:
                runs[token].append((part, lo, hi))
    for token, segments in enumerate(runs):
        covered = 0
        for part, lo, hi in segments:
            if lo != covered:
                state = "again" if lo < covered else f"skipping tiles {covered}..{lo - 1}"
                return f"part {part} runs token {token} from tile {lo} {state}"
            covered = hi
        if covered != work[token]:
            return (f"no part runs tiles {covered}..{work[token] - 1} of token {token} (it "
                    f"has {work[token]} tile(s))")
    return Coverage(tuple(tuple(part for part, _, _ in segments) for segments in runs))


def expected_schedule(rows: torch.Tensor, coverage: Coverage) -> torch.Tensor:
    """``rows`` as the meaning gives them: each row with tiles keeps its run and takes its
    first token's partial as first partial; rows with none are left as they are."""
    expected = rows.to(torch.int64).clone()
    offsets = coverage.offsets()
    for token, parts in enumerate(coverage.rows_of_token):
        for rank, part in enumerate(parts):
            if int(rows[part, 0]) == token:
                expected[part, 4] = offsets[token] + rank
    return expected
