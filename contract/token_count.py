"""The attention token-count rule (seed 004) and the two metadata builders every
speculator must use. No caller computes padding by hand.

The rule: a FULL graph replays a captured shape in which every padded request owns a full
query, so attention covers the descriptor's padded ``num_tokens``. In PIECEWISE and eager
mode the descriptor may carry graph or data-parallel padding that no request owns, so
attention covers only the real ``query_start_loc[-1]``. Getting this wrong in eager mode is
what made FlashInfer raise ``q.shape[0] (52) does not match qo_indptr[-1] (48)`` under DP.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from speccheck.contract.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from speccheck.contract.metadata import AttentionInputBuffers, CommonAttentionMetadata


def attention_token_count(
    batch_desc: BatchExecutionDescriptor, query_start_loc_np: np.ndarray
) -> int:
    """Tokens the attention metadata covers: padded in FULL mode, real otherwise."""
    if batch_desc.cg_mode == CUDAGraphMode.FULL:
        return batch_desc.num_tokens
    return int(query_start_loc_np[-1])


def attention_request_count(batch_desc: BatchExecutionDescriptor, num_reqs: int) -> int:
    """Requests the attention metadata covers: the descriptor's padded count if it pads."""
    if batch_desc.num_reqs is None:
        return num_reqs
    if batch_desc.num_reqs < num_reqs:
        raise ValueError(
            f"descriptor pads to num_reqs={batch_desc.num_reqs} but the batch has {num_reqs}"
        )
    return batch_desc.num_reqs


def padded_query_start_loc(
    query_start_loc_np: np.ndarray, num_reqs: int, num_reqs_padded: int
) -> np.ndarray:
    """``[num_reqs_padded + 1]`` offsets that repeat the last real offset past ``num_reqs``.

    Non-decreasing by construction, so padded requests own zero query tokens.
    """
    if len(query_start_loc_np) < num_reqs + 1:
        raise ValueError(
            f"query_start_loc has {len(query_start_loc_np)} entries, need num_reqs+1="
            f"{num_reqs + 1}"
        )
    out = np.empty(num_reqs_padded + 1, dtype=np.int32)
    out[: num_reqs + 1] = query_start_loc_np[: num_reqs + 1]
    out[num_reqs + 1 :] = query_start_loc_np[num_reqs]
    return out


def draft_seq_lens_upper_bound(
    base_seq_lens_np: np.ndarray,
    num_reqs: int,
    num_reqs_padded: int,
    step: int,
    max_model_len: int,
) -> np.ndarray:
    """Host upper bound of each request's KV length at draft ``step``.

    ``base + step`` clamped at ``max_model_len`` for the real requests; zero in the padded
    tail, so padding lanes attend to nothing.
    """
    out = np.zeros(num_reqs_padded, dtype=np.int32)
    _write_seq_lens_upper_bound(out, base_seq_lens_np, num_reqs, step, max_model_len)
    return out


def draft_steps_seq_lens_upper_bound(
    base_seq_lens_np: np.ndarray,
    num_reqs: int,
    num_reqs_padded: int,
    first_step: int,
    num_steps: int,
    max_model_len: int,
) -> np.ndarray:
    """``[num_steps, num_reqs_padded]`` int32: row ``i`` is
    :func:`draft_seq_lens_upper_bound` at draft step ``first_step + i``, every row in one
    NumPy pass (what a preplanned replay re-plans from)."""
    out = np.zeros((num_steps, num_reqs_padded), dtype=np.int32)
    steps = np.arange(first_step, first_step + num_steps, dtype=np.int64)[:, None]
    _write_seq_lens_upper_bound(out, base_seq_lens_np, num_reqs, steps, max_model_len)
    return out


def _write_seq_lens_upper_bound(out: np.ndarray, base_seq_lens_np: np.ndarray, num_reqs: int,
                                step: int | np.ndarray, max_model_len: int) -> None:
    """``out[..., :num_reqs] = min(base + step, max_model_len)``; the tail is the caller's
    zeros."""
    np.minimum(base_seq_lens_np[:num_reqs].astype(np.int64) + step, max_model_len,
               out=out[..., :num_reqs], casting="unsafe")


