"""``speccheck bench`` on the CPU at tiny shapes (the reference backend, eager loops), the
markdown renderer, the plots, and on a GPU the replay counts and capture cost."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from speccheck.checks.bench.markdown import render_markdown
from speccheck.checks.bench.profiling import device_us
from speccheck.checks.bench.records import BenchReport, BenchRow
from speccheck.checks.bench.table import sync_lines
from speccheck.checks.bench.workload import bench_batch, build_speculator, context_for
from speccheck.checks.cli.app import app
from speccheck.checks.verify.context import MatrixContext
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.autoregressive import AutoregressiveSpeculator, DecodePath
from speccheck.speculator.batch import DraftBatch

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--head-size", "16", "--num-heads", "2", "--num-kv-heads", "1", "--max-model-len", "64",
        "--block-size", "4"]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _bench(*args: str) -> Any:
    return CliRunner().invoke(app, ["bench", *args])


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU run's figures")
def test_reference_row_per_path_k_and_batch(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    profile = tmp_path / "profile.txt"
    result = _bench("--backend", "reference", "--steps", "2,3", "--batches", "1,2",
                    "--repeats", "2", "--json", str(out), "--profile", str(profile), *TINY)
    assert result.exit_code == 0, result.output
    assert profile.read_text().startswith("no profiler tables: host and GPU time are measured on CUDA only")
    lines = result.stdout.splitlines()
    assert lines[0].startswith("device: CPU (no CUDA device), torch ")
    assert "reference propose latency per call (CPU (no CUDA device))" in lines
    plain = [line for line in lines if line.startswith("path=")]
    assert len(plain) == 8
    assert "path=fused k=3 batch=2 " in result.stdout and "replays=0.00" in plain[0]
    data = json.loads(out.read_text())
    assert data["backend"] == "reference" and data["device"] == "CPU (no CUDA device)"
    assert data["torch_version"] == torch.__version__ and data["commit"]
    assert data["config"]["head_size"] == 16 and "num_speculative_steps" not in data["config"]
    report = BenchReport.from_json(data)
    assert report.to_json() == data
    cases = {(row.path, row.k, row.batch) for row in report.rows}
    assert cases == {(path, k, batch) for path in (DecodePath.PER_STEP, DecodePath.FUSED)
                     for k in (2, 3) for batch in (1, 2)}
    for row, raw in zip(report.rows, data["rows"], strict=True):
        assert row.wall_ms > 0 and row.host_ms is None and row.gpu_ms is None
        assert row.replays_per_propose == 0 and row.graph_reserved_bytes is None
        assert raw["ratios"]["host"] is None
        if row.path is DecodePath.PER_STEP:
            assert raw["ratios"]["wall"] == 1.0


def test_different_draft_tokens_exit_1_naming_the_request(monkeypatch: pytest.MonkeyPatch) -> None:
    original = AutoregressiveSpeculator.launch

    def corrupt(self: AutoregressiveSpeculator, batch: Any, path: DecodePath = DecodePath.AUTO) -> int:
        r = original(self, batch, path)
        if path is DecodePath.FUSED:
            self.draft_tokens[1, -1] += 1
        return r

    monkeypatch.setattr(AutoregressiveSpeculator, "launch", corrupt)
    result = _bench("--backend", "reference", "--steps", "2", "--batches", "2",
                    "--repeats", "1", *TINY)
    assert result.exit_code == 1, result.output
    line = _one_line(result.stderr.replace("bench reference: timing case 1/1: K=2, batch 2\n", ""))
    assert line.startswith("reference: draft tokens differ at K=2, batch 2: request 1 drafted ")
    assert "on eager per_step and " in line and line.endswith(" on fused")


@pytest.mark.parametrize(("args", "expected"), [
    (["--steps", "2,x"], "--steps: expected comma-separated counts"),
    (["--steps", "0"], "--steps: counts must lie in 1..64"),
    (["--batches", ""], "--batches: expected comma-separated counts"),
    (["--repeats", "0"], "--repeats: must lie in 1..10000"),
    (["--steps", "64"], "--steps: K=64 needs max_model_len >= 65"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], expected: str) -> None:
    result = _bench("--backend", "reference", "--batches", "1", *args, *TINY)
    assert result.exit_code == 2, result.output
    assert _one_line(result.stderr).startswith(expected)


def test_unknown_backend_exits_2() -> None:
    result = _bench("--backend", "nope")
    assert result.exit_code == 2, result.output
    line = _one_line(result.stderr)
    assert line.startswith("--backend: unknown backend 'nope'; valid: reference, ")
    assert not line.endswith(", all")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a backend this machine cannot run")
def test_backend_the_platform_cannot_run_exits_3() -> None:
    result = _bench("--backend", "fa3", "--steps", "2", "--batches", "1")
    assert result.exit_code == 3, result.output
    assert _one_line(result.stderr) == (
        "fa3: cannot run here: fa3 runs on cuda; this machine offers cpu (no CUDA device)")


def _report() -> BenchReport:
    rows = []
    for k in (2, 4):
        for batch in (1, 8):
            for path, scale in ((DecodePath.PER_STEP, 1.0), (DecodePath.FUSED, 0.5)):
                rows.append(BenchRow(path, k, batch, 2.0 * k * scale, 1.0 * k * scale, 0.5 * k,
                                     1.0 if path is DecodePath.FUSED else k - 1.0, 0.25,
                                     3 << 20, 4 << 20, 0.09 * batch))
    return BenchReport("reference", "NVIDIA H200", "2.13.0", "0123456789abcdef", "speccheck bench",
                       {"dtype": "bfloat16"}, {"vocab_size": 32000, "context": 200}, 30, 3,
                       tuple(rows), weight_bytes=274_000_000, bandwidth_gbps=4567.0)


_TINY_CONFIG = RuntimeConfig(head_size=16, num_heads=2, num_kv_heads=1, max_model_len=64,
                             block_size=4, num_speculative_steps=3, cudagraph_mode="none")


def _reference_speculator() -> AutoregressiveSpeculator:
    return build_speculator("reference", _TINY_CONFIG, 2, context_for(_TINY_CONFIG, 3),
                            MatrixContext.load(None).matrix, torch.device("cpu"))


def _work() -> DraftBatch:
    return bench_batch(_TINY_CONFIG, 2, context_for(_TINY_CONFIG, 3))


def _render_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("render_bench_docs",
                                                  ROOT / "scripts" / "render_bench_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_render_markdown_from_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "bench.json"
    source.write_text(json.dumps(_report().to_json()))
    assert _render_script().main([str(source)]) == 0
    text = capsys.readouterr().out
    assert "### reference: propose latency per call" in text
    assert "NVIDIA H200, torch 2.13.0, commit 0123456789ab; `speccheck bench`" in text
    assert ("| path | K | batch | wall ms | host ms | GPU ms | replays/propose | capture s "
            "| graph MiB alloc/resv | wall / per_step | host / per_step | GPU / per_step "
            "| step GPU ms | step / weight-read bound |") in text
    assert ("The weight-read bound of a decode step: 60.0 us (274.0 MB of weights at 4567 GB/s "
            "measured copy bandwidth).") in text
    assert ("| per_step | 4 | 8 | 8.000 | 4.000 | 2.000 | 3.00 | 0.25 | 3.0/4.0 | 1.00 | 1.00 "
            "| 1.00 | 0.7200 | 12.00 |") in text
    assert ("| fused | 4 | 1 | 4.000 | 2.000 | 2.000 | 1.00 | 0.25 | 3.0/4.0 | 0.50 | 0.50 | 1.00 "
            "| 0.0900 | 1.50 |") in text
    assert text.count("| fused |") == 4


def test_reports_written_before_the_weight_read_bound_still_load() -> None:
    data = _report().to_json()
    for key in ("weight_bytes", "bandwidth_gbps"):
        del data[key]
    for row in data["rows"]:
        del row["step_gpu_ms"]
    old = BenchReport.from_json(data)
    assert old.weight_read_bound_ms is None and old.step_over_bound(old.rows[0]) is None
    assert BenchReport.from_json(_report().to_json()) == _report()


def test_reports_written_before_the_host_preplanned_rename_still_load() -> None:
    data = _report().to_json()
    data["rows"][0]["path"] = "preplanned"
    assert BenchReport.from_json(data).rows[0].path is DecodePath.HOST_PREPLANNED


def test_decode_weight_bytes_leave_out_the_embedding() -> None:
    from speccheck.speculator.model import DrafterConfig, DraftModel

    cfg = DrafterConfig(vocab_size=100, num_layers=1, num_heads=2, num_kv_heads=1, head_size=8,
                        intermediate_size=32, dtype="bfloat16")
    model = DraftModel(cfg, torch.device("cpu"))
    embedding = 100 * 16 * 2
    total = sum(p.numel() * 2 for p in model.parameters())
    assert model.decode_weight_bytes() == total - embedding


def test_render_rejects_a_file_that_is_not_a_report(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "other.json"
    source.write_text(json.dumps({"backends": []}))
    assert _render_script().main([str(source)]) == 2
    assert _one_line(capsys.readouterr().err).startswith(f"{source}: not a `speccheck bench")


@pytest.mark.skipif(HAS_MATPLOTLIB, reason="checks the error without matplotlib")
def test_plots_without_matplotlib_exit_2_saying_how_to_install(tmp_path: Path) -> None:
    result = _bench("--backend", "reference", "--plots", str(tmp_path / "plots"), *TINY)
    assert result.exit_code == 2, result.output
    assert _one_line(result.stderr) == ("--plots needs matplotlib, which is not installed: "
                                        "pip install 'speccheck[bench]' (or: pip install matplotlib)")
    assert not (tmp_path / "plots").exists()


def test_write_plots_one_png_per_k(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from speccheck.checks.bench.plots import write_plots

    written = write_plots(_report(), tmp_path / "plots")
    assert [p.name for p in written] == ["reference-k2.png", "reference-k4.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)


def test_device_time_is_the_union_of_device_events() -> None:
    """Host events are left out; overlapping device events (a dependent kernel resident
    before the one ahead ends) count once; gaps count not at all."""
    from torch.autograd import DeviceType

    def event(kind: DeviceType, name: str, start: float, end: float) -> SimpleNamespace:
        return SimpleNamespace(device_type=kind, name=name,
                               time_range=SimpleNamespace(start=start, end=end))

    events = [event(DeviceType.CPU, "cudaStreamSynchronize", 0.0, 30.0),
              event(DeviceType.CUDA, "memcpy", 40.0, 42.0),
              event(DeviceType.CUDA, "gemm", 10.0, 21.0),
              event(DeviceType.CUDA, "dependent", 18.0, 25.0),
              event(DeviceType.CUDA, "inside", 19.0, 20.0),
              event(DeviceType.CPU, "aten::mm", 20.0, 27.0)]
    assert device_us(events) == 15.0 + 2.0
    assert device_us([]) == 0.0


def test_step_timeline_cuts_replays_between_spin_kernels() -> None:
    """A replay is what runs between an opening spin kernel and the next (closing) one;
    the rewinding copies between a closing and an opening spin are not part of it."""
    from speccheck.checks.bench.step_timeline import StepTimeline, TimelineKernel, _replays

    spin = "void at::cuda::(anonymous namespace)::spin_kernel(long)"
    events = [("Memcpy DtoD", 0.0, 1.0), (spin, 1.0, 100.0), ("qkv", 101.0, 105.0),
              ("attention", 104.0, 110.0), (spin, 111.0, 112.0), ("Memcpy DtoD", 113.0, 114.0),
              (spin, 115.0, 200.0), ("qkv", 200.5, 204.0), ("attention", 203.0, 209.0),
              (spin, 210.0, 211.0)]
    replays = _replays(events)
    assert [[name for name, _, _ in r[1:]] for r in replays] == [["qkv", "attention"]] * 2
    text = StepTimeline(1, 2, 8.75, (TimelineKernel("qkv", 3.75, 0.75),
                                     TimelineKernel("attention", 6.0, -1.0))).text()
    assert text.splitlines()[0].startswith("decode step timeline, batch 1: 2 kernels")
    assert "gap   -1.00 us" in text


def test_launch_queues_the_work_propose_returns() -> None:
    """``launch`` leaves in ``draft_tokens`` the tokens ``propose`` hands back: the bench
    times the launch as host time and the launch with the tokens' copy back as wall time."""
    spec = _reference_speculator()
    work = _work()
    want = spec.propose(work, DecodePath.FUSED).draft_tokens
    r = spec.launch(work, DecodePath.PER_STEP)
    assert r == work.num_reqs and torch.equal(spec.draft_tokens[:r].cpu(), want)


