"""The builder protocol's shared pieces: layer specs, persistent-buffer allocation, defaults."""

from __future__ import annotations

import pytest
import torch

from speccheck.backends.reference.builder import ReferenceMetadataBuilder
from speccheck.contract.builder import AttentionLayerSpec, AttentionMetadataBuilder, BuilderLimits
from speccheck.contract.runtime_config import RuntimeConfig

LAYER = AttentionLayerSpec(4, 2, 16, torch.float32, 4, 32)


def test_layer_spec_rejects_ungrouped_heads() -> None:
    with pytest.raises(ValueError, match="num_heads=6 must be a multiple of num_kv_heads=4"):
        AttentionLayerSpec(6, 4, 64, torch.float32, 16, 64)


def test_layer_spec_rounds_blocks_per_request_up() -> None:
    assert AttentionLayerSpec(4, 2, 16, torch.float32, 5, 32).max_blocks_per_req == 7


def test_persistent_buffers_come_from_the_allocator_and_are_listed() -> None:
    seen: list[str] = []

    def allocator(name, shape, dtype, device):
        seen.append(name)
        return torch.full(shape, 0, dtype=dtype, device=device)

    builder = ReferenceMetadataBuilder(LAYER, RuntimeConfig(), torch.device("cpu"),
                                       BuilderLimits(4, 4), buffer_allocator=allocator)
    buf = builder.allocate_persistent("x", (3,), torch.int32)
    assert seen == ["x"] and builder.persistent_buffers()["x"] is buf
    with pytest.raises(ValueError, match="already has a persistent buffer 'x'"):
        builder.allocate_persistent("x", (3,), torch.int32)


def test_defaults_refuse_what_a_builder_did_not_implement() -> None:
    class Bare(ReferenceMetadataBuilder):
        update_draft_decode_metadata = AttentionMetadataBuilder.update_draft_decode_metadata

    builder = Bare(LAYER, RuntimeConfig(), torch.device("cpu"), BuilderLimits(4, 4))
    assert builder.supports_draft_decode_metadata_update is False
    with pytest.raises(NotImplementedError, match="in-graph draft-decode metadata refresh"):
        builder.update_draft_decode_metadata(None)
    with pytest.raises(NotImplementedError, match="host_preplanned"):
        builder.plan_draft_steps([])
