"""State and helpers every draft-model speculator shares.

Persistent state (allocated once, read by captured graphs by address): the attention input
buffers, ``input_ids``, lane masks, seeds, ``draft_tokens``/``draft_logits``, the paged KV
cache, and ``current_step``, a device scalar so one single-step graph serves every step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from speccheck.contract.builder import AttentionImpl, BuilderLimits, blocks_for
from speccheck.contract.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from speccheck.contract.groups import AttentionGroup
from speccheck.contract.metadata import AttentionInputBuffers
from speccheck.contract.resolution import graph_capture_shortfall
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.contract.token_count import build_attention_metadata
from speccheck.speculator.batch import DraftBatch, RequestArrays, flattened, row_lengths
from speccheck.speculator.cudagraph_manager import CudaGraphManager, require_graph_support
from speccheck.speculator.kv_cache import PagedKVCache, compute_slot_mapping
from speccheck.speculator.model import DraftModel
from speccheck.speculator.pass_inputs import (
    HEADER_SIZE,
    IndexBuffers,
    scatter_pass_inputs,
    stage_pass_inputs,
)
from speccheck.speculator.sampling import SamplingMethod
from speccheck.speculator.staging import HostStaging

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpeculatorOptions:
    """Sizes fixed at construction. ``capture_sizes`` are the padded request counts that
    FULL graphs are captured for; the largest is the most requests a propose may carry."""

    capture_sizes: tuple[int, ...] = (1, 2, 4, 8)
    max_num_prefill_tokens: int = 256
    num_blocks: int = 256
    sampling: SamplingMethod = "argmax"
    host_preplanned: bool = False
    """Let ``propose(path="auto")`` take the host_preplanned path where it applies, instead
    of falling back to per-step rebuilds (the seed's behaviour, hence off by default)."""
    pad_to_capture_sizes: bool = False
    """Pad eager batches to the capture sizes as FULL graphs do (the verifier's CPU tier
    uses this to exercise padding lanes without graphs)."""
    first_pass_query_lens: tuple[int, ...] = ()
    """Uniform first passes to pad and capture: a batch whose requests all bring ``q`` new
    tokens, ``q`` in this set, runs its first pass as one FULL graph over the bucket (or,
    when padding without graphs, as the same padded body eagerly). Other batches, and
    backends that cannot capture ``q`` query tokens per request, run it eagerly."""

    @property
    def max_num_reqs(self) -> int:
        return max(self.capture_sizes)

    def limits(self, tokens_per_req: int = 1) -> BuilderLimits:
        """Builder buffer sizes matching a speculator built with these options."""
        return BuilderLimits(
            self.max_num_reqs,
            max(self.max_num_prefill_tokens, self.max_num_reqs * tokens_per_req),
        )


@dataclass
class StepCounters:
    """``eager_step_calls``: decode steps run eagerly; ``graph_replays``: graph launches
    that ran decode steps; ``first_pass_replays``: graph launches that ran a first pass (a
    whole fused propose's one launch counts in both)."""

    eager_step_calls: int = 0
    graph_replays: int = 0
    first_pass_replays: int = 0


class DraftModelSpeculator:
    """A :class:`DraftModel`, its attention groups, KV cache and persistent buffers."""

    attends_non_causally: ClassVar[bool] = False
    """Whether some pass of this drafter attends non-causally (a token sees later positions
    of its request): a ``causal_only`` backend refuses to serve it."""

    def __init__(
        self,
        model: DraftModel,
        groups: list[AttentionGroup],
        config: RuntimeConfig,
        device: torch.device,
        options: SpeculatorOptions,
        tokens_per_req: int = 1,
        kv_cache: PagedKVCache | None = None,
    ) -> None:
        """``kv_cache``: a cache to share instead of allocating one (it must have the
        layers and block count this speculator would allocate). Speculators that share a
        cache must never draft at the same time: the verifier's one-per-K speculators do
        not, and a serving-scale cache is gigabytes per layer."""
        self.model = model
        self.kernel = model.cfg.kernel_choice
        """The ``kernel`` argument of every one-kernel update this speculator makes (see
        :attr:`DrafterConfig.kernels`)."""
        self.groups = groups
        self.config = config
        self.device = device
        self.options = options
        self.num_steps = config.num_speculative_steps
        self.cg_mode = CUDAGraphMode.from_name(config.cudagraph_mode)
        if self.cg_mode == CUDAGraphMode.PIECEWISE:
            raise ValueError(
                "cudagraph_mode=piecewise is not supported for draft decode: single-token "
                "decode attention runs eagerly between pieces there; use full or none"
            )
        require_graph_support(self.cg_mode, device)
        self.graph_mode_note: str | None = None
        """Why FULL was downgraded to eager (the matrix's ``cudagraph_support``), else None."""
        if self.cg_mode == CUDAGraphMode.FULL:
            self.graph_mode_note = graph_capture_shortfall(
                {g.backend_name: g.cudagraph_support for g in groups}, tokens_per_req
            )
            if self.graph_mode_note is not None:
                logger.warning("cudagraph_mode full -> none, running eagerly: %s",
                               self.graph_mode_note)
                self.cg_mode = CUDAGraphMode.NONE
        cfg = model.cfg
        self.vocab_size = cfg.vocab_size
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        limits = options.limits(tokens_per_req)
        self.max_num_reqs, self.max_num_tokens = limits.max_num_reqs, limits.max_num_tokens
        self.layer_impls = self._layer_impls()
        specs = [cfg.layer_spec(config.block_size, config.max_model_len)] * cfg.num_layers
        if kv_cache is None:
            kv_cache = PagedKVCache.allocate(specs, options.num_blocks, device)
        else:
            kv_cache.require_layout(specs, options.num_blocks)
        self.kv_cache = kv_cache
        max_blocks = blocks_for(config.max_model_len, config.block_size)
        self.buffers = AttentionInputBuffers.allocate(
            self.max_num_reqs, self.max_num_tokens, max_blocks, device
        )
        t, r = self.max_num_tokens, self.max_num_reqs
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.token_request = torch.zeros(t, dtype=torch.int64, device=device)
        self.is_real_token = torch.zeros(t, dtype=torch.bool, device=device)
        self.is_real_req = torch.zeros(r, dtype=torch.bool, device=device)
        self.seeds = torch.zeros(r, dtype=torch.int64, device=device)
        self.draft_tokens = torch.zeros(r, self.num_steps, dtype=torch.int64, device=device)
        self.draft_logits = torch.zeros(
            r, self.num_steps, self.vocab_size, dtype=torch.float32, device=device
        )
        self.current_step = torch.zeros((), dtype=torch.int64, device=device)
        self.lanes_done = torch.zeros((), dtype=torch.int32, device=device)
        """The end-of-step kernel's count of lanes done (zero between steps): its last lane
        moves ``current_step`` on (:func:`~speccheck.speculator.sampling.finish_decode_step`)."""
        b = self.buffers
        self.index_buffers = IndexBuffers(
            block_table=b.block_table, seeds=self.seeds, seq_lens=b.seq_lens,
            query_start_loc=b.query_start_loc, is_real_req=self.is_real_req,
            positions=b.positions, input_ids=self.input_ids, token_request=self.token_request,
            slot_mapping=b.slot_mapping, is_real_token=self.is_real_token,
            draft_tokens=self.draft_tokens, current_step=self.current_step,
            num_reqs=torch.zeros((), dtype=torch.int64, device=device))
        """Every index buffer, for :meth:`reset_index_buffers` and the one-kernel scatter
        of a pass's inputs."""
        self.staging = HostStaging(HEADER_SIZE + r * (max_blocks + 4) + 3 * t, device)
        """A call's host inputs cross to the device in one copy (see :meth:`eager_pass`);
        persistent: the whole-propose graph's scatter reads its device buffer."""
        self.graphs = (
            CudaGraphManager(options.capture_sizes, device)
            if self.cg_mode == CUDAGraphMode.FULL
            else None
        )
        self.pads_to_buckets = self.graphs is not None or options.pad_to_capture_sizes
        self.counters = StepCounters()
        self.trace: list[tuple[str, int]] | None = None
        """Where set, :meth:`record` appends the propose's events (``("slots", step)``,
        ``("refresh", id(metadata))``, ``("generate", step)``) in the order they run."""
        self.in_capture = False
        """True while graphs are captured: capture runs count no step and trace nothing."""

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """:attr:`in_capture` for the block: what runs in it (a capture's dummy inputs, or
        the capture metadata the eager fused loop builds first) is no step of a call."""
        self.in_capture = True
        try:
            yield
        finally:
            self.in_capture = False

    def bucket_for(self, num_reqs: int) -> int:
        """Smallest capture size that holds ``num_reqs`` requests."""
        fits = [size for size in sorted(self.options.capture_sizes) if size >= num_reqs]
        if not fits:
            raise ValueError(
                f"batch of {num_reqs} requests exceeds the largest capture size "
                f"{self.options.max_num_reqs}"
            )
        return fits[0]

    def _layer_impls(self) -> list[AttentionImpl[Any]]:
        impls: list[AttentionImpl[Any] | None] = [None] * self.model.cfg.num_layers
        scale = self.model.cfg.softmax_scale
        for group in self.groups:
            for i in group.layer_indices:
                impls[i] = group.builder.make_impl(scale)
        missing = [i for i, impl in enumerate(impls) if impl is None]
        if missing:
            raise ValueError(f"layers {missing} belong to no attention group")
        return [impl for impl in impls if impl is not None]

    def _layer_metadata(self, group_metadata: Sequence[Any]) -> list[Any]:
        per_layer: list[Any] = [None] * self.model.cfg.num_layers
        for group, md in zip(self.groups, group_metadata, strict=True):
            for i in group.layer_indices:
                per_layer[i] = md
        return per_layer

    def run_model(self, num_tokens: int, group_metadata: Sequence[Any]) -> torch.Tensor:
        """Final hidden states of the first ``num_tokens`` lanes. Capture-safe."""
        return self.model(
            self.input_ids[:num_tokens], self.buffers.positions[:num_tokens], self.layer_impls,
            self._layer_metadata(group_metadata), self.kv_cache.layers,
        )

    def record(self, event: str, step: int) -> None:
        """Append ``(event, step)`` to :attr:`trace` where one is kept, outside captures."""
        if self.trace is not None and not self.in_capture:
            self.trace.append((event, step))

    def compute_slot_mappings(self, num_tokens: int, step: int) -> None:
        """Capture-safe: slots of the ``num_tokens`` lanes from the persistent positions.
        A pass written by :meth:`write_pass_inputs` needs no call (it writes the pass's
        slots), nor the autoregressive speculator's decode step 1 (its lane preparation
        writes them)."""
        b = self.buffers
        compute_slot_mapping(
            b.positions[:num_tokens],
            self.token_request[:num_tokens],
            b.block_table,
            self.is_real_token[:num_tokens],
            self.block_size,
            out=b.slot_mapping[:num_tokens],
            kernel=self.kernel,
        )
        self.record("slots", step)

    def reset_index_buffers(self) -> None:
        """Zero every index buffer, so no stale index can point out of bounds."""
        self.index_buffers.reset()

    def _copy_request_inputs(self, table: torch.Tensor, seeds: torch.Tensor) -> None:
        """Block-table rows and seeds from staged device views; every other entry stays
        the sink / zero (call after :meth:`reset_index_buffers`)."""
        r, width = table.shape
        self.buffers.block_table[:r, :width].copy_(table)
        self.seeds[:r].copy_(seeds)

    def _write_request_inputs(self, arrays: RequestArrays) -> None:
        """Block-table rows and seeds of the batch, in one host-to-device copy."""
        self._copy_request_inputs(*self.staging.stage([arrays.block_table, arrays.seeds]))

    def write_pass_inputs(
        self, arrays: RequestArrays, rows: Sequence[Sequence[int]],
        extra: Sequence[np.ndarray] = (), uniform_width: int = 0, scatter: bool = True,
    ) -> tuple[np.ndarray, list[torch.Tensor]]:
        """Inputs of a pass over ``rows[r]`` (tokens following request ``r``'s context;
        ``arrays``: the call's validated batch):
        every index buffer reset, then the real tokens' lanes, lengths, block-table rows
        and seeds written, all crossing to the device in one :class:`HostStaging` copy with
        ``extra`` (host arrays the caller needs next) and scattered by one kernel on CUDA
        (:func:`~speccheck.speculator.pass_inputs.scatter_pass_inputs`), which also writes
        the pass's slot mapping (real tokens' slots, the sink for every other lane): it is
        final before any metadata is built, and the trace records it as ``("slots", 0)``;
        for a pass padded over its bucket with ``uniform_width`` tokens per request, also
        its query offsets. ``scatter=False`` stages only: the caller replays a graph that
        begins with the scatter (:func:`~speccheck.speculator.pass_inputs.
        scatter_staged_pass_inputs`). Returns the query offsets and device views of
        ``extra``. Host work."""
        r = arrays.context_lens.shape[0]
        q = row_lengths(rows)
        t = int(q.sum())
        if t > self.max_num_tokens:
            raise ValueError(f"{t} prefill tokens exceed the {self.max_num_tokens} this drafter holds")
        qsl = np.zeros(r + 1, dtype=np.int64)
        qsl[1:] = np.cumsum(q)
        req_of_token = np.repeat(np.arange(r), q)
        ctx = arrays.context_lens
        positions = ctx[req_of_token] + (np.arange(t) - qsl[req_of_token])
        ids = flattened(rows, q)
        staged = stage_pass_inputs(self.staging, arrays.block_table, arrays.seeds, ctx + q,
                                   positions, ids, req_of_token, uniform_width, extra)
        if scatter:
            scatter_pass_inputs(self.index_buffers, staged, self.block_size, kernel=self.kernel)
        self.record("slots", 0)
        return qsl, staged.extra()

    def eager_pass(
        self, arrays: RequestArrays, rows: Sequence[Sequence[int]],
        extra: Sequence[np.ndarray] = (),
    ) -> tuple[torch.Tensor, np.ndarray, list[torch.Tensor]]:
        """Run ``rows`` (see :meth:`write_pass_inputs`) through the model eagerly, writing
        their KV; returns the hidden states, the query offsets and the staged ``extra``.
        The metadata covers exactly the real tokens."""
        qsl, staged_extra = self.write_pass_inputs(arrays, rows, extra)
        t = int(qsl[-1])
        ctx = arrays.context_lens
        common = build_attention_metadata(
            buffers=self.buffers, batch_desc=BatchExecutionDescriptor(CUDAGraphMode.NONE, t),
            num_reqs=ctx.shape[0], query_start_loc_np=qsl, base_seq_lens_np=ctx + np.diff(qsl),
            step=0, max_model_len=self.max_model_len,
        )
        return self.run_model(t, [g.build(common) for g in self.groups]), qsl, staged_extra

    def _validate(self, batch: DraftBatch, extra_positions: int) -> RequestArrays:
        """The batch's host arrays for this call, or ``ValueError`` (see
        :meth:`~speccheck.speculator.batch.DraftBatch.validate`)."""
        return batch.validate(
            max_model_len=self.max_model_len, block_size=self.block_size,
            num_blocks=self.kv_cache.num_blocks, extra_positions=extra_positions,
            max_num_reqs=self.max_num_reqs,
        )
