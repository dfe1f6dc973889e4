"""Declared refreshed fields whose value reaches no output are reported as latent, once per
run (``latent_fields``); a field the attention reads is not."""

from __future__ import annotations

import torch

from speccheck.checks.selftest.mutants import DERIVED_FIELD, DerivedBuilder
from speccheck.checks.selftest.run import verify_builder
from speccheck.checks.verify.vocabulary import Check, Status


def test_a_derived_field_no_kernel_reads_is_latent_and_the_run_still_passes() -> None:
    """``DerivedBuilder``'s ``kv_lens_plus_one`` is right, refreshed and read by nothing."""
    report = verify_builder(DerivedBuilder, torch.device("cpu"), shrink_seconds=10.0)
    assert report.status is Status.PASSED, report.failures
    assert report.latent_fields == [f"reference.metadata.{DERIVED_FIELD}"]
    assert report.checks[Check.LATENT_FIELDS].passed == 1


def test_fields_the_attention_reads_are_not_latent() -> None:
    """The shipped reference entry refreshes ``dcp_local_seq_lens`` and ``slot_mapping``;
    without DCP they are ``seq_lens`` and the speculator's slots, which reach the outputs."""
    report = verify_builder(DerivedBuilder, torch.device("cpu"), shrink_seconds=10.0,
                            declares=("kv_lens_plus_one", "slot_mapping", "dcp_local_seq_lens"))
    assert report.latent_fields == [f"reference.metadata.{DERIVED_FIELD}"]
    assert report.checks[Check.LATENT_FIELDS].passed == 3
