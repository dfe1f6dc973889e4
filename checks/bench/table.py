"""A report for people: a rich table on a terminal, one plain line per row in logs.

Both show, per path, K and batch size: wall, host and GPU ms per propose, graph replays
per propose, capture seconds and graph memory, the wall / host / GPU ratios to the
per-step row, the GPU time of one decode step against the weight-read bound, and how many
call sites in the launch may wait for the device (``-`` where a figure was not measured)."""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from speccheck.checks.bench.records import BASELINE_PATH, BenchReport, BenchRow

MIB = 1 << 20


def fmt(value: float | None, digits: int = 3) -> str:
    """``value`` with ``digits`` decimals, or ``-`` when it was not measured."""
    return "-" if value is None else f"{value:.{digits}f}"


def graph_mib(row: BenchRow) -> str:
    """Graph memory as ``allocated/reserved`` MiB, or ``-`` off CUDA."""
    if row.graph_allocated_bytes is None or row.graph_reserved_bytes is None:
        return "-"
    return f"{row.graph_allocated_bytes / MIB:.1f}/{row.graph_reserved_bytes / MIB:.1f}"


@dataclass(frozen=True)
class Column:
    """A column's header (table, markdown) and key (plain lines)."""

    header: str
    key: str


_BASE = BASELINE_PATH.value
COLUMNS = (
    Column("path", "path"), Column("K", "k"), Column("batch", "batch"),
    Column("wall ms", "wall_ms"), Column("host ms", "host_ms"), Column("GPU ms", "gpu_ms"),
    Column("replays/propose", "replays"), Column("capture s", "capture_s"),
    Column("graph MiB alloc/resv", "graph_mib"), Column(f"wall / {_BASE}", "wall_ratio"),
    Column(f"host / {_BASE}", "host_ratio"), Column(f"GPU / {_BASE}", "gpu_ratio"),
    Column("step GPU ms", "step_gpu_ms"), Column("step / weight-read bound", "step_over_bound"),
    Column("launch syncs", "launch_syncs"),
)


def row_cells(report: BenchReport, row: BenchRow) -> tuple[str, ...]:
    """One row's cells, in :data:`COLUMNS` order."""
    ratios = report.ratios(row)
    return (row.path.value, str(row.k), str(row.batch), fmt(row.wall_ms), fmt(row.host_ms),
            fmt(row.gpu_ms), fmt(row.replays_per_propose, 2), fmt(row.capture_s, 2),
            graph_mib(row), fmt(ratios.wall, 2), fmt(ratios.host, 2), fmt(ratios.gpu, 2),
            fmt(row.step_gpu_ms, 4), fmt(report.step_over_bound(row), 2),
            str(len(row.launch_syncs)) if row.host_ms is not None else "-")


def title(report: BenchReport) -> str:
    return f"{report.backend} propose latency per call ({report.device})"


def bound_line(report: BenchReport) -> str | None:
    """The weight-read bound of a decode step and how it was derived, or ``None``."""
    bound = report.weight_read_bound_ms
    if bound is None or report.weight_bytes is None or report.bandwidth_gbps is None:
        return None
    return (f"weight-read bound of a decode step: {bound * 1e3:.1f} us "
            f"({report.weight_bytes / 1e6:.1f} MB of weights at {report.bandwidth_gbps:.0f} GB/s "
            f"measured copy bandwidth)")


def bench_table(report: BenchReport) -> Table:
    table = Table(title=title(report))
    for column in COLUMNS:
        table.add_column(column.header, justify="left" if column.key == "path" else "right")
    for row in report.rows:
        table.add_row(*row_cells(report, row))
    return table


def plain_lines(report: BenchReport) -> list[str]:
    """A title line, the bound line, then one line of ``key=value`` pairs per row."""
    bound = bound_line(report)
    return [title(report), *([bound] if bound else [])] + [
        " ".join(f"{column.key}={cell}"
                 for column, cell in zip(COLUMNS, row_cells(report, row), strict=True))
        for row in report.rows]


def sync_lines(report: BenchReport) -> list[str]:
    """One line per row whose launch may wait for the device, naming the sites."""
    return [f"{row.path.value} K={row.k} batch {row.batch}: the launch may wait for the "
            f"device at {'; '.join(row.launch_syncs)} (host time includes any such wait)"
            for row in report.rows if row.launch_syncs]
