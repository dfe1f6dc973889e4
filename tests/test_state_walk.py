"""The state walker: paths, coverage, cycles, identities, snapshots and change detection."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from speccheck.checks.verify.state_walk import (
    TensorIdentity,
    changed_paths,
    same_value,
    snapshot,
    tensor_identity,
    walk_tensors,
)


@dataclass
class Group:
    seq_lens: torch.Tensor
    num_reqs: int


class Pair(NamedTuple):
    first: torch.Tensor
    second: int


class Slotted:
    __slots__ = ("buf", "__hidden")

    def __init__(self, buf: torch.Tensor, hidden: torch.Tensor) -> None:
        self.buf = buf
        self.__hidden = hidden


class Exploding:
    """A property that must never be called by the walk."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    @property
    def boom(self) -> torch.Tensor:
        raise AssertionError("walk_tensors called a property")


@dataclass
class Metadata:
    scheduler_metadata: torch.Tensor
    groups: list[Group]
    buffers: dict[str, torch.Tensor]
    pair: Pair
    slotted: Slotted
    exploding: Exploding
    module: object = torch
    fn: object = len
    cls: object = torch.Tensor
    dtype: torch.dtype = torch.int32
    lazy: torch.Tensor = field(init=False)


def _metadata() -> Metadata:
    return Metadata(
        scheduler_metadata=torch.zeros(8, dtype=torch.int32),
        groups=[Group(torch.ones(2), 2), Group(torch.ones(3), 3)],
        buffers={"tile": torch.arange(4), 7: torch.zeros(1)},
        pair=Pair(torch.ones(1), 5),
        slotted=Slotted(torch.zeros(2), torch.ones(2)),
        exploding=Exploding(torch.zeros(3)),
    )


def test_walk_paths_cover_every_container_kind() -> None:
    md = _metadata()
    found = walk_tensors(md, prefix="metadata")
    assert list(found) == [
        "metadata.scheduler_metadata",
        "metadata.groups[0].seq_lens",
        "metadata.groups[1].seq_lens",
        "metadata.buffers['tile']",
        "metadata.buffers[7]",
        "metadata.pair.first",
        "metadata.slotted.buf",
        "metadata.slotted._Slotted__hidden",
        "metadata.exploding.t",
    ]
    assert found["metadata.groups[1].seq_lens"] is md.groups[1].seq_lens
    md.lazy = torch.zeros(1)
    assert "metadata.lazy" in walk_tensors(md, prefix="metadata")


def test_walk_without_prefix_and_tensor_root() -> None:
    t = torch.zeros(2)
    assert walk_tensors({"a": [t]}) == {"['a'][0]": t}
    assert walk_tensors(t, prefix="x") == {"x": t}
    assert walk_tensors(Group(t, 1)) == {"seq_lens": t}


def test_walk_survives_cycles_and_expands_shared_containers_once() -> None:
    t = torch.zeros(2)
    shared = Group(t, 1)
    loop: list[object] = [shared]
    loop.append(loop)
    holder = {"a": shared, "b": shared, "loop": loop, "direct1": t, "direct2": t}
    found = walk_tensors(holder, prefix="h")
    assert list(found) == ["h['a'].seq_lens", "h['direct1']", "h['direct2']"]


def test_walk_stops_at_max_depth_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    deep: object = torch.zeros(1)
    for _ in range(10):
        deep = [deep]
    with caplog.at_level(logging.WARNING, logger="speccheck.checks.verify.state_walk"):
        assert walk_tensors(deep, prefix="d", max_depth=4) == {}
    assert "max_depth=4" in caplog.text
    assert list(walk_tensors(deep, prefix="d", max_depth=10)) == ["d" + "[0]" * 10]


def test_tensor_identity_tracks_object_address_and_layout() -> None:
    t = torch.zeros(4, 4)
    ident = tensor_identity(t)
    assert ident == TensorIdentity(id(t), t.data_ptr(), 0, (4, 4), (4, 1))
    row = t[1]
    assert tensor_identity(row).data_ptr == t.data_ptr() + 4 * t.element_size()
    assert tensor_identity(row).storage_offset == 4
    assert tensor_identity(t.t()).stride == (1, 4)
    t.add_(1)
    assert tensor_identity(t) == ident


def test_snapshot_is_immune_to_later_writes() -> None:
    live = {"a": torch.zeros(3), "b": torch.arange(3)}
    snap = snapshot(live)
    live["a"].fill_(5)
    live["b"].add_(1)
    assert torch.equal(snap["a"], torch.zeros(3))
    assert torch.equal(snap["b"], torch.arange(3))
    assert changed_paths([snap, live]) == {"a", "b"}


def test_same_value_edge_cases() -> None:
    nan = math.nan
    assert same_value(torch.tensor([nan, 1.0]), torch.tensor([nan, 1.0]))
    assert not same_value(torch.tensor([nan, 1.0]), torch.tensor([1.0, nan]))
    assert same_value(torch.tensor([-0.0]), torch.tensor([0.0]))
    assert not same_value(torch.ones(1, dtype=torch.int32), torch.ones(1, dtype=torch.int64))
    assert not same_value(torch.zeros(2), torch.zeros(1, 2))
    assert same_value(torch.tensor([complex(nan, 1)]), torch.tensor([complex(nan, 1)]))
    assert not same_value(torch.tensor([complex(nan, 1)]), torch.tensor([complex(nan, 2)]))
    assert same_value(torch.zeros(0), torch.zeros(0))


def test_changed_paths_counts_appearing_and_disappearing_paths() -> None:
    a = {"x": torch.zeros(1)}
    b = {"x": torch.zeros(1), "y": torch.zeros(1)}
    assert changed_paths([a, b]) == {"y"}
    assert changed_paths([b, a]) == {"y"}
    assert changed_paths([a]) == set()
    assert changed_paths([]) == set()


# --- hypothesis: changed_paths against an independent model --------------------------------

_PATHS = ("metadata.a", "metadata.b", "groups[0].c")


@st.composite
def small_tensors(draw: st.DrawFn) -> torch.Tensor:
    """Tiny tensors from small value pools, so equal neighbours are common.

    Shrinks towards float32 scalars of 0.0."""
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.int32, torch.bool]))
    shape = draw(st.sampled_from([(), (2,), (1, 2)]))
    if dtype.is_floating_point:
        pool: list[object] = [0.0, -0.0, 1.0, math.nan]
    elif dtype == torch.bool:
        pool = [False, True]
    else:
        pool = [0, 1]
    n = math.prod(shape)
    values = draw(st.lists(st.sampled_from(pool), min_size=n, max_size=n))
    return torch.tensor(values, dtype=dtype).reshape(shape)


snapshots_strategy = st.lists(
    st.dictionaries(st.sampled_from(_PATHS), small_tensors(), max_size=len(_PATHS)), max_size=4
)


def _model_same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return all(
        x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))
        for x, y in zip(a.reshape(-1).tolist(), b.reshape(-1).tolist(), strict=True)
    )


@given(snapshots_strategy)
def test_changed_paths_matches_model(snaps: list[dict[str, torch.Tensor]]) -> None:
    expected = {
        path
        for before, after in zip(snaps, snaps[1:])
        for path in _PATHS
        if not _model_same(before.get(path), after.get(path))
    }
    assert changed_paths(snaps) == expected
    assert changed_paths(snaps[::-1]) == expected
    if snaps:
        assert changed_paths([*snaps, snapshot(snaps[-1])]) == expected
    if len(snaps) >= 3:
        assert expected == changed_paths(snaps[:2]) | changed_paths(snaps[1:])
