#!/usr/bin/env bash
# CPU-tier mutation shards on the lent machine's cores (run from the repository root there):
#   scripts/lent_mutate.sh OUTDIR BACKEND SHARD...      e.g. ... /out sparse_swa 5/8 6/8
# installs .gpu-wheels/core as scripts/gpu_evidence.sh does, hides the GPU (the CPU tier, the
# Triton interpreter) and runs `speccheck mutate --backend BACKEND --shard SHARD --json` for
# every SHARD side by side, the cores shared out among them. OUTDIR/mutate.tar.gz holds each
# shard's report (merge them here with `speccheck mutate --rescore` given every part) and
# OUTDIR/mutate-console.txt what they printed. The image's Triton 3.6 interpreter crashes with
# its numpy 2.5 ("only 0-dimensional arrays can be converted to Python scalars" in every
# Triton backend's first example): carry a numpy 2.4 wheel for Python 3.12 in
# .gpu-wheels/numpy (pip download --only-binary=:all: --python-version 3.12
# --platform manylinux_2_28_x86_64 numpy==2.4.6), which is installed over it.
#   BUDGET  seconds after which a shard starts no new mutant (480)
#   CORES   the cores the shards use, as taskset takes them (all)
set -uo pipefail
usage="usage: scripts/lent_mutate.sh OUTDIR BACKEND SHARD..."
out=${1:?$usage}
backend=${2:?$usage}
shift 2
[ $# -gt 0 ] || { echo "$usage" >&2; exit 2; }
mkdir -p "$out/mutate"
mkdir -p /tmp/site && ln -sfn /tmp/site /tmp/site-packages
export PYTHONPATH=/tmp/site-packages PYTHONUNBUFFERED=1 COLUMNS=160 CUDA_VISIBLE_DEVICES=
export OMP_NUM_THREADS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/core/*.whl \
  .gpu-wheels/numpy/*.whl
python3 -m pip install -q --no-deps --no-index --no-build-isolation -e . >/dev/null
read -r commit index < .evidence-commit 2>/dev/null || { commit=unknown; index=; }
export SPECCHECK_COMMIT=$commit SPECCHECK_COMMIT_INDEX=$index
cores=${CORES:-0-$(($(nproc) - 1))}
count=$(taskset -c "$cores" nproc)
jobs=$(( count / $# > 0 ? count / $# : 1 ))
for shard in "$@"; do
  name=${shard//\//-of-}
  taskset -c "$cores" timeout $(( ${BUDGET:-480} + 300 )) speccheck mutate --backend "$backend" \
    --shard "$shard" --jobs "$jobs" --budget "${BUDGET:-480}" --json "$out/mutate/$name.json" \
    > "$out/mutate/$name.txt" 2>&1 &
done
wait
cat "$out"/mutate/*.txt > "$out/mutate-console.txt"
tar -czf "$out/mutate.tar.gz" -C "$out" mutate && rm -rf "$out/mutate"
exit 0
