"""The autoregressive speculator's first pass: draft token 0 from one prefill-style pass
over each request's new tokens, then the decode lanes of step 1.

A batch whose requests all bring ``query_len`` new tokens, ``query_len`` one of the
speculator's ``first_pass_query_lens``, runs its pass padded over its bucket (a FULL graph
replay where one was captured, else the same body eagerly); any other batch runs it eagerly
over the real tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from speccheck.contract.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from speccheck.contract.token_count import build_uniform_attention_metadata
from speccheck.speculator.batch import DraftBatch, RequestArrays
from speccheck.speculator.decode_inputs import DecodeLaneBuffers, prepare_decode_lanes
from speccheck.speculator.paths import FIRST_PASS
from speccheck.speculator.sampling import sample_tokens

if TYPE_CHECKING:
    from speccheck.speculator.autoregressive import AutoregressiveSpeculator


class FirstPass:
    """Draft token 0 and step 1's lanes for one speculator, over its persistent buffers."""

    def __init__(self, speculator: AutoregressiveSpeculator) -> None:
        self._spec = speculator

    def width(self, batch: DraftBatch) -> int | None:
        """``query_len`` when ``batch``'s first pass runs padded over its bucket (padding in
        use, every request brings ``query_len`` new tokens, one of the speculator's
        ``first_pass_query_lens``), else ``None`` (the pass runs eagerly over the real
        tokens only)."""
        widths = {len(row) for row in batch.new_tokens}
        if not self._spec.pads_to_buckets or len(widths) != 1:
            return None
        (query_len,) = widths
        return query_len if query_len in self._spec.first_pass_query_lens else None

    def run(self, batch: DraftBatch, arrays: RequestArrays, base_seq_lens: np.ndarray,
            use_graphs: bool, decode_lanes: int, emulate: bool = False) -> None:
        """Draft token 0: one pass over each request's new tokens: padded over the bucket
        when :meth:`width` says so (a graph replay where one was captured), else eagerly
        over the real tokens; then, with decode steps to come, the ``decode_lanes`` lanes
        of step 1 (:meth:`prepare_decode_lanes`: inside the padded pass's body).

        Where the speculator's ``refresh_rebuilds_in_graph``, a replay follows the pass's
        inputs directly (its body refreshes its metadata); ``emulate`` runs the padded pass
        eagerly as a replay runs it: on the metadata a capture of the bucket builds (dummy
        inputs, every lane a request), refreshed in the body."""
        spec = self._spec
        num_reqs = batch.num_reqs
        query_len = self.width(batch)
        if query_len is None:
            last_host = np.cumsum(arrays.query_lens) - 1
            hidden, _, (last,) = spec.eager_pass(arrays, batch.new_tokens, [last_host])
            self.store_draft_zero(hidden[last], spec.buffers.positions[last])
            if spec.num_steps > 1:
                self.prepare_decode_lanes(decode_lanes)
            return
        bucket = spec.bucket_for(num_reqs)
        key = (FIRST_PASS, bucket, query_len)
        replay = use_graphs and spec.graphs is not None and key in spec.graphs
        rebuild = spec.refresh_rebuilds_in_graph and (replay or emulate)
        group_metadata: list[Any] = []
        if rebuild and not replay:
            with spec.capturing():
                group_metadata = spec.graph_capture.first_pass_metadata(bucket, query_len)
        spec.write_pass_inputs(arrays, batch.new_tokens, uniform_width=query_len)
        if not rebuild:
            group_metadata = self.metadata(num_reqs, bucket, query_len, base_seq_lens)
        if not replay:
            self.body(bucket, query_len, group_metadata, rebuild)
            return
        assert spec.graphs is not None
        spec.graphs.replay(key)
        spec.counters.first_pass_replays += 1
        if spec.num_steps > 1:
            spec.record("slots", 1)

    def metadata(self, num_reqs: int, bucket: int, query_len: int, base_seq_lens: np.ndarray,
                 for_capture: bool = False) -> list[Any]:
        """Each group's metadata for the first pass of ``num_reqs`` requests padded to
        ``bucket`` of ``query_len`` tokens each, built on the host from the buffers as they
        are (for a capture with ``for_capture``). Host work."""
        spec = self._spec
        common = build_uniform_attention_metadata(
            buffers=spec.buffers,
            batch_desc=BatchExecutionDescriptor(
                CUDAGraphMode.FULL, bucket * query_len, bucket, query_len),
            num_reqs=num_reqs, num_query_per_req=query_len, base_seq_lens_np=base_seq_lens,
            step=0, max_model_len=spec.max_model_len,
        )
        if for_capture:
            return [group.build_for_cudagraph_capture(common) for group in spec.groups]
        return [group.build(common) for group in spec.groups]

    def body(self, bucket: int, query_len: int, group_metadata: Sequence[Any],
             refresh: bool) -> None:
        """Draft token 0 of ``bucket`` requests of ``query_len`` tokens each (lanes
        ``request * query_len`` onwards are ``request``'s; padding requests' lanes write the
        sink and their drafts are ignored), then, with decode steps to come, the ``bucket``
        decode lanes (no host value of the batch needed, so a replay of this body leaves
        nothing for the host to do before the decode steps). With ``refresh``,
        ``group_metadata`` is first refreshed in place from the pass's inputs (a build's
        stand-in: see the speculator's ``refresh_rebuilds_in_graph``). Capture-safe."""
        spec = self._spec
        num_tokens = bucket * query_len
        if refresh:
            spec.decode_steps.refresh(group_metadata)
        if spec.first_pass_observer is not None:
            spec.first_pass_observer(num_tokens, 0, group_metadata, None)
        hidden = spec.run_model(num_tokens, group_metadata).view(bucket, query_len, -1)[:, -1]
        positions = spec.buffers.positions[:num_tokens].view(bucket, query_len)[:, -1]
        self.store_draft_zero(hidden, positions)
        if spec.num_steps > 1:
            self.prepare_decode_lanes(bucket)

    def store_draft_zero(self, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """Draft token 0 (and its logits) of the first ``len(hidden)`` requests from the
        hidden state of each one's last new token at ``positions``. Capture-safe."""
        spec = self._spec
        num_reqs = hidden.shape[0]
        logits = spec.model.compute_logits(hidden)
        spec.draft_tokens[:num_reqs, 0] = sample_tokens(
            logits, spec.options.sampling, spec.seeds[:num_reqs], positions, kernel=spec.kernel)
        spec.draft_logits[:num_reqs, 0] = logits

    def prepare_decode_lanes(self, num_lanes: int) -> None:
        """Lanes ``0 .. num_lanes - 1`` for decode: draft token 0 as input, positions,
        lengths and slots for step 1 from the pass's requests and their lengths after it,
        read on the device (clamped at ``max_model_len``); padding lanes have length 0,
        sink slots; the query offsets one token per real request
        (:func:`~speccheck.speculator.decode_inputs.prepare_decode_lanes`). Capture-safe.
        Step 1's slot mapping is final here, before any step-1 metadata is built or
        refreshed; the trace records it as ``("slots", 1)``."""
        spec = self._spec
        buffers = spec.buffers
        lanes = DecodeLaneBuffers(
            positions=buffers.positions[:num_lanes], seq_lens=buffers.seq_lens[:num_lanes],
            input_ids=spec.input_ids[:num_lanes], token_request=spec.token_request[:num_lanes],
            is_real_req=spec.is_real_req[:num_lanes],
            is_real_token=spec.is_real_token[:num_lanes],
            slot_mapping=buffers.slot_mapping[:num_lanes],
            query_start_loc=buffers.query_start_loc[: num_lanes + 1],
            block_table=buffers.block_table, draft_tokens=spec.draft_tokens[:num_lanes],
            current_step=spec.current_step, num_reqs=spec.index_buffers.num_reqs)
        prepare_decode_lanes(lanes, spec.max_model_len, spec.block_size, kernel=spec.kernel)
        spec.record("slots", 1)