def build_attention_metadata(
    *,
    buffers: AttentionInputBuffers,
    batch_desc: BatchExecutionDescriptor,
    num_reqs: int,
    query_start_loc_np: np.ndarray,
    base_seq_lens_np: np.ndarray,
    step: int,
    max_model_len: int,
    causal: bool = True,
    uniform_query_len: int | None = None,
    offsets_on_device: bool = False,
) -> CommonAttentionMetadata:
    """Common metadata for one attention call, following the token-count rule.

    Host work only (never call it inside graph capture): writes the padded query offsets
    into ``buffers.query_start_loc`` and returns views of the persistent buffers sized to
    the attention request and token counts. ``buffers.seq_lens``, ``positions``,
    ``slot_mapping`` and ``block_table`` are owned by the caller and only viewed here.
    ``uniform_query_len``: every request brings that many tokens (``query_start_loc_np``
    is ``0, q, 2q, ...``), so the offsets are computed on the device instead of copied;
    with ``offsets_on_device`` too, the caller's device work has already written those
    uniform offsets (a decode step's lanes) and nothing is launched.
    """
    if offsets_on_device and uniform_query_len is None:
        raise ValueError("offsets_on_device needs uniform_query_len: only uniform offsets "
                         "are computed on the device")
    num_reqs_attn = attention_request_count(batch_desc, num_reqs)
    num_tokens_attn = attention_token_count(batch_desc, query_start_loc_np)
    real_tokens = int(query_start_loc_np[num_reqs])
    if num_tokens_attn < real_tokens:
        raise ValueError(
            f"attention token count {num_tokens_attn} is below the real token count {real_tokens}"
        )
    qsl = padded_query_start_loc(query_start_loc_np, num_reqs, num_reqs_attn)
    seq_upper = draft_seq_lens_upper_bound(
        base_seq_lens_np, num_reqs, num_reqs_attn, step, max_model_len
    )
    views = buffers.views(num_reqs_attn, num_tokens_attn)
    qsl_cpu = torch.from_numpy(qsl)
    if uniform_query_len is None:
        _copy_query_start_loc(views.query_start_loc, qsl_cpu)
    elif not offsets_on_device:
        _write_uniform_query_start_loc(views, num_reqs, uniform_query_len)
    if batch_desc.uniform_token_count is not None:
        max_query_len = batch_desc.uniform_token_count
    elif uniform_query_len is not None:
        max_query_len = uniform_query_len if num_reqs else 0
    else:
        max_query_len = int(np.diff(qsl[: num_reqs + 1]).max()) if num_reqs else 0
    return CommonAttentionMetadata(
        query_start_loc=views.query_start_loc,
        query_start_loc_cpu=qsl_cpu,
        seq_lens=views.seq_lens,
        seq_lens_cpu_upper_bound=torch.from_numpy(seq_upper),
        block_table=views.block_table,
        slot_mapping=views.slot_mapping,
        positions=views.positions,
        num_reqs=num_reqs_attn,
        num_real_reqs=num_reqs,
        num_actual_tokens=num_tokens_attn,
        max_query_len=max_query_len,
        max_seq_len=int(seq_upper.max()) if num_reqs_attn else 0,
        max_model_len=max_model_len,
        causal=causal,
    )


def _write_uniform_query_start_loc(views: AttentionInputBuffers, num_reqs: int,
                                   query_len: int) -> None:
    """``query_start_loc[i] = min(i, num_reqs) * query_len``, on the device: two small
    launches, where a copy would first pin host memory."""
    torch.clamp(views.request_index, max=num_reqs, out=views.query_start_loc)
    if query_len != 1:
        views.query_start_loc.mul_(query_len)


def _copy_query_start_loc(out: torch.Tensor, qsl_cpu: torch.Tensor) -> None:
    """Copy host offsets into ``out``. From page-locked memory the copy is queued and the
    host goes on; from pageable memory it would first wait for every earlier launch on the
    stream to finish. PyTorch's host allocator keeps the pinned block until the copy ran."""
    out.copy_(qsl_cpu.pin_memory() if out.is_cuda else qsl_cpu, non_blocking=True)


def uniform_query_start_loc(num_reqs: int, num_query_per_req: int) -> np.ndarray:
    """``[num_reqs + 1]`` offsets of a batch with ``num_query_per_req`` tokens per request."""
    return (np.arange(num_reqs + 1, dtype=np.int32) * num_query_per_req).astype(np.int32)


def build_uniform_attention_metadata(
    *,
    buffers: AttentionInputBuffers,
    batch_desc: BatchExecutionDescriptor,
    num_reqs: int,
    num_query_per_req: int,
    base_seq_lens_np: np.ndarray,
    step: int,
    max_model_len: int,
    causal: bool = True,
    offsets_on_device: bool = False,
) -> CommonAttentionMetadata:
    """:func:`build_attention_metadata` for a uniform layout (decode steps, DFlash blocks,
    padded first passes); the offsets are computed on the device, unless
    ``offsets_on_device`` says they are there already."""
    return build_attention_metadata(
        buffers=buffers,
        batch_desc=batch_desc,
        num_reqs=num_reqs,
        query_start_loc_np=uniform_query_start_loc(num_reqs, num_query_per_req),
        base_seq_lens_np=base_seq_lens_np,
        step=step,
        max_model_len=max_model_len,
        causal=causal,
        uniform_query_len=num_query_per_req,
        offsets_on_device=offsets_on_device,
    )


def at_later_draft_step(
    common: CommonAttentionMetadata, base_seq_lens_np: np.ndarray, step: int
) -> CommonAttentionMetadata:
    """``common`` (a decode step's metadata, built by :func:`build_attention_metadata`) as
    that function would build it for draft step ``step`` of the same batch, without its
    host work or device writes: the host upper bounds of the lengths and their maximum
    advanced; everything else, the device views included, shared (a draft step's device
    lengths, positions and slots are advanced in place by the steps before it)."""
    seq_upper = draft_seq_lens_upper_bound(
        base_seq_lens_np, common.num_real_reqs, common.num_reqs, step, common.max_model_len
    )
    return dataclasses.replace(
        common,
        seq_lens_cpu_upper_bound=torch.from_numpy(seq_upper),
        max_seq_len=int(seq_upper.max()) if common.num_reqs else 0,
    )
