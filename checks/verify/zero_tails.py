"""The zero-tail check: after a run, every persistent buffer's rows past what the last
metadata uses are zero (each builder declares the used extents,
``persistent_buffer_extents``). It runs after the oracle's per-step run as well as after
each candidate's: a configuration that falls back to the per-step path (triton_mla under
DCP) has no candidate on the CPU tier, and its builds' tails are read by the per-step
graphs on the GPU."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from speccheck.checks.probes import check_zero_tail
from speccheck.checks.verify.comparisons import Outcome
from speccheck.checks.verify.vocabulary import Check, Result
from speccheck.contract.groups import AttentionGroup


def zero_tail_buffers(
    groups: Sequence[AttentionGroup], metadata: Sequence[Any]
) -> list[torch.Tensor]:
    """The persistent buffers the builders of ``groups`` report a used extent for, given
    each group's ``metadata`` (in the order of ``groups``): their rows past the extent must
    be zero after every build."""
    return [group.builder.persistent_buffers()[name]
            for group, md in zip(groups, metadata, strict=True)
            for name in group.builder.persistent_buffer_extents(md)]


def zero_tails(
    groups: Sequence[AttentionGroup], last_metadata: Sequence[Any] | None, candidate: str
) -> list[Outcome]:
    """One outcome per zero-tail buffer of ``groups`` after ``candidate``'s run, whose last
    step recorded ``last_metadata`` (none when no decode step ran). The caller starts every
    example with these buffers poisoned whole, so a failure never depends on what earlier
    examples left there."""
    if last_metadata is None:
        return []
    out: list[Outcome] = []
    for group, md in zip(groups, last_metadata, strict=True):
        buffers = group.builder.persistent_buffers()
        for buffer_name, used in group.builder.persistent_buffer_extents(md).items():
            problem = check_zero_tail(buffers[buffer_name], used, name=buffer_name)
            if problem:
                out.append(Outcome(Check.ZERO_TAILS, Result.FAILED,
                                   f"{candidate}: {group.backend_name}: {problem} (every "
                                   "example starts with this buffer poisoned whole)", candidate,
                                   field=f"{group.backend_name}.buffers[{buffer_name!r}]"))
            else:
                out.append(Outcome(Check.ZERO_TAILS, Result.PASSED, candidate=candidate))
    return out
