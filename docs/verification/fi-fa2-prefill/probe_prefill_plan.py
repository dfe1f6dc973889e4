"""Where the first pass's prefill plan() host time goes (flashinfer, K=4): cProfile of
_upload_plan on the prefill wrapper, the C++ scheduler alone, and its args. Scratch."""
import cProfile, io, pstats, statistics, sys, time
import torch
from speccheck.checks.api import plan_verification
from speccheck.checks.bench.workload import bench_batch, build_speculator, context_for, decode_paths
from speccheck.checks.verify.context import MatrixContext
import speccheck.backends.flashinfer.builder as FB

backend, k = sys.argv[1], int(sys.argv[2])
for batch in map(int, sys.argv[3].split(",")):
    config = plan_verification(backend, config={"num_speculative_steps": k}).config_for(backend)
    context = context_for(config, k)
    spec = build_speculator(backend, config, batch, context, MatrixContext.load(None).matrix, torch.device("cuda"))
    spec.capture(); torch.cuda.synchronize()
    work = bench_batch(config, batch, context)
    print(f"b{batch}: new_tokens widths {sorted({len(r) for r in work.new_tokens})}, groups {len(spec.groups)}")
    paths = decode_paths(spec)
    for _ in range(30):
        for p in paths: spec.launch(work, p)
    torch.cuda.synchronize()
    builder = spec.groups[0].builder
    print("  wrappers:", sorted(builder._wrappers))
    pre = [gw for (kind, n), gw in builder._wrappers.items() if kind == "prefill" and n == spec.bucket_for(batch)][0]
    w = pre.wrapper
    print("  backend", w._backend, "max_total_num_rows", w._max_total_num_rows, "fixed bs", w._fixed_batch_size)
    mod = w._cached_module
    calls = []
    print("  module type", type(mod))
    cplan = mod.plan
    def tplan(*a):
        s = time.perf_counter(); r = cplan(*a); calls.append((time.perf_counter() - s, a)); return r
    mod.plan = tplan
    up = []
    orig = FB.FlashInferMetadataBuilder._upload_plan
    def timed(self, gw, *a, **kw):
        s = time.perf_counter(); r = orig(self, gw, *a, **kw)
        if gw is pre: up.append(time.perf_counter() - s)
        return r
    FB.FlashInferMetadataBuilder._upload_plan = timed
    fp = []
    origfp = type(spec)._first_pass_metadata
    def tfp(self, *a, **kw):
        s = time.perf_counter(); r = origfp(self, *a, **kw); fp.append(time.perf_counter() - s); return r
    type(spec)._first_pass_metadata = tfp
    for p in paths:
        calls.clear(); up.clear(); fp.clear()
        for _ in range(200):
            torch.cuda.synchronize(); spec.launch(work, p)
        print(f"  {p.value}: first_pass_metadata {statistics.median(fp)*1e6:.0f} us; prefill _upload_plan {statistics.median(up)*1e6:.0f} us; C++ plan {statistics.median([c[0] for c in calls] or [0])*1e6:.0f} us ({len(calls)} calls)")
    a = calls[-1][1]
    mod.plan = cplan
    print("  plan args:", [tuple(x.shape) if torch.is_tensor(x) else x for x in a])
    ts = []
    for _ in range(300):
        torch.cuda.synchronize(); s = time.perf_counter(); mod.plan(*a); ts.append(time.perf_counter() - s)
    print(f"  C++ plan alone, idle GPU: median {statistics.median(ts)*1e6:.1f} us")
    ts = []
    for _ in range(300):
        s = time.perf_counter(); mod.plan(*a); ts.append(time.perf_counter() - s)
    torch.cuda.synchronize()
    print(f"  C++ plan alone, back to back: median {statistics.median(ts)*1e6:.1f} us")
    FB.FlashInferMetadataBuilder._upload_plan = orig
    type(spec)._first_pass_metadata = origfp
    prof = cProfile.Profile()
    for _ in range(100):
        torch.cuda.synchronize(); prof.enable(); spec.launch(work, paths[-1]); prof.disable()
    s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
    print(f"===== {paths[-1].value} by tottime (100 launches)\n" + s.getvalue())
    s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(60)
    print(f"===== {paths[-1].value} by cumulative (100 launches)\n" + s.getvalue())
    del spec; torch.cuda.empty_cache()
