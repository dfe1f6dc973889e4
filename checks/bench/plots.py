"""PNG plots of a report: per K, one figure of three panels (wall, host and GPU ms per
propose against the batch size), one line per path. Needs matplotlib, an optional extra
(``pip install 'speccheck[bench]'``); :func:`matplotlib_missing` says so before a run
starts."""

from __future__ import annotations

import enum
import importlib.util
from pathlib import Path

from speccheck.checks.bench.records import BenchReport, BenchRow

INSTALL_HINT = "pip install 'speccheck[bench]' (or: pip install matplotlib)"


class Figure(enum.Enum):
    """The panels of a plot: a row's figure in ms, and its label."""

    WALL = ("wall_ms", "wall ms")
    HOST = ("host_ms", "host ms")
    GPU = ("gpu_ms", "GPU ms")

    def value_of(self, row: BenchRow) -> float | None:
        value: float | None = getattr(row, self.value[0])
        return value

    @property
    def label(self) -> str:
        return self.value[1]


def matplotlib_missing() -> str | None:
    """Why ``--plots`` cannot work here (one line, with the install command), or ``None``."""
    if importlib.util.find_spec("matplotlib") is None:
        return f"--plots needs matplotlib, which is not installed: {INSTALL_HINT}"
    return None


def plot_path(directory: Path, report: BenchReport, k: int) -> Path:
    return directory / f"{report.backend}-k{k}.png"


def write_plots(report: BenchReport, directory: Path) -> list[Path]:
    """Write one PNG per K of ``report`` into ``directory`` (created if missing) and
    return their paths. A panel whose figure was not measured (host and GPU time without
    CUDA) says so instead of plotting. Raises ``ModuleNotFoundError`` without
    matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for k in report.steps:
        fig, axes = plt.subplots(1, len(Figure), figsize=(5 * len(Figure), 4), squeeze=False)
        for ax, figure in zip(axes[0], Figure, strict=True):
            ax.set_title(f"{figure.label}, K={k}")
            ax.set_xlabel("batch (requests)")
            ax.set_ylabel(f"{figure.label} per propose")
            plotted = False
            for path in report.paths:
                points = [(row.batch, figure.value_of(row)) for row in report.rows
                          if row.k == k and row.path is path]
                measured = [(batch, value) for batch, value in points if value is not None]
                if measured:
                    ax.plot(*zip(*measured, strict=True), marker="o", label=path.value)
                    plotted = True
            if plotted:
                ax.set_xscale("log", base=2)
                ax.set_xticks(list(report.batches), labels=[str(b) for b in report.batches])
                ax.set_ylim(bottom=0)
                ax.legend()
            else:
                ax.set_xticks([])
                ax.set_yticks([])
                ax.text(0.5, 0.5, "not measured (no CUDA)", ha="center", va="center",
                        transform=ax.transAxes)
        fig.suptitle(f"{report.backend} on {report.device}, commit {report.commit[:12]}")
        fig.tight_layout()
        target = plot_path(directory, report, k)
        fig.savefig(target, dpi=100)
        plt.close(fig)
        written.append(target)
    return written
