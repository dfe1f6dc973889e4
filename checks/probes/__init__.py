"""Capture-safety probes for ``update_draft_decode_metadata`` (DESIGN.md, checks/ step 5).

The refresh runs between draft steps inside a captured CUDA graph, so it must emit only
capture-safe device work and write its results in place (``contract/builder.py``). These
probes find the ways it can break that contract:

- :class:`HostSyncRecorder` — host synchronisations (``.item()``, ``.tolist()``, ``bool()`` on
  a tensor, ``nonzero``, boolean-mask indexing, host copies, ...), each with its call site.
- :class:`AllocationRecorder` — new tensors created, and existing storage reallocated.
- :class:`IdentityGuard` — metadata tensors replaced by new objects instead of written in place.
- :func:`check_zero_tail` — persistent buffers whose unused tail must stay zero.
- :class:`GuardedBuffer` — poison-filled guard bands around a persistent buffer, to catch
  writes past either end (:class:`GuardedBufferSet` checks many at once); :func:`poison_` — the poison, also laid over every buffer under
  the zero-tail rule before every example, so that a tail a builder fails to zero shows at
  once.

The recorders trace with ``TorchFunctionMode`` and ``TorchDispatchMode``, so they work on CPU
tensors: on CPU CI the CPU plays the device, and a call that would synchronise on a GPU is
reported even though on the CPU it is free. Each probe reports :class:`ProbeFinding` records
whose message says what to change.

The walk over a builder's state that the probes and the verifier's comparisons share
(tensors and host values by attribute path, storage identity) is :mod:`.state_walk`.

All probes are verifier-side tools: their own checks synchronise, so use them around an eager
refresh (or a capture), never inside code that is itself being captured.
"""

from speccheck.checks.probes.allocation import AllocationEvent, AllocationRecorder
from speccheck.checks.probes.buffers import (
    DEFAULT_GUARD_ELEMENTS,
    GuardedBuffer,
    GuardedBufferSet,
    check_zero_tail,
    poison_,
)
from speccheck.checks.probes.findings import (
    ALLOCATION,
    GUARD_BAND,
    HOST_SYNC,
    REPLACED_TENSOR,
    ZERO_TAIL,
    ProbeFinding,
)
from speccheck.checks.probes.host_sync import HostSyncEvent, HostSyncRecorder
from speccheck.checks.probes.identity import IdentityGuard

__all__ = [
    "ALLOCATION",
    "DEFAULT_GUARD_ELEMENTS",
    "GUARD_BAND",
    "HOST_SYNC",
    "REPLACED_TENSOR",
    "ZERO_TAIL",
    "AllocationEvent",
    "AllocationRecorder",
    "GuardedBuffer",
    "GuardedBufferSet",
    "HostSyncEvent",
    "HostSyncRecorder",
    "IdentityGuard",
    "ProbeFinding",
    "check_zero_tail",
    "poison_",
]
