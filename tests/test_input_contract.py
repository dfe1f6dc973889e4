"""The adapter's input contract (docs/writing-an-adapter.md, "The input contract"): what the
speculator hands a metadata builder at each build and each refresh, one test per statement.

Every test drives the real speculator through ``propose`` on hand-made batches (padding
lanes, draft steps that cross a block boundary, block-table rows longer than the request
needs, requests at the ``max_model_len`` clamp) with :class:`RecordingBuilder`, the
reference builder recording what each hook receives, and compares it with values computed
from the batch alone.
"""

from __future__ import annotations

import enum
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from speccheck.backends.kv_cache_write import SINK_SLOT
from speccheck.backends.reference.builder import ReferenceMetadata, ReferenceMetadataBuilder
from speccheck.contract.builder import blocks_for
from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.metadata import CommonAttentionMetadata
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.autoregressive import AutoregressiveSpeculator, DecodePath
from speccheck.speculator.base import SpeculatorOptions
from speccheck.speculator.batch import DraftBatch
from speccheck.speculator.factory import create_speculator
from speccheck.speculator.kv_cache import PAD_SLOT, SINK_BLOCK
from speccheck.speculator.model import DrafterConfig
from tests.fixtures.catch import CATCH_ARGS

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "writing-an-adapter.md"
REBUILDING = ROOT / "tests" / "fixtures" / "adapters" / "rebuilding.py"
TAIL_ZEROING = "        self.kv_lens[num_reqs:].zero_()\n        self.slots[num_tokens:].zero_()\n"
"""The lines of the rebuilding fixture's refresh that zero its buffers' tails."""

BLOCK_SIZE = 4
MAX_MODEL_LEN = 32
WIDTH = blocks_for(MAX_MODEL_LEN, BLOCK_SIZE)
"""Columns of every block table a builder receives."""
K = 4
"""Draft tokens per request: the first pass, then decode steps 1, 2 and 3."""
DECODE_STEPS = range(1, K)
NUM_BLOCKS = 40
DRAFTER = DrafterConfig(vocab_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_size=16,
                        intermediate_size=64, seed=5)

BATCH = DraftBatch(
    context_lens=(4, 29, 0, 30, 10),
    new_tokens=((1, 2, 3), (4,), (7,), (6, 6), (1,)),
    block_table=((11, 3, 17, 29, 8), (2, 9, 13, 21, 22, 23, 24, 25), (5,),
                 tuple(range(30, 38)), (4, 6, 7, 10)),
    seeds=(0, 1, 2, 3, 4),
)
"""Five requests, padded to the bucket of 8 (lanes 5..7 are padding). Lengths after the
first pass (``base``) 7, 30, 1, 32 and 11: request 0's draft steps cross from its second
block into its third (positions 7, 8, 9), request 4's from its third into its fourth
(11, 12, 13); request 1 reaches the clamp at step 2 (positions 30, 31, 31); request 3
arrives at ``max_model_len`` (positions 31, 31, 31). Request 0's row has two blocks more
than its steps use; request 2's row has one block, every other column is the sink's."""
REAL, BUCKET = BATCH.num_reqs, 8
PADDING_LANES = range(REAL, BUCKET)


class Hook(enum.Enum):
    """The builder hooks the speculator calls."""

    BUILD = "build"
    CAPTURE_BUILD = "build_for_cudagraph_capture"
    REFRESH = "update_draft_decode_metadata"


INPUTS = ("query_start_loc", "seq_lens", "positions", "slot_mapping", "block_table")
"""The speculator's input tensors, as the common metadata and the reference metadata both
name them."""


@dataclass(frozen=True)
class HostValues:
    """The common metadata's host values at a build."""

    num_reqs: int
    num_real_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu_upper_bound: list[int]


