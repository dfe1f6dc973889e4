"""The state walker: paths, coverage, cycles, identities, snapshots and change detection;
host values (walked, compared and described like tensors); and the step comparison over
both."""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from speccheck.checks.verify.comparisons import compare_steps
from speccheck.checks.probes.state_walk import (
    TensorIdentity,
    attribute_storages,
    changed_paths,
    describe_host_value,
    same_host_value,
    same_value,
    snapshot,
    tensor_identity,
    walk_host_values,
    walk_state,
    walk_tensors,
)
from speccheck.checks.verify.step_recorder import StepSnapshots
from speccheck.contract.metadata import AttentionInputBuffers


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
    with caplog.at_level(logging.WARNING, logger="speccheck.checks.probes.state_walk"):
        assert walk_tensors(deep, prefix="d", max_depth=4) == {}
    assert "max_depth=4" in caplog.text
    assert list(walk_tensors(deep, prefix="d", max_depth=10)) == ["d" + "[0]" * 10]


class Mode(enum.Enum):
    FAST = 1


@dataclass
class HostFields:
    max_seq_len: int
    scale: float
    causal: bool
    name: str
    mode: Mode
    missing: None
    splits: tuple[int, ...]
    lens: np.ndarray
    nested: dict[str, object]
    tensor: torch.Tensor
    labels: np.ndarray


def _host_fields() -> HostFields:
    return HostFields(
        max_seq_len=17, scale=0.5, causal=True, name="fa3", mode=Mode.FAST, missing=None,
        splits=(1, 2, 3), lens=np.array([4, 5], dtype=np.int32),
        nested={"plan": [np.int64(3), (0.5, 1)], "size": torch.Size([2, 3]), "fn": len},
        tensor=torch.zeros(2), labels=np.array(["a"]),
    )


def test_host_values_are_plain_data_at_the_paths_tensors_would_have() -> None:
    md = _host_fields()
    found = walk_host_values(md, prefix="m")
    assert list(found) == [
        "m.max_seq_len", "m.scale", "m.causal", "m.name", "m.mode", "m.missing", "m.splits",
        "m.lens", "m.nested['plan'][0]", "m.nested['plan'][1]", "m.nested['size']",
    ]
    shown = {path: describe_host_value(value) for path, value in found.items()}
    assert shown == {
        "m.max_seq_len": "17", "m.scale": "0.5", "m.causal": "True", "m.name": "'fa3'",
        "m.mode": "<Mode.FAST: 1>", "m.missing": "None", "m.splits": "(1, 2, 3)",
        "m.lens": "(4, 5)", "m.nested['plan'][0]": "3", "m.nested['plan'][1]": "(0.5, 1.0)",
        "m.nested['size']": "(2, 3)",
    }
    assert found["m.lens"].dtype == np.int32
    md.lens[0] = 9
    assert found["m.lens"][0] == 4, "values are copies"
    # the same containers, in the same order, as the tensor walk
    assert walk_tensors(_metadata(), prefix="m").keys().isdisjoint(walk_host_values(_metadata(), "m"))
    assert list(walk_host_values(_metadata(), prefix="m")) == [
        "m.groups[0].num_reqs", "m.groups[1].num_reqs", "m.pair.second",
    ]


@pytest.mark.parametrize("root", [_metadata, _host_fields], ids=["metadata", "host_fields"])
def test_walk_state_is_both_walks_in_one(root: Callable[[], object]) -> None:
    """Shared containers, a cycle and a named tuple of numbers reached twice included."""
    obj = root()
    shared = Pair(torch.ones(1), 5)
    loop: list[object] = [shared, (1, 2)]
    loop.append(loop)
    holder = {"obj": obj, "a": shared, "b": shared, "loop": loop, "again": loop[1]}
    tensors, host = walk_state(holder, prefix="h")
    expected_tensors = walk_tensors(holder, prefix="h")
    assert list(tensors) == list(expected_tensors)
    assert all(tensors[path] is t for path, t in expected_tensors.items())
    expected_host = walk_host_values(holder, prefix="h")
    assert list(host) == list(expected_host)
    assert all(same_host_value(host[path], v) for path, v in expected_host.items())


