"""The attention token-count rule (seed 004) and the two metadata builders every
speculator must use. No caller computes padding by hand.

The rule: a FULL graph replays a captured shape in which every padded request owns a full
query, so attention covers the descriptor's padded ``num_tokens``. In PIECEWISE and eager
mode the descriptor may carry graph or data-parallel padding that no request owns, so
attention covers only the real ``query_start_loc[-1]``. Getting this wrong in eager mode is
what made FlashInfer raise ``q.shape[0] (52) does not match qo_indptr[-1] (48)`` under DP.
"""

from __future__ import annotations

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
    out[:num_reqs] = np.minimum(base_seq_lens_np[:num_reqs].astype(np.int64) + step, max_model_len)
    return out


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
) -> CommonAttentionMetadata:
    """Common metadata for one attention call, following the token-count rule.

    Host work only (never call it inside graph capture): writes the padded query offsets
    into ``buffers.query_start_loc`` and returns views of the persistent buffers sized to
    the attention request and token counts. ``buffers.seq_lens``, ``positions``,
    ``slot_mapping`` and ``block_table`` are owned by the caller and only viewed here.
    """
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
    qsl_cpu = torch.from_numpy(qsl)
    if buffers.query_start_loc.is_cuda:
        # From page-locked memory the copy is queued and the host goes on; from pageable
        # memory it would first wait for every earlier launch on the stream to finish.
        # PyTorch's host allocator keeps the block until the copy has run.
        qsl_cpu = qsl_cpu.pin_memory()
    buffers.query_start_loc[: num_reqs_attn + 1].copy_(qsl_cpu, non_blocking=True)
    query_lens = np.diff(qsl[: num_reqs + 1])
    if batch_desc.uniform_token_count is not None:
        max_query_len = batch_desc.uniform_token_count
    else:
        max_query_len = int(query_lens.max()) if num_reqs else 0
    return CommonAttentionMetadata(
        query_start_loc=buffers.query_start_loc[: num_reqs_attn + 1],
        query_start_loc_cpu=qsl_cpu,
        seq_lens=buffers.seq_lens[:num_reqs_attn],
        seq_lens_cpu_upper_bound=torch.from_numpy(seq_upper),
        block_table=buffers.block_table[:num_reqs_attn],
        slot_mapping=buffers.slot_mapping[:num_tokens_attn],
        positions=buffers.positions[:num_tokens_attn],
        num_reqs=num_reqs_attn,
        num_real_reqs=num_reqs,
        num_actual_tokens=num_tokens_attn,
        max_query_len=max_query_len,
        max_seq_len=int(seq_upper.max()) if num_reqs_attn else 0,
        max_model_len=max_model_len,
        causal=causal,
    )


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
) -> CommonAttentionMetadata:
    """:func:`build_attention_metadata` for a uniform layout (decode steps, DFlash blocks)."""
    return build_attention_metadata(
        buffers=buffers,
        batch_desc=batch_desc,
        num_reqs=num_reqs,
        query_start_loc_np=uniform_query_start_loc(num_reqs, num_query_per_req),
        base_seq_lens_np=base_seq_lens_np,
        step=step,
        max_model_len=max_model_len,
        causal=causal,
    )
