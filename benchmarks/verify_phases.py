"""Where one backend's verification spends its time, phase by phase.

    python benchmarks/verify_phases.py [--backend triton_attn] [--examples 200] [--seed 0]
        [--dtype DTYPE] [--capture-sizes 1,2,...] [--max-new-tokens N] [--aten] [--json OUT]

Runs what a ``speccheck verify`` worker runs for the backend at the tier's defaults
(``verify_backend``), in this process, with the engine's phases timed: each example's start
state, every propose (by backend, path and whether it replays graphs: the fp32 reference's
is the ``reference`` row of a backend other than ``reference``), the step recorder's
read-backs, every comparison, the KV cache's snapshots, restores and noise. Each timed call
runs between two device synchronisations: ``host`` is the time until it returns, ``wait``
the time the device then still needed. The fp32 reference is queued (``launch``), its tokens
read back later. Phases nest (``examine`` holds the rest of an
example), so the rows do not add up.

The synchronisations change what they measure: a synchronisation waits for every stream,
so the fp32 reference's side lane (``checks/verify/side_lane.py``) cannot overlap anything
here. The table says where the work is, not how long a run takes: for that, time the worker
alone (``benchmarks/verify_speed.py``) or the whole command (``benchmarks/verify_command.py``).

``--aten`` also counts the aten operator calls of each phase (a ``TorchDispatchMode``):
a measure of the host work of eager PyTorch that the CPU gives as well as a GPU, since the
count does not depend on the device. ``--capture-sizes`` and ``--max-new-tokens`` set the
batch scale (on the CPU, ``1,2,4,8,16,32,64`` and ``16`` are the GPU tier's), ``--dtype``
the drafter's (the reference backend in ``bfloat16`` gets an fp32 reference).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class Phase:
    """What the calls of one phase took, in seconds."""

    calls: int = 0
    host: float = 0.0
    wait: float = 0.0
    aten: int = 0
    """aten operator calls (counted with ``--aten`` only)."""


class AtenCounter(TorchDispatchMode):
    """Counts the aten operator calls made while it is active (an enclosing counter counts
    them too)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


class PhaseTimer:
    """Wraps functions so that each call is timed between device synchronisations."""

    def __init__(self, synchronize: Callable[[], None], count_aten: bool = False) -> None:
        self.synchronize = synchronize
        self.count_aten = count_aten
        self.phases: dict[str, Phase] = {}

    def wrap(self, owner: Any, name: str,
             label: Callable[..., str] | None = None) -> None:
        """Replace ``owner.name`` by a timed call of it, filed under ``label(*args)`` (by
        default ``name``)."""
        function = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            phase = self.phases.setdefault(label(*args, **kwargs) if label else name, Phase())
            self.synchronize()
            counter = AtenCounter() if self.count_aten else contextlib.nullcontext()
            started = time.perf_counter()
            try:
                with counter:
                    return function(*args, **kwargs)
            finally:
                returned = time.perf_counter()
                self.synchronize()
                phase.calls += 1
                phase.aten += counter.calls if isinstance(counter, AtenCounter) else 0
                phase.host += returned - started
                phase.wait += time.perf_counter() - returned

        setattr(owner, name, timed)

    def table(self) -> list[str]:
        rows = sorted(self.phases.items(), key=lambda item: -(item[1].host + item[1].wait))
        aten = f" {'aten':>9s}" if self.count_aten else ""
        lines = [f"{'phase':56s} {'calls':>6s} {'host s':>8s} {'wait s':>8s} {'sum s':>8s}{aten}"]
        lines += [f"{label:56s} {p.calls:6d} {p.host:8.2f} {p.wait:8.2f} {p.host + p.wait:8.2f}"
                  + (f" {p.aten:9d}" if self.count_aten else "")
                  for label, p in rows]
        return lines


def instrument(timer: PhaseTimer) -> None:
    """Time the engine's phases (see the module docstring)."""
    from speccheck.checks.verify import engine
    from speccheck.checks.verify.harness import HarnessSet
    from speccheck.checks.verify.step_recorder import StepMetadataRecorder
    from speccheck.speculator.autoregressive import AutoregressiveSpeculator
    from speccheck.speculator.kv_cache import PagedKVCache

    timer.wrap(engine.BackendVerifier, "examine")
    timer.wrap(HarnessSet, "start_state")
    for name in ("kv_untouched", "kv_matches", "compare_drafts", "compare_steps",
                 "expected_slots", "derived_step_changes", "first_divergence",
                 "declared_fields", "zero_tails", "guard_bands"):
        timer.wrap(engine, name)
    def cache_label(name: str) -> Callable[..., str]:
        return lambda cache, *_, **__: f"kv cache {name} ({cache.layers[0][0].dtype})"

    for name in ("snapshot", "restore", "fill_random_"):
        timer.wrap(PagedKVCache, name, cache_label(name))
    timer.wrap(StepMetadataRecorder, "collect", lambda *_: "step recorder collect")

    def propose_label(spec: AutoregressiveSpeculator, _batch: Any, path: Any = "auto",
                      use_graphs: bool = True) -> str:
        graphs = "graphs" if use_graphs and spec.graphs is not None else "eager"
        return f"propose {spec.groups[0].backend_name} {getattr(path, 'value', path)} {graphs}"

    def launch_label(spec: AutoregressiveSpeculator, _batch: Any, path: Any = "auto") -> str:
        return f"launch {spec.groups[0].backend_name} {getattr(path, 'value', path)}"

    timer.wrap(AutoregressiveSpeculator, "propose", propose_label)
    timer.wrap(AutoregressiveSpeculator, "launch", launch_label)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="triton_attn")
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", help="the drafter's dtype (default: the tier's)")
    parser.add_argument("--capture-sizes", help="comma-separated (default: the tier's)")
    parser.add_argument("--max-new-tokens", type=int, help="default: the tier's")
    parser.add_argument("--aten", action="store_true", help="also count aten calls")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from speccheck.checks.triton_interpreter import interpret_triton_without_cuda

    interpret_triton_without_cuda()
    import torch

    from speccheck.checks.api import plan_verification
    from speccheck.checks.verify.worker import verify_backend

    timer = PhaseTimer(torch.cuda.synchronize if torch.cuda.is_available() else lambda: None,
                       count_aten=args.aten)
    instrument(timer)
    sizes = [int(n) for n in args.capture_sizes.split(",")] if args.capture_sizes else None
    plan = plan_verification(args.backend, examples=args.examples, seed=args.seed,
                             config={"dtype": args.dtype} if args.dtype else None,
                             capture_sizes=sizes, max_new_tokens=args.max_new_tokens)
    with tempfile.TemporaryDirectory() as folder:
        report = verify_backend(plan.task(args.backend), Path(folder) / "progress.jsonl")
    print(f"{args.backend}: {report.status.value}, {report.examples} examples in "
          f"{report.seconds:.2f} s (capture {report.capture_seconds:.2f} s)")
    print("\n".join(timer.table()))
    if args.json:
        args.json.write_text(json.dumps({
            "backend": args.backend, "status": report.status.value,
            "examples": report.examples, "seconds": report.seconds,
            "capture_seconds": report.capture_seconds,
            "phases": {label: vars(p) for label, p in timer.phases.items()},
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
