"""Decode context parallelism (DCP): the KV cache of every request split across ranks.

Contract, with ``N = dcp_world_size``: token position ``p`` of every request lives on rank
``p % N`` at local position ``p // N`` (interleaved shares), so a request of ``L`` tokens
holds :func:`dcp_local_lengths` of them on each rank. Queries are replicated: every rank
attends them over its own share only and yields a *partial* output, normalised over the keys
it saw, with the natural-log log-sum-exp of those keys' scaled scores (``-inf`` where it saw
none); :func:`merge_partials` combines the ranks' partials into the attention over all keys.

Local lengths are step-dependent metadata: they advance with the global lengths, but only
on the rank that receives the new token, which is why a builder that does not refresh them
between draft steps computes the wrong attention (the reason backends gate fused drafting on
``dcp_world_size == 1``).

Every function is capture-safe: fixed shapes, no host synchronisation, nothing persistent.
"""

from __future__ import annotations

import torch


def _held(lengths: torch.Tensor, rank: torch.Tensor | int, world: int) -> torch.Tensor:
    """Positions ``< lengths`` that ``rank`` holds: ``max(0, ceil((L - rank) / world))``."""
    return ((lengths - rank + world - 1) // world).clamp(min=0)


def dcp_local_lengths(seq_lens: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """How many of each request's positions ``< seq_lens`` rank ``rank`` of ``world`` holds:
    ``max(0, ceil((L - rank) / world))``, in ``seq_lens``' dtype and device.

    ``rank`` and ``world`` are host integers (configuration, not data); a new tensor is
    returned, so a builder that keeps the field persistent copies it into its buffer.
    """
    if not 0 <= rank < world:
        raise ValueError(f"dcp rank {rank} is not in [0, {world})")
    return _held(seq_lens, rank, world).to(seq_lens.dtype)


def dcp_local_length_table(seq_lens: torch.Tensor, world: int) -> torch.Tensor:
    """:func:`dcp_local_lengths` of every rank at once: ``[num_reqs, world]``, column ``r``
    rank ``r``'s (rank 0 holds ``ceil(L / world)``), for a process that simulates all the
    ranks (``triton_mla``)."""
    ranks = torch.arange(world, device=seq_lens.device, dtype=seq_lens.dtype)
    return _held(seq_lens[:, None], ranks[None, :], world)


def merge_partials(outputs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """The attention over all ranks' keys from each rank's partial: ``outputs`` ``[N, T, H, D]``
    and ``lses`` ``[N, T, H]``, fp32, rank ``k``'s output normalised over its own keys and
    ``lses[k]`` their log-sum-exp.

    ``lse = logsumexp_k lses[k]`` and ``out = sum_k exp(lses[k] - lse) * outputs[k]``. A rank
    whose ``lse`` is ``-inf`` (it saw no key) contributes nothing whatever its output holds;
    rows that no rank saw give zeros, never NaN (their weights are NaN, and all masked).
    Returns ``[T, H, D]`` fp32.
    """
    weights = torch.exp(lses - torch.logsumexp(lses, dim=0))[..., None]
    return torch.where(torch.isneginf(lses)[..., None], 0.0, weights * outputs).sum(dim=0)
