"""The seed PR's headline bug as a known-bad ``fa3`` builder: FA3's scheduler metadata
built for step 1 and never refreshed, so every later fused draft step replays step 1's
split schedule. FA3's output does not change with the schedule (measured on the H200), so
only ``step_metadata`` can catch it, on the field the entry declares. CUDA and
``fa3-fwd`` only: :mod:`~speccheck.checks.selftest.process_mutants` runs it through
verify's worker processes."""

from __future__ import annotations

from speccheck.backends.fa3.builder import FA3Metadata, FA3MetadataBuilder

SCHEDULE_FIELD = "fa3.metadata.scheduler_metadata"
"""The field the missing refresh leaves stale, as a ``step_metadata`` failure names it."""


class WithoutScheduleRefresh(FA3MetadataBuilder):
    """Builds compute the schedule; the draft-step refresh does nothing (the seed PR's
    FA3 builder before its fix)."""

    def update_draft_decode_metadata(self, metadata: FA3Metadata) -> None:
        """The refresh, removed."""
