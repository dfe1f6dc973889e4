"""flashinfer K=4: decode wrappers on CUDA cores (the adapter's) against tensor cores (FA2
prefill kernels), interleaved in one process: single-step graph GPU time, propose wall and
host per path, token agreement. Scratch."""
import statistics, sys, time
import torch
from speccheck.checks.api import plan_verification
from speccheck.checks.bench.workload import bench_batch, build_speculator, context_for, decode_paths
from speccheck.checks.verify.context import MatrixContext

backend, k = sys.argv[1], int(sys.argv[2])
for batch in map(int, sys.argv[3].split(",")):
    config = plan_verification(backend, config={"num_speculative_steps": k}).config_for(backend)
    context = context_for(config, k)
    specs = {}
    for v in ("cuda_cores", "tensor_cores"):
        spec = build_speculator(backend, config, batch, context, MatrixContext.load(None).matrix, torch.device("cuda"))
        for g in spec.groups:
            g.builder.decode_tensor_cores = v == "tensor_cores"
        spec.capture(); torch.cuda.synchronize()
        specs[v] = spec
    work = bench_batch(config, batch, context)
    paths = decode_paths(next(iter(specs.values())))
    toks = {(v, p): s.propose_tokens(work, p).clone() for v, s in specs.items() for p in paths}
    base = toks[("cuda_cores", paths[0])]
    print(f"b{batch} tokens equal:", {f"{v}/{p.value}": bool(torch.equal(t, base)) for (v, p), t in toks.items()})
    from speccheck.checks.bench.roofline import decode_step_gpu_ms
    for v, spec in specs.items():
        spec.launch(work, paths[0]); torch.cuda.synchronize()
        print(f"  {v}: single-step graph GPU median {decode_step_gpu_ms(spec, batch, 50)*1e3:.1f} us")
    hs = {}; ws = {}
    for i in range(260):
        for v, spec in specs.items():
            for p in paths:
                torch.cuda.synchronize(); s = time.perf_counter(); r = spec.launch(work, p); m = time.perf_counter()
                spec.draft_tokens[:r].cpu(); e = time.perf_counter()
                if i >= 60:
                    hs.setdefault((v, p), []).append(m - s); ws.setdefault((v, p), []).append(e - s)
    ref = statistics.median(ws[("cuda_cores", paths[0])])
    for v in specs:
        med = {p: (statistics.median(ws[(v, p)]) * 1e3, statistics.median(hs[(v, p)]) * 1e3) for p in paths}
        print(f"  {v}: " + "; ".join(f"{p.value} wall {w:.3f} host {h:.3f} ms (wall / cuda_cores per_step {w / ref / 1e3:.3f})" for p, (w, h) in med.items()))
    from speccheck.checks.bench.roofline import rewound_step, step_graph_key
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for v, spec in specs.items():
            spec.launch(work, paths[0]); torch.cuda.synchronize()
            with rewound_step(spec) as rewind:
                for _ in range(20):
                    rewind(); spec.graphs.replay(step_graph_key(spec, batch))
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
    del specs, spec; torch.cuda.empty_cache()
