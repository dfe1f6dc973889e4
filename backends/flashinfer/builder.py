"""FlashInfer's paged decode and prefill wrappers in CUDA-graph mode: builder and impl.

How the wrappers behave, and what this adapter does about it:

- ``plan()`` is host work. It copies the page-table arrays (``indptr``, ``indices``,
  ``last_page_len``) into the wrapper's fixed device buffers, runs FlashInfer's scheduler
  on the CPU and uploads the plan into the wrapper's own int workspace. It cannot be
  captured, so the metadata cannot be refreshed inside a graph between draft steps:
  :meth:`FlashInferMetadataBuilder.update_draft_decode_metadata` keeps the protocol's
  ``NotImplementedError`` (the matrix declares the capability unsupported and the
  speculator falls back to per-step rebuilds). The ``host_preplanned`` strategy is offered
  by :meth:`FlashInferMetadataBuilder.plan_draft_steps`: one wrapper per draft step, every
  one planned on the host before a single replay. Knowing every step at once, it plans
  them together: one host computation of the page tables, one copy of their lengths, one
  launch for their page indices (inside the preplanned graph:
  :meth:`FlashInferMetadataBuilder.finish_draft_step_plans`), and FlashInfer's decode
  scheduler alone (the C++ call that its ``fast_decode_plan``, the re-plan for multi-step
  drafting, ends in) for every plan after a wrapper's first. A replay re-plans through
  :meth:`FlashInferMetadataBuilder.replan_draft_steps`: the same plans from the host
  lengths alone, with no metadata made for the captured body that will not read it.
- A plan makes no device-to-host copy and no stream synchronisation, so planning ahead can
  overlap the GPU's work. FlashInfer reads ``indptr`` and ``last_page_len`` on the host
  (it calls ``.to("cpu")`` on them), so they are computed there, from the host-tracked
  lengths, staged in pinned buffers of the wrapper and handed over as host tensors, with
  the KV lengths themselves (its copies into the fixed buffers are then truly
  asynchronous; the prefill plan's copy of KV lengths it derived itself, from pageable
  memory, may wait for the device). ``indices`` are block-table
  entries, which live on the device: the plan is given the used head of the wrapper's own
  indices buffer (its copy onto itself is a no-op, and nothing on the host reads it), and
  :func:`~speccheck.backends.flashinfer.page_indices.write_paged_kv_indices` then gathers
  the indices into that buffer on the device from the block table and the indptr buffer
  the plan has just filled, zeroing the buffer's tail.
- FlashInfer's plan writes its schedule into page-locked host memory owned by the wrapper
  and uploads it with an asynchronous copy; so do the staged ``indptr`` and
  ``last_page_len``. Re-planning a wrapper before that copy has run would overwrite what
  it is about to read (the host no longer waits for the GPU elsewhere in a plan). Each
  wrapper therefore records an event after its plan, and its next plan waits on that
  event only: it has long completed when each wrapper is planned once per replay
  (``plan_draft_steps``), and it keeps the host at most one plan ahead on a wrapper that
  is re-planned every step (the per-step path).
- FlashInfer attends to exactly the planned lengths, never to the device ``seq_lens``.
  They come from ``CommonAttentionMetadata.seq_lens_cpu_upper_bound``, which is exact for
  every live batch this builder plans: ``build_attention_metadata`` computes it from the
  same base lengths, step and ``max_model_len`` clamp as the device ``seq_lens`` the
  speculator writes (the prefill pass, each decode step of the per-step and preplanned
  paths, DFlash blocks; zero for padding lanes). It lags the device lengths in the fused
  loop after step 1 (this backend has no fused loop: no in-graph refresh), and the DFlash
  drafter's capture plans with 0 where the device holds the block length: that plan
  serves only the dummy capture inputs and is replaced before every replay (a graph-mode
  plan fixes the grid and the split-KV mode from the batch size and row bound, not from
  the lengths).
- A wrapper constructed with ``use_cuda_graph=True`` freezes its batch size (the length of
  its ``last_page_len`` buffer), so wrappers are created lazily, one decode/prefill pair per
  padded batch size (and one decode wrapper per draft step for
  :meth:`~FlashInferMetadataBuilder.plan_draft_steps`, their fixed buffers rows of shared
  ones), each with its own fixed index buffers, and cached. All of them share one 128 MiB float
  workspace, which is safe because their kernels run one after another on one stream.
- The graph-mode prefill wrapper also freezes the largest query-row count at its first
  plan; each new prefill wrapper is therefore planned once with the largest row count the
  builder can see (``BuilderLimits.max_num_tokens``) before its first real plan.
- The decode wrapper serves uniform single-token batches (``max_query_len == 1`` and one
  token per request); everything else goes through the paged prefill wrapper, planned with
  the metadata's ``query_start_loc_cpu[:num_reqs + 1]`` and run on exactly
  ``query[:num_actual_tokens]``, except a FULL-mode pass padded to its bucket, whose
  padding requests own no row: it runs on the real requests' rows
  (``FlashInferMetadata.num_attended_tokens``), as its replays do. Any other mismatch is
  *not* repaired: FlashInfer raises its own ``q.shape[0] (…) does not match
  qo_indptr[-1] (…)``, which is how a wrong attention token count under data parallelism
  (seed 004) shows up.

KV layout ``NHD``; the cache is passed as the pair ``(key_cache, value_cache)``, each
``[num_blocks, block_size, num_kv_heads, head_size]`` with ``page_size = block_size``.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MethodType, ModuleType
from typing import Any, ClassVar, cast

import numpy as np
import torch

from speccheck.backends.availability import require_module
from speccheck.backends.batch_layout import padding_tokens
from speccheck.backends.flashinfer.page_indices import (
    PagedKVLengths,
    paged_kv_lengths,
    stage_paged_kv_lengths,
    write_paged_kv_indices,
)
from speccheck.backends.kv_cache_write import write_kv_cache
from speccheck.contract.builder import (
    AttentionImpl,
    AttentionMetadataBuilder,
)
from speccheck.contract.metadata import CommonAttentionMetadata
from speccheck.contract.stream_events import cuda_device_index, record_on_current_stream

FLASHINFER_IMPORT_NAME = "flashinfer"
FLASHINFER_PACKAGE = "flashinfer-python"
FLASHINFER_INSTALL_HINT = (
    "pip install 'speccheck[flashinfer]' (flashinfer-python with apache-tvm-ffi, CUDA; "
    "kernels are JIT-built with nvcc on first use)"
)

WORKSPACE_BYTES = 128 * 1024 * 1024

logger = logging.getLogger(__name__)


def flashinfer_module() -> ModuleType:
    """The ``flashinfer`` module, or :class:`BackendUnavailable` with the install hint.
    Imported lazily: this module must import on machines without the package."""
    return require_module(FLASHINFER_IMPORT_NAME, FLASHINFER_PACKAGE, FLASHINFER_INSTALL_HINT)


class WrapperKind(enum.StrEnum):
    """Which FlashInfer wrapper serves a batch (:func:`wrapper_kind`); its value names the
    wrapper's persistent buffers (:func:`wrapper_buffer_name`)."""

    DECODE = "decode"
    """``BatchDecodeWithPagedKVCacheWrapper``: one query token per request."""
    PREFILL = "prefill"
    """``BatchPrefillWithPagedKVCacheWrapper``: every other layout."""


