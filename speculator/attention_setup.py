"""Attention groups built from ``matrix.yaml``: the only way a speculator gets a backend."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from typing import Any

import torch

from speccheck.contract.builder import (
    AttentionLayerSpec,
    AttentionMetadataBuilder,
    BufferAllocator,
    BuilderLimits,
    zeros_allocator,
)
from speccheck.contract.constraints import enforce_layer_constraints
from speccheck.contract.dcp import DcpRank
from speccheck.contract.groups import AttentionGroup
from speccheck.contract.matrix_model import Matrix
from speccheck.contract.resolution import resolve_backend
from speccheck.contract.runtime_config import Platform, RuntimeConfig


class BackendNotShipped(RuntimeError):
    """The matrix declares the backend but names no adapter to load."""


def machine_platform() -> Platform:
    """The platform this process runs attention on: ``rocm`` for a HIP build of torch with
    a device (torch calls its devices ``cuda`` there too), ``cuda`` with an NVIDIA device,
    else ``cpu``."""
    if not torch.cuda.is_available():
        return "cpu"
    return "rocm" if torch.version.hip else "cuda"


def device_name(device: torch.device) -> str:
    """How reports name ``device``: the GPU's model, or ``CPU (no CUDA device)``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "CPU (no CUDA device)"


def unrunnable_reason(backend_name: str, platform: str, matrix: Matrix) -> str | None:
    """Why ``backend_name`` cannot be built on ``platform`` (``cuda``/``cpu``) according to
    ``matrix``, or ``None`` when it can be."""
    entry = matrix.backend(backend_name)
    if entry.implementation is None:
        return f"no adapter shipped in speccheck for {backend_name}"
    if platform not in entry.platforms:
        missing = " (no CUDA device)" if platform == "cpu" else ""
        return (f"{backend_name} runs on {', '.join(entry.platforms)}; this machine offers "
                f"{platform}{missing}")
    return None


def builder_class(backend_name: str, matrix: Matrix) -> type[AttentionMetadataBuilder[Any]]:
    """The builder class ``matrix`` names for ``backend_name`` (``module:Class``)."""
    entry = matrix.backend(backend_name)
    if entry.implementation is None:
        raise BackendNotShipped(f"backend {backend_name!r} has no adapter shipped in speccheck")
    module_name, _, class_name = entry.implementation.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def holds_dcp_share(cls: type[AttentionMetadataBuilder[Any]]) -> bool:
    """Whether builders of ``cls`` can hold one rank's share of a real DCP group's KV cache:
    their constructor takes the keyword ``dcp`` (a
    :class:`~speccheck.contract.dcp.DcpRank`). Otherwise ``dcp_world_size`` is a
    configuration value only for them."""
    return "dcp" in inspect.signature(cls).parameters


def build_attention_groups(
    layer_backends: Sequence[str],
    layer: AttentionLayerSpec,
    config: RuntimeConfig,
    device: torch.device,
    limits: BuilderLimits,
    *,
    matrix: Matrix,
    builder_overrides: dict[str, type[AttentionMetadataBuilder[Any]]] | None = None,
    buffer_allocator: BufferAllocator = zeros_allocator,
    claim_fused: bool = False,
    dcp: DcpRank | None = None,
    non_causal: bool = False,
) -> list[AttentionGroup]:
    """One group per distinct backend, in order of first use; layer ``i`` runs
    ``layer_backends[i]``. Each builder's ``supports_draft_decode_metadata_update`` is
    ``matrix``'s answer for ``config``, and each group carries the entry's refresh strategy,
    CUDA-graph support and step-dependent fields. ``builder_overrides`` swaps the class of a
    backend (the verifier's mutants) while keeping the matrix's capability for its name;
    ``buffer_allocator`` backs the builders' persistent buffers. ``claim_fused`` grants
    every builder the refresh capability whatever the matrix says: the claims audit
    (``speccheck verify --audit-claims``) uses it to try a fused path the matrix forbids.

    ``dcp`` (a rank of a real DCP group, ``world_size == config.dcp_world_size``) goes to
    every builder, which must then hold its rank's share of the KV cache: a builder whose
    constructor takes no ``dcp`` keyword raises ``ValueError``. Without one,
    ``dcp_world_size`` is a configuration value only. ``non_causal``: the drafter builds
    non-causal passes (DFlash blocks), which a ``causal_only`` entry refuses
    (:func:`~speccheck.contract.constraints.causality_failures`).
    """
    if dcp is not None and dcp.world_size != config.dcp_world_size:
        raise ValueError(f"a DCP rank of a group of {dcp.world_size} under dcp_world_size="
                         f"{config.dcp_world_size}")
    groups: dict[str, AttentionGroup] = {}
    for index, name in enumerate(layer_backends):
        if name not in groups:
            cls = (builder_overrides or {}).get(name) or builder_class(name, matrix)
            entry = matrix.backend(name)
            resolution = resolve_backend(entry, config)
            enforce_layer_constraints(entry, config, layer, non_causal)
            share: dict[str, DcpRank] = {}
            if dcp is not None:
                if not holds_dcp_share(cls):
                    raise ValueError(
                        f"{name}: {cls.__name__} holds no share of a DCP group's KV cache (its "
                        "constructor takes no dcp keyword); run it without a DCP rank")
                share = {"dcp": dcp}
            builder = cls(
                layer, config, device, limits,
                supports_draft_decode_metadata_update=claim_fused or resolution.fused_multi_step,
                buffer_allocator=buffer_allocator, **share,
            )
            groups[name] = AttentionGroup(
                name, builder, (), entry.draft_decode.refresh_strategy,
                entry.cudagraph_support, entry.draft_decode.step_dependent_fields,
                entry.draft_decode.refresh_rebuilds,
            )
        group = groups[name]
        group.layer_indices = (*group.layer_indices, index)
    return list(groups.values())
