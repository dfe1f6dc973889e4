"""The metadata-builder protocol and the attention implementation interface.

A backend is a pair: an :class:`AttentionMetadataBuilder` (host side: turns common metadata
into backend metadata, and owns the backend's persistent buffers) and an
:class:`AttentionImpl` (device side: the kernel call, which must be graph-capturable).
``matrix.yaml`` names the builder class by import path; the builder names its impl.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import numpy as np
import torch

from speccheck.contract.matrix_model import KvLayout
from speccheck.contract.metadata import CommonAttentionMetadata
from speccheck.contract.runtime_config import RuntimeConfig


def blocks_for(length: int, block_size: int) -> int:
    """KV-cache blocks that ``length`` positions occupy: ``ceil(length / block_size)``."""
    return -(-length // block_size)


@dataclass(frozen=True)
class AttentionLayerSpec:
    """Shape of one attention layer and its KV cache.

    Every layer's KV cache is a pair of tensors ``[num_blocks, block_size, heads, width]``;
    slot ``s`` is ``(s // block_size, s % block_size)``. What the pair holds depends on
    ``kv_layout``:

    - :attr:`KvLayout.NHD` (grouped-query attention): keys and values, each
      ``[num_blocks, block_size, num_kv_heads, head_size]``.
    - :attr:`KvLayout.LATENT` (multi-head latent attention, MLA): ``(latent, empty)``. The
      latent is ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``, one paged
      entry per token: the normalised compressed KV (``kv_c``, the first ``kv_lora_rank``
      channels) followed by the rotated rope key (``k_pe``). The second tensor is
      ``[num_blocks, block_size, 1, 0]``, so code that walks ``(keys, values)`` pairs
      (snapshots, restores, comparisons) needs no special case. ``num_kv_heads`` is 1.
      Queries are absorbed (``[T, num_heads, kv_lora_rank + qk_rope_head_dim]``: the
      no-rope part through ``W_UK``, then the rope part); attention scores use the whole
      latent entry, values are its first ``kv_lora_rank`` channels, and the attention
      output is ``[T, num_heads, kv_lora_rank]`` (``W_UV`` is applied by the layer).
      ``head_size`` is the per-head no-rope query / value width (``qk_nope_head_dim ==
      v_head_dim``), which only the layer and the softmax scale see.

    ``sliding_window`` W > 0: a query at position ``p`` sees the positions ``p-W+1 .. p``
    only; 0 is full attention.
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int
    max_model_len: int
    kv_layout: KvLayout = KvLayout.NHD
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    sliding_window: int = 0

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_size", "block_size", "max_model_len",
                     "kv_lora_rank", "qk_rope_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 0")
        if self.kv_layout not in (KvLayout.NHD, KvLayout.LATENT):
            raise ValueError(f"kv_layout={self.kv_layout.value} is not a layout speccheck "
                             "allocates; use NHD or latent")
        if self.kv_layout is KvLayout.LATENT and self.num_kv_heads != 1:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must be 1 for the latent "
                             "layout (one latent entry per token)")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads="
                f"{self.num_kv_heads} (grouped-query attention)"
            )

    @property
    def max_blocks_per_req(self) -> int:
        return blocks_for(self.max_model_len, self.block_size)

    @property
    def latent_size(self) -> int:
        """Width of one latent cache entry: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def kv_cache_shapes(self, num_blocks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of the layer's ``(first, second)`` cache tensors (see the class docstring)."""
        if self.kv_layout is KvLayout.LATENT:
            return ((num_blocks, self.block_size, 1, self.latent_size),
                    (num_blocks, self.block_size, 1, 0))
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_size)
        return shape, shape


@dataclass(frozen=True)
class BuilderLimits:
    """Largest batch the builder's persistent buffers are sized for (the largest bucket)."""

    max_num_reqs: int
    max_num_tokens: int


M = TypeVar("M")

BufferAllocator = Callable[[str, tuple[int, ...], torch.dtype, torch.device], torch.Tensor]
"""``(name, shape, dtype, device) -> zero-filled tensor``: where persistent buffers come from.
The verifier passes one that surrounds each buffer with poisoned guard bands."""


