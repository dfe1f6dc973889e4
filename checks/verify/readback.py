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


class HostCopyPlan:
    """:func:`host_copies` of a fixed list of contiguous tensors, with the per-tensor work
    (grouping, flattening, sizes) done once, for a caller that reads the same tensors back
    again and again (the step recorder's snapshot buffers, once per run). Valid while every
    tensor keeps its storage, shape and dtype: a caller that replaces one builds a new plan.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.count = len(tensors)
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, tensor in enumerate(tensors):
            if not tensor.is_contiguous():
                raise ValueError(f"tensor {i} of a host-copy plan is not contiguous")
            groups.setdefault((tensor.dtype, tensor.device), []).append(i)
        self._groups = [
            (members, [tensors[i].detach().view(-1) for i in members],
             [tensors[i].numel() for i in members], [tensors[i].shape for i in members])
            for members in groups.values()
        ]

    def copies(self) -> list[torch.Tensor]:
        """Contiguous host copies of the tensors, in order, sharing no memory with them
        (the copies of one dtype are views of one host tensor); one transfer per dtype.

        From a device, each transfer lands in page-locked memory (PyTorch's caching host
        allocator hands back blocks of earlier read-backs once their copies are freed): a
        fresh pageable tensor would be faulted in page by page during the copy, which cost
        a FlashInfer verify run more than the transfers themselves."""
        out: list[torch.Tensor] = [torch.empty(0)] * self.count
        streams = []
        for members, flats, sizes, shapes in self._groups:
            flat = torch.cat(flats)
            if flat.is_cuda:
                host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                host.copy_(flat, non_blocking=True)
                streams.append(torch.cuda.current_stream(flat.device))
            else:
                host = flat
            for i, part, shape in zip(members, host.split(sizes), shapes, strict=True):
                out[i] = part.view(shape)
        for stream in streams:
            stream.synchronize()
        return out


def host_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous host copies of ``tensors``, in order, sharing no memory with them (the
    copies of one dtype are views of one host tensor): the tensors of each (dtype, device)
    are concatenated on their device and read back in one copy, then split."""
    return HostCopyPlan([tensor.contiguous() for tensor in tensors]).copies()
