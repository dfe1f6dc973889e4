"""Which ``torch.distributed`` backends a group of ranks on one host uses, and what a
backend string says about a device type.

- :class:`Collectives` names the two choices :func:`~speccheck.speculator.dp_launch.run_ranks`
  makes: plain gloo (ranks may share a device), or gloo for CPU tensors with NCCL for CUDA
  tensors (one GPU per rank: NCCL refuses two ranks on one GPU).
- :func:`choose_collectives` is the choice as a pure function of the machine's facts;
  :func:`rank_collectives` asks torch for those facts.
- :func:`backend_for_device` reads a backend string as ``dist.get_backend`` returns it
  (``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``) for one device type.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist


class Collectives(enum.Enum):
    """The default process group of a run of ranks; the value is the ``backend`` argument of
    ``torch.distributed.init_process_group``."""

    GLOO = "gloo"
    """Every collective over gloo (TCP on loopback); ranks may share a device."""
    GLOO_CPU_NCCL_CUDA = "cpu:gloo,cuda:nccl"
    """CPU tensors over gloo, CUDA tensors over NCCL; every rank on a GPU of its own."""

    @property
    def backend(self) -> str:
        """The ``init_process_group`` backend string."""
        return self.value

    @property
    def one_gpu_per_rank(self) -> bool:
        """Whether rank ``r`` must own ``cuda:r`` (made current before the group is joined)."""
        return self is Collectives.GLOO_CPU_NCCL_CUDA


def choose_collectives(
    world_size: int, *, cuda_available: bool, device_count: int, nccl_available: bool
) -> Collectives:
    """:attr:`Collectives.GLOO_CPU_NCCL_CUDA` when there is more than one rank, CUDA and NCCL
    are available and there are at least ``world_size`` GPUs; else :attr:`Collectives.GLOO`
    (no CUDA, fewer GPUs than ranks so that ranks share one, or a single rank, which has no
    peer to reach). Pure.

    Raises ``ValueError`` if ``world_size < 1`` or ``device_count < 0``.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if device_count < 0:
        raise ValueError(f"device_count={device_count} must be >= 0")
    if world_size > 1 and cuda_available and nccl_available and device_count >= world_size:
        return Collectives.GLOO_CPU_NCCL_CUDA
    return Collectives.GLOO


def rank_collectives(world_size: int) -> Collectives:
    """:func:`choose_collectives` for this machine (CUDA availability, GPU count and whether
    this torch was built with NCCL)."""
    cuda = torch.cuda.is_available()
    return choose_collectives(
        world_size, cuda_available=cuda, device_count=torch.cuda.device_count() if cuda else 0,
        nccl_available=dist.is_nccl_available(),
    )


def backend_for_device(backend: str, device_type: str) -> str | None:
    """The backend that handles ``device_type`` tensors in a group whose backend string is
    ``backend``, or ``None`` if none does.

    ``backend`` is either a device map, ``"cpu:gloo,cuda:nccl"`` (the entry for
    ``device_type``, if any), or one backend name, ``"gloo"`` (that backend if
    ``torch.distributed.Backend.backend_capability`` lists ``device_type`` for it). Case is
    ignored. Raises ``ValueError`` for a device map entry that is not ``device:backend``.
    """
    text = backend.strip().lower()
    if ":" not in text:
        capable = dist.Backend.backend_capability.get(text, [])
        return text if device_type in capable else None
    backends: dict[str, str] = {}
    for entry in text.split(","):
        device, sep, name = (part.strip() for part in entry.partition(":"))
        if not (sep and device and name):
            raise ValueError(
                f"backend {backend!r}: entry {entry.strip()!r} is not 'device:backend'"
            )
        backends[device] = name
    return backends.get(device_type)