@dataclass
class _GraphWrapper:
    """One CUDA-graph-mode wrapper, the fixed device buffers it was constructed with, and
    the pinned host buffers its plans are staged in."""

    kind: WrapperKind
    wrapper: Any
    paged_kv_indptr: torch.Tensor
    paged_kv_indices: torch.Tensor
    paged_kv_last_page_len: torch.Tensor
    qo_indptr: torch.Tensor | None
    staged: dict[str, torch.Tensor]
    """Pinned host copies of the plan inputs handed to ``plan()`` (``paged_kv_indptr``,
    ``paged_kv_last_page_len``, the KV lengths ``seq_lens`` and, for prefill,
    ``qo_indptr``); overwritten by each plan."""
    uploaded: torch.cuda.Event
    """Recorded after each plan: once it has completed, the plan's asynchronous uploads
    from the staged buffers and FlashInfer's page-locked workspace have run."""


@dataclass(frozen=True)
class _DecodeScheduler:
    """FlashInfer's CUDA-core decode scheduler of one graph-mode decode wrapper, called
    directly: the C++ ``plan`` that both ``plan()`` and ``fast_decode_plan`` end in, given
    the host ``indptr`` (the page counts) and every other argument as the wrapper's first
    ``plan()`` fixed it. It writes the schedule into the wrapper's page-locked workspace,
    queues its upload into the wrapper's int workspace and sets the wrapper's plan info;
    what else a plan sets (heads, dtypes, scale, window, the frozen batch size) is the same
    for every draft step of the wrapper, so is left as the first plan set it.

    This reaches into FlashInfer's wrapper state (what ``fast_decode_plan`` itself does):
    :meth:`of` takes a wrapper only when it has that state and runs the CUDA-core module."""

    wrapper: Any
    arguments: tuple[Any, ...]
    """The scheduler's arguments after ``batch_size``: heads, page size, graph mode,
    window, soft cap, head dims and the dtype carriers."""

    @classmethod
    def of(cls, wrapper: Any, layer: Any) -> _DecodeScheduler | None:
        """The scheduler of ``wrapper`` after its first ``plan()``, or ``None`` where the
        wrapper does not run FlashInfer's CUDA-core decode module through its plan state
        (tensor cores, cuDNN, another release's layout): its draft steps then re-plan
        through ``plan()``."""
        state = ("_cached_module", "_float_workspace_buffer", "_int_workspace_buffer",
                 "_pin_memory_int_workspace_buffer", "_window_left", "_logits_soft_cap")
        if (
            wrapper.use_tensor_cores
            or getattr(wrapper, "resolved_backend", None) != "fa2"
            or not all(hasattr(wrapper, name) for name in state)
            or not wrapper.is_cuda_graph_enabled
        ):
            return None
        carriers = tuple(torch.empty(0, dtype=layer.dtype) for _ in range(2))
        return cls(wrapper, (
            layer.num_heads, layer.num_kv_heads, layer.block_size, True,
            wrapper._window_left, wrapper._logits_soft_cap, layer.head_size, layer.head_size,
            *carriers,
        ))

    def __call__(self, indptr_host: torch.Tensor, batch_size: int) -> None:
        """Re-plan the wrapper for the pinned host ``indptr`` of ``batch_size`` requests."""
        w = self.wrapper
        w._plan_info = w._cached_module.plan(
            w._float_workspace_buffer, w._int_workspace_buffer,
            w._pin_memory_int_workspace_buffer, indptr_host, batch_size, *self.arguments,
        )


