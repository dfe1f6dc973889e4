"""A DFlash-style parallel drafter: one non-causal forward over a block of 1+K query tokens
per request (the last accepted token, then K mask tokens) drafts all K tokens at once.

Its metadata is uniform (``num_query_per_req = 1 + K``) and is built through
:func:`~speccheck.contract.token_count.build_uniform_attention_metadata`, so the attention
token count follows the seed-004 rule: under data parallelism the model input is padded to
the agreed token count, but in eager mode attention covers only the real tokens.
"""

from __future__ import annotations

from functools import partial
from typing import Any, ClassVar

import numpy as np
import torch

from speccheck.contract.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from speccheck.contract.groups import AttentionGroup
from speccheck.contract.metadata import CommonAttentionMetadata
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.contract.token_count import build_uniform_attention_metadata
from speccheck.speculator.base import DraftModelSpeculator, SpeculatorOptions
from speccheck.speculator.batch import DraftBatch, DraftResult, RequestArrays
from speccheck.speculator.kv_cache import PagedKVCache
from speccheck.speculator.model import DraftModel
from speccheck.speculator.sampling import sample_tokens


class DFlashSpeculator(DraftModelSpeculator):
    """Drafts K tokens per request in one forward. ``last_common_metadata`` keeps the common
    metadata of the latest block pass, so checks can compare its token count with the rule."""

    attends_non_causally: ClassVar[bool] = True

    def __init__(
        self,
        model: DraftModel,
        groups: list[AttentionGroup],
        config: RuntimeConfig,
        device: torch.device,
        options: SpeculatorOptions = SpeculatorOptions(),
        kv_cache: PagedKVCache | None = None,
    ) -> None:
        super().__init__(
            model, groups, config, device, options,
            tokens_per_req=config.num_speculative_steps + 1, kv_cache=kv_cache,
        )
        self.query_per_req = self.num_steps + 1
        self.mask_token_id = self.vocab_size - 1
        self.last_common_metadata: CommonAttentionMetadata | None = None
        self._captured_metadata: dict[int, list[Any]] = {}

    def block_descriptor(self, num_reqs: int) -> BatchExecutionDescriptor:
        """This rank's own descriptor: a FULL bucket, or the real tokens when eager."""
        q = self.query_per_req
        if not self.pads_to_buckets:
            return BatchExecutionDescriptor(CUDAGraphMode.NONE, num_reqs * q, None, q)
        bucket = self.bucket_for(num_reqs)
        return BatchExecutionDescriptor(CUDAGraphMode.FULL, bucket * q, bucket, q)

    def _block_forward(self, num_tokens: int, group_metadata: list[Any]) -> None:
        """Forward over ``num_tokens`` lanes; drafts from lanes 1..K of each block.
        Capture-safe."""
        q = self.query_per_req
        n = num_tokens // q
        hidden = self.run_model(num_tokens, group_metadata).view(n, q, -1)[:, 1:]
        logits = self.model.compute_logits(hidden)
        positions = self.buffers.positions[:num_tokens].view(n, q)[:, 1:]
        tokens = sample_tokens(
            logits.reshape(n * self.num_steps, -1),
            self.options.sampling,
            self.seeds[:n].repeat_interleave(self.num_steps, output_size=n * self.num_steps),
            positions.reshape(-1),
            kernel=self.kernel,
        )
        self.draft_tokens[:n].copy_(tokens.view(n, self.num_steps))
        self.draft_logits[:n].copy_(logits)
        if not self.in_capture:
            self.counters.eager_step_calls += 1

    def capture(self) -> None:
        """One FULL graph of the block forward per bucket, on sink-only dummy inputs."""
        if self.graphs is None:
            return
        self.in_capture = True
        try:
            for n in self.graphs.capture_sizes:
                q = self.query_per_req
                self.reset_index_buffers()
                self.buffers.seq_lens[:n].fill_(q)
                self.is_real_token[: n * q] = True
                self.token_request[: n * q].copy_(
                    torch.arange(n, device=self.device).repeat_interleave(q)
                )
                self.buffers.positions[: n * q].copy_(torch.arange(q, device=self.device).repeat(n))
                desc = BatchExecutionDescriptor(CUDAGraphMode.FULL, n * q, n, q)
                self.compute_slot_mappings(n * q, 0)
                md = self._build_block_metadata(desc, n, np.zeros(n, np.int64), capture=True)
                self._captured_metadata[n] = md
                self.graphs.capture(("block", n), partial(self._block_forward, n * q, md))
        finally:
            self.in_capture = False
            self.reset_index_buffers()

    def _build_block_metadata(
        self, desc: BatchExecutionDescriptor, num_reqs: int, seq_lens: np.ndarray, capture: bool = False
    ) -> list[Any]:
        common = build_uniform_attention_metadata(
            buffers=self.buffers,
            batch_desc=desc,
            num_reqs=num_reqs,
            num_query_per_req=self.query_per_req,
            base_seq_lens_np=seq_lens,
            step=0,
            max_model_len=self.max_model_len,
            causal=False,
        )
        self.last_common_metadata = common
        if capture:
            return [g.build_for_cudagraph_capture(common) for g in self.groups]
        return [g.build(common) for g in self.groups]

    def propose(
        self, batch: DraftBatch, batch_desc: BatchExecutionDescriptor | None = None
    ) -> DraftResult:
        """Draft K tokens per request. ``batch_desc`` overrides this rank's own descriptor
        (data parallelism: every rank pads its model input to the agreed token count)."""
        arrays = self._validate(batch, extra_positions=self.num_steps)
        r, q = batch.num_reqs, self.query_per_req
        for i in range(r):
            if batch.context_lens[i] + len(batch.new_tokens[i]) + self.num_steps > self.max_model_len:
                raise ValueError(
                    f"request {i}: a block of {q} tokens after position "
                    f"{batch.context_lens[i] + len(batch.new_tokens[i]) - 1} passes max_model_len "
                    f"{self.max_model_len}"
                )
        desc = batch_desc or self.block_descriptor(r)
        if desc.uniform_token_count not in (None, q):
            raise ValueError(f"descriptor uniform_token_count {desc.uniform_token_count} != 1+K={q}")
        if desc.num_tokens < r * q or desc.num_tokens % q:
            raise ValueError(f"descriptor num_tokens {desc.num_tokens} cannot hold {r} blocks of {q}")
        context_rows = [row[:-1] for row in batch.new_tokens]
        if any(context_rows):
            self.eager_pass(arrays, context_rows)
        n_tokens = desc.num_tokens
        start = arrays.context_lens + arrays.query_lens - 1
        self._write_block_inputs(batch, arrays, n_tokens, start)
        # Slots before the build: a builder may read ``common.slot_mapping`` in build().
        self.compute_slot_mappings(n_tokens, 0)
        md = self._build_block_metadata(desc, r, start + q)
        if desc.cg_mode == CUDAGraphMode.FULL and self.graphs is not None:
            self.graphs.replay(("block", n_tokens // q))
            self.counters.graph_replays += 1
        else:
            self._block_forward(n_tokens, md)
        return DraftResult(
            draft_tokens=self.draft_tokens[:r].cpu().clone(),
            logits=self.draft_logits[:r].cpu().clone(),
        )

    def _write_block_inputs(self, batch: DraftBatch, arrays: RequestArrays, num_tokens: int,
                            start: np.ndarray) -> None:
        """Lanes of request ``i``: ``i*q .. i*q+q-1``; the last accepted token then masks at
        positions ``start[i] ..``; lanes past the real blocks are padding (sink slots)."""
        r, q = batch.num_reqs, self.query_per_req
        self.reset_index_buffers()
        self._write_request_inputs(arrays)
        b = self.buffers
        ids = np.full(num_tokens, self.mask_token_id, dtype=np.int64)
        ids[: r * q : q] = [row[-1] for row in batch.new_tokens]
        ids[r * q :] = 0
        positions = np.zeros(num_tokens, dtype=np.int64)
        positions[: r * q] = (start[:, None] + np.arange(q)[None, :]).reshape(-1)
        self.input_ids[:num_tokens].copy_(torch.from_numpy(ids))
        b.positions[:num_tokens].copy_(torch.from_numpy(positions))
        b.seq_lens[:r].copy_(torch.from_numpy(start + q))
        self.token_request[:num_tokens].copy_(
            torch.from_numpy(np.minimum(np.arange(num_tokens) // q, self.max_num_reqs - 1))
        )
        self.is_real_token[: r * q] = True
        self.is_real_req[:r] = True
