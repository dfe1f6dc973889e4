"""Construct speculators wired to backends through ``matrix.yaml``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from speccheck.contract.builder import AttentionMetadataBuilder, BufferAllocator, zeros_allocator
from speccheck.contract.dcp import DcpRank
from speccheck.contract.matrix_model import Matrix
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.attention_setup import build_attention_groups
from speccheck.speculator.autoregressive import AutoregressiveSpeculator
from speccheck.speculator.base import SpeculatorOptions
from speccheck.speculator.dflash import DFlashSpeculator
from speccheck.speculator.drafter_kind import DrafterKind
from speccheck.speculator.kv_cache import PagedKVCache
from speccheck.speculator.model import DrafterConfig, DraftModel


def create_speculator(
    kind: DrafterKind | str,
    layer_backends: Sequence[str],
    config: RuntimeConfig,
    drafter: DrafterConfig,
    device: torch.device,
    options: SpeculatorOptions = SpeculatorOptions(),
    *,
    matrix: Matrix,
    builder_overrides: dict[str, type[AttentionMetadataBuilder[Any]]] | None = None,
    buffer_allocator: BufferAllocator = zeros_allocator,
    speculator_cls: type[AutoregressiveSpeculator | DFlashSpeculator] | None = None,
    claim_fused: bool = False,
    kv_cache: PagedKVCache | None = None,
    dcp: DcpRank | None = None,
) -> AutoregressiveSpeculator | DFlashSpeculator:
    """``kind`` is a :class:`DrafterKind` (or its value); layer ``i`` of the drafter runs on
    backend ``layer_backends[i]`` (one name repeats for a single-backend model), as
    ``matrix`` declares it. ``speculator_cls`` swaps in a subclass of the kind's speculator
    (the DP regression plants the seed-004 bug with one); ``builder_overrides`` and
    ``claim_fused`` are passed to :func:`build_attention_groups`; ``kv_cache`` is shared
    instead of allocated (see :class:`~speccheck.speculator.base.DraftModelSpeculator`);
    ``dcp`` makes this process one rank of a real DCP group: its builders hold the rank's
    share of the KV cache and merge attention across the group (see
    :func:`build_attention_groups`)."""
    kinds: dict[DrafterKind, type[AutoregressiveSpeculator | DFlashSpeculator]] = {
        DrafterKind.AUTOREGRESSIVE: AutoregressiveSpeculator, DrafterKind.DFLASH: DFlashSpeculator,
    }
    try:
        kind = DrafterKind(kind)
    except ValueError:
        raise ValueError(f"unknown speculator kind {kind!r}; valid: "
                         f"{', '.join(DrafterKind)}") from None
    cls = speculator_cls or kinds[kind]
    if not issubclass(cls, kinds[kind]):
        raise TypeError(f"{cls.__name__} is not a {kinds[kind].__name__}")
    if len(layer_backends) != drafter.num_layers:
        raise ValueError(
            f"{len(layer_backends)} layer backends for a drafter of {drafter.num_layers} layers"
        )
    tokens_per_req = config.num_speculative_steps + 1 if kind is DrafterKind.DFLASH else 1
    groups = build_attention_groups(
        layer_backends,
        drafter.layer_spec(config.block_size, config.max_model_len),
        config,
        device,
        options.limits(tokens_per_req),
        matrix=matrix,
        builder_overrides=builder_overrides,
        buffer_allocator=buffer_allocator,
        claim_fused=claim_fused,
        dcp=dcp,
        non_causal=cls.attends_non_causally,
    )
    return cls(DraftModel(drafter, device), groups, config, device, options, kv_cache=kv_cache)
