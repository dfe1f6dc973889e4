"""DP agreement on padded sizes: the pure reduction (hypothesis against a simple model), the
descriptor each rank executes, the drafter's reuse of the target's agreement without a
collective, the real thing on two gloo processes, and the multi-process runner's failure
handling.

The rank functions below run in spawned processes, which import them from this module by
name: the repository root goes on ``sys.path`` for the module (the ``repo_on_path``
fixture) so that ``tests.test_dp_sync`` is importable there.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from speccheck.checks.verify.raise_site import site_of
from speccheck.contract.cudagraph import BatchExecutionDescriptor as Desc
from speccheck.contract.cudagraph import CUDAGraphMode
from speccheck.speculator.dp_launch import RankFailed, RanksTimedOut, run_ranks
from speccheck.speculator.dp_sync import (
    DP_FIELDS,
    DPSyncState,
    agreed_descriptor,
    dp_column,
    reduce_dp_table,
    reuse_for_draft,
    sync_dp_padding,
)

NONE, PIECEWISE, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def repo_on_path() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT))
        yield


def _table(columns: list[tuple[int, int, int, int]]) -> torch.Tensor:
    return torch.tensor(columns, dtype=torch.int64).t().contiguous()


# ---------------------------------------------------------------- the pure reduction


def _model(columns: list[tuple[int, int, int, int]]) -> DPSyncState:
    """The agreement rules, written out rank by rank."""
    n = len(columns)
    if all(c[0] == 0 for c in columns):
        return DPSyncState((0,) * n, None, NONE, None)
    agreed, mode, reqs = 0, FULL, 0
    for tokens, m, _, r in columns:
        agreed, mode, reqs = max(agreed, tokens), min(mode, CUDAGraphMode(m)), max(reqs, r)
    first = columns[0][2]
    same = all(c[2] == first for c in columns)
    if mode == FULL and not same:
        mode = NONE
    return DPSyncState((agreed,) * n, first if same and first else None, mode, reqs)


columns_st = st.lists(
    st.tuples(st.integers(0, 64), st.sampled_from([0, 1, 2]), st.sampled_from([0, 1, 4]),
              st.integers(0, 16)),
    min_size=1, max_size=4,
)


@given(columns_st, st.randoms())
def test_reduction_matches_the_model_and_ignores_rank_order(columns, rnd) -> None:
    state = reduce_dp_table(_table(columns))
    assert state == _model(columns)
    shuffled = list(columns)
    rnd.shuffle(shuffled)
    assert reduce_dp_table(_table(shuffled)) == state
    if state.num_reqs is not None:
        assert all(state.num_tokens >= c[0] and state.cg_mode <= c[1] for c in columns)


def test_reduction_rejects_a_malformed_table() -> None:
    with pytest.raises(ValueError, match="shape"):
        reduce_dp_table(torch.zeros(3, 2, dtype=torch.int64))


def test_column_reports_padded_requests_only_when_the_descriptor_pads() -> None:
    assert len(DP_FIELDS) == 4
    assert dp_column(Desc(FULL, 32, 8, 4), 5) == (32, 2, 4, 8)
    assert dp_column(Desc(NONE, 20, None, 4), 5) == (20, 0, 4, 5)
    assert dp_column(Desc(NONE, 7), 2) == (7, 0, 0, 2)
    with pytest.raises(ValueError, match="pads to num_reqs=4"):
        dp_column(Desc(FULL, 16, 4, 4), 5)


# ---------------------------------------------------------------- agreed descriptors


def test_agreed_descriptor_pads_tokens_in_every_mode_and_requests_only_in_full() -> None:
    eager = DPSyncState((20, 20), 4, NONE, 5)
    assert agreed_descriptor(eager, 3, 4) == Desc(NONE, 20, None, 4)
    full = DPSyncState((32, 32), 4, FULL, 8)
    assert agreed_descriptor(full, 3, 4) == Desc(FULL, 32, 8, 4)
    piecewise = DPSyncState((20, 20), None, PIECEWISE, 5)
    assert agreed_descriptor(piecewise, 2, 3) == Desc(PIECEWISE, 20, None, 3)
    idle = DPSyncState((0, 0), None, NONE, None)
    assert agreed_descriptor(idle, 0, 4) == Desc(NONE, 0)


def test_agreed_descriptor_refuses_a_batch_that_does_not_fit() -> None:
    state = DPSyncState((20, 20), 4, NONE, 5)
    with pytest.raises(ValueError, match="exceeds the agreed num_reqs=5"):
        agreed_descriptor(state, 6, 4)
    with pytest.raises(ValueError, match="exceeds the agreed num_tokens=20"):
        agreed_descriptor(state, 4, 6)
    with pytest.raises(ValueError, match="uniform_token_count=4"):
        agreed_descriptor(DPSyncState((32, 32), 4, FULL, 8), 3, 2)
    with pytest.raises(ValueError, match="no DP rank reported work"):
        agreed_descriptor(DPSyncState((0, 0), None, NONE, None), 1, 4)


# ---------------------------------------------------------------- no collective


@pytest.fixture
def no_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a collective was issued")

    monkeypatch.setattr(dist, "all_reduce", refuse)


def test_dp_size_one_issues_no_collective(no_collectives: None) -> None:
    assert not dist.is_initialized()
    state = sync_dp_padding(Desc(FULL, 16, 4, 4), 3, 0, 1)
    assert state == DPSyncState((16,), 4, FULL, 4)


def test_reuse_for_draft_derives_the_agreement_without_a_collective(no_collectives: None) -> None:
    target = DPSyncState((24, 24), 2, FULL, 6)
    assert reuse_for_draft(target, 4, 3) == DPSyncState((24, 24), 4, FULL, 6)
    eager = DPSyncState((11, 11), None, NONE, 5)
    assert reuse_for_draft(eager, 4, 5) == DPSyncState((20, 20), 4, NONE, 5)
    assert reuse_for_draft(DPSyncState((0, 0), None, NONE, None), 4, 0).num_tokens == 0
    with pytest.raises(ValueError, match="does not fit the target's agreed num_reqs=5"):
        reuse_for_draft(eager, 4, 6)


def test_sync_without_a_process_group_says_so() -> None:
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        sync_dp_padding(Desc(NONE, 4, None, 4), 1, 0, 2)


# ---------------------------------------------------------------- two real gloo ranks

ROUNDS: list[tuple[tuple[Desc, int], tuple[Desc, int]]] = [
    ((Desc(NONE, 12, None, 4), 3), (Desc(NONE, 20, None, 4), 5)),  # eager, 3 vs 5 requests
    ((Desc(FULL, 16, 4, 4), 3), (Desc(FULL, 32, 8, 4), 5)),  # FULL buckets 4 and 8
    ((Desc(FULL, 16, 4, 4), 3), (Desc(NONE, 20, None, 4), 5)),  # one eager rank
    ((Desc(NONE, 0), 0), (Desc(NONE, 0), 0)),  # no work anywhere
    ((Desc(FULL, 16, 4, 4), 4), (Desc(FULL, 16, 8, 2), 8)),  # FULL, different layouts
]
EXPECTED = [
    DPSyncState((20, 20), 4, NONE, 5),
    DPSyncState((32, 32), 4, FULL, 8),
    DPSyncState((20, 20), 4, NONE, 5),
    DPSyncState((0, 0), None, NONE, None),
    DPSyncState((16, 16), None, NONE, 8),
]


def _sync_rank(dp_rank: int, dp_size: int, rounds: list[Any]) -> dict[str, Any]:
    """Every round's agreement, the collectives it took, then a drafter reuse of round 1."""
    calls: list[tuple[tuple[int, ...], torch.dtype, str]] = []
    real_all_reduce = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append((tuple(tensor.shape), tensor.dtype, tensor.device.type))
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        states = [sync_dp_padding(*r[dp_rank], dp_rank, dp_size) for r in rounds]
        synced = list(calls)
        descriptors = [
            agreed_descriptor(s, r[dp_rank][1], r[dp_rank][0].uniform_token_count)
            for s, r in zip(states, rounds)
        ]
        draft = reuse_for_draft(states[1], 2, rounds[1][dp_rank][1])
        return {"states": states, "descriptors": descriptors, "synced": synced,
                "draft": draft, "calls_after_reuse": len(calls)}
    finally:
        dist.all_reduce = real_all_reduce


