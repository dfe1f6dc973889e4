"""Agreement among the ranks of a DCP group: a decision every rank must take the same way
(stop an example, stop a run), or the ranks wait in different collectives."""

from __future__ import annotations

import torch
import torch.distributed as dist


def any_rank(flag: bool, group: dist.ProcessGroup) -> bool:
    """Whether ``flag`` is set on any rank of ``group``: one all-reduce of a CPU tensor,
    which every rank of ``group`` must call at the same point."""
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())
