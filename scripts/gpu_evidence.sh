#!/usr/bin/env bash
# The GPU tier's status records, on the lent H200 (run from the repository root there):
#   scripts/gpu_evidence.sh OUTDIR core|flashinfer [BACKEND ...]
#   scripts/gpu_evidence.sh OUTDIR mutate BACKEND [MUTATE_OPTION ...]
# installs the suite's wheels (core: .gpu-wheels/core, pydantic + fa3-fwd; mutate: the same
# but fa3-fwd; flashinfer: .gpu-wheels/fi, pydantic + apache-tvm-ffi + flashinfer-slim.zip,
# with an optional JIT cache .gpu-wheels/fi-jit/cache.tar.gz) and runs `speccheck status` for each backend (default: the
# suite's), which overwrites the GPU records in docs/status/. OUTDIR/status.tar.gz brings
# docs/status back (unpack it over the checkout, then `speccheck status --render`);
# OUTDIR/console.txt holds what the commands printed. The mutate suite is the CPU tier's
# `speccheck mutate` (CUDA hidden: the CPU tier's defaults, Triton interpreted) on the lent
# machine's cores, its report in OUTDIR/mutate-BACKEND.json (a --shard part's, to merge with
# `speccheck mutate --rescore`); LIMIT bounds it, and its --budget should leave room for the
# unmutated gate's traced run and the mutants under way. SHARDS="I/N J/N ..." runs one
# `speccheck mutate --shard` per part side by side (give each a --jobs share of the cores and
# one --gate FILE saved by an earlier part of the same code, carried along), their reports
# in OUTDIR/mutate.tar.gz.
#   EXAMPLES   examples of each verify run (200)
#   SELFTEST   0 leaves the self-test rows out (1); "only" runs just the rows, into the
#              records an earlier SELFTEST=0 call wrote at this commit (a long row then
#              gets a call of its own), and no bench
#   BENCH      0 leaves the bench out (1)
#   PYTEST     1 also runs the suite's CUDA tests into OUTDIR/pytest-cuda.txt (0)
#   LIMIT      seconds each backend's status may take (540)
#   JOBS       backends verified side by side (2: each verify's workers hold serving-scale
#              caches, ~25 GiB per backend); the benches run afterwards, one at a time.
#              On a card under 100 GiB (an H100) the default is 1, and the CUDA tests
#              wait for the backends: side by side they ran the device out of memory
#   BENCH_UNTIL  seconds into the script after which no further bench is started
set -uo pipefail
usage="usage: scripts/gpu_evidence.sh OUTDIR core|flashinfer [BACKEND ...] | mutate BACKEND [OPTION ...]"
out=${1:?$usage}
suite=${2:?$usage}
shift 2
mkdir -p "$out"
# Wheels go to /tmp/site, imported through a link named site-packages as a pip install would
# be: hypothesis scans the source of modules outside "/site-packages/" for constants.
mkdir -p /tmp/site && ln -sfn /tmp/site /tmp/site-packages
export PYTHONPATH=/tmp/site-packages PYTHONUNBUFFERED=1 COLUMNS=160
case $suite in
  core)
    backends=(reference triton_attn triton_mla sparse_swa fa3)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/core/*.whl ;;
  mutate)  # the CPU tier: the pydantic stack of .gpu-wheels/core, not fa3-fwd
    backends=()
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      $(ls .gpu-wheels/core/*.whl | grep -v /fa3_fwd-) ;;
  flashinfer)
    backends=(flashinfer flashinfer_fixed_plan)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-wheels/fi/*.whl
    python3 -m zipfile -e .gpu-wheels/fi/flashinfer-slim.zip /tmp/site
    # Ninja rebuilds an output whose inputs are newer than its .ninja_log entry: date the
    # extracted headers back so that a saved JIT cache still serves.
    find /tmp/site -exec touch -h -d 2020-01-01 {} +
    [ -f .gpu-wheels/fi-jit/cache.tar.gz ] && tar -xzf .gpu-wheels/fi-jit/cache.tar.gz -C "$HOME" ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
[ $# -gt 0 ] && backends=("$@")
python3 -m pip install -q --no-deps --no-index --no-build-isolation -e . >/dev/null
# The image sets PYTHONDONTWRITEBYTECODE=1: compile the installed packages once.
python3 -m compileall -q -j 0 "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  /tmp/site >/dev/null 2>&1
# The copy has no usable .git: the launcher writes the commit and its index there.
read -r commit index < .evidence-commit 2>/dev/null || { commit=unknown; index=; }
export SPECCHECK_COMMIT=$commit SPECCHECK_COMMIT_INDEX=$index
console=$out/console.txt
if [ "$suite" = mutate ]; then
  backend=${1:?$usage}; shift
  mutate() {  # JSON OPTION...
    local json=$1; shift
    echo "\$ speccheck mutate --backend $backend $*"
    CUDA_VISIBLE_DEVICES= timeout "${LIMIT:-540}" speccheck mutate --backend "$backend" \
      --json "$json" "$@"
    echo "exit $?"
  }
  { echo "commit $commit ($index), CPU tier on $(nproc) cores"; date -u; } > "$console"
  read -ra shards <<< "${SHARDS:-}"
  if [ ${#shards[@]} -eq 0 ]; then
    mutate "$out/mutate-$backend.json" "$@" >> "$console" 2>&1
  else
    for shard in "${shards[@]}"; do
      part=${shard/\//of}
      mutate "$out/mutate-$backend-$part.json" --shard "$shard" "$@" > "$out/console-$part.txt" 2>&1 &
    done
    wait
    for shard in "${shards[@]}"; do cat "$out/console-${shard/\//of}.txt" >> "$console"; done
    rm -f "$out"/console-*of*.txt
    tar -czf "$out/mutate.tar.gz" -C "$out" $(cd "$out" && ls mutate-*.json 2>/dev/null)
  fi
  date -u >> "$console"
  exit 0
fi
{ echo "commit $commit ($index), suite $suite: ${backends[*]}"; date -u; nvidia-smi -L; } > "$console" 2>&1
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
small_card=0
[ "${gpu_mib:-0}" -lt 100000 ] && small_card=1
[ "$small_card" = 1 ] && : "${JOBS:=1}"
cuda_tests() {
  local tests
  case $suite in
    core) tests=(tests/test_gpu_kernels.py tests/test_speculator.py tests/test_gpu_verifier.py -k "not flashinfer") ;;
    flashinfer) tests=(tests/test_gpu_kernels.py tests/test_flashinfer_page_indices.py tests/test_host_preplanned.py -k flashinfer) ;;
  esac
  { timeout 300 python3 -m pytest -q -m cuda "${tests[@]}"; echo "pytest exit $?"; } \
    > "$out/pytest-cuda.txt" 2>&1
}
pytest_pid=
if [ "${PYTEST:-0}" = 1 ] && [ "$small_card" = 0 ]; then
  cuda_tests &
  pytest_pid=$!
fi
flags=(--examples "${EXAMPLES:-200}")
[ "${SELFTEST:-1}" = 0 ] && flags+=(--no-selftest)
if [ "${SELFTEST:-1}" = only ]; then flags=(--selftest-only); BENCH=0; fi
# Verify and the self-test rows of every backend run side by side (JOBS at a time); the
# benches run afterwards one at a time, alone on the machine (--bench-only completes the
# record each backend's run wrote).
run_status() {  # BACKEND FLAG...
  local backend=$1; shift
  { echo "\$ speccheck status --backend $backend $*"
    timeout "${LIMIT:-540}" speccheck status --backend "$backend" "$@"
    echo "exit $?"; } > "$out/console-$backend.txt" 2>&1
}
for backend in "${backends[@]}"; do
  while [ "$(jobs -rp | grep -cv "^${pytest_pid:-none}$")" -ge "${JOBS:-2}" ]; do sleep 1; done
  run_status "$backend" "${flags[@]}" --no-bench &
done
for pid in $(jobs -rp); do [ "$pid" = "$pytest_pid" ] || wait "$pid"; done
[ -n "$pytest_pid" ] && wait "$pytest_pid"
[ "${PYTEST:-0}" = 1 ] && [ "$small_card" = 1 ] && cuda_tests
for backend in "${backends[@]}"; do cat "$out/console-$backend.txt" >> "$console"; done
tar -czf "$out/status.tar.gz" docs/status  # what came back so far, should the call be cut
if [ "${BENCH:-1}" = 1 ]; then
  for backend in "${backends[@]}"; do
    if [ "$SECONDS" -ge "${BENCH_UNTIL:-100000}" ]; then
      echo "bench of $backend not started: past BENCH_UNTIL (${BENCH_UNTIL}s)" >> "$console"
      continue
    fi
    run_status "$backend" --bench-only
    cat "$out/console-$backend.txt" >> "$console"
    tar -czf "$out/status.tar.gz" docs/status
  done
fi
rm -f "$out"/console-*.txt
if [ "$suite" = flashinfer ]; then
  mkdir -p "$out/fi-jit" && tar -czf "$out/fi-jit/cache.tar.gz" -C "$HOME" .cache/flashinfer 2>/dev/null
fi
exit 0
