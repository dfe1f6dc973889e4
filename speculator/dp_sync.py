"""Data-parallel agreement on padded batch sizes and the CUDA-graph mode (seed 004).

Under data parallelism every rank must run its forward on the same number of tokens (the
model's DP collectives exchange fixed shapes), so the ranks agree before each forward:

- :func:`sync_dp_padding` runs **one** CPU all-reduce (a CPU tensor even when the model runs
  on GPUs, as vLLM's DP sync does over its CPU group) over the group's CPU backend — gloo,
  also in a mixed ``"cpu:gloo,cuda:nccl"`` group — of an int64 ``[4, dp_size]`` table in
  which each rank fills only its own column (:func:`dp_column`), and reduces the summed
  table with the pure :func:`reduce_dp_table`, so every rank derives the same
  :class:`DPSyncState`;
- :func:`agreed_descriptor` turns that state into the descriptor each rank executes;
- :func:`reuse_for_draft` derives the drafter's agreement from the target's, with no new
  collective.

What the agreement pads is the *model input*. Which token count the attention metadata
covers is a separate decision, :func:`speccheck.contract.token_count.attention_token_count`:
the padded count in FULL mode, the real ``query_start_loc[-1]`` otherwise. Handing the
padded count to eager attention is the bug that made FlashInfer raise
``q.shape[0] (52) does not match qo_indptr[-1] (48)``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from speccheck.contract.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from speccheck.speculator.collectives import backend_for_device

logger = logging.getLogger(__name__)

DP_FIELDS = ("num_tokens", "cg_mode", "uniform_token_count", "num_reqs")
"""Rows of the all-reduced table, in order; column ``r`` belongs to DP rank ``r``."""
_TOKENS, _MODE, _UNIFORM, _REQS = range(len(DP_FIELDS))


@dataclass(frozen=True)
class DPSyncState:
    """What every DP rank agreed on; identical on all ranks by construction.

    - ``num_tokens_across_dp``: the token count each rank runs its model on, one entry per
      rank. Every entry is the agreed count (each rank pads to it), which is the shape the
      forward's DP collectives need; all zeros when no rank has work.
    - ``uniform_token_count``: the query tokens per request every rank reported, or ``None``
      when the ranks disagreed (or none reported one).
    - ``cg_mode``: the weakest mode across ranks (any eager rank makes every rank eager).
    - ``num_reqs``: the agreed padded request count (the largest across ranks); ``None`` when
      no rank has work.
    """

    num_tokens_across_dp: tuple[int, ...]
    uniform_token_count: int | None
    cg_mode: CUDAGraphMode
    num_reqs: int | None

    @property
    def dp_size(self) -> int:
        return len(self.num_tokens_across_dp)

    @property
    def num_tokens(self) -> int:
        """The agreed (padded) token count of every rank's model input."""
        return self.num_tokens_across_dp[0]


def dp_column(local: BatchExecutionDescriptor, num_reqs: int) -> tuple[int, int, int, int]:
    """This rank's column of the table, in :data:`DP_FIELDS` order: the local descriptor's
    token count (a captured bucket in FULL mode), its mode, its uniform query count (0 for
    none) and its request count (the descriptor's padded one if it pads, else ``num_reqs``).

    Raises ``ValueError`` if ``num_reqs`` is negative or exceeds the descriptor's padding.
    """
    if num_reqs < 0:
        raise ValueError(f"num_reqs={num_reqs} must be >= 0")
    if local.num_reqs is not None and local.num_reqs < num_reqs:
        raise ValueError(f"descriptor pads to num_reqs={local.num_reqs} but the batch has {num_reqs}")
    return (
        local.num_tokens,
        int(local.cg_mode),
        local.uniform_token_count or 0,
        num_reqs if local.num_reqs is None else local.num_reqs,
    )


