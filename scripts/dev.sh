#!/usr/bin/env bash
# speccheck developer entry point.
#   scripts/dev.sh verify [ARGS]  set up .venv if needed, then `speccheck verify` (default backend)
#   scripts/dev.sh test   [ARGS]  set up .venv if needed, then the generated-file checks,
#                                 mypy, and the whole test suite (which also installs
#                                 examples/adapter_template into a temporary folder and gates
#                                 it, and a broken copy of it, through the pytest plugin)
# Needs only Python 3.11+. On a machine without an NVIDIA GPU it installs the CPU build of
# torch 2.13 (a bare `torch` requirement could pull a multi-GB CUDA build).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv="$root/.venv"
py="$venv/bin/python"

setup() {
    if [ -x "$py" ] && "$py" -c "import speccheck.checks.cli.app, pytest, xdist, mypy" 2>/dev/null; then
        return
    fi
    python3 -m venv "$venv"
    local kernels=(torch==2.13.0 triton==3.7.1)
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        kernels=("torch>=2.9" "triton>=3.6")
    fi
    # One resolution; byte-code compiled afterwards on every core (pip compiles one file at
    # a time, a third of its 50 s here). Compiled at all because an environment with
    # PYTHONDONTWRITEBYTECODE would otherwise re-compile torch in every process.
    "$py" -m pip install -q --no-compile "${kernels[@]}" numpy -e ".[test]"
    # A file that does not compile (test data of a package) is skipped, as pip skips it.
    local purelib
    purelib=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$py" -m compileall -q -j 0 "$purelib" >/dev/null || true
}

refresh_entry_points() {
    # Entry points (the console script, the pytest plugin) are recorded when speccheck is
    # installed: a .venv made before one was added is missing it. Offline, from this tree.
    # -P: the installed metadata, not a stale speccheck.egg-info in the working directory.
    if ! "$py" -P -c "import importlib.metadata as m, sys; sys.exit(not m.entry_points(group='pytest11', name='speccheck'))"; then
        "$py" -m pip install -q --no-deps --no-build-isolation -e .
    fi
}

cmd=${1:-}
shift || true
case "$cmd" in
    verify)
        setup
        exec "$venv/bin/speccheck" verify "$@"
        ;;
    test)
        setup
        refresh_entry_points
        # docs --check reads the shipped matrix alone, whatever plug-in backends this .venv holds.
        "$venv/bin/speccheck" docs --check
        "$venv/bin/speccheck" status --check
        "$venv/bin/speccheck" docs --checks --check
        "$venv/bin/speccheck" schema --check
        # mypy must see the tree as the `speccheck` package (the editable install's import
        # hook is invisible to it): a symlink in a scratch folder gives it that view.
        # mypy runs beside the tests, its report printed after theirs: a cold mypy is
        # about 20 s of one core, which the tests' workers would otherwise wait for.
        typeroot=$(mktemp -d)
        ln -s "$root" "$typeroot/speccheck"
        (cd "$typeroot" && "$py" -m mypy --config-file "$root/pyproject.toml" \
            -p speccheck.contract -p speccheck.backends -p speccheck.speculator \
            -p speccheck.checks) > "$typeroot/mypy.txt" 2>&1 &
        mypy_pid=$!
        set +e
        # One pytest worker per core, at most four (each imports torch): the suite is
        # mostly single-threaded CPU work, so two cores take about half the time of one.
        "$py" -m pytest -q -n auto --maxprocesses 4 --dist worksteal "$@"
        status=$?
        wait "$mypy_pid"
        mypy_status=$?
        set -e
        cat "$typeroot/mypy.txt"
        rm -rf "$typeroot"
        if [ "$status" -eq 5 ]; then
            echo "pytest collected no tests: failing" >&2
            exit 1
        fi
        if [ "$mypy_status" -ne 0 ]; then
            echo "mypy found errors (above): failing" >&2
            exit 1
        fi
        exit "$status"
        ;;
    *)
        echo "usage: scripts/dev.sh verify|test [ARGS]" >&2
        exit 2
        ;;
esac
