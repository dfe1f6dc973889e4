"""Slim the FlashInfer wheel so it fits in one GPU-machine call (64 MiB with the checkout).

    python scripts/slim_flashinfer_wheel.py FLASHINFER.whl OUT.zip

Drops kernel sources that attention decode/prefill never compiles (sampling, MoE, KDA, GDN,
Blackwell-only) and CUTLASS's examples and Python bindings. Keeps ``cutlass/tools``: the
sm90 prefill JIT includes ``cutlass/util/*`` from it. On the GPU machine, extract the
result into a site directory (``python3 -m zipfile -e OUT.zip DIR``) beside
``apache-tvm-ffi``, which pip installs with ``--no-deps``.
"""

from __future__ import annotations

import sys
import zipfile

DROPPED = (
    "flashinfer/data/csrc/cake_sampling",
    "flashinfer/data/csrc/kda",
    "flashinfer/data/csrc/cake_dsv4",
    "flashinfer/data/csrc/fused_moe",
    "flashinfer/data/csrc/cake_fmha",
    "flashinfer/data/csrc/gdn",
    "flashinfer/data/csrc/experimental",
    "flashinfer/data/csrc/blackwell_bf16_fp4",
    "flashinfer/data/csrc/blackwell_msa",
    "flashinfer/data/cutlass/examples",
    "flashinfer/data/cutlass/python",
    "flashinfer/data/cutlass/test",
)


def main(source: str, target: str) -> None:
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if not info.filename.startswith(DROPPED):
                zout.writestr(info, zin.read(info.filename))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
