"""The ranks' process group: which collectives :func:`run_ranks` picks (a pure function of
CUDA, NCCL and the GPU count), how a backend string is read per device type, the DP sync
over a device-mapped group on two real gloo ranks, and — on a machine with two GPUs — one
rank per GPU over gloo (CPU) + NCCL (CUDA).

The rank functions run in spawned processes, which import them from this module by name
(the ``repo_on_path`` fixture puts the repository root on ``sys.path``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from speccheck.contract.cudagraph import BatchExecutionDescriptor as Desc
from speccheck.contract.cudagraph import CUDAGraphMode
from speccheck.speculator.collectives import (
    Collectives,
    backend_for_device,
    choose_collectives,
    rank_collectives,
)
from speccheck.speculator.dp_launch import rank_device, run_ranks
from speccheck.speculator.dp_sync import DPSyncState, cpu_collective_backend, sync_dp_padding

ROOT = Path(__file__).resolve().parents[1]
GLOO, MIXED = Collectives.GLOO, Collectives.GLOO_CPU_NCCL_CUDA
TWO_GPUS = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices (one DP rank per GPU over NCCL)"
)


@pytest.fixture(scope="module")
def repo_on_path() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT))
        yield


# ---------------------------------------------------------------- the choice


@pytest.mark.parametrize(
    ("world", "cuda", "gpus", "nccl", "expected"),
    [
        (2, False, 0, False, GLOO),  # CPU machine
        (2, False, 0, True, GLOO),  # NCCL built in, no CUDA device
        (2, True, 1, True, GLOO),  # one GPU: the ranks share it, NCCL would refuse
        (4, True, 2, True, GLOO),  # fewer GPUs than ranks
        (2, True, 2, True, MIXED),  # one GPU per rank
        (2, True, 8, True, MIXED),  # more GPUs than ranks
        (4, True, 4, True, MIXED),
        (2, True, 2, False, GLOO),  # a CUDA torch built without NCCL
        (1, True, 1, True, GLOO),  # one rank has no peer
        (1, False, 0, False, GLOO),
    ],
)
def test_collectives_are_a_function_of_cuda_nccl_and_the_gpu_count(
    world: int, cuda: bool, gpus: int, nccl: bool, expected: Collectives
) -> None:
    got = choose_collectives(world, cuda_available=cuda, device_count=gpus, nccl_available=nccl)
    assert got is expected
    if got.one_gpu_per_rank:  # rank r runs on cuda:(r mod gpus) = cuda:r, never a shared GPU
        assert len({r % gpus for r in range(world)}) == world


def test_the_choice_refuses_impossible_inputs() -> None:
    with pytest.raises(ValueError, match="world_size=0"):
        choose_collectives(0, cuda_available=True, device_count=2, nccl_available=True)
    with pytest.raises(ValueError, match="device_count=-1"):
        choose_collectives(2, cuda_available=True, device_count=-1, nccl_available=True)


def test_the_enum_values_are_init_process_group_backends() -> None:
    assert GLOO.backend == "gloo" and not GLOO.one_gpu_per_rank
    assert MIXED.backend == "cpu:gloo,cuda:nccl" and MIXED.one_gpu_per_rank
    assert backend_for_device(MIXED.backend, "cpu") == "gloo"
    assert backend_for_device(MIXED.backend, "cuda") == "nccl"


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks a machine with under two GPUs")
def test_this_machine_keeps_gloo_and_refuses_forced_nccl(repo_on_path: None) -> None:
    assert rank_collectives(2) is GLOO
    with pytest.raises(ValueError, match="one GPU for each of the 2 ranks"):
        run_ranks(_backend_of, 2, (), timeout_s=60, collectives=MIXED)


# ---------------------------------------------------------------- reading backend strings


@pytest.mark.parametrize(
    ("backend", "device", "expected"),
    [
        ("gloo", "cpu", "gloo"),
        ("gloo", "cuda", "gloo"),
        ("nccl", "cpu", None),
        ("nccl", "cuda", "nccl"),
        ("mpi", "cpu", "mpi"),
        ("cpu:gloo,cuda:nccl", "cpu", "gloo"),
        ("cpu:gloo,cuda:nccl", "cuda", "nccl"),
        ("CUDA:NCCL, CPU:GLOO", "cpu", "gloo"),
        ("cuda:nccl", "cpu", None),
        ("cpu:gloo", "cuda", None),
        ("undefined", "cpu", None),
    ],
)
def test_backend_for_device(backend: str, device: str, expected: str | None) -> None:
    assert backend_for_device(backend, device) == expected


def test_a_malformed_device_map_is_refused() -> None:
    with pytest.raises(ValueError, match="entry 'cuda' is not 'device:backend'"):
        backend_for_device("cpu:gloo,cuda", "cpu")
    with pytest.raises(ValueError, match="entry 'cpu:' is not"):
        backend_for_device("cpu:", "cpu")


def test_the_dp_sync_accepts_a_cpu_backend_and_refuses_a_group_without_one() -> None:
    assert cpu_collective_backend("gloo") == "gloo"
    assert cpu_collective_backend("cpu:gloo,cuda:nccl") == "gloo"
    for backend in ("nccl", "cuda:nccl"):
        with pytest.raises(ValueError, match=f"backend '{backend}' has no backend for CPU") as err:
            cpu_collective_backend(backend)
        assert "\n" not in str(err.value)


# ---------------------------------------------------------------- two real gloo ranks

ROUND = ((Desc(CUDAGraphMode.NONE, 12, None, 4), 3), (Desc(CUDAGraphMode.NONE, 20, None, 4), 5))
AGREED = DPSyncState((20, 20), 4, CUDAGraphMode.NONE, 5)
DEVICE_MAP = "cpu:gloo,cuda:gloo"
"""A device-mapped group, the form of ``cpu:gloo,cuda:nccl``, that a CPU-only torch builds."""


def _backend_of(dp_rank: int, dp_size: int) -> str:
    return str(dist.get_backend())


def _sync_over_device_map(dp_rank: int, dp_size: int) -> dict[str, Any]:
    group = dist.new_group(backend=DEVICE_MAP)
    return {
        "default": str(dist.get_backend()),
        "group": str(dist.get_backend(group)),
        "state": sync_dp_padding(*ROUND[dp_rank], dp_rank, dp_size, group=group),
    }


def test_the_sync_runs_over_a_device_mapped_group(repo_on_path: None) -> None:
    ranks = run_ranks(_sync_over_device_map, 2, (), timeout_s=60, collectives=GLOO)
    for rank in ranks:
        assert rank["default"] == "gloo"
        assert rank["group"] == DEVICE_MAP, "dist.get_backend returns the device map as given"
        assert rank["state"] == AGREED


# ---------------------------------------------------------------- one rank per GPU


def _nccl_rank(dp_rank: int, dp_size: int) -> dict[str, Any]:
    """The group's backend, the current and the rank's device, a CUDA all-reduce (NCCL) and
    the DP sync (gloo)."""
    device = rank_device(dp_rank)
    summed = torch.full((4,), float(dp_rank + 1), device=device)
    dist.all_reduce(summed)
    return {
        "backend": str(dist.get_backend()),
        "current": torch.cuda.current_device(),
        "device": str(device),
        "summed": summed.cpu().tolist(),
        "state": sync_dp_padding(*ROUND[dp_rank], dp_rank, dp_size),
    }


@pytest.mark.cuda
@TWO_GPUS
def test_two_gpus_give_each_rank_its_own_gpu_over_nccl(repo_on_path: None) -> None:
    assert rank_collectives(2) is MIXED
    ranks = run_ranks(_nccl_rank, 2, (), timeout_s=120)
    for r, rank in enumerate(ranks):
        assert rank["backend"] == MIXED.backend
        assert rank["current"] == r and rank["device"] == f"cuda:{r}"
        assert rank["summed"] == [3.0] * 4, "the CUDA all-reduce over NCCL"
        assert rank["state"] == AGREED, "the CPU all-reduce over gloo"
