"""A process's place in decode context parallelism (DCP), as the speculator hands it to the
builders of backends that hold a real share of the KV cache.

A pure record: the layout, the local lengths and the merge of the ranks' partials are the
backends' (``speccheck.backends.dcp``). It lives here because whoever constructs the
builders (the speculator, which imports only the contract) creates it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class DcpRank:
    """DCP rank ``rank`` of ``world_size``, and ``group``, the process group whose members
    are exactly the DCP ranks (group rank ``k`` is DCP rank ``k``), over which the ranks'
    partial attention outputs are all-gathered. ``group`` may be ``None`` only at
    ``world_size == 1`` (nothing to gather).

    A builder that takes one (keyword ``dcp``) must get ``world_size ==
    config.dcp_world_size``; without one, ``dcp_world_size`` is a configuration value only.
    """

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"dcp rank {self.rank} is not in [0, {self.world_size})")
        if self.world_size > 1 and self.group is None:
            raise ValueError(f"dcp_world_size={self.world_size} needs a process group")

    def check_group(self) -> None:
        """Raise ``ValueError`` unless ``group`` has ``world_size`` members and this process
        is its member ``rank`` (host calls, no communication; run at construction)."""
        if self.group is None:
            return
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if (size, rank) != (self.world_size, self.rank):
            raise ValueError(f"DCP rank {self.rank} of {self.world_size} runs in a process "
                             f"group where it is rank {rank} of {size}")
