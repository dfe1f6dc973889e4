"""FULL CUDA-graph capture for the autoregressive speculator, on dummy inputs, per bucket:
the padded first pass (per first-pass width), the single decode step, the fused body where
the matrix allows it, the whole fused propose where every refresh rebuilds its metadata,
and the host_preplanned body where that strategy applies.

The metadata each graph was captured with is kept (:attr:`GraphCapture.metadata`): a
per-step replay's observer reads its host values, and a host_preplanned replay re-plans it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from speccheck.contract.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from speccheck.speculator.pass_inputs import (
    PassInputs,
    scatter_pass_inputs,
    scatter_staged_pass_inputs,
    stage_pass_inputs,
)
from speccheck.speculator.paths import (
    FIRST_PASS,
    FUSED_PROPOSE,
    SINGLE_STEP,
    DecodePath,
    GraphKey,
)

if TYPE_CHECKING:
    from speccheck.speculator.autoregressive import AutoregressiveSpeculator


class GraphCapture:
    """Captures one speculator's graphs and keeps the metadata they were captured with."""

    def __init__(self, speculator: AutoregressiveSpeculator) -> None:
        self._spec = speculator
        self.metadata: dict[GraphKey, Any] = {}
        """The capture metadata of each decode graph by key: a list per group, or for the
        host_preplanned body a list per step of such lists."""

    def capture_all(self) -> None:
        """Every graph of every bucket (see the module's docstring). Index buffers are reset
        afterwards, so a stale index from a capture's dummy inputs never outlives it."""
        spec = self._spec
        if spec.graphs is None or spec.num_steps < 2:
            return
        spec.graphs.reset()
        steps = spec.decode_steps
        spec.in_capture = True
        try:
            for bucket in spec.graphs.capture_sizes:
                for query_len in spec.first_pass_query_lens:
                    self._first_pass(bucket, query_len)
                self._decode_body((SINGLE_STEP, bucket),
                                  partial(steps.one_step, bucket, step=0, observe=False))
                if spec.use_fused_multi_step_decode:
                    self._decode_body((DecodePath.FUSED, bucket), partial(steps.fused, bucket))
                if spec.refresh_rebuilds_in_graph:
                    for query_len in spec.first_pass_query_lens:
                        self._fused_propose(bucket, query_len)
                if spec.host_preplanned_applies:
                    self._decode_body((DecodePath.HOST_PREPLANNED, bucket),
                                      partial(steps.host_preplanned, bucket))
        finally:
            spec.in_capture = False
            spec.reset_index_buffers()

    def _decode_body(self, key: tuple[str, int], body: Callable[[Any], None]) -> None:
        """Dummy inputs for ``bucket`` lanes, all live at position 0 (length 1), every
        block-table entry the sink (so warm-up and capture write only the sink), written as
        a propose writes step 1's lanes (slots included) after a pass of ``bucket`` requests
        of length 0, then fresh capture metadata, then capture."""
        spec = self._spec
        assert spec.graphs is not None
        bucket = key[1]
        metadata: list[Any]
        if key[0] == DecodePath.HOST_PREPLANNED:
            self._write_dummy_decode_lanes(bucket)
            metadata = spec.host_preplanner.plan(
                BatchExecutionDescriptor(CUDAGraphMode.FULL, bucket, bucket, 1), bucket,
                np.zeros(bucket, np.int64), for_capture=True)
        else:
            metadata = self.decode_metadata(bucket)
        self.metadata[key] = metadata
        spec.graphs.capture(key, lambda: body(metadata))

    def _write_dummy_decode_lanes(self, bucket: int) -> None:
        """Step 1's lanes of ``bucket`` requests of length 0 after a pass, on reset
        buffers."""
        spec = self._spec
        spec.reset_index_buffers()
        spec.index_buffers.num_reqs.fill_(bucket)
        spec.first_pass.prepare_decode_lanes(bucket)

    def decode_metadata(self, bucket: int) -> list[Any]:
        """Capture metadata of a decode step over ``bucket`` lanes, on dummy lanes."""
        self._write_dummy_decode_lanes(bucket)
        return self._spec.build_decode_metadata(
            BatchExecutionDescriptor(CUDAGraphMode.FULL, bucket, bucket, 1), bucket,
            np.zeros(bucket, np.int64), 1, for_capture=True)

    def _first_pass(self, bucket: int, query_len: int) -> None:
        """The padded first pass of ``bucket`` requests of ``query_len`` tokens on dummy
        inputs (context 0, every block the sink), with capture metadata."""
        spec = self._spec
        assert spec.graphs is not None
        metadata = self.first_pass_metadata(bucket, query_len)
        refresh = spec.refresh_rebuilds_in_graph
        spec.graphs.capture((FIRST_PASS, bucket, query_len),
                            lambda: spec.first_pass.body(bucket, query_len, metadata, refresh))

    def _fused_propose(self, bucket: int, query_len: int) -> None:
        """A whole fused propose of ``bucket`` requests of ``query_len`` tokens in one
        graph: the scatter of the staged pass inputs (where the speculator's
        ``scatters_in_graph``; the first pass's dummy inputs are the last staged), the first
        pass's body, then the fused decode body, each refreshing capture metadata of its own
        (the decode's built first: the first pass's dummy inputs are the last written, as a
        propose's pass inputs are)."""
        spec = self._spec
        assert spec.graphs is not None
        decode = self.decode_metadata(bucket)
        first = self.first_pass_metadata(bucket, query_len)
        scatter = spec.scatters_in_graph

        def body() -> None:
            if scatter:
                scatter_staged_pass_inputs(spec.index_buffers, spec.staging.device_buffer,
                                           spec.block_size)
            spec.first_pass.body(bucket, query_len, first, refresh=True)
            spec.decode_steps.fused(bucket, decode)

        spec.graphs.capture((FUSED_PROPOSE, bucket, query_len), body)

    def _stage_dummy_pass(self, bucket: int, query_len: int) -> PassInputs:
        """Capture inputs, staged: ``bucket`` requests of ``query_len`` tokens at positions
        ``0 .. query_len - 1`` (length ``query_len``), no block-table entry (every block the
        sink), token ids and seeds 0."""
        return stage_pass_inputs(
            self._spec.staging, np.zeros((bucket, 0), np.int64), np.zeros(bucket, np.int64),
            np.full(bucket, query_len, np.int64), np.tile(np.arange(query_len), bucket),
            np.zeros(bucket * query_len, np.int64), np.repeat(np.arange(bucket), query_len),
            query_len)

    def first_pass_metadata(self, bucket: int, query_len: int) -> list[Any]:
        """Capture metadata of the padded first pass of ``bucket`` requests of
        ``query_len`` tokens, on dummy inputs (:meth:`_stage_dummy_pass`, scattered as a
        pass's inputs are: every other index reset, the sink's slots)."""
        spec = self._spec
        scatter_pass_inputs(spec.index_buffers, self._stage_dummy_pass(bucket, query_len),
                            spec.block_size, kernel=spec.kernel)
        return spec.first_pass.metadata(bucket, bucket, query_len,
                                        np.full(bucket, query_len), for_capture=True)
