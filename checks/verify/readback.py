"""Reading many small device tensors back to the host at once.

The verifier snapshots metadata field by field: a step's tensors number in the dozens, and
with a backend that keeps buffers per wrapper and batch size, in the hundreds. A ``.cpu()``
each is a device-to-host copy and a synchronisation each (tens of microseconds apiece, most
of a FlashInfer verify run's time). :func:`host_copies` reads them back in one transfer per
dtype and device instead. Verifier-side only: it synchronises.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def host_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous host copies of ``tensors``, in order, sharing no memory with them (the
    copies of one dtype are views of one host tensor): the tensors of each (dtype, device)
    are concatenated on their device and read back in one copy, then split."""
    copies: dict[int, torch.Tensor] = {}
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, tensor in enumerate(tensors):
        groups.setdefault((tensor.dtype, tensor.device), []).append(i)
    for members in groups.values():
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in members]).cpu()
        parts = flat.split([tensors[i].numel() for i in members])
        copies.update(zip(members, (part.view(tensors[i].shape)
                                    for i, part in zip(members, parts, strict=True))))
    return [copies[i] for i in range(len(tensors))]
