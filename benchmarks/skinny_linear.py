"""The drafter's projections at decode batch sizes: cuBLAS (``torch.nn.functional.linear``)
against the weight-streaming kernel of :mod:`speccheck.speculator.skinny_linear`, side by
side in one run, with the time the weight read alone takes at the measured copy bandwidth.

Usage: python benchmarks/skinny_linear.py [--rows 1,4,8,16] [--sweep] [--json FILE]
Each time is Triton's ``do_bench`` median (L2 flushed before every run: a decode step's
weights do not fit in L2). ``--sweep`` also times a grid of tile choices per shape and
prints the best, to choose :func:`~speccheck.speculator.skinny_linear.default_tiles` from.
Needs CUDA.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from functools import partial
from typing import Any

import torch
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

from speccheck.checks.bench.roofline import copy_bandwidth_gbps
from speccheck.speculator.skinny_linear import SkinnyTiles, default_tiles, skinny_linear

SHAPES = {  # name: (n, k) of the serving-size drafter (hidden 2048, SwiGLU 4096, vocab 32000)
    "qkv_proj": (3072, 2048),
    "o_proj": (2048, 2048),
    "gate_up_proj": (8192, 2048),
    "down_proj": (2048, 4096),
    "lm_head": (32000, 2048),
}
SWEEP = [SkinnyTiles(bn, bk, warps, stages) for bn, bk, warps, stages in
         itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 4))]


def _us(fn: Any) -> float:
    return float(do_bench(fn, warmup=25, rep=100)) * 1e3


def measure(rows: tuple[int, ...], sweep: bool) -> list[dict[str, Any]]:
    device = torch.device("cuda")
    gbps = copy_bandwidth_gbps(device)
    out = []
    for (name, (n, k)), m in itertools.product(SHAPES.items(), rows):
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        expected = torch.nn.functional.linear(x, w)
        got = skinny_linear(x, w)
        err = (got.float() - expected.float()).abs().max().item()
        bound = w.numel() * w.element_size() / (gbps * 1e3)
        row: dict[str, Any] = {
            "shape": name, "n": n, "k": k, "rows": m, "bound_us": bound,
            "cublas_us": _us(partial(torch.nn.functional.linear, x, w)),
            "skinny_us": _us(partial(skinny_linear, x, w)), "max_abs_diff": err,
            "tiles": vars(default_tiles(n, k)),
        }
        if sweep:
            timed = []
            for t in SWEEP:
                try:
                    timed.append((_us(partial(skinny_linear, x, w, tiles=t)), t))
                except OutOfResources:  # too many stages of too large a tile
                    continue
            best_us, best = min(timed, key=lambda pair: pair[0])
            row["best_us"], row["best_tiles"] = best_us, vars(best)
        out.append(row)
        line = (f"{name:13s} rows={m:2d} bound={bound:6.2f}us cublas={row['cublas_us']:6.2f}us "
                f"skinny={row['skinny_us']:6.2f}us skinny/cublas={row['skinny_us'] / row['cublas_us']:.2f} "
                f"diff={err:.3g}")
        if sweep:
            line += f" best={row['best_us']:6.2f}us {row['best_tiles']}"
        print(line, flush=True)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("skinny_linear benchmark: needs CUDA", file=sys.stderr)
        return 2
    rows = tuple(int(r) for r in args.rows.split(","))
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    results = measure(rows, args.sweep)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
