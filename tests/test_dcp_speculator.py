"""The speculator over a real DCP group: two gloo ranks, each holding its interleaved share
of the KV cache (token ``t`` on rank ``t % 2``), draft what one rank holding the whole cache
drafts, on the per-step and the fused path, for reference and triton_attn (Triton in the
interpreter on CPU). A builder whose refresh keeps step 1's DCP-local lengths drafts
differently on the fused path. The rank function runs in spawned processes, which import
it from this module by name."""

from __future__ import annotations

import functools
from typing import cast

import pytest
import torch
import torch.distributed as dist

from speccheck.backends.reference.builder import ReferenceMetadataBuilder
from speccheck.checks.selftest.dcp_mutants import STALE_DCP_BUILDERS
from speccheck.checks.verify.kv_share import whole_cache_start
from speccheck.contract.builder import (
    AttentionLayerSpec,
    BufferAllocator,
    BuilderLimits,
    zeros_allocator,
)
from speccheck.contract.dcp import DcpRank
from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.autoregressive import AutoregressiveSpeculator, DecodePath
from speccheck.speculator.base import SpeculatorOptions
from speccheck.speculator.batch import DraftBatch
from speccheck.speculator.dflash import DFlashSpeculator
from speccheck.speculator.dp_launch import run_ranks
from speccheck.speculator.factory import create_speculator
from speccheck.speculator.model import DrafterConfig

WORLD = 2
K = 4
DRAFTER = DrafterConfig(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_size=16,
                        intermediate_size=64, seed=5)
OPTIONS = SpeculatorOptions(capture_sizes=(4,), max_num_prefill_tokens=40, num_blocks=40,
                            pad_to_capture_sizes=True, first_pass_query_lens=(1, 2))
BATCH = DraftBatch(
    context_lens=(0, 0, 0),
    new_tokens=((3, 1, 4, 1, 5, 9, 2, 6, 5), (7, 7, 1, 8, 2), (11, 3, 3, 8, 1, 9, 4)),
    block_table=((5, 9, 2, 11), (20, 3, 14), (30, 7, 8)),
    seeds=(1, 2, 3),
)
"""Three requests, empty contexts (every KV entry comes from the first pass, so each rank's
share is written by the model itself), one padding lane, rows across block boundaries."""


def _config(dcp_world_size: int) -> RuntimeConfig:
    return RuntimeConfig(platform="cpu", cudagraph_mode="none", num_speculative_steps=K,
                         block_size=4, max_model_len=32, dtype="float32", head_size=16,
                         num_heads=4, num_kv_heads=2, dcp_world_size=dcp_world_size)


def _speculator(backend: str, dcp: DcpRank | None, stale: bool) -> AutoregressiveSpeculator:
    overrides = {backend: STALE_DCP_BUILDERS[backend]} if stale else None
    spec = create_speculator("autoregressive", [backend] * DRAFTER.num_layers,
                             _config(dcp.world_size if dcp else 1), DRAFTER,
                             torch.device("cpu"), OPTIONS, matrix=load_matrix(),
                             builder_overrides=overrides, dcp=dcp)
    assert isinstance(spec, AutoregressiveSpeculator)
    return spec


