#!/usr/bin/env bash
# Produce the GPU-tier evidence committed under docs/verification/ (run on the H200 machine,
# from the repository root, with the wheels of ../shared/gpu/fetch-wheels.sh in .gpu-wheels/).
#   scripts/gpu_evidence.sh OUTDIR [--no-bench]
set -uo pipefail
out=${1:?usage: scripts/gpu_evidence.sh OUTDIR}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/core/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 COLUMNS=160
python3 -m pip install -q --no-deps --no-index --no-build-isolation -e . >/dev/null
commit=$(cat .evidence-commit 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)
export SPECCHECK_COMMIT=$commit
{
  echo "commit: $commit"; date -u; nvidia-smi -L
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$out/device.txt" 2>&1
timeout 240 python3 -m pytest -q -m cuda tests/test_speculator.py tests/test_gpu_kernels.py \
  tests/test_verifier_mutants.py tests/test_gpu_verifier.py tests/test_dp_dflash.py \
  > "$out/pytest-cuda.txt" 2>&1
echo "pytest exit $?" >> "$out/pytest-cuda.txt"
run() {  # NAME ARGS...
  local name=$1; shift
  { echo "\$ speccheck verify $*"; timeout 150 speccheck verify "$@" --json "$out/gpu-$name.json"
    echo "exit $?"; } >> "$out/verify-console.txt" 2>&1
}
run reference --backend reference --examples 200
run triton_attn --backend triton_attn --examples 200
run fa3 --backend fa3 --block-size 512 --max-model-len 512 --examples 200
run fa3-dcp2 --backend fa3 --block-size 512 --max-model-len 512 --dcp-world-size 2 --examples 50
run reference-dp2 --backend reference --dp-size 2 --num-speculative-steps 3 --examples 8
[ "${2:-}" = "--no-bench" ] && exit 0
timeout 200 python3 benchmarks/attention_latency.py --json "$out/attention-latency.json" \
  > "$out/attention-latency.txt" 2>&1
echo "benchmark exit $?" >> "$out/attention-latency.txt"