@dataclass(frozen=True)
class Received:
    """What one hook received: the metadata object (``id``), a copy of each input tensor
    as it was at the call, the storage each one views, and, at a build, the host values."""

    hook: Hook
    metadata: int
    inputs: dict[str, torch.Tensor]
    storage: dict[str, int]
    host: HostValues | None

    @classmethod
    def record(cls, hook: Hook, metadata: ReferenceMetadata, source: Any,
               common: CommonAttentionMetadata | None) -> Received:
        """``source`` holds the inputs (the common metadata, or the metadata refreshed).
        Copies stay on the device (the refresh may run inside a graph capture)."""
        tensors = {name: getattr(source, name) for name in INPUTS}
        host = None if common is None else HostValues(
            common.num_reqs, common.num_real_reqs, common.num_actual_tokens,
            common.max_query_len, common.max_seq_len, common.query_start_loc_cpu.tolist(),
            common.seq_lens_cpu_upper_bound.tolist())
        return cls(hook, id(metadata), {name: t.clone() for name, t in tensors.items()},
                   {name: t.untyped_storage().data_ptr() for name, t in tensors.items()}, host)

    def __getitem__(self, name: str) -> list[Any]:
        """Input ``name`` as (nested) lists."""
        return self.inputs[name].tolist()


class RecordingBuilder(ReferenceMetadataBuilder):
    """The reference builder, recording in :attr:`received` what every hook receives."""

    def setup(self) -> None:
        super().setup()
        self.received: list[Received] = []

    def build(self, common: CommonAttentionMetadata) -> ReferenceMetadata:
        metadata = super().build(common)
        self.received.append(Received.record(Hook.BUILD, metadata, common, common))
        return metadata

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> ReferenceMetadata:
        metadata = super().build(common)
        self.received.append(Received.record(Hook.CAPTURE_BUILD, metadata, common, common))
        return metadata

    def update_draft_decode_metadata(self, metadata: ReferenceMetadata) -> None:
        self.received.append(Received.record(Hook.REFRESH, metadata, metadata, None))
        super().update_draft_decode_metadata(metadata)


@cache
def _speculator(*, rebuilds: bool = False, first_pass_query_lens: tuple[int, ...] = (),
                cuda_graphs: bool = False) -> AutoregressiveSpeculator:
    """A one-layer drafter on the reference backend (recorded), K = 4, block size 4,
    ``max_model_len`` 32, capture sizes 2, 4 and 8, padding eager batches to them (or
    capturing FULL graphs on CUDA with ``cuda_graphs``); ``rebuilds`` is the matrix entry's
    ``refresh_rebuilds``."""
    shipped = load_matrix()
    entry = shipped.backend("reference")
    draft = entry.draft_decode.model_copy(update={"refresh_rebuilds": rebuilds})
    matrix = shipped.replacing(entry.model_copy(update={"draft_decode": draft}))
    device = torch.device("cuda" if cuda_graphs else "cpu")
    config = RuntimeConfig(platform=device.type, cudagraph_mode="full" if cuda_graphs else "none",
                           num_speculative_steps=K, block_size=BLOCK_SIZE,
                           max_model_len=MAX_MODEL_LEN, dtype="float32", head_size=16,
                           num_heads=2, num_kv_heads=1)
    options = SpeculatorOptions(capture_sizes=(2, 4, BUCKET), num_blocks=NUM_BLOCKS,
                                pad_to_capture_sizes=True,
                                first_pass_query_lens=first_pass_query_lens)
    spec = create_speculator("autoregressive", ["reference"], config, DRAFTER, device, options,
                             matrix=matrix, builder_overrides={"reference": RecordingBuilder})
    assert isinstance(spec, AutoregressiveSpeculator)
    return spec


def _builder(spec: AutoregressiveSpeculator) -> RecordingBuilder:
    builder = spec.groups[0].builder
    assert isinstance(builder, RecordingBuilder)
    return builder


def _propose(spec: AutoregressiveSpeculator, batch: DraftBatch, path: DecodePath, *,
             with_capture_build: bool = False) -> list[Received]:
    """What the builder received during one ``propose``, in call order; without
    ``with_capture_build``, less the capture builds on dummy lanes that the eager fused
    loop makes first (statements 10 and 12)."""
    builder = _builder(spec)
    builder.received.clear()
    spec.propose(batch, path)
    received = list(builder.received)
    while not with_capture_build and received and received[0].hook is Hook.CAPTURE_BUILD:
        received.pop(0)
    return received


def _hooks(received: list[Received]) -> list[Hook]:
    return [r.hook for r in received]


def _decode_steps(received: list[Received]) -> dict[int, Received]:
    """The per-step or fused run (without ``refresh_rebuilds``) of :data:`BATCH`: the first
    pass's build, then per decode step a build (per-step: every step; fused: step 1) or a
    refresh (fused: steps 2 and 3). Returns what each decode step received."""
    assert received[0].hook is Hook.BUILD
    return dict(zip(DECODE_STEPS, received[1:], strict=True))