def test_same_host_value_needs_the_same_dtype_shape_and_elements() -> None:
    def value(x: object) -> np.ndarray:
        return walk_host_values({"x": x})["['x']"]

    assert same_host_value(value(3), value(3))
    assert not same_host_value(value(3), value(3.0))
    assert not same_host_value(value(True), value(1))
    assert not same_host_value(value(None), value("None"))
    assert not same_host_value(value((1, 2)), value((1, 2, 3)))
    assert same_host_value(value(math.nan), value(math.nan))
    assert same_host_value(value(-0.0), value(0.0))
    assert same_host_value(value(2**70), value(2**70))
    assert not same_host_value(value(2**70), value(2**70 + 1))
    assert describe_host_value(value(tuple(range(10)))) == "(0, 1, 2, 3, 4, 5, 6, 7, ...)"
    assert describe_host_value(value(np.zeros((2, 2), dtype=np.int8))) == (
        "(0, 0, 0, 0) (shape (2, 2))")


def _steps(host: dict[int, dict[str, object]]) -> StepSnapshots:
    """Snapshots of an ``fa3`` metadata object with the given host fields at each step (and
    one tensor, the same at every step)."""
    tensors = {step: {"fa3.metadata.seq_lens": torch.tensor([3])} for step in host}
    return StepSnapshots(tensors, {
        step: walk_host_values(SimpleNamespace(**fields), prefix="fa3.metadata")
        for step, fields in host.items()
    })


def test_compare_steps_reports_the_first_host_value_that_differs_with_both_values() -> None:
    oracle = _steps({1: {"max_seq_len": 5, "causal": True}, 2: {"max_seq_len": 6, "causal": True}})
    baked = _steps({1: {"max_seq_len": 5, "causal": True}, 2: {"max_seq_len": 5, "causal": True}})
    (outcome,) = compare_steps(oracle, baked, "fused_graph")
    assert (outcome.check, outcome.result) == ("step_metadata", "failed")
    assert (outcome.candidate, outcome.step, outcome.field) == (
        "fused_graph", 2, "fa3.metadata.max_seq_len")
    assert outcome.diagnosis.startswith(
        "fused_graph: before draft step 2, host value fa3.metadata.max_seq_len is 5, a fresh "
        "eager build's is 6 — ")
    fresh = _steps({1: {"max_seq_len": 5, "causal": True}, 2: {"max_seq_len": 6, "causal": True}})
    assert compare_steps(oracle, fresh, "fused_eager")[0].result == "passed"
    (missing,) = compare_steps(oracle, _steps({1: {"causal": True}, 2: {}}), "fused_eager")
    assert missing.step == 1
    assert "host value fa3.metadata.max_seq_len is missing, a fresh eager build's is 5" in (
        missing.diagnosis)


def test_tensors_come_before_host_values_and_host_preplanned_runs_skip_them() -> None:
    oracle = _steps({1: {"draft_step": None}})
    planned = _steps({1: {"draft_step": 1}})
    assert compare_steps(oracle, planned, "host_preplanned_eager", metadata_only=True)[0].result == (
        "passed")
    assert compare_steps(oracle, planned, "fused_eager")[0].field == "fa3.metadata.draft_step"
    planned[1]["fa3.metadata.seq_lens"] = torch.tensor([7])
    assert compare_steps(oracle, planned, "fused_eager")[0].field == "fa3.metadata.seq_lens"


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


def test_attribute_storages_of_input_buffers_with_cached_views() -> None:
    """The speculator's input buffers hold a cache of views besides the buffers: their
    storages are the buffers' own, and the cache is skipped."""
    buffers = AttentionInputBuffers.allocate(4, 8, 3, torch.device("cpu"))
    buffers.views(2, 4)
    own = {f.name: getattr(buffers, f.name) for f in fields(buffers) if f.name != "_views"}
    assert attribute_storages(buffers) == {t.untyped_storage().data_ptr() for t in own.values()}


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
