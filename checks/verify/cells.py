"""The configuration cells a matrix entry claims fused support for, and the batch classes
its CUDA-graph claim covers: what a verification at the defaults must exercise so that a
PASS covers the claim rather than one point of it.

A :class:`Cell` is one runtime configuration (the run's own, or it with a few fields
changed) and the layer kind the drafter is built with. :func:`claimed_cells` derives them
from the entry (its conditions and constraints, resolved by
:func:`~speccheck.contract.resolution.backend_failures`) and from what the adapter holds
(a real DCP share); :func:`narrowed` keeps those a run's explicit options allow. A cell the
machine cannot run carries the reason (:attr:`Cell.not_run`) and is reported as not run,
never as passed.

Torch-free: planning derives cells before any worker starts.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from speccheck.checks.verify.vocabulary import Tier
from speccheck.contract.constraints import constraint_failures, platform_failures
from speccheck.contract.matrix_model import BackendEntry, CudaGraphSupport, FieldMeaning, KvLayout
from speccheck.contract.resolution import backend_failures
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.drafter_kind import DrafterKind

INT16_MAX = 2**15 - 1
"""Largest length an int16 holds: a long cell reaches lengths past it."""

LONG_MAX_MODEL_LEN = 2**15 + 256
"""``max_model_len`` of the long cell, where the run's own cannot reach past
:data:`INT16_MAX`: lengths near its clamp are past it."""

LONG_BLOCK_SIZE = 256
"""``block_size`` of the long cell where the entry allows it: few, large blocks in use
(a row of 129), so that block tables and the KV cache stay small (the CPU harness caps its
cache at two rows: :func:`~speccheck.checks.verify.harness.kv_cache_token_budget`)."""

CELL_SEED_STRIDE = 1 << 16
"""Cell ``i`` draws from the run's seed plus ``i`` times this (its workers from that plus
their shard index), so that cells do not all begin with the same batches."""

DCP_CELL_WORLD_SIZE = 2
"""``dcp_world_size`` of the DCP cell: two real ranks, each holding its share."""

DP_CELL_SIZE = 2
"""``dp_size`` of the data-parallel cell: two real ranks drafting with the DFlash drafter."""

HEADS_CELL_NUM_HEADS = 24
"""``num_heads`` of the heads change: more than the 16 query heads one program of a latent
kernel covers (sparse_swa's ``HEAD_BLOCK``, triton_mla's ``BLOCK_H``), and not a multiple
of them, so that a kernel indexing head blocks runs a second, partly masked one, which
neither tier's default layout (4 heads on the CPU, 16 on the GPU) does."""

HEADS_CELL_NUM_KV_HEADS = 8
"""``num_kv_heads`` of the heads change: 24 query heads over 8 KV heads (Llama-3.2-3B's
layout) are groups of 3, where both tiers' defaults group a power of two (2 on the CPU, 4
on the GPU): a grouped-query kernel that rounds the group up to a power of two (its tile's
rows, its head index) is right at every default and wrong here. FlashInfer's CUDA-core
decode kernels dispatch groups of 1, 2, 3, 4 and 8 only, so the group is 3."""

HEADS_FIELDS = frozenset({"num_heads", "num_kv_heads"})
"""The fields of the heads change, which only go together: a run that gives either keeps
neither (:func:`narrowed`), since its value with the other's cell value may not divide."""

INTERPRETER_PACKAGE = "triton"
"""The kernel package whose kernels run under the Triton interpreter on the CPU tier."""

INTERPRETER_BF16 = ("the Triton interpreter computes bfloat16 kernels wrongly on the CPU; "
                    "run this cell on the GPU tier")
"""Why a bfloat16 cell of an interpreted backend is not run on the CPU tier."""

INTERPRETER_LONG = ("the Triton interpreter probes and runs lengths past 32767 too slowly on "
                    "the CPU (its breakpoint probe made no progress for the example timeout); "
                    "run this cell on the GPU tier")
"""Why the long cell of an interpreted backend is not run on the CPU tier."""