def _drafts(spec: AutoregressiveSpeculator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for path in (DecodePath.PER_STEP, DecodePath.FUSED):
        result = spec.propose(BATCH, path)
        out[path.value] = (result.draft_tokens, result.logits)
    return out


def rank_drafts(rank: int, world: int, backend: str, stale: bool
                ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One DCP rank: a speculator over the default (gloo) group, drafting ``BATCH``."""
    spec = _speculator(backend, DcpRank(rank, world, dist.group.WORLD), stale)
    return _drafts(spec)


@functools.cache
def _single_rank(backend: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return _drafts(_speculator(backend, None, stale=False))


@pytest.mark.parametrize("backend", ["reference", "triton_attn"])
def test_two_dcp_ranks_draft_what_one_rank_drafts(backend: str) -> None:
    expected = _single_rank(backend)
    assert torch.equal(expected["per_step"][0], expected["fused"][0])
    for rank, drafts in enumerate(run_ranks(rank_drafts, WORLD, (backend, False), timeout_s=240)):
        for path, (tokens, logits) in drafts.items():
            assert torch.equal(tokens, expected[path][0]), (rank, path)
            torch.testing.assert_close(logits, expected[path][1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["reference", "triton_attn"])
def test_stale_dcp_local_lengths_change_the_fused_drafts(backend: str) -> None:
    """Per step, the stale builder's fresh builds are right; fused, its refresh keeps step
    1's local lengths and the later steps attend to the wrong share."""
    expected = _single_rank(backend)
    for drafts in run_ranks(rank_drafts, WORLD, (backend, True), timeout_s=240):
        torch.testing.assert_close(drafts["per_step"][1], expected["per_step"][1],
                                   rtol=1e-4, atol=1e-4)
        assert not torch.allclose(drafts["fused"][1], expected["fused"][1], rtol=1e-4, atol=1e-4)


DFLASH_BATCH = DraftBatch(
    context_lens=(6, 13, 0),
    new_tokens=((1, 2), (3,), (4, 5, 6)),
    block_table=((5, 9, 2), (20, 3, 14, 30, 7), (8, 11)),
    seeds=(1, 2, 3),
)
"""DFlash blocks (1 + K tokens each, attended non-causally) over contexts of random KV, one
of them empty."""
KV_SEED = 7


def _dflash(backend: str, dcp: DcpRank | None) -> DFlashSpeculator:
    world = dcp.world_size if dcp else 1
    spec = create_speculator("dflash", [backend] * DRAFTER.num_layers, _config(world), DRAFTER,
                             torch.device("cpu"), OPTIONS, matrix=load_matrix(), dcp=dcp)
    assert isinstance(spec, DFlashSpeculator)
    spec.kv_cache.fill_random_(KV_SEED)
    return spec


def rank_dflash_drafts(rank: int, world: int, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One DCP rank drafting ``DFLASH_BATCH`` with the DFlash drafter, its cache's share
    filled with the noise of ``KV_SEED``."""
    result = _dflash(backend, DcpRank(rank, world, dist.group.WORLD)).propose(DFLASH_BATCH)
    return result.draft_tokens, result.logits


@pytest.mark.parametrize("backend", ["reference", "triton_attn"])
def test_two_dcp_ranks_draft_dflash_blocks_as_one_rank_does(backend: str) -> None:
    """The only non-causal attention under DCP: each rank's share masked by its local
    lengths alone (no causal bound clips a position past them). Verify runs the DFlash
    drafter on data-parallel ranks only, never under DCP; a reference that let each rank see
    one local position past its length (`<` -> `<=`) passed it and fails here."""
    alone = _dflash(backend, None)
    alone.kv_cache.restore(whole_cache_start(
        alone.kv_cache.snapshot(), DFLASH_BATCH, alone.config.block_size, WORLD))
    expected = alone.propose(DFLASH_BATCH)
    for rank, (tokens, logits) in enumerate(
            run_ranks(rank_dflash_drafts, WORLD, (backend,), timeout_s=240)):
        assert torch.equal(tokens, expected.draft_tokens), rank
        torch.testing.assert_close(logits, expected.logits, rtol=1e-4, atol=1e-4)


class _WithoutShare(ReferenceMetadataBuilder):
    """A builder whose constructor takes no ``dcp`` keyword (as fa3's and triton_mla's)."""

    def __init__(self, layer: AttentionLayerSpec, config: RuntimeConfig, device: torch.device,
                 limits: BuilderLimits, *, supports_draft_decode_metadata_update: bool = False,
                 buffer_allocator: BufferAllocator = zeros_allocator) -> None:
        super().__init__(layer, config, device, limits, buffer_allocator=buffer_allocator,
                         supports_draft_decode_metadata_update=supports_draft_decode_metadata_update)


def test_a_builder_without_a_dcp_share_is_refused() -> None:
    unused_group = cast(dist.ProcessGroup, object())  # refused before any collective
    with pytest.raises(ValueError, match="_WithoutShare holds no share of a DCP group's KV"):
        create_speculator("autoregressive", ["reference"] * DRAFTER.num_layers, _config(2),
                          DRAFTER, torch.device("cpu"), OPTIONS, matrix=load_matrix(),
                          builder_overrides={"reference": _WithoutShare},
                          dcp=DcpRank(0, 2, unused_group))
    with pytest.raises(ValueError, match="a DCP rank of a group of 2 under dcp_world_size=1"):
        create_speculator("autoregressive", ["reference"] * DRAFTER.num_layers, _config(1),
                          DRAFTER, torch.device("cpu"), OPTIONS, matrix=load_matrix(),
                          dcp=DcpRank(0, 2, unused_group))
