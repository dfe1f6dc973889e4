"""The claims audit of the oracle run (``declared_fields``): derived tensors that change
between its steps must be declared in the matrix entry's step-dependent fields, and every
declared field must exist."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from speccheck.checks.verify.comparisons import Outcome
from speccheck.checks.probes.state_walk import attribute_storages, changed_paths
from speccheck.checks.verify.step_recorder import metadata_path
from speccheck.checks.verify.vocabulary import Check, Result
from speccheck.contract.groups import AttentionGroup
from speccheck.speculator.autoregressive import AutoregressiveSpeculator


def input_storages(spec: AutoregressiveSpeculator) -> set[int]:
    """Storage addresses of the speculator's own input buffers: metadata views of them are
    advanced by the speculator, not derived by the backend."""
    return attribute_storages(spec.buffers)


def declared_fields(
    groups: Sequence[AttentionGroup], oracle: Mapping[int, Mapping[str, torch.Tensor]],
    storage_of: Mapping[str, int], inputs: set[int],
) -> list[Outcome]:
    """Claims audit of the oracle run, whose recorded steps are ``oracle`` (step -> path ->
    tensor): derived tensors that change between its steps must be declared in the matrix
    entry's step-dependent fields (``refreshed_fields``, ``invalidated_caches``), and every
    declared field must exist. Views of the speculator's own input buffers (storages
    ``inputs``, :func:`input_storages`) are not derived (the speculator advances them), and
    a persistent buffer behind a declared field is covered by that declaration.
    ``storage_of`` maps paths to storage addresses as the oracle run saw them: a candidate
    may bind the same field to another buffer (one per host_preplanned step)."""
    if len(oracle) < 2:
        return [Outcome(Check.DECLARED_FIELDS, Result.SKIPPED, "fewer than two draft steps")]
    snapshots = [oracle[s] for s in sorted(oracle)]
    changed = changed_paths(snapshots)
    out: list[Outcome] = []
    for group in groups:
        builder = type(group.builder).__name__
        where = f"the matrix entry {group.backend_name!r} (draft_decode.refreshed_fields)"
        prefix = metadata_path(group.backend_name, "")
        declared = {prefix + f for f in group.step_dependent_fields}
        for path in sorted(declared - set(snapshots[0])):
            out.append(Outcome(Check.DECLARED_FIELDS, Result.FAILED,
                               f"{where} declares step-dependent field "
                               f"{path[len(prefix):]!r}, which the metadata of {builder} "
                               "does not have", field=path))
        covered = inputs | {storage_of[p] for p in declared if p in storage_of}
        for path in sorted(changed - declared):
            if path.startswith(group.backend_name + ".") and storage_of[path] not in covered:
                out.append(Outcome(Check.DECLARED_FIELDS, Result.FAILED,
                                   f"{path} changes between draft steps but {where} does "
                                   "not declare it", field=path))
    return out or [Outcome(Check.DECLARED_FIELDS, Result.PASSED)]