def zeros_allocator(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The default :data:`BufferAllocator`: plain zero-filled device memory."""
    del name
    return torch.zeros(shape, dtype=dtype, device=device)


class AttentionImpl(ABC, Generic[M]):
    """Device-side attention of one backend.

    ``forward`` must be capture-safe: no host synchronisation, no host-to-device copies of
    pageable memory, and no shapes that depend on tensor *values*; it may read only the
    metadata's tensors and the builder's persistent buffers, which replays update in place.
    An impl with a faster eager path must choose it with
    :func:`speccheck.contract.capture_state.capturing`: the verifier traces ``forward`` on
    every tier under an emulated capture, and any host synchronisation on that path fails
    ``host_sync``.
    """

    def __init__(self, layer: AttentionLayerSpec, scale: float) -> None:
        self.layer = layer
        self.scale = scale

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: M,
        output: torch.Tensor,
    ) -> None:
        """Write ``key``/``value`` (``[T, num_kv_heads, head_size]``) at the metadata's slot
        mapping, then attend ``query`` (``[T, num_heads, head_size]``) over the paged cache
        into ``output`` (same shape as ``query``). ``T`` is the metadata's token count.

        Rows of ``output`` past ``query_start_loc[num_reqs]`` (tokens of no request:
        FULL-mode padding) arrive zero, and must be left zero: the caller clears them (the
        drafter clears the whole output in the kernel that projects ``query``), so an impl
        whose kernel writes only the requests' rows needs no launch of its own for them.
        Other rows arrive holding anything.

        For a latent layer (:attr:`AttentionLayerSpec.kv_layout` ``latent``): ``key`` is the
        latent entry ``[T, 1, kv_lora_rank + qk_rope_head_dim]`` written into
        ``key_cache``, ``value`` is ``key[..., :kv_lora_rank]`` (nothing is written to the
        empty ``value_cache``), ``query`` is ``[T, num_heads, kv_lora_rank +
        qk_rope_head_dim]`` and ``output`` ``[T, num_heads, kv_lora_rank]``."""


class AttentionMetadataBuilder(ABC, Generic[M]):
    """Turns :class:`CommonAttentionMetadata` into backend metadata ``M``.

    ``build`` and ``build_for_cudagraph_capture`` are host work and are never captured.
    ``update_draft_decode_metadata`` is the one method that runs *inside* a captured fused
    draft-decode graph (or the eager fused loop), between draft steps, after the speculator
    has advanced ``seq_lens``/``positions``/``slot_mapping`` in place; and, where the
    matrix entry says ``refresh_rebuilds``, also in place of a build: at the start of the
    first pass's graph and before the first draft step, after the speculator has written
    that pass's inputs (lengths, positions, slots, query offsets, block table), on
    metadata built for capture.

    Which attributes of ``M`` depend on the draft step is declared once, in the backend's
    matrix entry (``draft_decode.refreshed_fields``), not here: the verifier snapshots
    those after every step and fails any other derived field that changes between steps.
    Configuration constraints (dtypes, head and block sizes, …) are matrix data too, enforced
    before a builder is constructed.
    """

    backend_name: ClassVar[str]
    impl_cls: ClassVar[type[AttentionImpl]]

    def __init__(
        self,
        layer: AttentionLayerSpec,
        config: RuntimeConfig,
        device: torch.device,
        limits: BuilderLimits,
        *,
        supports_draft_decode_metadata_update: bool = False,
        buffer_allocator: BufferAllocator = zeros_allocator,
    ) -> None:
        """``supports_draft_decode_metadata_update`` is resolved from ``matrix.yaml`` for the
        live ``config`` by whoever constructs the builder; a builder never claims it itself.
        ``buffer_allocator`` backs :meth:`allocate_persistent`."""
        self.layer = layer
        self.config = config
        self.device = device
        self.limits = limits
        self.supports_draft_decode_metadata_update = supports_draft_decode_metadata_update
        self._buffer_allocator = buffer_allocator
        self._persistent: dict[str, torch.Tensor] = {}
        self.setup()

    def setup(self) -> None:
        """Create the backend's own state (persistent buffers through
        :meth:`allocate_persistent`, kernel handles); runs at the end of construction, once
        the fields above are set. Raise ``BackendUnavailable`` here when the kernel package
        is missing. Default: nothing."""

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> M:
        """Backend metadata for one attention call. Host work; may synchronise."""

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> M:
        """Metadata used while capturing a graph. Defaults to :meth:`build`; an override must
        still write every persistent buffer a replay reads."""
        return self.build(common)

    def update_draft_decode_metadata(self, metadata: M) -> None:
        """Refresh the step-dependent fields of ``metadata`` for the next draft step.

        Contract: called only while a fused draft-decode graph is being captured, or in the
        eager fused loop, never after the last step (and, where the matrix entry declares
        ``refresh_rebuilds``, in place of a build of the first pass and of step 1: then the
        refresh must leave what a build of that batch would, from the inputs alone). It
        must emit only capture-safe GPU work
        (no ``.item()``, ``.tolist()``, ``nonzero``, host copies, or host-side decisions on
        device values) and must write results *in place* into storage that outlives the call
        (the builder's persistent buffers or the metadata's existing tensors): a replay
        re-executes the recorded kernels against the recorded addresses, so a new tensor
        bound to ``metadata`` would be invisible to the next replay's readers.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not support in-graph draft-decode metadata refresh"
        )

    def plan_draft_steps(self, commons: Sequence[CommonAttentionMetadata]) -> list[M]:
        """The ``host_preplanned`` strategy: metadata for every draft step, planned on the
        host before a single replay of the fused body (``commons[i]`` describes step
        ``i + 1``; its lengths are known ahead because each step adds one token).

        Host work, never captured. Each step's metadata must live in storage of its own
        (persistent, sized at construction), so that planning step ``i + 1`` never
        overwrites what step ``i``'s captured kernels read. Device work the plans need may
        be left to :meth:`finish_draft_step_plans`, which the body runs first. Default:
        unsupported.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no host_preplanned strategy (plan_draft_steps)"
        )

    def replan_draft_steps(
        self, metadata_per_step: Sequence[M], seq_lens_per_step: np.ndarray
    ) -> None:
        """The host half of :meth:`plan_draft_steps` again, for a replay of the host_preplanned
        body captured with ``metadata_per_step`` (what :meth:`plan_draft_steps` returned at
        capture): the same steps of the same padded batch and block table, now with host
        KV length upper bounds ``seq_lens_per_step`` (``[steps, num_reqs]`` int32, row
        ``i`` for step ``i + 1``, zero in padding lanes; the ``seq_lens_cpu_upper_bound``
        of :meth:`plan_draft_steps`'s ``commons``).

        Host work, never captured. Writes exactly what :meth:`plan_draft_steps` would for
        those lengths, into the storage ``metadata_per_step`` views, and makes no metadata:
        a replay runs the captured objects, so building new ones is host time spent on
        nothing. The verifier's ``host_preplanned_graph`` candidate runs through this, its
        ``host_preplanned_eager`` one through :meth:`plan_draft_steps`. Default: unsupported.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no host_preplanned strategy (replan_draft_steps)"
        )

    def finish_draft_step_plans(self, metadata_per_step: Sequence[M]) -> None:
        """The device half of :meth:`plan_draft_steps`: the work that completes its host
        plans (``metadata_per_step``, as it returned them), run at the start of the
        preplanned body, before any step's attention, so inside its graph. Must be
        capture-safe: no host synchronisation, no allocation, launch grids fixed by the
        metadata's shapes, reading only device state that :meth:`plan_draft_steps` left in
        persistent storage. Default: nothing to do (plans complete on the host)."""

    def allocate_persistent(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """A zero-filled device buffer that graphs will read by address, sized once for
        ``limits``; listed by :meth:`persistent_buffers`. Allocate every persistent buffer
        through this (the verifier guards them against overruns)."""
        if name in self._persistent:
            raise ValueError(f"{type(self).__name__} already has a persistent buffer {name!r}")
        buffer = self._buffer_allocator(name, shape, dtype, self.device)
        self._persistent[name] = buffer
        return buffer

    def persistent_buffers(self) -> Mapping[str, torch.Tensor]:
        """Device buffers this builder owns and graphs read by address: those allocated with
        :meth:`allocate_persistent`."""
        return dict(self._persistent)

    def persistent_buffer_extents(self, metadata: M) -> Mapping[str, int]:
        """For buffers whose leading rows ``metadata`` uses, how many: the rest (the tail)
        must be zero, so that a kernel reading the whole buffer sees no stale entries from
        an earlier, larger batch. Default: no such buffers."""
        del metadata
        return {}

    def workspace_buffers(self) -> Mapping[str, torch.Tensor]:
        """Scratch this builder owns whose contents are meaningless between kernel calls
        (split-KV partials). Persistent like the buffers above, but never step-dependent
        state: the verifier leaves them out of its snapshots. Default: none."""
        return {}

    def make_impl(self, scale: float) -> AttentionImpl[M]:
        return self.impl_cls(self.layer, scale)