INTERPRETED_MAX_MODEL_LEN = 1024
"""``max_model_len`` of the length cell, which stands in for the long cell where the Triton
interpreter runs the kernels: sixteen times the CPU tier's own, past the lengths at which a
kernel that sizes its schedule by ``max_model_len`` takes another one (a split-KV kernel
cuts it into runs of 512 positions, so its splits and their merge run here and nowhere
else on the CPU tier), and short enough for the interpreter."""


class CellAxis(enum.StrEnum):
    """What a cell varies from the run's own configuration."""

    BASE = "base"
    """The run's configuration itself."""
    DCP = "dcp"
    """Decode context parallelism on real ranks."""
    DCP_BLOCKS = "dcp_blocks"
    """The DFlash drafter on real DCP ranks: blocks attended non-causally over each rank's
    share of the KV cache (:func:`~speccheck.checks.verify.data_parallel.verify_dcp_blocks`),
    where no causal bound clips a local length or mask that is one position too wide."""
    DATA_PARALLEL = "data_parallel"
    """The DFlash drafter on data-parallel ranks: blocks attended non-causally, each rank's
    input padded to the agreed count (:mod:`~speccheck.checks.verify.data_parallel`)."""
    LAYOUT = "layout"
    """Another KV-cache layout the builder reads (the latent, MLA one)."""
    HEADS = "heads"
    """More query heads than one kernel program covers, in groups that are not a power of
    two (:data:`HEADS_CELL_NUM_HEADS` over :data:`HEADS_CELL_NUM_KV_HEADS`)."""
    WINDOW = "window"
    """A sliding window."""
    BLOCK_SIZE = "block_size"
    """A second allowed block size."""
    DTYPE = "dtype"
    """Another allowed activation dtype."""
    LONG = "long"
    """Lengths past :data:`INT16_MAX`."""
    LENGTH = "length"
    """A longer ``max_model_len`` the Triton interpreter runs
    (:data:`INTERPRETED_MAX_MODEL_LEN`), where the long cell is not run."""


