"""What a verification runs at by default, per machine tier: the runtime config, how large
the batches it draws may be, and the draft step counts. Torch-free: the command line shows
these defaults without importing the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from speccheck.checks.verify.vocabulary import Tier

MAX_REQUESTS = 1024
"""Most requests in one batch (an example's, and the largest capture size)."""

MAX_NEW_TOKENS = 1024
"""Most new tokens of one request."""


@dataclass(frozen=True)
class HarnessScale:
    """How large the batches a verification draws may be: the search space, and what the
    harness allocates for it."""

    capture_sizes: tuple[int, ...]
    """Padded request counts the harness captures graphs for (and pads eager runs to); the
    largest is the most requests an example may have (``speccheck verify
    --capture-sizes``)."""
    max_new_tokens: int
    """Most tokens one request brings to the first (prefill) pass (``--max-new-tokens``);
    the drafter's prefill budget is this many per request of the largest capture size."""


TIER_SCALE: dict[Tier, HarnessScale] = {
    Tier.GPU: HarnessScale(capture_sizes=(1, 2, 4, 8, 16, 32, 64), max_new_tokens=16),
    Tier.CPU: HarnessScale(capture_sizes=(1, 2, 4, 8), max_new_tokens=3),
}
"""Default scale per machine tier: serving-scale batches on the GPU, small ones under the
CPU tier's Triton interpreter."""

DEFAULT_CAPTURE_SIZES = TIER_SCALE[Tier.CPU].capture_sizes
"""What :class:`~speccheck.checks.verify.engine.VerifySettings` takes when not told."""
DEFAULT_MAX_NEW_TOKENS = TIER_SCALE[Tier.CPU].max_new_tokens

TIER_DEFAULTS: dict[Tier, dict[str, object]] = {
    Tier.GPU: {"platform": "cuda", "cudagraph_mode": "full", "dtype": "bfloat16",
               "head_size": 128, "num_heads": 16, "num_kv_heads": 4, "block_size": 16,
               "max_model_len": 32768},
    Tier.CPU: {"platform": "cpu", "cudagraph_mode": "none", "dtype": "float32",
               "head_size": 32, "num_heads": 4, "num_kv_heads": 2, "block_size": 4,
               "max_model_len": 64, "kv_lora_rank": 32, "qk_rope_head_dim": 16},
}
"""Runtime defaults per tier, overridden by a backend's ``verify_defaults`` and then by any
field given: a small drafter on the CPU (MLA layers too: a 32 + 16 latent instead of
DeepSeek's 512 + 64, which the Triton interpreter runs in seconds per example), a realistic
head layout and serving-scale lengths on the GPU."""

DEFAULT_STEPS = tuple(range(1, 9))
"""Draft step counts (K) drawn from when neither ``steps`` nor ``num_speculative_steps``
is given; K = 1 (no draft decode step, hence no fused path) is the control."""

DEFAULT_SHRINK_SECONDS = 120.0
"""How long a run shrinks a failure by default (``--shrink-seconds``); past it the smallest
failing example found so far is reported. Finding the failure does not depend on it."""

AUTO_JOBS = 2
"""Workers an automatic ``--jobs`` starts where the machine allows (:func:`default_jobs`).
A worker is one busy host thread feeding a mostly idle GPU, so a second one overlaps its
host work with the first's; from the third on, the processes contend for the one device
(time-sliced between their contexts) more than they overlap. Measured on an H200,
``verify --backend triton_attn --examples 200``: 36.0 s with one worker, 28.8 s with two,
32.9 s with four (docs/notes/verify-jobs.md)."""

EXAMPLES_PER_JOB = 50
"""Fewest examples a worker of an automatic ``--jobs`` gets: below this, a worker's fixed
cost (imports, breakpoint discovery, graph capture: about 10 s on the H200) outweighs its
share of the examples."""

DEVICE_GIB_PER_JOB = 32
"""Device memory an automatic ``--jobs`` asks per worker at 16-bit activations and the GPU
tier's drafter width (:data:`GPU_HIDDEN_SIZE`): each holds a serving-scale KV cache and its
fp32 reference's (at the GPU tier's defaults about 4 and 8 GiB), the snapshots the
comparisons take of them, and the graph pools. A margin, not a measured peak: two workers
ran side by side on a 140 GiB H200. At fp32 a worker asks twice as much, and as much again
per drafter or KV cache twice as wide (:func:`memory_jobs`): two fp32 workers held 34 and
44 GiB and ran an 80 GiB H100 out of memory (the reference's and triton_attn's
``dtype=float32`` cells, 4ea21a5), and so did two fp16 workers of the reference's 32-head
cell, at 36 and 42 GiB (db28504)."""

_GPU = TIER_DEFAULTS[Tier.GPU]

GPU_HIDDEN_SIZE = cast(int, _GPU["num_heads"]) * cast(int, _GPU["head_size"])
"""The drafter's ``hidden_size`` (``num_heads * head_size``) at the GPU tier's defaults:
its activations, its queries and attention outputs, and the fp32 reference's gathered
scores grow with it."""

GPU_KV_SIZE = cast(int, _GPU["num_kv_heads"]) * cast(int, _GPU["head_size"])
"""``num_kv_heads * head_size`` at the GPU tier's defaults: the KV caches (the run's and
its fp32 reference's) and their snapshots grow with it."""

_ACTIVATION_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of each activation dtype (torch-free: planning runs before torch is
imported)."""


def default_jobs(tier: Tier, examples: int, cpus: int, device_gib: float) -> int:
    """Worker processes per backend when ``--jobs`` is not given.

    GPU tier: :data:`AUTO_JOBS` where every worker gets :data:`EXAMPLES_PER_JOB` examples,
    two CPU cores and :data:`DEVICE_GIB_PER_JOB` GiB of the device; else one. CPU tier:
    one (its workers compete for the cores the Triton interpreter already fills). The
    examples are split among the workers, worker ``i`` drawing from ``seed + i``: the
    example count, hence the search's size, is the same whatever the worker count."""
    if tier is not Tier.GPU:
        return 1
    return max(1, min(AUTO_JOBS, examples // EXAMPLES_PER_JOB, cpus // 2,
                      memory_jobs(device_gib, "bfloat16")))


def memory_jobs(
    device_gib: float, dtype: str, hidden_size: int = GPU_HIDDEN_SIZE,
    kv_size: int = GPU_KV_SIZE,
) -> int:
    """Workers a device of ``device_gib`` GiB holds side by side at activations of
    ``dtype``, a drafter of ``hidden_size`` and KV heads of ``kv_size`` in all:
    :data:`DEVICE_GIB_PER_JOB` each at 16 bits and the GPU tier's widths, in proportion to
    the dtype and to the larger of the two widths' growth (at least one)."""
    growth = max(1.0, hidden_size / GPU_HIDDEN_SIZE, kv_size / GPU_KV_SIZE)
    per_job = DEVICE_GIB_PER_JOB * _ACTIVATION_BYTES[dtype] / 2 * growth
    return max(1, int(device_gib // per_job))
