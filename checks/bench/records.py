"""The figures of one benchmark run and their JSON form.

A :class:`BenchRow` is one decode path at one K and batch size; a :class:`BenchReport` is
every row of one backend with what they were measured on (device, torch, commit, runtime
config, drafter). :meth:`BenchReport.to_json` and :meth:`BenchReport.from_json` round-trip;
the JSON also carries each row's :class:`Ratios` to the per-step path, for readers (they
are recomputed from the rows, never read back).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from speccheck.speculator.autoregressive import DecodePath

BASELINE_PATH = DecodePath.PER_STEP
_RENAMED_PATHS = {"preplanned": DecodePath.HOST_PREPLANNED}
"""Path names in reports written before the host_preplanned path took the matrix's word."""
"""What every ratio divides by: the eager per-step rebuild the verifier takes as oracle."""


@dataclass(frozen=True)
class BenchRow:
    """One path at one K and batch size; times per ``launch`` and the copy of its tokens back in ms.

    ``host_ms`` (the launching thread's time to queue the work, unprofiled: the launch
    without the copy of the tokens back) and ``gpu_ms`` (device busy time) are ``None``
    without CUDA, where the launch runs the work itself; ``graph_*_bytes`` (CUDA memory
    allocated and reserved across ``capture()``) too. ``capture_s`` and the graph memory belong to
    the case's speculator, which captures every path's graphs at once: the rows of one K
    and batch repeat them."""

    path: DecodePath
    k: int
    batch: int
    wall_ms: float
    host_ms: float | None
    gpu_ms: float | None
    replays_per_propose: float
    capture_s: float
    graph_allocated_bytes: int | None
    graph_reserved_bytes: int | None
    step_gpu_ms: float | None = None
    """GPU time of one decode step at this K and batch (the single-step graph replayed
    alone; :func:`~speccheck.checks.bench.roofline.decode_step_gpu_ms`), the case's, so
    the rows of one K and batch repeat it; ``None`` without CUDA graphs."""
    launch_syncs: tuple[str, ...] = ()
    """Where the launch may wait for the device (``op at file:line``; CUDA only: a scalar
    read, a copy to the host, a copy from pageable host memory, ...); any such wait is in
    ``host_ms``. Empty for a launch that only queues work."""

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "path": self.path.value, "launch_syncs": list(self.launch_syncs)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BenchRow:
        known = {f.name for f in fields(cls)}
        values = {name: value for name, value in data.items() if name in known}
        path = _RENAMED_PATHS.get(data["path"]) or DecodePath(data["path"])
        return cls(**{**values, "path": path,
                      "launch_syncs": tuple(data.get("launch_syncs", ()))})


@dataclass(frozen=True)
class Ratios:
    """A row's figures divided by the per-step row's at the same K and batch; ``None``
    where either figure is missing (or there is no per-step row)."""

    wall: float | None
    host: float | None
    gpu: float | None


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


_OPTIONAL = frozenset({"weight_bytes", "bandwidth_gbps"})
"""Report fields that reports written before they existed lack."""


@dataclass(frozen=True)
class BenchReport:
    """Every row of one backend, in measurement order (K, then batch, then path)."""

    backend: str
    device: str
    torch_version: str
    commit: str
    command: str
    config: Mapping[str, Any]
    """The runtime config, without ``num_speculative_steps`` (each row has its K)."""
    drafter: Mapping[str, Any]
    """The drafter and the batch: vocabulary, layers, context and new tokens per request."""
    repeats: int
    warmup_rounds: int
    rows: tuple[BenchRow, ...]
    weight_bytes: int | None = None
    """Bytes of the weights one decode step reads (every parameter but the embedding)."""
    bandwidth_gbps: float | None = None
    """The device's measured copy bandwidth (GB/s); ``None`` without CUDA."""

    @property
    def weight_read_bound_ms(self) -> float | None:
        """The least GPU time a decode step can take: its weights read once."""
        if self.weight_bytes is None or not self.bandwidth_gbps:
            return None
        return self.weight_bytes / (self.bandwidth_gbps * 1e9) * 1e3

    def step_over_bound(self, row: BenchRow) -> float | None:
        """``row``'s decode-step GPU time over :attr:`weight_read_bound_ms`."""
        return _ratio(row.step_gpu_ms, self.weight_read_bound_ms)

    @property
    def steps(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(row.k for row in self.rows))

    @property
    def batches(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(row.batch for row in self.rows))

    @property
    def paths(self) -> tuple[DecodePath, ...]:
        return tuple(dict.fromkeys(row.path for row in self.rows))

    def ratios(self, row: BenchRow) -> Ratios:
        """``row`` against the per-step row of its K and batch."""
        base = next((r for r in self.rows if r.path is BASELINE_PATH and r.k == row.k
                     and r.batch == row.batch), None)
        if base is None:
            return Ratios(None, None, None)
        return Ratios(_ratio(row.wall_ms, base.wall_ms), _ratio(row.host_ms, base.host_ms),
                      _ratio(row.gpu_ms, base.gpu_ms))

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "rows"}
        data["config"], data["drafter"] = dict(self.config), dict(self.drafter)
        data["rows"] = [{**row.to_json(), "ratios": asdict(self.ratios(row))}
                        for row in self.rows]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BenchReport:
        """The report of :meth:`to_json`'s output. Raises ``KeyError``, ``TypeError`` or
        ``ValueError`` when ``data`` is not one."""
        values = {f.name: data[f.name] for f in fields(cls)
                  if f.name != "rows" and (f.name in data or f.name not in _OPTIONAL)}
        return cls(**values, rows=tuple(BenchRow.from_json(row) for row in data["rows"]))
