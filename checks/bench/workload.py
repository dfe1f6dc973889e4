"""What one benchmark case (backend, K, batch size) runs on: a speculator captured for
exactly that batch size, a batch of identical requests, and the paths the backend allows.

Every request has ``context`` tokens in the cache and brings :data:`NEW_TOKENS` to the
first pass; its block-table row covers exactly the positions the K draft steps write, in
blocks of its own, so the KV cache holds ``batch * blocks_per_row + 1`` blocks (the sink
included) however long ``max_model_len`` is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from speccheck.backends.availability import BackendUnavailable
from speccheck.checks.bench.errors import BackendCannotRun, BenchInputError
from speccheck.contract.constraints import ConstraintViolation
from speccheck.contract.matrix_model import KvLayout, Matrix
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.attention_setup import machine_platform, unrunnable_reason
from speccheck.speculator.autoregressive import AutoregressiveSpeculator, DecodePath
from speccheck.speculator.base import SpeculatorOptions
from speccheck.speculator.batch import DraftBatch
from speccheck.speculator.factory import create_speculator
from speccheck.speculator.model import DrafterConfig

NEW_TOKENS = (1, 2)
"""The tokens each request brings to the first pass (the target's accepted tokens)."""
DEFAULT_CONTEXT = 200
"""Tokens already cached per request, unless ``max_model_len`` is shorter."""
NUM_LAYERS = 2
VOCAB_SIZE = {"cuda": 32000, "cpu": 256}
"""Drafter vocabulary per device type: a real one on the GPU (the LM head is a large part
of a step), a small one on the CPU, where the run is a smoke test."""


def vocab_size_for(device: torch.device) -> int:
    return VOCAB_SIZE.get(device.type, VOCAB_SIZE["cpu"])


def context_for(config: RuntimeConfig, max_k: int) -> int:
    """:data:`DEFAULT_CONTEXT`, or less so that the first pass and ``max_k - 1`` decode
    steps fit ``config.max_model_len``. Raises :class:`BenchInputError` when not even an
    empty context fits."""
    room = config.max_model_len - len(NEW_TOKENS) - (max_k - 1)
    if room < 0:
        raise BenchInputError(
            f"--steps: K={max_k} needs max_model_len >= {len(NEW_TOKENS) + max_k - 1} "
            f"({len(NEW_TOKENS)} new tokens and {max_k - 1} decode steps per request), "
            f"got {config.max_model_len}")
    return min(DEFAULT_CONTEXT, room)


def blocks_per_row(config: RuntimeConfig, context: int) -> int:
    """Blocks one request's row needs for its context, new tokens and K-1 decode steps."""
    last = min(context + len(NEW_TOKENS) - 1 + config.num_speculative_steps - 1,
               config.max_model_len - 1)
    return last // config.block_size + 1


def bench_batch(config: RuntimeConfig, num_reqs: int, context: int) -> DraftBatch:
    """``num_reqs`` identical requests in disjoint blocks 1, 2, …; seed ``r`` for request
    ``r``."""
    per_row = blocks_per_row(config, context)
    rows = tuple(tuple(range(1 + r * per_row, 1 + (r + 1) * per_row)) for r in range(num_reqs))
    return DraftBatch((context,) * num_reqs, (NEW_TOKENS,) * num_reqs, rows,
                      tuple(range(num_reqs)))


def check_runnable(backend: str, matrix: Matrix) -> None:
    """Raise :class:`BackendCannotRun` when ``matrix`` says ``backend`` cannot run on
    this machine's platform (or names no adapter for it)."""
    why = unrunnable_reason(backend, machine_platform(), matrix)
    if why is not None:
        raise BackendCannotRun(why)


def build_speculator(backend: str, config: RuntimeConfig, num_reqs: int, context: int,
                     matrix: Matrix, device: torch.device) -> AutoregressiveSpeculator:
    """A two-layer autoregressive drafter on ``backend`` under ``config`` (its K
    included), with graphs (under ``cudagraph_mode=full``) for ``num_reqs`` requests only,
    the first pass among them (every request brings :data:`NEW_TOKENS`), and the
    host_preplanned path enabled where it applies. Raises
    :class:`BackendCannotRun` when the backend's kernel package is missing and
    :class:`BenchInputError` when its matrix entry does not admit ``config``."""
    layout = matrix.backend(backend).constraints.kv_layout or KvLayout.NHD
    drafter = DrafterConfig.for_runtime(config, vocab_size=vocab_size_for(device),
                                        num_layers=NUM_LAYERS, kv_layout=layout)
    options = SpeculatorOptions(
        capture_sizes=(num_reqs,), max_num_prefill_tokens=num_reqs * len(NEW_TOKENS),
        num_blocks=num_reqs * blocks_per_row(config, context) + 1, host_preplanned=True,
        first_pass_query_lens=(len(NEW_TOKENS),))
    try:
        spec = create_speculator("autoregressive", [backend] * NUM_LAYERS, config, drafter,
                                 device, options, matrix=matrix)
    except BackendUnavailable as exc:
        raise BackendCannotRun(str(exc)) from None
    except ConstraintViolation as exc:
        raise BenchInputError(" ".join(str(exc).split())) from None
    assert isinstance(spec, AutoregressiveSpeculator)
    return spec


def decode_paths(spec: AutoregressiveSpeculator) -> tuple[DecodePath, ...]:
    """The paths ``spec`` may take: per-step always; fused when the matrix lets it fuse
    under its config; host_preplanned when every group plans on the host or refreshes in-graph
    (:attr:`AutoregressiveSpeculator.host_preplanned_applies`). Per-step comes first."""
    paths = [DecodePath.PER_STEP]
    if spec.use_fused_multi_step_decode:
        paths.append(DecodePath.FUSED)
    if spec.host_preplanned_applies:
        paths.append(DecodePath.HOST_PREPLANNED)
    return tuple(paths)


@dataclass(frozen=True)
class CaptureCost:
    """What ``capture()`` took: seconds, and the CUDA memory allocated and reserved
    across it in bytes (``None`` off CUDA, where nothing is captured)."""

    seconds: float
    allocated_bytes: int | None
    reserved_bytes: int | None


def capture(spec: AutoregressiveSpeculator) -> CaptureCost:
    """Capture ``spec``'s graphs (a no-op without graphs) and measure the cost."""
    cuda = spec.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(spec.device)
        allocated, reserved = (torch.cuda.memory_allocated(spec.device),
                               torch.cuda.memory_reserved(spec.device))
    start = time.perf_counter()
    spec.capture()
    if cuda:
        torch.cuda.synchronize(spec.device)
    seconds = time.perf_counter() - start
    if not cuda:
        return CaptureCost(seconds, None, None)
    return CaptureCost(seconds, torch.cuda.memory_allocated(spec.device) - allocated,
                       torch.cuda.memory_reserved(spec.device) - reserved)