def _runs() -> dict[DecodePath, dict[int, Received]]:
    """What each decode step of :data:`BATCH` received on the fused and per-step paths."""
    spec = _speculator()
    return {path: _decode_steps(_propose(spec, BATCH, path))
            for path in (DecodePath.FUSED, DecodePath.PER_STEP)}


def _base(batch: DraftBatch) -> list[int]:
    """Each request's length after the first pass: context plus new tokens."""
    return [c + len(t) for c, t in zip(batch.context_lens, batch.new_tokens, strict=True)]


def _position(base: int, step: int) -> int:
    return min(base + step - 1, MAX_MODEL_LEN - 1)


def _length(base: int, step: int) -> int:
    return min(base + step, MAX_MODEL_LEN)


def _slot(batch: DraftBatch, request: int, position: int) -> int:
    return batch.block_table[request][position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE


def _table(batch: DraftBatch, rows: int) -> list[list[int]]:
    """``rows`` rows of the full width: each request's row as given, then zeros."""
    out = [[0] * WIDTH for _ in range(rows)]
    for r, row in enumerate(batch.block_table):
        out[r][: len(row)] = row
    return out


def test_the_guide_names_every_test_here_as_a_statements_pin() -> None:
    """Section 7 of the guide names, after each statement, the test that pins it: every one
    exists, and every other test of this module pins one."""
    named = set(re.findall(r"tests/test_input_contract\.py::(test_\w+)", GUIDE.read_text()))
    here = {name for name in globals() if name.startswith("test_")}
    assert named == here - {"test_the_guide_names_every_test_here_as_a_statements_pin"}


# --- 1. the sink ------------------------------------------------------------------------

def test_block_zero_is_the_sink_and_no_request_may_own_it() -> None:
    assert SINK_SLOT == PAD_SLOT == SINK_BLOCK * BLOCK_SIZE == 0
    spec = _speculator()
    owns_the_sink = DraftBatch((0,), ((1,),), ((0,),), (0,))
    live = rf"request 0: block ids must lie in 1\.\.{NUM_BLOCKS - 1}"
    with pytest.raises(ValueError, match=live):
        spec.propose(owns_the_sink)


# --- 2. padding lanes and padding tokens ------------------------------------------------

def test_padding_lanes_have_length_zero_position_zero_and_the_sink_slot() -> None:
    for path, steps in _runs().items():
        for step, seen in steps.items():
            where = f"{path} step {step} ({seen.hook.value})"
            for lane in PADDING_LANES:
                assert seen["seq_lens"][lane] == 0, where
                assert seen["positions"][lane] == 0, where
                assert seen["slot_mapping"][lane] == SINK_SLOT, where
                assert seen["block_table"][lane] == [0] * WIDTH, where


def test_padding_tokens_lie_past_the_last_query_offset() -> None:
    """A decode step pads to the bucket: one token per lane, the real requests' first."""
    spec = _speculator()
    received = _propose(spec, BATCH, DecodePath.FUSED)
    offsets = [min(i, REAL) for i in range(BUCKET + 1)]
    for step, seen in _decode_steps(received).items():
        assert seen["query_start_loc"] == offsets, f"step {step}"
    step_one = _decode_steps(received)[1].host
    assert step_one is not None
    assert (step_one.num_reqs, step_one.num_real_reqs, step_one.num_actual_tokens,
            step_one.max_query_len) == (BUCKET, REAL, BUCKET, 1)
    assert step_one.query_start_loc_cpu == offsets
    # A first pass whose requests bring different token counts runs unpadded.
    first_pass = received[0].host
    assert first_pass is not None
    lengths = [len(t) for t in BATCH.new_tokens]
    assert (first_pass.num_reqs, first_pass.num_real_reqs, first_pass.num_actual_tokens) == (
        REAL, REAL, sum(lengths))
    assert received[0]["query_start_loc"] == [sum(lengths[:i]) for i in range(REAL + 1)]


@pytest.mark.parametrize("rebuilds", [False, True], ids=["build", "refresh_rebuilds"])
def test_a_padded_first_pass_pads_whole_requests(rebuilds: bool) -> None:
    """Requests that all bring ``q`` new tokens (``q`` in ``first_pass_query_lens``) run
    their first pass padded over the bucket, ``q`` lanes per request. Without
    ``refresh_rebuilds`` its build sees the pass's inputs; with it, the pass's metadata is
    built for capture (every lane of the bucket a request, as a graph's was) and the refresh
    at the start of the pass does."""
    q = 2
    batch = DraftBatch((3, 0, 9), ((1, 2), (3, 4), (5, 6)), ((1, 2, 3), (4, 5), (6, 7, 8, 9)),
                       (0, 0, 0))
    spec = _speculator(rebuilds=rebuilds, first_pass_query_lens=(q,))
    received = _propose(spec, batch, DecodePath.FUSED, with_capture_build=rebuilds)
    real, bucket = batch.num_reqs, 4
    if rebuilds:
        assert _hooks(received) == [Hook.CAPTURE_BUILD, Hook.CAPTURE_BUILD, *[Hook.REFRESH] * K]
        pass_build, seen = received[1], received[2]
        assert pass_build["query_start_loc"] == [i * q for i in range(bucket + 1)]
    else:
        assert _hooks(received) == [Hook.BUILD, Hook.BUILD, *[Hook.REFRESH] * (K - 2)]
        pass_build = seen = received[0]
    assert pass_build.host is not None
    assert (pass_build.host.num_reqs, pass_build.host.num_real_reqs,
            pass_build.host.num_actual_tokens, pass_build.host.max_query_len) == (
        bucket, bucket if rebuilds else real, bucket * q, q)
    assert seen["query_start_loc"] == [min(i, real) * q for i in range(bucket + 1)]
    assert seen["seq_lens"] == _base(batch) + [0]
    positions = [c + j for c in batch.context_lens for j in range(q)]
    assert seen["positions"] == positions + [0] * q
    slots = [_slot(batch, t // q, p) for t, p in enumerate(positions)]
    assert seen["slot_mapping"] == slots + [SINK_SLOT] * q
    assert seen["block_table"] == _table(batch, bucket)


# --- 3. the block table -----------------------------------------------------------------

def test_block_tables_hold_each_row_as_given_then_sink_blocks() -> None:
    """Full width at every hook; unused entries the batch gave stay as given, the rest of
    each row and every padding row are block 0; nothing changes within a propose."""
    spec = _speculator()
    for path in (DecodePath.FUSED, DecodePath.PER_STEP):
        received = _propose(spec, BATCH, path)
        assert received[0]["block_table"] == _table(BATCH, REAL)
        for step, seen in _decode_steps(received).items():
            assert seen["block_table"] == _table(BATCH, BUCKET), f"{path} step {step}"
    unused = BATCH.block_table[0][blocks_for(_position(_base(BATCH)[0], K - 1) + 1, BLOCK_SIZE):]
    assert unused == (29, 8), "the batch must give request 0 blocks it does not use"


# --- 4. lengths, positions and slots of each draft step, the clamp ----------------------

def test_draft_steps_write_the_row_entry_of_their_position_across_block_boundaries() -> None:
    for path, steps in _runs().items():
        for step, seen in steps.items():
            for r, base in enumerate(_base(BATCH)):
                position = _position(base, step)
                assert seen["slot_mapping"][r] == _slot(BATCH, r, position), (path, step, r)
    crossings = [r for r, base in enumerate(_base(BATCH))
                 if _position(base, 1) // BLOCK_SIZE != _position(base, K - 1) // BLOCK_SIZE]
    assert crossings == [0, 4], "requests 0 and 4 must cross a block boundary"


def test_the_clamp_holds_position_length_and_slot_at_max_model_len() -> None:
    """Real lanes: position ``min(base + step - 1, max_model_len - 1)``, length
    ``min(base + step, max_model_len)``, so ``seq_lens == positions + 1``; once clamped a
    request writes the slot of position ``max_model_len - 1`` at every step."""
    for path, steps in _runs().items():
        for step, seen in steps.items():
            for r, base in enumerate(_base(BATCH)):
                assert seen["positions"][r] == _position(base, step), (path, step, r)
                assert seen["seq_lens"][r] == _length(base, step), (path, step, r)
                assert seen["seq_lens"][r] == seen["positions"][r] + 1, (path, step, r)
        last = _slot(BATCH, 1, MAX_MODEL_LEN - 1)
        assert [steps[s]["positions"][1] for s in DECODE_STEPS] == [30, 31, 31]
        assert [steps[s]["slot_mapping"][1] for s in DECODE_STEPS] == [
            _slot(BATCH, 1, 30), last, last]
        assert {steps[s]["positions"][3] for s in DECODE_STEPS} == {MAX_MODEL_LEN - 1}
        assert {steps[s]["seq_lens"][3] for s in DECODE_STEPS} == {MAX_MODEL_LEN}


def test_host_lengths_are_the_step_lengths_and_stay_the_builds() -> None:
    """A build's host lengths are its step's clamped lengths (zero for padding lanes) and
    their maximum; the fused path's decode steps run on its capture build, whose host
    values are the dummy lanes' (length 1 each), and no later hook brings others."""
    spec = _speculator()
    per_step = _decode_steps(_propose(spec, BATCH, DecodePath.PER_STEP))
    for step, seen in per_step.items():
        assert seen.host is not None
        lengths = [_length(base, step) for base in _base(BATCH)] + [0] * len(PADDING_LANES)
        assert seen.host.seq_lens_cpu_upper_bound == lengths, f"step {step}"
        assert seen.host.max_seq_len == max(lengths), f"step {step}"
    received = _propose(spec, BATCH, DecodePath.FUSED, with_capture_build=True)
    capture = received[0].host
    assert capture is not None and received[0].hook is Hook.CAPTURE_BUILD
    assert (capture.seq_lens_cpu_upper_bound, capture.max_seq_len) == ([1] * BUCKET, 1)
    fused = _decode_steps(received[1:])
    assert [fused[s].host is None for s in DECODE_STEPS] == [False, True, True]


# --- 5. what the refresh may assume -----------------------------------------------------

@pytest.mark.parametrize("path", [DecodePath.FUSED, DecodePath.PER_STEP])
def test_refreshes_run_between_draft_steps_only(path: DecodePath) -> None:
    """Fused (without ``refresh_rebuilds``): build the first pass and step 1, refresh before
    steps 2 .. K - 1, never after the last; per-step: a build before every step."""
    expected = [Hook.BUILD, Hook.BUILD] + [
        Hook.REFRESH if path is DecodePath.FUSED else Hook.BUILD] * (K - 2)
    assert _hooks(_propose(_speculator(), BATCH, path)) == expected


def test_the_refresh_gets_the_capture_object_over_storage_that_never_moves() -> None:
    """Without ``refresh_rebuilds``, every refresh of the eager fused loop gets the object
    built for capture on dummy lanes before the call's inputs existed (a replay refreshes
    the one its graph was captured with); step 1's build, with the call's inputs, only
    writes the storage that object views, which never moves."""
    spec = _speculator()
    first = _propose(spec, BATCH, DecodePath.FUSED, with_capture_build=True)
    again = _propose(spec, BATCH, DecodePath.FUSED, with_capture_build=True)
    capture, calls = first[0], first[1:]
    assert capture.hook is Hook.CAPTURE_BUILD
    assert capture["seq_lens"] == [1] * BUCKET  # dummy lanes, not the batch's
    steps = _decode_steps(calls)
    assert steps[1].hook is Hook.BUILD and steps[1].metadata != capture.metadata
    assert {steps[s].metadata for s in DECODE_STEPS[1:]} == {capture.metadata}
    for name in INPUTS:
        assert len({seen.storage[name] for seen in first + again}) == 1, name


def test_before_each_refresh_the_inputs_are_what_a_build_of_that_step_sees() -> None:
    """The speculator advanced positions and lengths and recomputed the slots in place;
    query offsets and block table are unchanged since the build."""
    runs = _runs()
    for step in DECODE_STEPS[1:]:
        refreshed, built = runs[DecodePath.FUSED][step], runs[DecodePath.PER_STEP][step]
        assert (refreshed.hook, built.hook) == (Hook.REFRESH, Hook.BUILD)
        for name in INPUTS:
            assert refreshed[name] == built[name], f"{name} before step {step}"


def test_under_refresh_rebuilds_the_refresh_stands_in_for_the_step_one_build() -> None:
    """With ``refresh_rebuilds`` the metadata of the decode steps is the one a capture
    builds, on dummy lanes of the bucket (as a replay's was): its host values and device
    views are the capture's, every lane a request of length 1, never this call's nor what
    the previous call left; the refresh before step 1 sees what a build of step 1 sees."""
    spec = _speculator(rebuilds=True)
    _propose(spec, BATCH, DecodePath.FUSED)
    received = _propose(spec, BATCH, DecodePath.FUSED, with_capture_build=True)
    assert _hooks(received) == [Hook.CAPTURE_BUILD, Hook.BUILD, *[Hook.REFRESH] * (K - 1)]
    early, refreshed = received[0], received[2]
    assert early.metadata == refreshed.metadata
    assert early.host is not None
    assert (early.host.num_reqs, early.host.num_real_reqs) == (BUCKET, BUCKET)
    assert early.host.seq_lens_cpu_upper_bound == [1] * BUCKET
    assert early["seq_lens"] == [1] * BUCKET, "the capture's lengths, not the previous call's"
    assert early["query_start_loc"] == list(range(BUCKET + 1))
    built = _runs()[DecodePath.PER_STEP][1]
    for name in INPUTS:
        assert refreshed[name] == built[name], name


def test_a_rebuilding_refresh_must_zero_its_tails(tmp_path: Path) -> None:
    """``tests/fixtures/adapters/rebuilding.py`` (``refresh_rebuilds: true``, a refresh that
    zeroes its buffers' tails) passes ``speccheck verify`` at its defaults; a copy whose
    refresh does not zero them fails ``zero_tails`` (``--fail-fast``: the default search up
    to its first failure)."""
    source = REBUILDING.read_text()
    assert source.count(TAIL_ZEROING) == 1, "the fixture's tail zeroing moved: update TAIL_ZEROING"
    (tmp_path / "rebuilding_unzeroed.py").write_text(source.replace(TAIL_ZEROING, ""))
    matrix = REBUILDING.with_suffix(".yaml").read_text()
    unzeroed = tmp_path / "unzeroed.yaml"
    unzeroed.write_text(matrix.replace("tests.fixtures.adapters.rebuilding:",
                                       "rebuilding_unzeroed:"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    runs = {}
    for label, path, extra in (("zeroed", REBUILDING.with_suffix(".yaml"), []),
                               ("unzeroed", unzeroed, list(CATCH_ARGS))):
        report = tmp_path / f"{label}.json"
        runs[label] = (report, subprocess.Popen(
            [sys.executable, "-c", "from speccheck.checks.cli.app import main; main()",
             "verify", "--backend", "rebuilding", "--matrix", str(path), "--json", str(report),
             *extra],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = {label: proc.communicate(timeout=600)[0] for label, (_, proc) in runs.items()}
    reports = {label: json.loads(report.read_text())["backends"][0]
               for label, (report, _) in runs.items()}
    assert runs["zeroed"][1].returncode == 0, outputs["zeroed"]
    assert reports["zeroed"]["checks"]["zero_tails"]["passed"] > 0
    assert runs["unzeroed"][1].returncode == 1, outputs["unzeroed"]
    failed = {f["check"]: f for f in reports["unzeroed"]["failures"]}
    assert "zero_tails" in failed, outputs["unzeroed"]
    assert failed["zero_tails"]["field"] == "rebuilding.buffers['slots']"  # names its buffer


# --- 6. capture (CUDA) ------------------------------------------------------------------

@pytest.mark.cuda
def test_capture_builds_see_dummy_lanes_that_write_only_the_sink() -> None:
    """Capture metadata is built on dummy lanes: every lane real, length 1, position 0,
    block table all block 0, so every slot is the sink; a replay's launches keep the host
    values of that build."""
    spec = _speculator(cuda_graphs=True)
    builder = _builder(spec)
    builder.received.clear()
    spec.capture()
    captured = [r for r in builder.received if r.hook is Hook.CAPTURE_BUILD]
    assert captured, "capture must build its metadata with build_for_cudagraph_capture"
    for seen in captured:
        assert seen.host is not None
        n = seen.host.num_reqs
        assert seen.host.num_real_reqs == n and seen.host.num_actual_tokens == n
        assert seen["query_start_loc"] == list(range(n + 1))
        assert seen["seq_lens"] == [1] * n
        assert seen["positions"] == [0] * n
        assert seen["slot_mapping"] == [SINK_SLOT] * n
        assert seen["block_table"] == [[0] * WIDTH for _ in range(n)]