@dataclass
class _DraftStepWrappers:
    """The decode wrappers of the draft steps of one preplanned replay over ``batch_size``
    lanes, one per step, planned together. Their fixed buffers are rows of shared
    persistent buffers: ``lengths[step]`` holds step ``step``'s ``indptr``
    (``batch_size + 1`` entries) then its ``last_page_len`` (``batch_size``), and
    ``indices[step]`` its page indices; so one host-to-device copy from the pinned
    ``staged`` rows fills every step's lengths, and one launch every step's indices. The
    per-step views are made once, here: a view costs microseconds of host time."""

    batch_size: int
    lengths: torch.Tensor
    """``[steps, 2 * batch_size + 1]`` int32, device."""
    indices: torch.Tensor
    """``[steps, batch_size * max_blocks_per_req]`` int32, device."""
    staged: torch.Tensor
    """``[steps, 2 * batch_size + 1]`` int32, pinned host: the lengths of the last plan."""
    uploaded: torch.cuda.Event
    """Recorded after each planning of the set (see :class:`_GraphWrapper`'s)."""
    wrappers: list[Any] = field(default_factory=list)
    schedulers: list[_DecodeScheduler] | None = None
    """Each wrapper's scheduler, once every wrapper has had its first plan through
    ``plan()`` (which fixes what a re-plan reuses: the kernel module, the frozen shape);
    ``None`` before, or where a wrapper has no scheduler to call (:meth:`_DecodeScheduler.
    of`): every plan then goes through ``plan()``."""
    planned: bool = False
    """Whether every wrapper has had its first plan."""

    block_table: torch.Tensor | None = None
    """The block table the last plan was made for (a view of the speculator's persistent
    one), which :meth:`FlashInferMetadataBuilder.finish_draft_step_plans` gathers from."""
    staged_rows: np.ndarray = field(init=False)
    """``staged`` as a NumPy array (the same page-locked memory)."""
    indptr_views: list[torch.Tensor] = field(init=False)
    """Each step's device ``indptr``: the buffer its wrapper is built over."""
    last_page_len_views: list[torch.Tensor] = field(init=False)
    """Each step's device ``last_page_len``: the buffer its wrapper is built over."""
    index_rows: list[torch.Tensor] = field(init=False)
    """Each step's device indices buffer (a row of ``indices``)."""
    indptr_rows: torch.Tensor = field(init=False)
    """Every step's device ``indptr``, ``[steps, batch_size + 1]`` (a view of ``lengths``)."""
    staged_indptr: list[torch.Tensor] = field(init=False)
    """Each step's pinned host ``indptr``: what its plans are given."""
    staged_last_page_len: list[torch.Tensor] = field(init=False)
    """Each step's pinned host ``last_page_len``."""

    def __post_init__(self) -> None:
        n = self.batch_size
        self.staged_rows = self.staged.numpy()
        self.index_rows = list(self.indices)
        self.indptr_rows = self.lengths[:, : n + 1]
        self.indptr_views = list(self.indptr_rows)
        self.last_page_len_views = list(self.lengths[:, n + 1 :])
        self.staged_indptr = list(self.staged[:, : n + 1])
        self.staged_last_page_len = list(self.staged[:, n + 1 :])


@dataclass
class FlashInferMetadata:
    """Metadata of one FlashInfer attention call: the planned wrapper, the views of its
    fixed page-table buffers (the step-dependent plan inputs), and views of the
    speculator's persistent input buffers."""

    run: Callable[..., Any] | None = field(repr=False, compare=False)
    """``run`` of the planned ``BatchDecodeWithPagedKVCacheWrapper`` or
    ``BatchPrefillWithPagedKVCacheWrapper``, bound to it (``None`` for an empty batch).

    A bound method on purpose: the verifier's state walk does not descend into methods, so
    it sees this adapter's plan inputs below and not FlashInfer's private state (the plan in
    the wrapper's int workspace, its host mirrors), which is a function of those inputs.
    """
    use_decode: bool
    paged_kv_indptr: torch.Tensor
    """``[num_reqs + 1]`` int32: the wrapper's fixed indptr buffer."""
    paged_kv_indices: torch.Tensor
    """``[num_pages]`` int32: the used head of the wrapper's fixed indices buffer, written
    on the device from the block table; the rest of that buffer is zero."""
    paged_kv_last_page_len: torch.Tensor
    """``[num_reqs]`` int32: the wrapper's fixed last-page-length buffer."""
    qo_indptr: torch.Tensor | None
    """``[num_reqs + 1]`` int32: the prefill wrapper's fixed query indptr (``None`` for
    decode)."""
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    """View of the speculator's persistent block table (``[num_reqs, max_blocks]``): what
    the page indices are gathered from."""
    num_actual_tokens: int
    num_attended_tokens: int
    """Query rows the wrapper runs on: ``num_actual_tokens``, but for a pass padded to its
    bucket in FULL mode (padding requests, owning no token) planned with the real query
    offsets, the rows the real requests own. A replay's kernels, launched for every row at
    capture, skip the rows the plan gives no request; an eager run leaves them zero too."""
    num_reqs: int
    causal: bool
    sm_scale: float
    """Softmax scale the wrapper was planned with (FlashInfer takes it at plan time)."""
    draft_step: int | None = None
    """Draft step this metadata was pre-planned for by ``plan_draft_steps``."""

    @property
    def wrapper(self) -> Any:
        """The planned wrapper itself (``None`` for an empty batch)."""
        return None if self.run is None else cast(MethodType, self.run).__self__