@pytest.fixture(scope="module")
def two_ranks(repo_on_path: None) -> list[dict[str, Any]]:
    return run_ranks(_sync_rank, 2, (ROUNDS,), timeout_s=60)


def test_both_ranks_reach_the_expected_agreement(two_ranks: list[dict[str, Any]]) -> None:
    assert two_ranks[0]["states"] == two_ranks[1]["states"] == EXPECTED
    for states_round, (a, b) in zip(EXPECTED, ROUNDS):
        assert states_round == reduce_dp_table(_table([dp_column(*a), dp_column(*b)]))


def test_each_rank_pads_its_input_to_the_agreed_count(two_ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = (r["descriptors"] for r in two_ranks)
    assert rank0[0] == rank1[0] == Desc(NONE, 20, None, 4), "rank 0 pads 12 real tokens to 20"
    assert rank0[1] == rank1[1] == Desc(FULL, 32, 8, 4)
    assert rank0[3] == Desc(NONE, 0)


def test_one_cpu_int64_all_reduce_per_sync_and_none_for_reuse(two_ranks: list[dict[str, Any]]) -> None:
    for rank in two_ranks:
        assert rank["synced"] == [((4, 2), torch.int64, "cpu")] * len(ROUNDS)
        assert rank["calls_after_reuse"] == len(ROUNDS), "reuse_for_draft issued a collective"
        assert rank["draft"] == DPSyncState((16, 16), 2, FULL, 8)


# ---------------------------------------------------------------- the runner's failures


def _raise_on(dp_rank: int, dp_size: int, bad_rank: int) -> int:
    if dp_rank == bad_rank:
        raise ValueError(f"planted failure on rank {dp_rank}")
    dist.barrier()  # waits for the failed rank forever: the runner must end it
    return dp_rank


def _exit_on(dp_rank: int, dp_size: int, bad_rank: int) -> int:
    if dp_rank == bad_rank:
        os._exit(3)
    dist.barrier()  # fails once the dead rank's sockets close: the dead rank is blamed
    return dp_rank


def _sleep_on(dp_rank: int, dp_size: int, bad_rank: int) -> int:
    if dp_rank == bad_rank:
        time.sleep(120)
    return dp_rank


def test_a_raising_rank_is_named_and_its_peer_is_ended(repo_on_path: None) -> None:
    with pytest.raises(RankFailed, match="DP rank 1 of 2 failed: ValueError: planted failure") as err:
        run_ranks(_raise_on, 2, (1,), timeout_s=60)
    assert err.value.rank == 1 and "planted failure on rank 1" in err.value.traceback
    # where it raised crosses the process boundary as data: a report's ``raised_at``
    assert re.fullmatch(r"at \S*tests/test_dp_sync\.py:\d+", site_of(err.value.frames)), \
        err.value.frames


def test_a_rank_that_dies_is_named_not_its_blocked_peer(repo_on_path: None) -> None:
    with pytest.raises(RankFailed, match="DP rank 0 of 2 failed: ProcessExited: exit code 3"):
        run_ranks(_exit_on, 2, (0,), timeout_s=60)


def test_a_hung_rank_times_out(repo_on_path: None) -> None:
    start = time.monotonic()
    with pytest.raises(RanksTimedOut) as err:
        run_ranks(_sleep_on, 2, (1,), timeout_s=6)
    assert 1 in err.value.ranks
    assert time.monotonic() - start < 6 + 8, "the hung rank was not ended promptly"