def test_rows_name_where_a_launch_synchronises() -> None:
    report = _report()
    row = report.rows[0]
    synced = dataclasses.replace(row, host_ms=1.0, launch_syncs=("item at x.py:3",))
    again = BenchRow.from_json(json.loads(json.dumps(synced.to_json())))
    assert again == synced
    report = dataclasses.replace(report, rows=(synced, *report.rows[1:]))
    assert sync_lines(report) == [
        (f"{row.path.value} K={row.k} batch {row.batch}: the launch may wait for the "
         "device at item at x.py:3 (host time includes any such wait)")]
    assert "- " + sync_lines(report)[0] in render_markdown([report])


@pytest.mark.cuda
def test_gpu_replays_capture_cost_and_host_time() -> None:
    from speccheck.checks.bench.measure import BenchPhase, BenchSettings, run_bench

    config = RuntimeConfig(platform="cuda", cudagraph_mode="full", dtype="bfloat16",
                           head_size=64, num_heads=4, num_kv_heads=2, block_size=16,
                           max_model_len=512)
    settings = BenchSettings("reference", config, MatrixContext.load(None), (3,), (2,), 2,
                             step_timelines=True)
    phases: list[tuple[BenchPhase, int, int]] = []
    run = run_bench(settings, torch.device("cuda"), commit="test", command="test",
                    on_case=lambda phase, k, batch, number, total: phases.append((phase, k, batch)))
    # every case timed before the profiler first runs (its CUPTI callbacks outlive it)
    assert phases == [(BenchPhase.TIMING, 3, 2), (BenchPhase.PROFILING, 3, 2)]
    report = run.report
    for path in ("per_step", "fused"):
        assert f"=== reference: K=3, batch 2, path {path} " in run.profile_text()
    timeline = run.step_timelines[(3, 2)]
    assert "=== reference: K=3, batch 2, one decode step" in run.profile_text()
    assert timeline.kernels and all(k.duration_us > 0 for k in timeline.kernels)
    assert not any("spin_kernel" in k.name for k in timeline.kernels)
    assert 0 < timeline.span_us < 1000
    by_path = {row.path: row for row in report.rows}
    assert set(by_path) == {DecodePath.PER_STEP, DecodePath.FUSED}
    assert by_path[DecodePath.PER_STEP].replays_per_propose == 2.0
    assert by_path[DecodePath.FUSED].replays_per_propose == 1.0
    for row in report.rows:
        assert row.host_ms is not None and row.graph_reserved_bytes is not None
        assert row.gpu_ms is not None and row.gpu_ms > 0
        assert row.capture_s > 0
        # the spin kernel queued before the start event (over a millisecond at any clock an
        # H200 runs) is outside the timed span: this small drafter's step takes far less
        assert row.step_gpu_ms is not None and 0 < row.step_gpu_ms < 1.0
    assert report.bandwidth_gbps is not None and report.bandwidth_gbps > 100
    assert report.weight_read_bound_ms is not None and report.weight_read_bound_ms > 0


@pytest.mark.skipif(not HAS_MATPLOTLIB or torch.cuda.is_available(),
                    reason="plots for real where matplotlib is installed (CPU run)")
def test_plots_option_writes_pngs(tmp_path: Path) -> None:
    result = _bench("--backend", "reference", "--steps", "2", "--batches", "1,2", "--repeats", "1",
                    "--plots", str(tmp_path / "plots"), *TINY)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "plots" / "reference-k2.png").read_bytes().startswith(b"\x89PNG")


def test_commands_without_cuda_run_triton_in_its_interpreter() -> None:
    """``speccheck selftest``, ``bench`` and the verify worker call this before they import
    a backend: on a machine without CUDA, a Triton kernel then runs in the interpreter
    instead of failing for want of a driver (``0 active drivers``)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import os\nfrom speccheck.checks.triton_interpreter import "
            "interpret_triton_without_cuda\ninterpret_triton_without_cuda()\n"
            "print(os.environ.get('TRITON_INTERPRET'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.strip()
    assert out == ("None" if torch.cuda.is_available() else "1")
