"""What launching each captured graph of a bench case costs the host, and what the graph is
made of: for every graph the speculator captures (first pass, single step, fused, fused
propose, preplanned), its nodes by type (kernel, memset, memcpy, ...) from the graph's own
debug dump, and the host time of its ``replay()`` calls within real ``launch()`` calls on
every path the backend allows (median over rounds, the device drained before each round,
so no launch waits for a full queue; a graph replayed on its own would not have its
inputs rewritten between replays). CUDA only.

    python benchmarks/graph_launch.py --backend triton_attn [--steps 4,8] [--batches 1,64]
        [--rounds 50] [--json OUT]

Measured on an H200, a launch of these graphs (kernel nodes only, 32 to 390 of them) cost
the host 4 to 22 us whatever the node count (docs/notes/fused-launch-host-time.md).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from speccheck.checks.api import plan_verification
from speccheck.checks.bench.workload import (
    bench_batch,
    build_speculator,
    context_for,
    decode_paths,
)
from speccheck.checks.verify.context import MatrixContext

NODE_TYPE = re.compile(r'label="\{?(?:\\n)?([A-Z_]+)')
"""A node's label in CUDA's DOT dump starts with its type (``KERNEL``, ``MEMSET``,
``MEMCPY``, ``EMPTY``, ...)."""


def node_types(graph: torch.cuda.CUDAGraph, keep: Path | None) -> dict[str, int]:
    """The graph's nodes counted by type, from its DOT debug dump (kept at ``keep``)."""
    with tempfile.TemporaryDirectory() as folder:
        path = keep or Path(folder) / "graph.dot"
        graph.debug_dump(str(path))
        text = path.read_text(errors="replace")
    return dict(collections.Counter(NODE_TYPE.findall(text)))


def measure(backend: str, k: int, batch: int, rounds: int, dot_dir: Path | None
            ) -> tuple[list[dict[str, Any]], dict[str, dict[str, float]]]:
    """Each graph's row (nodes by type, median replay host time) and, per path, the median
    host time of a whole launch and the mean host time per launch of each of
    :data:`SECTIONS` (nested sections count in each that holds them)."""
    config = plan_verification(backend, config={"num_speculative_steps": k}).config_for(backend)
    context = context_for(config, k)
    spec = build_speculator(backend, config, batch, context, MatrixContext.load(None).matrix,
                            torch.device("cuda"))
    original = torch.cuda.CUDAGraph

    def debug_graph(*args: Any, **kwargs: Any) -> torch.cuda.CUDAGraph:
        # keep_graph: the cudaGraph_t outlives instantiation (which the first replay does),
        # so debug_dump can print it.
        return original(*args, **{**kwargs, "keep_graph": True})

    torch.cuda.CUDAGraph = debug_graph  # type: ignore[misc,assignment]
    try:
        spec.capture()
    finally:
        torch.cuda.CUDAGraph = original  # type: ignore[misc]
    assert spec.graphs is not None
    graphs = dict(spec.graphs.captured())
    launches: dict[int, list[float]] = collections.defaultdict(list)
    replay = torch.cuda.CUDAGraph.replay

    def timed_replay(graph: torch.cuda.CUDAGraph) -> None:
        start = time.perf_counter()
        replay(graph)
        launches[id(graph)].append(time.perf_counter() - start)

    work = bench_batch(config, batch, context)
    paths: dict[str, dict[str, float]] = {}
    torch.cuda.CUDAGraph.replay = timed_replay  # type: ignore[method-assign]
    try:
        for path in decode_paths(spec):
            with _sections() as spent:
                calls = []
                for _ in range(rounds):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    spec.launch(work, path)
                    calls.append(time.perf_counter() - start)
                torch.cuda.synchronize()
            paths[path.value] = {"launch_us": statistics.median(calls) * 1e6,
                                 **{f"{name}_us": sum(times) / rounds * 1e6
                                    for name, times in spent.items()}}
    finally:
        torch.cuda.CUDAGraph.replay = replay  # type: ignore[method-assign]
    graph_rows = [{"backend": backend, "k": k, "batch": batch, "graph": str(key),
                   "nodes": node_types(graph, dot_dir and dot_dir / _file_name(k, batch, key)),
                   "replays": len(launches[id(graph)]),
                   "launch_us": statistics.median(launches[id(graph)] or [float("nan")]) * 1e6}
                  for key, graph in graphs.items()]
    return graph_rows, paths


SECTIONS = (
    ("validate", "speccheck.speculator.batch", "DraftBatch.validate"),
    ("stage", "speccheck.speculator.staging", "HostStaging.stage"),
    ("scatter", "speccheck.speculator.base", "scatter_pass_inputs"),
    ("write_pass_inputs", "speccheck.speculator.base", "DraftModelSpeculator.write_pass_inputs"),
    ("slot_mappings", "speccheck.speculator.base", "DraftModelSpeculator.compute_slot_mappings"),
    ("decode_metadata", "speccheck.speculator.autoregressive",
     "AutoregressiveSpeculator.build_decode_metadata"),
    ("replay", "speccheck.speculator.cudagraph_manager", "CudaGraphManager.replay"),
)
"""Parts of a launch timed on their own: (name, module, attribute path)."""


@contextlib.contextmanager
def _sections() -> Iterator[dict[str, list[float]]]:
    """While open, every call of a :data:`SECTIONS` function records its host seconds."""
    spent: dict[str, list[float]] = collections.defaultdict(list)
    restore = []
    for name, module_name, path in SECTIONS:
        owner: Any = importlib.import_module(module_name)
        *parents, attribute = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        original = getattr(owner, attribute)

        def timed(*args: Any, _original: Any = original, _name: str = name,
                  **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_name].append(time.perf_counter() - start)

        setattr(owner, attribute, timed)
        restore.append((owner, attribute, original))
    try:
        yield spent
    finally:
        for owner, attribute, original in restore:
            setattr(owner, attribute, original)


def _file_name(k: int, batch: int, key: object) -> str:
    return re.sub(r"[^\w]+", "_", f"k{k}_b{batch}_{key}").strip("_") + ".dot"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="triton_attn")
    parser.add_argument("--steps", default="4,8")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--dot-dir", type=Path, help="keep each graph's DOT dump here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_launch: needs a CUDA device", file=sys.stderr)
        return 2
    if args.dot_dir:
        args.dot_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for k in map(int, args.steps.split(",")):
        for batch in map(int, args.batches.split(",")):
            graph_rows, paths = measure(args.backend, k, batch, args.rounds, args.dot_dir)
            for path, parts in paths.items():
                print(f"{args.backend} K={k} batch {batch} path {path}: " + ", ".join(
                    f"{name} {value:.1f}" for name, value in parts.items()), flush=True)
                rows.append({"backend": args.backend, "k": k, "batch": batch, "path": path,
                             **parts})
            for row in graph_rows:
                nodes = ", ".join(f"{n} {t}" for t, n in sorted(row["nodes"].items()))
                print(f"{args.backend} K={k} batch {batch} {row['graph']:<32} "
                      f"launch {row['launch_us']:8.1f} us ({row['replays']} replays)  "
                      f"nodes: {nodes}", flush=True)
                rows.append(row)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
