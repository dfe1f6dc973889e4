"""The attention call runs traced too (issue 43, item 1): on the CPU tier the probed
candidate's every ``forward()`` runs under an emulated capture, so a host synchronisation
in it fails ``host_sync`` with its file and line, while the same adapter without it, and
reference attention's capture path, pass."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

import speccheck
from speccheck.backends.reference.attention import paged_attention_reference
from speccheck.checks.probes import HostSyncRecorder
from speccheck.checks.verify.vocabulary import Check, Status
from speccheck.contract.capture_state import capturing, emulated_capture
from tests.fixtures.adapters import forward_sync
from tests.fixtures.catch import CATCH

FORWARD_SYNC = Path(forward_sync.__file__).with_suffix(".yaml")


def _item_site() -> str:
    """``file:line`` of the fixture's ``.item()`` call."""
    lines, first = inspect.getsourcelines(forward_sync.ItemInForwardImpl.forward)
    (offset,) = [i for i, line in enumerate(lines) if ".item()" in line]
    return f"{forward_sync.__file__}:{first + offset}"


def test_item_in_forward_fails_host_sync_at_the_defaults_naming_file_and_line() -> None:
    report = speccheck.verify("item_in_forward", matrix=FORWARD_SYNC, **CATCH)
    assert report.status is Status.FAILED
    verdict = {v.check: v for v in report.verdicts("item_in_forward")}[Check.HOST_SYNC]
    assert verdict.status is Status.FAILED
    assert f"{_item_site()}: attention forward calls Tensor.item in forward()" in verdict.message
    assert "cannot be captured in a CUDA graph" in verdict.message


def test_the_same_adapter_without_the_host_read_passes_at_the_defaults() -> None:
    report = speccheck.verify("clean_forward", matrix=FORWARD_SYNC)
    assert report.passed, report.summary_lines()
    verdict = {v.check: v for v in report.verdicts("clean_forward")}[Check.HOST_SYNC]
    assert verdict.status is Status.PASSED


def _paged_batch() -> tuple[torch.Tensor, ...]:
    """Two requests (lengths 5 and 3, one new token each) over a 4-block paged cache."""
    torch.manual_seed(0)
    key_cache = torch.randn(4, 4, 2, 8)
    value_cache = torch.randn(4, 4, 2, 8)
    query = torch.randn(2, 4, 8)
    query_start_loc = torch.tensor([0, 1, 2], dtype=torch.int32)
    seq_lens = torch.tensor([5, 3], dtype=torch.int32)
    block_table = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    return query, key_cache, value_cache, query_start_loc, seq_lens, block_table


def test_an_emulated_capture_takes_reference_attentions_capture_path() -> None:
    """Outside a capture, reference attention reads the lengths back (its eager path);
    under :func:`emulated_capture` it reads nothing and computes the same attention."""
    batch = _paged_batch()
    with HostSyncRecorder() as eager:
        expected = paged_attention_reference(*batch, 0.5, True)
    with emulated_capture(), HostSyncRecorder() as emulated:
        assert capturing()
        got = paged_attention_reference(*batch, 0.5, True)
    assert not capturing()
    assert eager.findings() and emulated.findings() == []
    torch.testing.assert_close(got, expected)
