"""flashinfer K=4: the prefill wrapper on FlashInfer's auto backend (FA3 on sm90) against
fa2, interleaved in one process: median wall and host per path, ratios, token agreement,
the first pass's prefill plan host time. Scratch."""
import statistics, sys, time
import torch
from speccheck.checks.api import plan_verification
from speccheck.checks.bench.workload import bench_batch, build_speculator, context_for, decode_paths
from speccheck.checks.verify.context import MatrixContext
import speccheck.backends.flashinfer.builder as FB

backend, k = sys.argv[1], int(sys.argv[2])
variants = sys.argv[4].split(",")
for batch in map(int, sys.argv[3].split(",")):
    config = plan_verification(backend, config={"num_speculative_steps": k}).config_for(backend)
    context = context_for(config, k)
    specs = {}
    for v in variants:
        spec = build_speculator(backend, config, batch, context, MatrixContext.load(None).matrix, torch.device("cuda"))
        for g in spec.groups:
            if v.startswith("fa2"):
                g.builder.kernel_backend = "fa2"
            if v.endswith("uq"):
                g.builder.uniform_first_pass = True
        spec.capture(); torch.cuda.synchronize()
        specs[v] = spec
    work = bench_batch(config, batch, context)
    paths = decode_paths(next(iter(specs.values())))
    toks = {}
    for v, spec in specs.items():
        pre = [gw for (kind, n), gw in spec.groups[0].builder._wrappers.items() if kind == "prefill"]
        print(f"b{batch} {v}: prefill backend {[p.wrapper._backend for p in pre]}")
        for p in paths:
            toks[(v, p)] = spec.propose_tokens(work, p).clone()
    base = toks[(variants[0], paths[0])]
    print(f"  tokens equal to {variants[0]}/{paths[0].value}:", {f"{v}/{p.value}": bool(torch.equal(t, base)) for (v, p), t in toks.items()})
    hs = {}; ws = {}
    for i in range(260):
        for v, spec in specs.items():
            for p in paths:
                torch.cuda.synchronize(); s = time.perf_counter(); r = spec.launch(work, p); m = time.perf_counter()
                spec.draft_tokens[:r].cpu(); e = time.perf_counter()
                if i >= 60:
                    hs.setdefault((v, p), []).append(m - s); ws.setdefault((v, p), []).append(e - s)
    for v in specs:
        med = {p: (statistics.median(ws[(v, p)]) * 1e3, statistics.median(hs[(v, p)]) * 1e3) for p in paths}
        ps = med[paths[0]]
        print(f"  {v}: " + "; ".join(f"{p.value} wall {w:.3f} host {h:.3f} ms (wall ratio {w / ps[0]:.3f}, host {h / ps[1]:.3f})" for p, (w, h) in med.items()))
    # first-pass plan host time per variant
    for v, spec in specs.items():
        up = []
        orig = FB.FlashInferMetadataBuilder._upload_plan
        def timed(self, gw, *a, **kw):
            s = time.perf_counter(); r = orig(self, gw, *a, **kw)
            if gw.kind == "prefill": up.append(time.perf_counter() - s)
            return r
        FB.FlashInferMetadataBuilder._upload_plan = timed
        for _ in range(200):
            torch.cuda.synchronize(); spec.launch(work, paths[-1])
        FB.FlashInferMetadataBuilder._upload_plan = orig
        print(f"  {v}: prefill _upload_plan median {statistics.median(up)*1e6:.0f} us")
    # GPU time of the first pass alone (graph replay), per variant
    from speccheck.speculator.autoregressive import FIRST_PASS
    for v, spec in specs.items():
        key = (FIRST_PASS, spec.bucket_for(batch), 2)
        spec.launch(work, paths[-1]); torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = []
        for _ in range(50):
            a.record(); spec.graphs.replay(key); b.record(); b.synchronize(); t.append(a.elapsed_time(b))
        print(f"  {v}: first-pass graph GPU median {statistics.median(t)*1e3:.1f} us")
    del specs, spec; torch.cuda.empty_cache()