def reduce_dp_table(table: torch.Tensor) -> DPSyncState:
    """The agreement, from the summed ``[4, dp_size]`` table (pure; no communication).

    Rules:

    - every rank reports 0 tokens: NONE, no padding (all-zero counts, ``num_reqs`` None);
    - agreed tokens: the maximum across ranks;
    - graph mode: the minimum across ranks;
    - uniform count: kept only if every rank reported the same non-zero count;
    - FULL survives only if every rank reported the same uniform count (or every rank none):
      a padded FULL shape is ``num_reqs`` requests of one layout, so ranks with different
      layouts fall back to NONE;
    - ``num_reqs``: the maximum across ranks.
    """
    if table.dim() != 2 or table.shape[0] != len(DP_FIELDS) or table.shape[1] < 1:
        raise ValueError(
            f"DP table must have shape [{len(DP_FIELDS)}, dp_size >= 1], got {tuple(table.shape)}"
        )
    rows = table.tolist()
    tokens, modes, uniforms, reqs = (rows[i] for i in (_TOKENS, _MODE, _UNIFORM, _REQS))
    dp_size = len(tokens)
    if not any(tokens):
        return DPSyncState((0,) * dp_size, None, CUDAGraphMode.NONE, None)
    same_layout = len(set(uniforms)) == 1
    uniform = uniforms[0] if same_layout and uniforms[0] > 0 else None
    mode = CUDAGraphMode(min(modes))
    if mode == CUDAGraphMode.FULL and not same_layout:
        mode = CUDAGraphMode.NONE
    return DPSyncState((max(tokens),) * dp_size, uniform, mode, max(reqs))


