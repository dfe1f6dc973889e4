"""Attention metadata shared by every backend, and the persistent buffers it views."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionInputBuffers:
    """Device buffers that outlive every batch; captured graphs read them by address.

    Allocated once for the largest bucket and never reallocated. Anything a graph replay
    must see change (lengths, positions, slots, block tables) is written into these in place.

    - ``query_start_loc``: ``[max_num_reqs + 1]`` int32, cumulative query offsets.
    - ``seq_lens``: ``[max_num_reqs]`` int32, KV length of each request *including* the
      current step's tokens; 0 for padding lanes.
    - ``block_table``: ``[max_num_reqs, max_blocks_per_req]`` int32, physical block ids.
    - ``slot_mapping``: ``[max_num_tokens]`` int64, KV-cache slot written by each token.
    - ``positions``: ``[max_num_tokens]`` int64, rotary position of each token.
    - ``request_index``: ``[max_num_reqs + 1]`` int32, ``0, 1, 2, ...``: never written; the
      query offsets of a uniform batch are computed from it on the device.

    The buffers must never be rebound: :meth:`views` hands out the same view objects for the
    same sizes every time.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    request_index: torch.Tensor
    _views: dict[tuple[int, int], AttentionInputBuffers] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    def views(self, num_reqs: int, num_tokens: int) -> AttentionInputBuffers:
        """The buffers' heads for ``num_reqs`` requests and ``num_tokens`` tokens (views,
        same storage), made once per size: slicing costs host time on every build
        otherwise."""
        key = (num_reqs, num_tokens)
        views = self._views.get(key)
        if views is None:
            views = AttentionInputBuffers(
                query_start_loc=self.query_start_loc[: num_reqs + 1],
                seq_lens=self.seq_lens[:num_reqs], block_table=self.block_table[:num_reqs],
                slot_mapping=self.slot_mapping[:num_tokens],
                positions=self.positions[:num_tokens],
                request_index=self.request_index[: num_reqs + 1])
            self._views[key] = views
        return views

    @classmethod
    def allocate(
        cls, max_num_reqs: int, max_num_tokens: int, max_blocks_per_req: int, device: torch.device
    ) -> AttentionInputBuffers:
        return cls(
            query_start_loc=torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(max_num_reqs, dtype=torch.int32, device=device),
            block_table=torch.zeros(
                max_num_reqs, max_blocks_per_req, dtype=torch.int32, device=device
            ),
            slot_mapping=torch.zeros(max_num_tokens, dtype=torch.int64, device=device),
            positions=torch.zeros(max_num_tokens, dtype=torch.int64, device=device),
            request_index=torch.arange(max_num_reqs + 1, dtype=torch.int32, device=device),
        )


@dataclass
class CommonAttentionMetadata:
    """Backend-independent description of one attention call.

    Device tensors are *views* of :class:`AttentionInputBuffers`, sized to the attention
    request count ``num_reqs`` and token count ``num_actual_tokens`` chosen by
    :func:`speccheck.contract.token_count.build_attention_metadata`; they stay valid (same
    storage) across graph replays. Host values are upper bounds for the step the metadata
    was built for and must not be baked into captured work that outlives that step.
    """

    query_start_loc: torch.Tensor
    """``[num_reqs + 1]`` int32 on device; repeats its last real value past the real requests."""
    query_start_loc_cpu: torch.Tensor
    """Host copy of ``query_start_loc``."""
    seq_lens: torch.Tensor
    """``[num_reqs]`` int32 on device; advanced in place by draft steps."""
    seq_lens_cpu_upper_bound: torch.Tensor
    """``[num_reqs]`` int32 on host: base length + step, clamped at ``max_model_len``, zero
    in the padded tail. Optimistic: not the exact per-row length during fused replay."""
    block_table: torch.Tensor
    """``[num_reqs, max_blocks_per_req]`` int32 on device."""
    slot_mapping: torch.Tensor
    """``[num_actual_tokens]`` int64 on device."""
    positions: torch.Tensor
    """``[num_actual_tokens]`` int64 on device."""
    num_reqs: int
    """Requests the attention call covers (padded in FULL mode)."""
    num_real_reqs: int
    """Requests that own tokens; the rest are padding lanes."""
    num_actual_tokens: int
    """Tokens the attention call covers: the seed-004 rule."""
    max_query_len: int
    max_seq_len: int
    """Upper bound of ``seq_lens`` for this step."""
    max_model_len: int
    causal: bool = True