class FlashInferAttentionImpl(AttentionImpl[FlashInferMetadata]):
    """Writes the new keys/values of ``num_actual_tokens`` tokens with
    :func:`write_kv_cache`, then ``wrapper.run`` on exactly ``query[:num_attended_tokens]``
    into ``output``.

    The decode wrapper runs one row per request, a padded pass's padding requests (no KV)
    included, and its rows for them were found written non-zero on an H100 (``verify``'s
    ``padding_rows``: one row per layer, in a few examples of fifty, eager and replayed
    alike): the rows past ``query_start_loc[num_reqs]`` are put back to the zeros they
    arrived with. Capture-safe: a mask from the device offsets, written in place."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: FlashInferMetadata,
        output: torch.Tensor,
    ) -> None:
        flashinfer_module()
        if not _same_scale(metadata.sm_scale, self.scale):
            raise ValueError(
                f"flashinfer: the wrapper was planned with sm_scale={metadata.sm_scale} but "
                f"this layer's scale is {self.scale}; create impls with builder.make_impl(scale) "
                "before building metadata, so plan() gets the layer's scale"
            )
        n = metadata.num_actual_tokens
        write_kv_cache(key[:n], value[:n], key_cache, value_cache, metadata.slot_mapping)
        rows = metadata.num_attended_tokens
        if rows == 0 or metadata.run is None:
            return  # no request to attend: padding rows arrive zero
        attended = output[:rows]
        metadata.run(query[:rows], (key_cache, value_cache), out=attended)
        if metadata.use_decode:
            padding = padding_tokens(metadata.query_start_loc, rows)
            attended.masked_fill_(padding.view(-1, *[1] * (attended.dim() - 1)), 0)


def wrapper_buffer_name(kind: WrapperKind, batch_size: int, field: str) -> str:
    """The persistent-buffer name of a graph-mode wrapper's fixed buffer ``field``
    (``KIND[bs=N].FIELD``)."""
    return f"{kind}[bs={batch_size}].{field}"


def _same_scale(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(abs(a), abs(b))


def _is_decode(common: CommonAttentionMetadata) -> bool:
    """Whether the decode wrapper serves the batch: one query token per request."""
    return common.max_query_len == 1 and common.num_actual_tokens == common.num_reqs


def wrapper_kind(use_decode: bool) -> WrapperKind:
    """The wrapper of a batch the decode wrapper does (``use_decode``) or does not serve."""
    return WrapperKind.DECODE if use_decode else WrapperKind.PREFILL


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _check_capacity(num_pages: int, capacity: int) -> None:
    if num_pages > capacity:
        raise ValueError(
            f"flashinfer: the batch needs {num_pages} pages but the wrapper's indices "
            f"buffer holds {capacity}"
        )


def _wait_for_upload(uploaded: torch.cuda.Event) -> None:
    """Block until the uploads of a wrapper's last plan have run (see the module
    docstring); they almost always have."""
    if not uploaded.query():
        logger.debug("flashinfer: re-planning a wrapper whose last plan is still queued")
        uploaded.synchronize()


class FlashInferMetadataBuilder(AttentionMetadataBuilder[FlashInferMetadata]):
    """Refresh strategy ``host_preplanned`` (see :meth:`plan_draft_steps`); in-graph refresh
    is impossible because ``plan()`` runs on the host.

    Constraints on the layer and config (fp16/bf16 only, KV cache in the activation dtype,
    platform) are enforced from the ``flashinfer`` matrix entry before construction;
    :meth:`setup` checks only that the package and a CUDA device are there."""

    backend_name = "flashinfer"
    impl_cls = FlashInferAttentionImpl

    workspace_bytes: ClassVar[int] = WORKSPACE_BYTES
    kv_layout: ClassVar[str] = "NHD"
    split_kv: ClassVar[bool] = True
    """Whether FlashInfer's scheduler may split a request's KV over several CTAs (its
    default, chosen per plan from the lengths); every plan passes
    ``disable_split_kv=not split_kv``."""
    decode_tensor_cores: ClassVar[bool] = False
    """The decode wrapper's ``use_tensor_cores``: FlashInfer's FA2 prefill kernels with one
    query row per lane, instead of its CUDA-core decode kernels."""
    kernel_backend: ClassVar[str] = "fa2"
    """The wrappers' ``backend``: FlashInfer's FA2 kernels on every GPU. What goes through
    the prefill wrapper here is a drafter's first pass (or a DFlash block): a few query
    rows per request. FlashInfer's ``"auto"`` picks its SM90 (FA3) prefill on Hopper,
    which gives every request and query head a 128-row tile of its own, and whose host
    scheduler, a heap over the SMs fed one work item per request and head, is most of a
    plan's host time at larger batches (run 59, batch 64: FA3's first pass 293 us of GPU
    time and 488 us to plan, FA2's 226 us and 355 us; the draft tokens identical); FA2
    packs the query heads of a KV head into one tile."""

    def setup(self) -> None:
        layer, device = self.layer, self.device
        self._flashinfer = flashinfer_module()
        if torch.device(device).type != "cuda":
            raise ValueError(f"flashinfer backend runs on CUDA devices only, got device={device}")
        self.sm_scale: float = layer.head_size**-0.5
        """Softmax scale planned into every wrapper; :meth:`make_impl` records the layer's."""
        self._device_index = cuda_device_index(device)
        # "Must be initialized to 0 for its first use" (FlashInfer); shared by all wrappers.
        self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
        self._wrappers: dict[tuple[WrapperKind, int], _GraphWrapper] = {}
        self._draft_steps: dict[tuple[int, int], _DraftStepWrappers] = {}

    def make_impl(self, scale: float) -> AttentionImpl[FlashInferMetadata]:
        self.sm_scale = float(scale)
        return super().make_impl(scale)

    # -- wrappers -----------------------------------------------------------------------

    def _wrapper(self, kind: WrapperKind, batch_size: int) -> _GraphWrapper:
        key = (kind, batch_size)
        cached = self._wrappers.get(key)
        if cached is None:
            cached = self._new_wrapper(kind, batch_size)
            self._wrappers[key] = cached
        return cached

    def _new_wrapper(self, kind: WrapperKind, batch_size: int) -> _GraphWrapper:
        """A graph-mode wrapper over index buffers of its own, allocated as persistent
        buffers (named by :func:`wrapper_buffer_name`), with pinned host buffers to stage its
        plans in."""
        logger.debug("flashinfer: new graph-mode wrapper %s[bs=%d]", kind, batch_size)

        def buffer(field: str, size: int) -> torch.Tensor:
            return self.allocate_persistent(
                wrapper_buffer_name(kind, batch_size, field), (size,), torch.int32)

        def pinned(size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.int32, pin_memory=True)

        indptr = buffer("paged_kv_indptr", batch_size + 1)
        indices = buffer("paged_kv_indices", self._indices_capacity(batch_size))
        last_page_len = buffer("paged_kv_last_page_len", batch_size)
        staged = {
            "paged_kv_indptr": pinned(batch_size + 1),
            "paged_kv_last_page_len": pinned(batch_size),
            "seq_lens": pinned(batch_size),
        }
        if kind is WrapperKind.DECODE:
            wrapper = self._decode_wrapper(indptr, indices, last_page_len)
            return _GraphWrapper(
                kind, wrapper, indptr, indices, last_page_len, None, staged, torch.cuda.Event()
            )
        qo_indptr = buffer("qo_indptr", batch_size + 1)
        staged["qo_indptr"] = pinned(batch_size + 1)
        wrapper = self._prefill_wrapper(qo_indptr, indptr, indices, last_page_len)
        created = _GraphWrapper(
            kind, wrapper, indptr, indices, last_page_len, qo_indptr, staged, torch.cuda.Event()
        )
        self._prime_prefill(created, batch_size)
        return created

    def _indices_capacity(self, batch_size: int) -> int:
        """The largest page count a wrapper can ever see: every request at max_model_len."""
        return batch_size * self.layer.max_blocks_per_req

    def _decode_wrapper(
        self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor
    ) -> Any:
        """A graph-mode decode wrapper over the given fixed buffers (one query token per
        request; :attr:`decode_tensor_cores`, :attr:`kernel_backend`)."""
        return self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace,
            kv_layout=self.kv_layout,
            use_cuda_graph=True,
            use_tensor_cores=self.decode_tensor_cores,
            paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last_page_len,
            backend=self.kernel_backend,
        )

    def _prefill_wrapper(
        self,
        qo_indptr: torch.Tensor,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
    ) -> Any:
        """A graph-mode paged prefill wrapper over the given fixed buffers, on
        :attr:`kernel_backend`."""
        return self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace,
            kv_layout=self.kv_layout,
            use_cuda_graph=True,
            qo_indptr_buf=qo_indptr,
            paged_kv_indptr_buf=indptr,
            paged_kv_indices_buf=indices,
            paged_kv_last_page_len_buf=last_page_len,
            backend=self.kernel_backend,
        )

    def _draft_step_wrappers(self, batch_size: int, steps: int) -> _DraftStepWrappers:
        """The draft-step decode wrappers of ``steps`` steps over ``batch_size`` lanes, with
        their shared persistent buffers (``draft[bs=N,steps=S].lengths`` and
        ``.paged_kv_indices``); created on first use and cached."""
        key = (batch_size, steps)
        cached = self._draft_steps.get(key)
        if cached is not None:
            return cached
        prefix = f"draft[bs={batch_size},steps={steps}]"
        logger.debug("flashinfer: new draft-step wrappers %s", prefix)
        width = 2 * batch_size + 1
        lengths = self.allocate_persistent(f"{prefix}.lengths", (steps, width), torch.int32)
        indices = self.allocate_persistent(
            f"{prefix}.paged_kv_indices", (steps, self._indices_capacity(batch_size)), torch.int32
        )
        staged = torch.zeros((steps, width), dtype=torch.int32, pin_memory=True)
        created = _DraftStepWrappers(batch_size, lengths, indices, staged, torch.cuda.Event())
        created.wrappers.extend(
            self._decode_wrapper(indptr, row, last_page_len)
            for indptr, row, last_page_len in zip(
                created.indptr_views, created.index_rows, created.last_page_len_views,
                strict=True,
            )
        )
        self._draft_steps[key] = created
        return created

    def _prime_prefill(self, graph_wrapper: _GraphWrapper, batch_size: int) -> None:
        """Plan a new graph-mode prefill wrapper once with the largest row count it will
        ever serve: FlashInfer freezes the row bound (and sizes the captured grid from it)
        at the first plan, and rejects later plans with more rows. Only the plan matters
        here, so the indices buffer is left as it is (the next real plan rewrites it)."""
        rows = max(self.limits.max_num_tokens, batch_size)
        qo_lens = np.full(batch_size, rows // batch_size, dtype=np.int64)
        qo_lens[: rows % batch_size] += 1
        qo_indptr = np.zeros(batch_size + 1, dtype=np.int32)
        np.cumsum(qo_lens, out=qo_indptr[1:])
        kv_lens = np.minimum(np.maximum(qo_lens, 1), self.layer.max_model_len)
        lengths = paged_kv_lengths(kv_lens, self.layer.block_size, self.layer.max_blocks_per_req)
        self._upload_plan(
            graph_wrapper, torch.from_numpy(kv_lens.astype(np.int32)), lengths,
            torch.from_numpy(qo_indptr), causal=True,
        )

    def _upload_plan(
        self,
        graph_wrapper: _GraphWrapper,
        seq_lens: torch.Tensor,
        lengths: PagedKVLengths,
        qo_indptr: torch.Tensor | None,
        *,
        causal: bool,
    ) -> None:
        """``plan()`` the wrapper from host KV lengths ``seq_lens`` (int32) and their page
        table ``lengths`` (and, for prefill, the host query offsets ``qo_indptr``), without
        reading anything back from the device.

        Waits for the wrapper's previous plan to have been uploaded (see the module
        docstring), stages the host arrays in the wrapper's pinned buffers and plans with
        the used head of its own indices buffer as ``indices``. The KV lengths are handed
        over too: FlashInfer would otherwise derive them into a fresh pageable tensor, and
        the prefill plan's copy from that one may wait for the device. Leaves the
        indices buffer to the caller: FlashInfer's scheduler does not read it, and its
        kernels read it only when they run."""
        num_pages = lengths.num_pages
        _check_capacity(num_pages, graph_wrapper.paged_kv_indices.shape[0])
        _wait_for_upload(graph_wrapper.uploaded)
        staged = graph_wrapper.staged
        staged["paged_kv_indptr"].copy_(lengths.indptr)
        staged["paged_kv_last_page_len"].copy_(lengths.last_page_len)
        staged["seq_lens"].copy_(seq_lens)
        indices = graph_wrapper.paged_kv_indices[:num_pages]
        layer = self.layer
        shape = (layer.num_heads, layer.num_kv_heads, layer.head_size, layer.block_size)
        if graph_wrapper.kind is WrapperKind.DECODE:
            graph_wrapper.wrapper.plan(
                staged["paged_kv_indptr"],
                indices,
                staged["paged_kv_last_page_len"],
                *shape,
                q_data_type=layer.dtype,
                kv_data_type=layer.dtype,
                sm_scale=self.sm_scale,
                seq_lens=staged["seq_lens"],
                disable_split_kv=not self.split_kv,
            )
        else:
            if qo_indptr is None:
                raise ValueError("flashinfer: a prefill plan needs the query offsets")
            staged["qo_indptr"].copy_(qo_indptr)
            graph_wrapper.wrapper.plan(
                staged["qo_indptr"],
                staged["paged_kv_indptr"],
                indices,
                staged["paged_kv_last_page_len"],
                *shape,
                causal=causal,
                sm_scale=self.sm_scale,
                q_data_type=layer.dtype,
                kv_data_type=layer.dtype,
                seq_lens=staged["seq_lens"],
                disable_split_kv=not self.split_kv,
            )
        record_on_current_stream(graph_wrapper.uploaded, self._device_index)

    # -- protocol -----------------------------------------------------------------------

    def build(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        num_reqs = common.num_reqs
        self._check_batch_size(num_reqs)
        if num_reqs == 0:
            return self._empty_metadata(common, draft_step=None)
        # Host work from host lengths only; the indices are gathered on the device.
        seq_lens = common.seq_lens_cpu_upper_bound[:num_reqs]
        lengths = paged_kv_lengths(seq_lens, self.layer.block_size, common.block_table.shape[1])
        use_decode = _is_decode(common)
        graph_wrapper = self._wrapper(wrapper_kind(use_decode), num_reqs)
        qo_indptr = None if use_decode else common.query_start_loc_cpu[: num_reqs + 1]
        self._upload_plan(graph_wrapper, seq_lens, lengths, qo_indptr, causal=common.causal)
        rows = common.num_actual_tokens
        if qo_indptr is not None and common.num_real_reqs < num_reqs:
            rows = int(qo_indptr[-1])  # a padded pass: its padding requests own no row
        # The plan has queued the copy of indptr into the fixed buffer the kernel reads.
        write_paged_kv_indices(
            graph_wrapper.paged_kv_indices,
            common.block_table,
            graph_wrapper.paged_kv_indptr,
            num_reqs,
        )
        return self._metadata(
            common,
            graph_wrapper.wrapper.run,
            use_decode=use_decode,
            paged_kv_indptr=graph_wrapper.paged_kv_indptr,
            paged_kv_indices=graph_wrapper.paged_kv_indices[: lengths.num_pages],
            paged_kv_last_page_len=graph_wrapper.paged_kv_last_page_len,
            qo_indptr=graph_wrapper.qo_indptr,
            draft_step=None,
            num_attended_tokens=rows,
        )

    def plan_draft_steps(
        self, common_per_step: Sequence[CommonAttentionMetadata]
    ) -> list[FlashInferMetadata]:
        """The ``host_preplanned`` strategy: plan one decode wrapper per draft step, all
        before a single replay of the fused graph.

        ``common_per_step[i]`` describes draft step ``i`` (its lengths known ahead: each
        step adds one token per request; one query token per request, one block table for
        all). Step ``i`` gets its own wrapper and fixed buffers (cached per batch size and
        step count), so planning step ``i + 1`` never overwrites what step ``i``'s captured
        kernels read. Capture the preplanned body (:meth:`finish_draft_step_plans` first,
        then the steps) with the metadata this returns; before every replay, plan the live
        batch's lengths with :meth:`replan_draft_steps`, the same plans without metadata.

        The steps are planned together, which is cheaper on the host than as many builds:
        their page tables are computed in one host call and copied to the device in one
        transfer, and their page indices are left to :meth:`finish_draft_step_plans`, one
        launch inside the preplanned graph; and once a wrapper has been planned through
        ``plan()``, a re-plan is FlashInfer's scheduler alone (:class:`_DecodeScheduler`: on
        the host page counts, nothing copied, the buffers already filled). :meth:`build`,
        which the per-step path and the verifier's eager oracle use, always plans through
        ``plan()``.
        """
        if not common_per_step:
            return []
        sizes = {c.num_reqs for c in common_per_step}
        if len(sizes) != 1:
            raise ValueError(
                f"plan_draft_steps: every draft step of one replay must have the same padded "
                f"batch size, got num_reqs={[c.num_reqs for c in common_per_step]}"
            )
        (num_reqs,) = sizes
        self._check_batch_size(num_reqs)
        if num_reqs == 0:
            return [self._empty_metadata(c, draft_step=i) for i, c in enumerate(common_per_step)]
        block_table = common_per_step[0].block_table
        for step, common in enumerate(common_per_step):
            if not _is_decode(common):
                raise ValueError(
                    f"plan_draft_steps plans decode steps (one query token per request), but "
                    f"step {step} has max_query_len={common.max_query_len} over "
                    f"{common.num_actual_tokens} tokens for {num_reqs} requests"
                )
            if common.block_table is not block_table and not _same_view(
                common.block_table, block_table
            ):
                raise ValueError(
                    f"plan_draft_steps: step {step} reads another block table than step 0 "
                    "(the draft steps of one replay share one)"
                )
        group = self._draft_step_wrappers(num_reqs, len(common_per_step))
        group.block_table = block_table
        pages = self._plan_step_lengths(group, block_table, np.stack(
            [c.seq_lens_cpu_upper_bound.numpy()[:num_reqs] for c in common_per_step]
        ))
        return [
            self._metadata(
                common,
                group.wrappers[step].run,
                use_decode=True,
                paged_kv_indptr=group.indptr_views[step],
                paged_kv_indices=group.index_rows[step][:num_pages],
                paged_kv_last_page_len=group.last_page_len_views[step],
                qo_indptr=None,
                draft_step=step,
            )
            for step, (common, num_pages) in enumerate(zip(common_per_step, pages, strict=True))
        ]

    def replan_draft_steps(
        self, metadata_per_step: Sequence[FlashInferMetadata], seq_lens_per_step: np.ndarray
    ) -> None:
        """:meth:`plan_draft_steps`'s plans again for new host lengths, for a replay of the
        body captured with ``metadata_per_step``: the staging, the one lengths copy and the
        schedulers, nothing else (the protocol's contract)."""
        if not metadata_per_step or metadata_per_step[0].num_reqs == 0:
            return
        self._plan_step_lengths(*self._planned_draft_steps(metadata_per_step), seq_lens_per_step)

    def _plan_step_lengths(
        self, group: _DraftStepWrappers, block_table: torch.Tensor, seq_lens: np.ndarray
    ) -> list[int]:
        """Plan ``group``'s wrappers for the host lengths ``seq_lens`` (``[steps,
        batch_size]``) over ``block_table``: stage their page tables, queue the one copy
        into the fixed buffers, re-plan each wrapper. Returns each step's page count."""
        _wait_for_upload(group.uploaded)
        pages = stage_paged_kv_lengths(
            seq_lens, self.layer.block_size, block_table.shape[1], group.staged_rows
        )
        _check_capacity(max(pages), group.indices.shape[1])
        group.lengths.copy_(group.staged, non_blocking=True)
        if group.schedulers is not None:
            for schedule, step_indptr in zip(group.schedulers, group.staged_indptr, strict=True):
                schedule(step_indptr, group.batch_size)
        else:
            self._plan_draft_steps_in_full(group, pages)
        record_on_current_stream(group.uploaded, self._device_index)
        return pages

    def _planned_draft_steps(
        self, metadata_per_step: Sequence[FlashInferMetadata]
    ) -> tuple[_DraftStepWrappers, torch.Tensor]:
        """The wrappers :meth:`plan_draft_steps` planned ``metadata_per_step`` on, and the
        block table it planned them over."""
        group = self._draft_steps.get((metadata_per_step[0].num_reqs, len(metadata_per_step)))
        if group is None or group.block_table is None:
            raise ValueError("flashinfer: plan_draft_steps has not planned these draft steps")
        return group, group.block_table

    def finish_draft_step_plans(self, metadata_per_step: Sequence[FlashInferMetadata]) -> None:
        """Gather every draft step's page indices into its wrapper's indices buffer, in one
        launch, from the block table and the ``indptr`` rows :meth:`plan_draft_steps`
        copied to the device, zeroing each buffer's tail. Capture-safe: the preplanned body
        runs it first, inside its graph, so a replay gathers from the lengths planned for
        it (the host spends no launch on it)."""
        if not metadata_per_step or metadata_per_step[0].num_reqs == 0:
            return
        group, block_table = self._planned_draft_steps(metadata_per_step)
        write_paged_kv_indices(group.indices, block_table, group.indptr_rows, group.batch_size)

    def _plan_draft_steps_in_full(self, group: _DraftStepWrappers, pages: Sequence[int]) -> None:
        """Plan every draft step's wrapper through ``plan()`` from the lengths staged in
        ``group`` (their copy into its fixed buffers already queued); after the first time,
        take each wrapper's scheduler for the later plans where there is one."""
        layer = self.layer
        shape = (layer.num_heads, layer.num_kv_heads, layer.head_size, layer.block_size)
        for step, (wrapper, num_pages) in enumerate(zip(group.wrappers, pages, strict=True)):
            wrapper.plan(
                group.staged_indptr[step],
                group.index_rows[step][:num_pages],
                group.staged_last_page_len[step],
                *shape,
                q_data_type=layer.dtype,
                kv_data_type=layer.dtype,
                sm_scale=self.sm_scale,
                disable_split_kv=not self.split_kv,
            )
        if not group.planned:
            group.planned = True
            schedulers = [_DecodeScheduler.of(w, layer) for w in group.wrappers]
            if all(schedulers):
                group.schedulers = cast(list[_DecodeScheduler], schedulers)

    def _check_batch_size(self, num_reqs: int) -> None:
        if num_reqs > self.limits.max_num_reqs:
            raise ValueError(
                f"flashinfer backend: num_reqs={num_reqs} exceeds BuilderLimits.max_num_reqs="
                f"{self.limits.max_num_reqs}"
            )

    def _metadata(
        self,
        common: CommonAttentionMetadata,
        run: Callable[..., Any] | None,
        *,
        use_decode: bool,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        qo_indptr: torch.Tensor | None,
        draft_step: int | None,
        num_attended_tokens: int | None = None,
    ) -> FlashInferMetadata:
        """The metadata of ``common``'s call; the wrapper runs on ``num_attended_tokens``
        query rows (default: ``num_actual_tokens``)."""
        return FlashInferMetadata(
            run=run,
            use_decode=use_decode,
            paged_kv_indptr=paged_kv_indptr,
            paged_kv_indices=paged_kv_indices,
            paged_kv_last_page_len=paged_kv_last_page_len,
            qo_indptr=qo_indptr,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            slot_mapping=common.slot_mapping,
            block_table=common.block_table,
            num_actual_tokens=common.num_actual_tokens,
            num_attended_tokens=(common.num_actual_tokens if num_attended_tokens is None
                                 else num_attended_tokens),
            num_reqs=common.num_reqs,
            causal=common.causal,
            sm_scale=self.sm_scale,
            draft_step=draft_step,
        )

    def _empty_metadata(
        self, common: CommonAttentionMetadata, draft_step: int | None
    ) -> FlashInferMetadata:
        """Metadata of a batch without requests: nothing to plan or run."""
        empty = torch.zeros(0, dtype=torch.int32, device=self.device)
        return self._metadata(
            common,
            None,
            use_decode=False,
            paged_kv_indptr=empty,
            paged_kv_indices=empty,
            paged_kv_last_page_len=empty,
            qo_indptr=None,
            draft_step=draft_step,
        )

    # update_draft_decode_metadata: the protocol's NotImplementedError stands. plan() is
    # host work and cannot run inside a captured graph; see plan_draft_steps.

    def workspace_buffers(self) -> Mapping[str, torch.Tensor]:
        """The float workspace shared by every wrapper (split-KV partials)."""
        return {"float_workspace": self._workspace}
