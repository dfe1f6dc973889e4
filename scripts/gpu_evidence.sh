#!/usr/bin/env bash
# Produce the GPU-tier evidence committed under docs/verification/ (run on the H200 machine,
# from the repository root). Two suites, because the FA3 and FlashInfer wheels do not fit in
# one 64 MiB device call together:
#   scripts/gpu_evidence.sh OUTDIR core [--no-bench]
#       wheels in .gpu-wheels/core (../shared/gpu/fetch-wheels.sh): reference, triton_attn and
#       FA3 kernel tests and verify runs, DP on the reference, the attention-latency benchmark
#   scripts/gpu_evidence.sh OUTDIR flashinfer [--no-bench]
#       wheels in .gpu-wheels/fi: pydantic, apache-tvm-ffi and flashinfer-slim.zip (made by
#       scripts/slim_flashinfer_wheel.py); an optional .gpu-wheels/fi-jit/cache.tar.gz from
#       an earlier run skips FlashInfer's JIT compile. FlashInfer kernel and DP tests, verify
#       with per-step and preplanned graphs, verify --dp-size 2, the propose-latency benchmark
#   scripts/gpu_evidence.sh OUTDIR fi-fixed-plan
#       wheels in .gpu-wheels/fi (+ fi-jit): the FlashInfer GPU tests of both builders and
#       the device page table, the fixed-plan backend's known-bad builders through real
#       verify commands (tests/test_gpu_verifier.py), verify of flashinfer_fixed_plan at its
#       defaults, speccheck bench for flashinfer_fixed_plan (K=4 and 8) and flashinfer (K=4),
#       batches 1, 8, 64, in one call, and benchmarks/attention_latency.py --flashinfer
#       (split KV against none)
#   scripts/gpu_evidence.sh OUTDIR serving
#       wheels in .gpu-wheels/core: verify at the GPU tier's serving-scale defaults (no flags
#       but the example count) for reference, triton_attn and fa3, FA3 without its refresh
#       at default settings for ten seeds, the GPU mutants, and the verifier-throughput
#       benchmark (new defaults beside the old ones)
#   (flashinfer: FI_PYTEST_LIMIT=0 / FI_DP2_LIMIT=0 leave out its pytest / DP runs; VERIFY_LIMIT
#   and EXAMPLES set the verify run's.)
#   scripts/gpu_evidence.sh OUTDIR latent
#       wheels in .gpu-wheels/core: the MLA and sparse-SWA kernel tests, and verify for triton_mla (DCP 1 and,
#       per step only, DCP 2) and sparse_swa at the GPU tier's defaults (BACKENDS=...)
#   scripts/gpu_evidence.sh OUTDIR concurrent
#       wheels in .gpu-wheels/core: the serving-scale runs at once, each in a process and
#       console file of its own (the GPU is mostly idle under one verifier): FA3 without its
#       refresh for ten seeds (FA3_SEEDS_LIMIT, 0 leaves it out), verify for each of BACKENDS
#       (VERIFY_LIMIT, EXAMPLES), and triton_mla at DCP 2 per step (DCP2_EXAMPLES, 0 leaves it
#       out). No benchmark: timings taken beside other runs would not mean anything.
#   scripts/gpu_evidence.sh OUTDIR lean
#       wheels in .gpu-wheels/fi (+ fi-jit): speccheck bench for triton_attn (K=4 and 8,
#       STEPS) and flashinfer (K=4), batches 1, 8, 64 (wall, host and GPU time per path,
#       decode-step GPU time against the weight-read bound), the serving path's CUDA tests
#       (one-kernel layers, Gumbel sampling, first-pass graph, bench, FlashInfer's
#       device-built page indices), short verifies of triton_attn and flashinfer at the GPU
#       defaults (no false positive), and FlashInfer's JIT cache in fi-jit/
#   scripts/gpu_evidence.sh OUTDIR lean-fi
#       wheels in .gpu-wheels/fi (+ fi-jit): speccheck bench for flashinfer (K=4, batches 1,
#       8, 64, with the profiler's tables), verify of flashinfer (EXAMPLES, default 100: the
#       verifier-throughput target) at the GPU defaults, and FlashInfer's JIT cache in fi-jit/
#   scripts/gpu_evidence.sh OUTDIR lean-core
#       wheels in .gpu-wheels/core: speccheck bench for triton_attn and fa3 (K=4 and 8,
#       batches 1, 8, 64, with the profiler's tables), the one-kernel layers', index-buffer
#       kernels' and speculator's CUDA tests (compilations per kernel across batches
#       included), verify of triton_attn (EXAMPLES, default 200: the verifier-throughput
#       target) twice, with Triton's on-disk cache cold then warm, and fa3 (FA3_EXAMPLES,
#       30) at the GPU defaults, and reference on two DCP ranks sharing the GPU
#       (DCP2_EXAMPLES, 20; 0 leaves it out)
#   scripts/gpu_evidence.sh OUTDIR verify-jobs | verify-jobs-fi
#       wheels in .gpu-wheels/core | fi (+ fi-jit): the wall time of the whole verify command
#       (benchmarks/verify_command.py) at the default --jobs beside --jobs 1 (JOBS), for
#       triton_attn at 200 examples after a short warm-up run that fills Triton's on-disk
#       cache, then the FA3 refresh bug at default settings for ten seeds (FA3_SEEDS_LIMIT,
#       0 leaves it out) | flashinfer at 100 examples and its bench with the profiler's tables
#   scripts/gpu_evidence.sh OUTDIR verify-speed
#       wheels in .gpu-wheels/fi (+ fi-jit): the verifier-throughput targets, the whole
#       command timed from outside with one worker (benchmarks/verify_command.py): triton_attn
#       at 200 examples and flashinfer at 100, each after a short run that fills the caches
#   scripts/gpu_evidence.sh OUTDIR verify-overlap | verify-overlap-fi
#       wheels in .gpu-wheels/core | fi (+ fi-jit): the verifier's CUDA tests (FA3 without its
#       refresh at default settings for ten seeds, then every mutant with real graphs, one
#       process) | every mutant with real graphs and a short flashinfer warm-up; then the verify worker of triton_attn at 200
#       examples | flashinfer at 100 against BASE (a checkout of another commit, when set;
#       ROUNDS alternations, benchmarks/verify_speed.py) and the whole command, one worker
#   scripts/gpu_evidence.sh OUTDIR lean-host
#       wheels in .gpu-wheels/core: the serving path's CUDA tests, benchmarks/graph_launch.py
#       for triton_attn (each graph's nodes, the host time of a launch and of its parts),
#       speccheck bench for triton_attn and fa3 (K=4 and 8, batches 1, 8, 64, REPEATS, no
#       profiler), and short verifies of both at the GPU defaults (no false positive)
#   scripts/gpu_evidence.sh OUTDIR lean-trust
#       wheels in .gpu-wheels/core: the serving path's and the verifier's CUDA tests (every
#       mutant caught with real graphs; FA3 without its refresh caught at default settings
#       for ten seeds), then speccheck bench for triton_attn (K=4 and 8, batches 1, 8, 64)
#   scripts/gpu_evidence.sh OUTDIR audit-core | audit-flashinfer
#       the same wheels as core / flashinfer: claims audits (verify --audit-claims) of the
#       backends the matrix does not allow to fuse (fa3 at DCP 2; flashinfer), next to plain
#       verify runs of every shipped backend (no false positives), and the self-test
#   scripts/gpu_evidence.sh OUTDIR two-gpu
#       on the nvidia-h200-x2 machine (two GPUs), wheels in .gpu-wheels/fi (+ fi-jit): one DP
#       rank per GPU over gloo (CPU) + NCCL (CUDA). The two-GPU tests of the rank launcher and
#       the DP drafter (TWO_GPU_PYTEST_LIMIT, 0 leaves them out), then verify --dp-size 2 for
#       triton_attn and flashinfer (eager and FULL each; DP2_LIMIT, DP2_EXAMPLES) and verify
#       --dcp-world-size 2 for reference and triton_attn (DCP2_LIMIT, DCP2_EXAMPLES), one after
#       the other (each run uses both GPUs), each into a console file of its own.
set -uo pipefail
usage="usage: scripts/gpu_evidence.sh OUTDIR core|flashinfer|fi-fixed-plan|serving|latent|concurrent|lean|lean-fi|lean-core|lean-host|lean-trust|verify-jobs|verify-jobs-fi|verify-speed|verify-overlap|verify-overlap-fi|audit-core|audit-flashinfer|two-gpu [--no-bench]"
out=${1:?$usage}
suite=${2:?$usage}
bench=${3:-}
mkdir -p "$out"
# The wheels go to /tmp/site, imported through a link named site-packages, as a user's pip
# install would be: hypothesis scans the source of every module whose path lacks
# "/site-packages/" for constants (FlashInfer's: about 5 s of a verify run), while
# FlashInfer's JIT resolves its own path, so a JIT cache saved from /tmp/site still serves.
mkdir -p /tmp/site && ln -sfn /tmp/site /tmp/site-packages
export PYTHONPATH=/tmp/site-packages PYTHONUNBUFFERED=1 COLUMNS=160
case $suite in
  core|audit-core|serving|latent|concurrent|lean-core|verify-jobs|lean-host|lean-trust|verify-overlap) python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/core/*.whl ;;
  flashinfer|fi-fixed-plan|audit-flashinfer|lean|lean-fi|two-gpu|verify-jobs-fi|verify-speed|verify-overlap-fi)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/fi/*.whl
    python3 -m zipfile -e .gpu-wheels/fi/flashinfer-slim.zip /tmp/site
    # Ninja rebuilds an output when any input is newer than the output's mtime in its
    # .ninja_log, whatever the output's own mtime: the headers just extracted (time: now)
    # made it rebuild the cached kernels on every call (the sm90 prefill: about 97 s). So
    # the headers are dated back, and the cache keeps the times it was saved with.
    find /tmp/site -exec touch -h -d 2020-01-01 {} +
    [ -f .gpu-wheels/fi-jit/cache.tar.gz ] && tar -xzf .gpu-wheels/fi-jit/cache.tar.gz -C "$HOME" ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
python3 -m pip install -q --no-deps --no-index --no-build-isolation -e . >/dev/null
# The image sets PYTHONDONTWRITEBYTECODE=1: every process compiled every module it imported
# from source (import torch: 4.4 to 5.7 s there, 2.1 to 2.4 s from bytecode). Compile the
# installed packages once, as pip does on any other machine.
python3 -m compileall -q -j 0 "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  /tmp/site >/dev/null 2>&1
commit=$(cat .evidence-commit 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)
export SPECCHECK_COMMIT=$commit
{
  echo "commit: $commit"; echo "suite: $suite"; date -u; nvidia-smi -L
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  case $suite in *flashinfer|fi-fixed-plan|lean|lean-fi|two-gpu|verify-jobs-fi|verify-speed|verify-overlap-fi) python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" ;; esac
  [ "$suite" = two-gpu ] && python3 -c "import torch, torch.distributed as d; print('GPUs', torch.cuda.device_count(), 'nccl', d.is_nccl_available() and torch.cuda.nccl.version())"
} > "$out/device-$suite.txt" 2>&1

console=$out/verify-console-$suite.txt
run() {  # NAME TIMEOUT ARGS...
  local name=$1 limit=$2; shift 2
  { echo "\$ speccheck verify $*"; timeout "$limit" speccheck verify "$@" --json "$out/gpu-$name.json"
    echo "exit $?"; } >> "$console" 2>&1
}
flashinfer_bench() {  # [EXTRA BENCH ARGS...]
  # FlashInfer's first plan of a new kernel configuration JIT-compiles it (about 100 s for
  # the sm90 prefill): the limit leaves room for that; the cache comes back in fi-jit/.
  { timeout "${FI_BENCH_LIMIT:-240}" speccheck bench --backend flashinfer --steps 4 \
      --batches 1,8,64 --repeats "${REPEATS:-10}" --json "$out/bench-flashinfer.json" "$@"
    echo "exit $?"; } > "$out/bench-flashinfer.txt" 2>&1
  mkdir -p "$out/fi-jit"
  tar -czf "$out/fi-jit/cache.tar.gz" -C "$HOME" .cache/flashinfer 2>/dev/null
}

if [ "$suite" = two-gpu ]; then
  # The machine turns NVLink multicast off (KINDS.md); keep it off whatever this shell got.
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  if [ "${TWO_GPU_PYTEST_LIMIT:-120}" != 0 ]; then
    timeout "${TWO_GPU_PYTEST_LIMIT:-120}" python3 -m pytest -rA -q -m cuda tests/test_dp_collectives.py \
      tests/test_dp_dflash.py -k "not flashinfer" > "$out/pytest-cuda-two-gpu.txt" 2>&1
    echo "pytest exit $?" >> "$out/pytest-cuda-two-gpu.txt"
  fi
  for backend in triton_attn flashinfer; do
    console=$out/verify-console-$backend-dp2.txt run "$backend-dp2" "${DP2_LIMIT:-150}" \
      --backend "$backend" --dp-size 2 --num-speculative-steps 3 --examples "${DP2_EXAMPLES:-8}"
  done
  for backend in reference triton_attn; do
    console=$out/verify-console-$backend-dcp2.txt run "$backend-dcp2" "${DCP2_LIMIT:-90}" \
      --backend "$backend" --dcp-world-size 2 --examples "${DCP2_EXAMPLES:-50}"
  done
  mkdir -p "$out/fi-jit"
  tar -czf "$out/fi-jit/cache.tar.gz" -C "$HOME" .cache/flashinfer 2>/dev/null
  exit 0
fi
if [ "$suite" = fi-fixed-plan ]; then
  timeout "${FI_PYTEST_LIMIT:-480}" python3 -m pytest -rA -q -s -m cuda tests/test_gpu_verifier.py \
    tests/test_flashinfer_page_indices.py tests/test_gpu_kernels.py -k flashinfer \
    > "$out/pytest-cuda-fi-fixed-plan.txt" 2>&1
  echo "pytest exit $?" >> "$out/pytest-cuda-fi-fixed-plan.txt"
  mkdir -p "$out/fi-jit"
  tar -czf "$out/fi-jit/cache.tar.gz" -C "$HOME" .cache/flashinfer 2>/dev/null
  run flashinfer_fixed_plan "${VERIFY_LIMIT:-170}" --backend flashinfer_fixed_plan
  [ "$bench" = --no-bench ] && exit 0
  for backend in flashinfer_fixed_plan flashinfer; do
    steps=4,8; [ "$backend" = flashinfer ] && steps=4
    { timeout "${BENCH_LIMIT:-150}" speccheck bench --backend "$backend" --steps "$steps" \
        --batches 1,8,64 --repeats "${REPEATS:-20}" --json "$out/bench-$backend.json"
      echo "exit $?"; } > "$out/bench-$backend.txt" 2>&1
  done
  timeout 120 python3 benchmarks/attention_latency.py --flashinfer --batches 1 16 128 \
    --seq-lens 512 4096 32768 --json "$out/attention-flashinfer.json" \
    > "$out/attention-flashinfer.txt" 2>&1
  echo "benchmark exit $?" >> "$out/attention-flashinfer.txt"
  exit 0
fi
if [ "$suite" = lean ]; then
  { timeout "${BENCH_LIMIT:-90}" speccheck bench --backend triton_attn --steps "${STEPS:-4,8}" \
      --batches 1,8,64 --repeats "${REPEATS:-10}" --json "$out/bench-triton_attn.json"
    echo "exit $?"; } > "$out/bench-triton_attn.txt" 2>&1
  timeout "${PYTEST_LIMIT:-120}" python3 -m pytest -rA -q -m cuda tests/test_model_kernels.py \
    tests/test_speculator.py tests/test_bench.py tests/test_flashinfer_page_indices.py \
    > "$out/pytest-cuda-lean.txt" 2>&1
  echo "pytest exit $?" >> "$out/pytest-cuda-lean.txt"
  flashinfer_bench
  run triton_attn "${VERIFY_LIMIT:-60}" --backend triton_attn --examples "${EXAMPLES:-30}"
  run flashinfer "${VERIFY_LIMIT:-60}" --backend flashinfer --examples "${EXAMPLES:-30}"
  exit 0
fi
verify_command() {  # BACKEND EXAMPLES LIMIT
  { timeout "$3" python3 benchmarks/verify_command.py --backend "$1" --examples "$2" \
      --jobs "${JOBS:-default,1}" --json "$out/verify-command-$1.json"
    echo "exit $?"; } > "$out/verify-command-$1.txt" 2>&1
}
if [ "$suite" = verify-jobs ]; then
  run triton_attn-warmup 120 --backend triton_attn --examples 10
  verify_command triton_attn 200 "${VERIFY_LIMIT:-240}"
  if [ "${FA3_SEEDS_LIMIT:-240}" != 0 ]; then
    timeout "${FA3_SEEDS_LIMIT:-240}" python3 -m pytest -rA -q -s -m cuda tests/test_gpu_verifier.py \
      -k default_settings > "$out/pytest-cuda-fa3-default-settings.txt" 2>&1
    echo "pytest exit $?" >> "$out/pytest-cuda-fa3-default-settings.txt"
  fi
  exit 0
fi
if [ "$suite" = lean-host ]; then
  timeout "${PYTEST_LIMIT:-200}" python3 -m pytest -rA -q -m cuda tests/test_speculator.py \
    tests/test_lane_kernels.py tests/test_bench.py tests/test_triton_specialization.py \
    tests/test_kv_cache_write.py tests/test_model_kernels.py > "$out/pytest-cuda-lean-host.txt" 2>&1
  echo "pytest exit $?" >> "$out/pytest-cuda-lean-host.txt"
  { timeout 120 python3 benchmarks/graph_launch.py --backend triton_attn --steps 4,8 \
      --batches 1,8,64 --rounds 30 --json "$out/graph-launch-triton_attn.json" 2>&1 | grep -v debug_dump
    echo "exit ${PIPESTATUS[0]}"; } > "$out/graph-launch-triton_attn.txt"
  for backend in triton_attn fa3; do
    { timeout "${BENCH_LIMIT:-100}" speccheck bench --backend "$backend" --steps 4,8 \
        --batches 1,8,64 --repeats "${REPEATS:-20}" --json "$out/bench-$backend.json"
      echo "exit $?"; } > "$out/bench-$backend.txt" 2>&1
  done
  run triton_attn "${VERIFY_LIMIT:-100}" --backend triton_attn --examples "${EXAMPLES:-50}"
  run fa3 "${VERIFY_LIMIT:-100}" --backend fa3 --examples "${FA3_EXAMPLES:-30}"
  exit 0
fi
if [ "$suite" = lean-trust ]; then
  timeout "${PYTEST_LIMIT:-330}" python3 -m pytest -rA -q -s -m cuda tests/test_speculator.py \
    tests/test_lane_kernels.py tests/test_verifier_mutants.py tests/test_gpu_verifier.py \
    > "$out/pytest-cuda-lean-trust.txt" 2>&1
  echo "pytest exit $?" >> "$out/pytest-cuda-lean-trust.txt"
  { timeout "${BENCH_LIMIT:-100}" speccheck bench --backend triton_attn --steps 4,8 \
      --batches 1,8,64 --repeats "${REPEATS:-20}" --json "$out/bench-triton_attn.json"
    echo "exit $?"; } > "$out/bench-triton_attn.txt" 2>&1
  exit 0
fi
if [ "$suite" = verify-speed ]; then
  # Issue 15's verifier-throughput targets, one worker each, after short runs that fill
  # Triton's and FlashInfer's on-disk caches: the whole command timed from outside.
  run triton_attn-warmup 120 --backend triton_attn --examples 10
  run flashinfer-warmup "${FI_WARMUP_LIMIT:-240}" --backend flashinfer --examples 5
  JOBS=1 verify_command triton_attn 200 "${VERIFY_LIMIT:-240}"
  JOBS=1 verify_command flashinfer 100 "${VERIFY_LIMIT:-240}"
  mkdir -p "$out/fi-jit"
  tar -czf "$out/fi-jit/cache.tar.gz" -C "$HOME" .cache/flashinfer 2>/dev/null
  exit 0
fi
verify_speed() {  # BACKEND EXAMPLES LIMIT: this checkout against $BASE (another commit's), alternately
  [ -n "${BASE:-}" ] || return 0
  { timeout "$3" python3 benchmarks/verify_speed.py --backend "$1" --examples "$2" \
      --rounds "${ROUNDS:-1}" --against "$BASE" --json "$out/verify-speed-$1.json"
    echo "exit $?"; } > "$out/verify-speed-$1.txt" 2>&1
}
if [ "$suite" = verify-overlap ]; then
  # The verifier's CUDA tests (the FA3 refresh bug at default settings for ten seeds, then
  # every mutant with real graphs, in one process), then the worker against BASE and the
  # whole command.
  timeout "${PYTEST_LIMIT:-300}" python3 -m pytest -rA -q -s -m cuda tests/test_side_lane.py \
    tests/test_gpu_verifier.py tests/test_verifier_mutants.py > "$out/pytest-cuda-verifier.txt" 2>&1
  echo "pytest exit $?" >> "$out/pytest-cuda-verifier.txt"
  run triton_attn-warmup 120 --backend triton_attn --examples 10
  verify_speed triton_attn 200 "${SPEED_LIMIT:-200}"
  JOBS=1 verify_command triton_attn 200 "${VERIFY_LIMIT:-120}"
  exit 0
fi
if [ "$suite" = verify-overlap-fi ]; then
  timeout "${PYTEST_LIMIT:-200}" python3 -m pytest -rA -q -s -m cuda tests/test_side_lane.py \
    tests/test_verifier_mutants.py > "$out/pytest-cuda-verifier.txt" 2>&1
  echo "pytest exit $?" >> "$out/pytest-cuda-verifier.txt"
  run flashinfer-warmup "${FI_WARMUP_LIMIT:-240}" --backend flashinfer --examples 5
  verify_speed flashinfer 100 "${SPEED_LIMIT:-300}"
  JOBS=1 verify_command flashinfer 100 "${VERIFY_LIMIT:-150}"
  mkdir -p "$out/fi-jit"
  tar -czf "$out/fi-jit/cache.tar.gz" -C "$HOME" .cache/flashinfer 2>/dev/null
  exit 0
fi
if [ "$suite" = verify-jobs-fi ]; then
  verify_command flashinfer 100 "${VERIFY_LIMIT:-240}"
  flashinfer_bench --profile "$out/profile-flashinfer.txt"
  exit 0
fi
if [ "$suite" = lean-fi ]; then
  flashinfer_bench --profile "$out/profile-flashinfer.txt"
  run flashinfer "${VERIFY_LIMIT:-200}" --backend flashinfer --examples "${EXAMPLES:-100}"
  exit 0
fi
if [ "$suite" = lean-core ]; then
  for backend in triton_attn fa3; do
    { timeout "${BENCH_LIMIT:-90}" speccheck bench --backend "$backend" --steps "${STEPS:-4,8}" \
        --batches 1,8,64 --repeats "${REPEATS:-10}" --json "$out/bench-$backend.json" \
        --profile "$out/profile-$backend.txt"
      echo "exit $?"; } > "$out/bench-$backend.txt" 2>&1
  done
  timeout "${PYTEST_LIMIT:-150}" python3 -m pytest -rA -q -m cuda tests/test_model_kernels.py \
    tests/test_projection_kernels.py \
    tests/test_lane_kernels.py tests/test_speculator.py tests/test_bench.py \
    tests/test_triton_specialization.py tests/test_kv_cache_write.py \
    > "$out/pytest-cuda-lean-core.txt" 2>&1
  echo "pytest exit $?" >> "$out/pytest-cuda-lean-core.txt"
  # The bench and the tests above compiled some kernels into Triton's on-disk cache; a
  # user's first verify compiles the rest. The second run finds every kernel compiled.
  rm -rf "$HOME/.triton/cache"
  run triton_attn "${VERIFY_LIMIT:-150}" --backend triton_attn --examples "${EXAMPLES:-200}"
  run triton_attn-warm "${VERIFY_LIMIT:-150}" --backend triton_attn --examples "${EXAMPLES:-200}"
  run fa3 "${VERIFY_LIMIT:-120}" --backend fa3 --examples "${FA3_EXAMPLES:-30}"
  # DCP ranks sharing the one GPU (gloo: graphs off, the fused refresh run eagerly).
  [ "${DCP2_EXAMPLES:-20}" != 0 ] && run reference-dcp2 "${VERIFY_LIMIT:-120}" --backend reference \
    --dcp-world-size 2 --examples "${DCP2_EXAMPLES:-20}"
  exit 0
fi
if [ "$suite" = concurrent ]; then
  if [ "${FA3_SEEDS_LIMIT:-400}" != 0 ]; then
    { timeout "${FA3_SEEDS_LIMIT:-400}" python3 -m pytest -rA -q -s -m cuda tests/test_gpu_verifier.py \
        -k default_settings; echo "pytest exit $?"; } > "$out/pytest-cuda-fa3-default-settings.txt" 2>&1 &
  fi
  for backend in ${BACKENDS:-reference sparse_swa}; do
    console=$out/verify-console-$backend.txt run "$backend" "${VERIFY_LIMIT:-400}" \
      --backend "$backend" --examples "${EXAMPLES:-200}" &
  done
  if [ "${DCP2_EXAMPLES:-200}" != 0 ]; then
    console=$out/verify-console-triton_mla-dcp2.txt run triton_mla-dcp2 "${VERIFY_LIMIT:-400}" \
      --backend triton_mla --dcp-world-size 2 --examples "${DCP2_EXAMPLES:-200}" &
  fi
  wait
  exit 0
fi

if [ "$suite" = serving ] || [ "$suite" = latent ]; then
  if [ "$suite" = latent ]; then
    timeout "${KERNELS_LIMIT:-120}" python3 -m pytest -rA -q -m cuda tests/test_triton_mla.py \
      tests/test_sparse_swa.py tests/test_mla_layer.py > "$out/pytest-cuda-latent.txt" 2>&1
    echo "pytest exit $?" >> "$out/pytest-cuda-latent.txt"
  elif [ "${FA3_SEEDS_LIMIT:-240}" != 0 ]; then
    timeout "${FA3_SEEDS_LIMIT:-240}" python3 -m pytest -rA -q -s -m cuda tests/test_gpu_verifier.py \
      -k default_settings > "$out/pytest-cuda-fa3-default-settings.txt" 2>&1
    echo "pytest exit $?" >> "$out/pytest-cuda-fa3-default-settings.txt"
  fi
  for backend in ${BACKENDS:-triton_attn fa3 reference}; do
    run "$backend" "${VERIFY_LIMIT:-150}" --backend "$backend" --examples "${EXAMPLES:-200}"
  done
  [ "$suite" = latent ] && run triton_mla-dcp2 "${VERIFY_LIMIT:-150}" --backend triton_mla \
    --dcp-world-size 2 --examples "${DCP2_EXAMPLES:-50}"
  [ "$bench" = --no-bench ] && exit 0
  timeout "${BENCH_LIMIT:-200}" python3 benchmarks/verify_throughput.py --examples 30 \
    --json "$out/verify-throughput.json" > "$out/verify-throughput.txt" 2>&1
  echo "benchmark exit $?" >> "$out/verify-throughput.txt"
  timeout "${MUTANTS_LIMIT:-200}" python3 -m pytest -rA -q -m cuda tests/test_verifier_mutants.py \
    > "$out/pytest-cuda-mutants.txt" 2>&1
  echo "pytest exit $?" >> "$out/pytest-cuda-mutants.txt"
  exit 0
fi
if [ "$suite" = audit-core ]; then
  timeout 200 python3 -m pytest -rA -q -s -m cuda tests/test_gpu_verifier.py tests/test_verifier_mutants.py \
    > "$out/pytest-cuda-verifier.txt" 2>&1
  echo "pytest exit $?" >> "$out/pytest-cuda-verifier.txt"
  run fa3-dcp2-audit 150 --backend fa3 --block-size 512 --max-model-len 512 --dcp-world-size 2 \
    --audit-claims --examples 60
  run fa3 80 --backend fa3 --block-size 512 --max-model-len 512 --examples 100
  run triton_attn 80 --backend triton_attn --examples 100
  exit 0
fi
if [ "$suite" = audit-flashinfer ]; then
  run flashinfer-audit 400 --backend flashinfer --audit-claims --examples 60
  mkdir -p "$out/fi-jit"
  tar -czf "$out/fi-jit/cache.tar.gz" -C "$HOME" .cache/flashinfer 2>/dev/null
  exit 0
fi
if [ "$suite" = core ]; then
  timeout 300 python3 -m pytest -rA -q -m cuda tests/test_speculator.py tests/test_gpu_kernels.py \
    tests/test_triton_attn.py tests/test_verifier_mutants.py tests/test_gpu_verifier.py \
    tests/test_dp_dflash.py -k "not flashinfer" > "$out/pytest-cuda-core.txt" 2>&1
  echo "pytest exit $?" >> "$out/pytest-cuda-core.txt"
  run reference 150 --backend reference --examples 200
  run triton_attn 150 --backend triton_attn --examples 200
  run fa3 150 --backend fa3 --block-size 512 --max-model-len 512 --examples 200
  run fa3-dcp2 90 --backend fa3 --block-size 512 --max-model-len 512 --dcp-world-size 2 --examples 50
  run reference-dp2 90 --backend reference --dp-size 2 --num-speculative-steps 3 --examples 8
  [ "$bench" = --no-bench ] && exit 0
  timeout 200 python3 benchmarks/attention_latency.py --json "$out/attention-latency.json" \
    > "$out/attention-latency.txt" 2>&1
  echo "benchmark exit $?" >> "$out/attention-latency.txt"
else
  if [ "${FI_PYTEST_LIMIT:-330}" != 0 ]; then
    timeout "${FI_PYTEST_LIMIT:-330}" python3 -m pytest -rA -q -m cuda tests/test_gpu_kernels.py \
      tests/test_host_preplanned.py tests/test_speculator.py tests/test_dp_dflash.py \
      -k "flashinfer or preplanned" > "$out/pytest-cuda-flashinfer.txt" 2>&1
    echo "pytest exit $?" >> "$out/pytest-cuda-flashinfer.txt"
  fi
  run flashinfer "${VERIFY_LIMIT:-330}" --backend flashinfer --examples "${EXAMPLES:-200}"
  mkdir -p "$out/fi-jit"
  tar -czf "$out/fi-jit/cache.tar.gz" -C "$HOME" .cache/flashinfer 2>/dev/null
  [ "${FI_DP2_LIMIT:-120}" != 0 ] && run flashinfer-dp2 "${FI_DP2_LIMIT:-120}" --backend flashinfer \
    --dp-size 2 --num-speculative-steps 3 --examples 8
  [ "$bench" = --no-bench ] && exit 0
  timeout 200 python3 benchmarks/propose_latency.py --backend flashinfer \
    --json "$out/propose-latency-flashinfer.json" --breakdown "$out/propose-latency-flashinfer-profile.txt" \
    > "$out/propose-latency-flashinfer.txt" 2>&1
  echo "benchmark exit $?" >> "$out/propose-latency-flashinfer.txt"
fi