@dataclass(frozen=True)
class Cell:
    """One configuration a verification runs: the run's config with ``config`` changed,
    drafter layers of ``kv_layout`` (``None``: the entry's own), the ``drafter`` named
    (``None``: the run's), or not run at all (``not_run`` says why)."""

    axis: CellAxis
    """What it varies (the first of them, for a cell that packs several: its ``config``
    and ``kv_layout`` say all)."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """Runtime fields this cell sets (by :class:`RuntimeConfig` field name)."""
    kv_layout: KvLayout | None = None
    not_run: str | None = None
    drafter: DrafterKind | None = None

    @property
    def name(self) -> str:
        """The cell in words: ``base``, ``dcp_world_size=2``, ``kv_layout=latent``,
        ``dcp_world_size=2, drafter=dflash``..."""
        parts = [f"{key}={value}" for key, value in self.config.items()]
        if self.kv_layout is not None:
            parts.append(f"kv_layout={self.kv_layout.value}")
        if self.drafter is not None:
            parts.append(f"drafter={self.drafter.value}")
        return ", ".join(parts) or CellAxis.BASE.value


class BatchClass(enum.StrEnum):
    """A shape of batch a CUDA-graph claim covers; every run draws each its entry claims
    (:func:`claimed_batch_classes`)."""

    MIXED = "mixed"
    """Requests of independent query widths (a graph of ``always`` support)."""
    SINGLE_TOKEN_DECODE = "single_token_decode"
    """Every request brings one token."""
    UNIFORM_PADDED = "uniform_padded"
    """Several requests of one query width (two tokens or more where the drafter pads such
    a width: one token each is the single-token decode class), fewer than their bucket:
    padding lanes."""
    FULL = "full"
    """As many requests as the largest bucket, each bringing the most new tokens: the first
    pass fills the drafter's prefill budget (``max_num_prefill_tokens``), so every buffer
    sized by it is full and every token-chunked loop runs past its first chunk."""


def claimed_batch_classes(support: CudaGraphSupport) -> tuple[BatchClass, ...]:
    """The batch classes an entry of ``support`` claims graphs (or, ``never``, eager runs)
    for, mixed widths first (hypothesis shrinks towards it)."""
    if support is CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE:
        return (BatchClass.SINGLE_TOKEN_DECODE,)
    if support is CudaGraphSupport.UNIFORM_BATCH:
        return (BatchClass.SINGLE_TOKEN_DECODE, BatchClass.UNIFORM_PADDED, BatchClass.FULL)
    return tuple(BatchClass)


def claimed_cells(
    entry: BackendEntry, config: RuntimeConfig, tier: Tier, holds_dcp_share: bool
) -> tuple[Cell, ...]:
    """The cells ``entry`` claims fused support for around ``config`` (the run's), base
    first, from these changes of one axis each, kept where the entry's constraints and
    draft-decode condition allow them fused
    (:func:`~speccheck.contract.resolution.backend_failures` empty):

    - DCP: ``dcp_world_size`` 2 where ``config`` runs without DCP and the adapter holds a
      real share (``holds_dcp_share``) or simulates every rank's in one process
      (:func:`simulates_dcp`). Kept wherever the entry runs there (platform and
      constraints), fused or not: where its draft-decode condition excludes DCP, the cell
      verifies the per-step path it falls back to, whose DCP code the base cell never runs;
    - DCP blocks: the same ``dcp_world_size`` with the DFlash drafter, where the adapter
      holds a real share and the entry serves non-causal passes (not
      ``constraints.causal_only``): each rank attends the blocks over its share with no
      causal bound, the one path where a rank's local length or mask that covers one
      position too many changes an output (every autoregressive step clips it);
    - data parallel: ``dp_size`` :data:`DP_CELL_SIZE`, the DFlash drafter on real ranks,
      where ``config`` runs neither data parallelism nor DCP (they do not combine), the
      entry serves non-causal passes (not ``constraints.causal_only``) and runs there: the
      only cells whose attention is non-causal, a path no autoregressive step takes; a
      second such cell adds the window where the entry claims one (each block token's
      window then ends at its own position while it sees the block's later tokens: a path
      neither the window cell nor the first data-parallel cell takes);
    - heads: ``num_heads`` :data:`HEADS_CELL_NUM_HEADS` over ``num_kv_heads``
      :data:`HEADS_CELL_NUM_KV_HEADS` where ``config`` has fewer query heads;
    - window: ``sliding_window`` of a quarter of ``max_model_len`` where ``config`` has
      none;
    - block size: twice ``config``'s;
    - dtype: each other dtype the entry allows (on the CPU tier, bfloat16 of a backend
      whose kernels run under the Triton interpreter is not run: :data:`INTERPRETER_BF16`);
    - layout: the latent layout where the entry states no ``kv_layout`` (it reads both)
      and the run's layers are not latent;
    - long: :data:`LONG_MAX_MODEL_LEN` (in blocks of :data:`LONG_BLOCK_SIZE` where
      allowed) where ``config``'s lengths cannot pass :data:`INT16_MAX`; on the CPU tier
      a backend whose kernels run under the Triton interpreter does not run it
      (:data:`INTERPRETER_LONG`) and gets a length cell instead:
      :data:`INTERPRETED_MAX_MODEL_LEN` where ``config``'s is shorter.

    The heads, window, block-size, dtype and layout changes that the machine can run are
    packed into as few cells as the entry allows together (:func:`_packed`): each cell
    costs a worker's start-up (seconds on the CPU tier), and a cell's reproduce command
    names every field it sets, so a failure narrows with the options. DCP, DCP blocks,
    data parallelism (real ranks), long (its own block size) and length stay cells of their
    own.

    Nothing but the base cell where the entry does not allow fusing under ``config``
    (its fallback is verified there).
    """
    base = Cell(CellAxis.BASE)
    if backend_failures(entry, config):
        return (base,)
    wanted: list[Cell] = []
    dcp = Cell(CellAxis.DCP, {"dcp_world_size": DCP_CELL_WORLD_SIZE})
    runs_dcp = ((holds_dcp_share or simulates_dcp(entry)) and config.dcp_world_size == 1
                and _runs(entry, config, dcp))
    dcp_blocks = Cell(CellAxis.DCP_BLOCKS, dcp.config, drafter=DrafterKind.DFLASH)
    runs_dcp_blocks = (runs_dcp and holds_dcp_share and config.dp_size == 1
                       and not entry.constraints.causal_only)
    data_parallel = Cell(CellAxis.DATA_PARALLEL, {"dp_size": DP_CELL_SIZE})
    runs_dp = (config.dp_size == 1 and config.dcp_world_size == 1
               and not entry.constraints.causal_only and _runs(entry, config, data_parallel))
    if config.num_heads < HEADS_CELL_NUM_HEADS:
        wanted.append(Cell(CellAxis.HEADS, {"num_heads": HEADS_CELL_NUM_HEADS,
                                            "num_kv_heads": HEADS_CELL_NUM_KV_HEADS}))
    if config.sliding_window == 0 and config.max_model_len >= 8:
        wanted.append(Cell(CellAxis.WINDOW, {"sliding_window": config.max_model_len // 4}))
    if config.block_size * 2 <= config.max_model_len:
        wanted.append(Cell(CellAxis.BLOCK_SIZE, {"block_size": config.block_size * 2}))
    for dtype in entry.constraints.dtypes or ():
        if dtype != config.dtype:
            wanted.append(Cell(CellAxis.DTYPE, {"dtype": dtype},
                               not_run=_dtype_not_run(entry, dtype, tier)))
    if entry.constraints.kv_layout is None:
        wanted.append(Cell(CellAxis.LAYOUT, kv_layout=KvLayout.LATENT))
    if config.max_model_len <= INT16_MAX:
        not_run = INTERPRETER_LONG if _interpreted_on(entry, tier) else None
        long = Cell(CellAxis.LONG, {"max_model_len": LONG_MAX_MODEL_LEN,
                                    "block_size": max(config.block_size, LONG_BLOCK_SIZE)},
                    not_run=not_run)
        wanted.append(long if _claimed(entry, config, long)
                      else Cell(CellAxis.LONG, {"max_model_len": LONG_MAX_MODEL_LEN},
                                not_run=not_run))
        if not_run is not None and config.max_model_len < INTERPRETED_MAX_MODEL_LEN:
            wanted.append(Cell(CellAxis.LENGTH, {"max_model_len": INTERPRETED_MAX_MODEL_LEN}))
    claimed = [cell for cell in wanted if _claimed(entry, config, cell)]
    alone = [cell for cell in claimed
             if cell.axis in (CellAxis.LONG, CellAxis.LENGTH) or cell.not_run is not None]
    packable = [cell for cell in claimed if not any(cell is other for other in alone)]
    parallel = [data_parallel] if runs_dp else []
    window = next((cell for cell in claimed if cell.axis is CellAxis.WINDOW), None)
    if runs_dp and window is not None:
        windowed = Cell(CellAxis.DATA_PARALLEL, {**data_parallel.config, **window.config})
        if _runs(entry, config, windowed):
            parallel.append(windowed)
    return (base, *([dcp] if runs_dcp else []), *([dcp_blocks] if runs_dcp_blocks else []),
            *parallel,
            *_packed(entry, config, packable), *alone)


def _packed(entry: BackendEntry, config: RuntimeConfig, cells: Sequence[Cell]) -> list[Cell]:
    """``cells`` (single-axis changes) merged greedily, in order, into as few cells as go
    together: no field set twice, and the entry claims the merged change too. A latent
    cache's single KV head broadcasts over any head grouping, so a mistake in the grouping
    shows only in the other layout: a layout change never joins the heads change (whose
    groups of 3 would then never run), and joins a cell without a window where one takes
    it (the window's attention path then runs in both layouts)."""
    packed: list[Cell] = []
    for cell in cells:
        order = list(range(len(packed)))
        if cell.kv_layout is not None:
            order = [i for i in order if not HEADS_FIELDS & set(packed[i].config)]
            windowed = [i for i in order if "sliding_window" in packed[i].config]
            order = [i for i in order if i not in windowed] + windowed
        for i in order:
            group = packed[i]
            if set(group.config) & set(cell.config) or (group.kv_layout and cell.kv_layout):
                continue
            merged = Cell(group.axis, {**group.config, **cell.config},
                          group.kv_layout or cell.kv_layout)
            if _claimed(entry, config, merged):
                packed[i] = merged
                break
        else:
            packed.append(cell)
    return packed


def _claimed(entry: BackendEntry, config: RuntimeConfig, cell: Cell) -> bool:
    """Whether ``entry`` allows fusing under ``config`` changed as ``cell`` says."""
    return not backend_failures(entry, config.model_copy(update=dict(cell.config)))


def simulates_dcp(entry: BackendEntry) -> bool:
    """Whether ``entry``'s adapter runs every DCP rank's share in one process: it declares
    a field of every rank's local lengths
    (:attr:`~speccheck.contract.matrix_model.FieldMeaning.LOCAL_SEQ_LEN_TABLE`)."""
    return FieldMeaning.LOCAL_SEQ_LEN_TABLE in entry.draft_decode.field_meanings.values()


def _runs(entry: BackendEntry, config: RuntimeConfig, cell: Cell) -> bool:
    """Whether ``entry`` runs at all (fused or per-step) under ``config`` changed as
    ``cell`` says: its platform and constraints hold."""
    changed = config.model_copy(update=dict(cell.config))
    return not (platform_failures(entry, changed) or constraint_failures(entry, changed))


def _interpreted_on(entry: BackendEntry, tier: Tier) -> bool:
    """Whether ``entry``'s kernels run under the Triton interpreter on ``tier``."""
    return tier is Tier.CPU and entry.package.import_name == INTERPRETER_PACKAGE


def _dtype_not_run(entry: BackendEntry, dtype: str, tier: Tier) -> str | None:
    return INTERPRETER_BF16 if dtype == "bfloat16" and _interpreted_on(entry, tier) else None


DFLASH_RANK_FIELDS = {CellAxis.DATA_PARALLEL: "dp_size", CellAxis.DCP_BLOCKS: "dcp_world_size"}
"""The cells that run the DFlash drafter on ranks, each with the runtime field that counts
its ranks."""


def narrowed(
    cells: Sequence[Cell], given: Mapping[str, Any], kv_layout: KvLayout | None,
    drafter: DrafterKind | None = None,
) -> tuple[Cell, ...]:
    """The ``cells`` a run's explicit options allow: the base cell, and each other without
    the runtime fields the run gave (the base cell already runs at the value given; given
    either of :data:`HEADS_FIELDS`, without both) nor, ``kv_layout`` given, its layout (the
    base cell runs in it); a cell left with no change, a DFlash cell
    (:data:`DFLASH_RANK_FIELDS`) left without the field that counts its ranks or where the
    run names the autoregressive ``drafter``, or one left as another kept is dropped.
    ``--dcp-world-size 1`` thus runs only cells at DCP 1, ``--sliding-window 8`` one
    data-parallel cell (at that window), and ``--drafter autoregressive`` no DFlash cell."""
    dropped = set(given) | (HEADS_FIELDS if HEADS_FIELDS & set(given) else set())
    kept: list[Cell] = []
    for cell in cells:
        if cell.axis is not CellAxis.BASE:
            config = {key: value for key, value in cell.config.items() if key not in dropped}
            layout = None if kv_layout is not None else cell.kv_layout
            if not config and layout is None:
                continue
            rank_field = DFLASH_RANK_FIELDS.get(cell.axis)
            if rank_field is not None and (rank_field not in config
                                           or drafter is DrafterKind.AUTOREGRESSIVE):
                continue
            cell = Cell(cell.axis, config, layout, cell.not_run, cell.drafter)
        if cell not in kept:
            kept.append(cell)
    return tuple(kept)


def example_shares(examples: int, runnable: int) -> list[int]:
    """``examples`` spread over ``runnable`` cells as evenly as they go, the first cells
    (the base first) taking the remainder; a cell past the budget gets none."""
    return [examples // runnable + (i < examples % runnable) for i in range(runnable)]
