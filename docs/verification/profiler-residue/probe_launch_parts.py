"""Median host time of the parts of a fused launch (validate, stage, pass inputs, replay), with and without the garbage collector, and a cProfile of 300 launches. CUDA only: python probe_launch_parts.py triton_attn 8 64"""
import cProfile, gc, pstats, statistics, sys, time, io
import torch
from speccheck.checks.api import plan_verification
from speccheck.checks.bench.workload import bench_batch, build_speculator, context_for
from speccheck.checks.verify.context import MatrixContext
from speccheck.speculator.autoregressive import DecodePath
import speccheck.speculator.batch as B, speccheck.speculator.base as BA, speccheck.speculator.staging as ST
import speccheck.speculator.cudagraph_manager as CM

backend, k, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
config = plan_verification(backend, config={"num_speculative_steps": k}).config_for(backend)
context = context_for(config, k)
spec = build_speculator(backend, config, batch, context, MatrixContext.load(None).matrix, torch.device("cuda"))
spec.capture(); torch.cuda.synchronize()
work = bench_batch(config, batch, context)
parts = {}
def wrap(owner, name, label):
    f = getattr(owner, name)
    def g(*a, **kw):
        s = time.perf_counter(); r = f(*a, **kw); parts.setdefault(label, []).append(time.perf_counter() - s); return r
    setattr(owner, name, g)
    return lambda: setattr(owner, name, f)
def launches(path, n):
    out = []
    for _ in range(n):
        torch.cuda.synchronize(); s = time.perf_counter(); spec.launch(work, path); out.append(time.perf_counter() - s)
    torch.cuda.synchronize()
    return out
for path in (DecodePath.FUSED, DecodePath.PER_STEP):
    launches(path, 20)
    for gcon in (True, False):
        if not gcon: gc.disable()
        t = launches(path, 200)
        gc.enable()
        print(f"{path.value} gc={gcon}: median {statistics.median(t)*1e6:.1f} us, p10 {sorted(t)[20]*1e6:.1f}, p90 {sorted(t)[180]*1e6:.1f}")
undo = [wrap(B.DraftBatch, "validate", "validate"), wrap(ST.HostStaging, "stage", "stage"),
        wrap(BA.DraftModelSpeculator, "_write_pass_inputs", "write_pass_inputs"),
        wrap(CM.CudaGraphManager, "replay", "replay"), wrap(torch.cuda.CUDAGraph, "replay", "graph.replay")]
t = launches(DecodePath.FUSED, 200)
print(f"fused with part timers: median {statistics.median(t)*1e6:.1f} us; parts (median us per call):",
      {k2: round(statistics.median(v) * 1e6, 1) for k2, v in parts.items()})
for u in undo: u()
prof = cProfile.Profile()
for _ in range(300):
    torch.cuda.synchronize(); prof.enable(); spec.launch(work, DecodePath.FUSED); prof.disable()
s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(35); print(s.getvalue())