def sync_dp_padding(
    local: BatchExecutionDescriptor,
    num_reqs: int,
    dp_rank: int,
    dp_size: int,
    group: dist.ProcessGroup | None = None,
) -> DPSyncState:
    """Agree with the other DP ranks on the padded token count, graph mode, uniform count and
    padded request count (see :func:`reduce_dp_table` for the rules).

    ``local`` is this rank's own descriptor (a captured FULL bucket, or the real tokens when
    eager) and ``num_reqs`` its real request count. Every rank of ``group`` (default: the
    default group) must call this once per forward, in the same order: it is one
    ``all_reduce`` of a CPU int64 tensor, whatever device the model runs on, so ``group``
    needs a backend for CPU tensors (:func:`cpu_collective_backend`): ``"gloo"`` or a mixed
    ``"cpu:gloo,cuda:nccl"`` group, not ``"nccl"`` alone. ``dp_size == 1`` issues no
    collective and needs no process group.

    Raises ``RuntimeError`` if ``dp_size > 1`` and torch.distributed is not initialised,
    ``ValueError`` if the group has no CPU backend or its size and rank are not ``dp_size``
    and ``dp_rank``.
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is outside 0..{dp_size - 1}")
    table = torch.zeros(len(DP_FIELDS), dp_size, dtype=torch.int64)
    table[:, dp_rank] = torch.tensor(dp_column(local, num_reqs), dtype=torch.int64)
    if dp_size > 1:
        _check_group(group, dp_rank, dp_size)
        dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
    state = reduce_dp_table(table)
    logger.debug("DP rank %d/%d: table %s -> %s", dp_rank, dp_size, table.tolist(), state)
    return state


def cpu_collective_backend(backend: str) -> str:
    """The backend that carries the DP sync's CPU all-reduce in a group whose backend string
    (as ``dist.get_backend`` returns it) is ``backend``: ``"gloo"`` for ``"gloo"`` and for
    ``"cpu:gloo,cuda:nccl"``. Pure.

    Raises ``ValueError`` (one line) if no backend of the group handles CPU tensors
    (``"nccl"``, ``"cuda:nccl"``).
    """
    cpu = backend_for_device(backend, "cpu")
    if cpu is None:
        raise ValueError(
            f"the DP sync all-reduces a CPU tensor, but process group backend {backend!r} has no "
            f"backend for CPU tensors; use 'gloo' or a mixed group such as 'cpu:gloo,cuda:nccl'"
        )
    return cpu


def _check_group(group: dist.ProcessGroup | None, dp_rank: int, dp_size: int) -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            f"dp_size={dp_size} needs torch.distributed initialised (a group with gloo for CPU "
            f"tensors); it is not"
        )
    cpu_collective_backend(str(dist.get_backend(group)))
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if (world, rank) != (dp_size, dp_rank):
        raise ValueError(
            f"group has world size {world} and rank {rank}, but dp_size={dp_size}, dp_rank={dp_rank}"
        )


def agreed_descriptor(
    state: DPSyncState, local_num_reqs: int, uniform: int | None
) -> BatchExecutionDescriptor:
    """The descriptor this rank executes under the agreement ``state``.

    ``local_num_reqs`` is this rank's real request count and ``uniform`` its query tokens per
    request (``None`` for a non-uniform batch).

    - FULL: the agreed padded ``num_tokens`` and ``num_reqs`` and the agreed uniform count
      (which must equal ``uniform``); the graph of that size must exist on this rank, which
      holds when every rank's local descriptor came from the same capture sizes.
    - otherwise (NONE, PIECEWISE): the agreed mode with ``num_tokens`` = the agreed count, so
      the model input is padded to it, ``num_reqs`` None (no request padding) and this
      rank's own ``uniform``.
    - no rank has work: NONE with 0 tokens.

    Raises ``ValueError`` if this rank's batch does not fit the agreement.
    """
    if state.num_reqs is None:
        if local_num_reqs:
            raise ValueError(f"no DP rank reported work, but this rank has {local_num_reqs} requests")
        return BatchExecutionDescriptor(CUDAGraphMode.NONE, 0)
    if local_num_reqs > state.num_reqs:
        raise ValueError(
            f"local batch of {local_num_reqs} requests exceeds the agreed num_reqs={state.num_reqs}"
        )
    if uniform is not None and local_num_reqs * uniform > state.num_tokens:
        raise ValueError(
            f"local batch of {local_num_reqs} x {uniform} tokens exceeds the agreed "
            f"num_tokens={state.num_tokens}"
        )
    if state.cg_mode == CUDAGraphMode.FULL:
        if uniform != state.uniform_token_count:
            raise ValueError(
                f"FULL agreement has uniform_token_count={state.uniform_token_count}, this rank's "
                f"batch has {uniform}"
            )
        return BatchExecutionDescriptor(
            CUDAGraphMode.FULL, state.num_tokens, state.num_reqs, state.uniform_token_count
        )
    return BatchExecutionDescriptor(state.cg_mode, state.num_tokens, None, uniform)


def reuse_for_draft(target_state: DPSyncState, num_query_per_req: int, num_reqs: int) -> DPSyncState:
    """The drafter's agreement derived from the target's, with **no** new collective.

    The drafter runs ``num_query_per_req`` tokens for each of the requests the target
    agreed on, so on every rank: uniform count ``num_query_per_req``, tokens = the agreed
    ``num_reqs`` × ``num_query_per_req``, the target's graph mode and padded request count.
    Every rank derives the same state from the same agreed input.

    Raises ``ValueError`` if this rank's ``num_reqs`` does not fit the target's agreement.
    """
    if num_query_per_req < 1:
        raise ValueError(f"num_query_per_req={num_query_per_req} must be >= 1")
    dp_size = target_state.dp_size
    if target_state.num_reqs is None:
        if num_reqs:
            raise ValueError(f"the target agreed on no work, but this rank drafts {num_reqs} requests")
        return DPSyncState((0,) * dp_size, None, CUDAGraphMode.NONE, None)
    if not 0 <= num_reqs <= target_state.num_reqs:
        raise ValueError(
            f"draft batch of {num_reqs} requests does not fit the target's agreed "
            f"num_reqs={target_state.num_reqs}"
        )
    tokens = target_state.num_reqs * num_query_per_req
    return DPSyncState(
        (tokens,) * dp_size, num_query_per_req, target_state.cg_mode, target_state.num_reqs
    )
