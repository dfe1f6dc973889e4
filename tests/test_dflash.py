"""The DFlash-style drafter: uniform metadata through the helper, and padding that never
changes the drafts."""

from __future__ import annotations

import torch

from speccheck.contract.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.base import SpeculatorOptions
from speccheck.speculator.batch import DraftBatch
from speccheck.speculator.dflash import DFlashSpeculator
from speccheck.speculator.factory import create_speculator
from speccheck.speculator.model import DrafterConfig

MATRIX = load_matrix()

DRAFTER = DrafterConfig(vocab_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_size=16,
                        intermediate_size=64, seed=5)
CONFIG = RuntimeConfig(platform="cpu", cudagraph_mode="none", num_speculative_steps=3,
                       block_size=4, max_model_len=40, dtype="float32", head_size=16,
                       num_heads=2, num_kv_heads=1)


def _dflash() -> DFlashSpeculator:
    spec = create_speculator("dflash", ["reference"] * 2, CONFIG, DRAFTER, torch.device("cpu"),
                             SpeculatorOptions(capture_sizes=(1, 2, 4, 8), num_blocks=64), matrix=MATRIX)
    assert isinstance(spec, DFlashSpeculator)
    spec.kv_cache.fill_random_(0)
    return spec


BATCH = DraftBatch((6, 20, 0), ((1, 2), (3,), (4, 5, 6)), ((1, 2, 3), tuple(range(4, 11)), (11, 12)), (1, 2, 3))


def test_block_metadata_is_uniform_and_non_causal() -> None:
    spec = _dflash()
    spec.propose(BATCH)
    md = spec.last_common_metadata
    assert md is not None and not md.causal
    assert md.query_start_loc_cpu.tolist() == [0, 4, 8, 12]
    assert md.num_actual_tokens == 12 and md.max_query_len == 4
    assert md.seq_lens_cpu_upper_bound.tolist() == [8 + 3, 20 + 4, 3 + 3]


def test_eager_padding_to_an_agreed_count_keeps_real_attention_tokens_and_drafts() -> None:
    spec = _dflash()
    start = spec.kv_cache.snapshot()
    alone = spec.propose(BATCH)
    spec.kv_cache.restore(start)
    padded = BatchExecutionDescriptor(CUDAGraphMode.NONE, 5 * 4, None, 4)
    together = spec.propose(BATCH, padded)
    md = spec.last_common_metadata
    assert md is not None
    assert md.num_actual_tokens == 12, "eager attention covers the real query_start_loc[-1]"
    assert torch.equal(alone.draft_tokens, together.draft_tokens)
    assert alone.draft_tokens.shape == (3, 3)
