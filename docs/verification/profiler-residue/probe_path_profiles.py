"""Median host and wall time of each decode path of one bench case, then cProfile tables (by own and by cumulative time) of 100 launches per path. CUDA only: python probe_path_profiles.py flashinfer 4 64"""
import cProfile, io, pstats, statistics, sys, time
import torch
from speccheck.checks.api import plan_verification
from speccheck.checks.bench.workload import bench_batch, build_speculator, context_for, decode_paths
from speccheck.checks.verify.context import MatrixContext

backend, k, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
config = plan_verification(backend, config={"num_speculative_steps": k}).config_for(backend)
context = context_for(config, k)
spec = build_speculator(backend, config, batch, context, MatrixContext.load(None).matrix, torch.device("cuda"))
spec.capture(); torch.cuda.synchronize()
work = bench_batch(config, batch, context)
paths = decode_paths(spec)
t = {p: [] for p in paths}; w = {p: [] for p in paths}
for i in range(120):
    for p in paths[i % len(paths):] + paths[:i % len(paths)]:
        torch.cuda.synchronize(); s = time.perf_counter(); r = spec.launch(work, p); m = time.perf_counter()
        spec.draft_tokens[:r].cpu(); e = time.perf_counter()
        if i >= 20: t[p].append(m - s); w[p].append(e - s)
for p in paths:
    print(f"{p.value}: host median {statistics.median(t[p])*1e6:.0f} us, wall {statistics.median(w[p])*1e6:.0f} us")
for p in paths:
    prof = cProfile.Profile()
    for _ in range(100):
        torch.cuda.synchronize(); prof.enable(); spec.launch(work, p); prof.disable()
    for key in ("tottime", "cumulative"):
        s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats(key).print_stats(45)
        print(f"===== {p.value} by {key} (100 launches)\n" + s.getvalue())
