"""flashinfer K=4 at one batch: the kernels of the first-pass graph and of the preplanned
graph, each replayed alone (queued behind a spin kernel) under torch.profiler, by GPU
time per replay; and each graph's span by CUDA events. Scratch."""
import statistics, sys
import torch
from torch.profiler import ProfilerActivity, profile
from speccheck.checks.api import plan_verification
from speccheck.checks.bench.workload import bench_batch, build_speculator, context_for
from speccheck.checks.verify.context import MatrixContext
from speccheck.speculator.autoregressive import DecodePath, FIRST_PASS

backend, k, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
config = plan_verification(backend, config={"num_speculative_steps": k}).config_for(backend)
context = context_for(config, k)
spec = build_speculator(backend, config, batch, context, MatrixContext.load(None).matrix, torch.device("cuda"))
spec.capture(); torch.cuda.synchronize()
work = bench_batch(config, batch, context)
for _ in range(20): spec.launch(work, DecodePath.PREPLANNED)
torch.cuda.synchronize()
keys = [(FIRST_PASS, spec.bucket_for(batch), 2), (DecodePath.PREPLANNED, spec.bucket_for(batch))]
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
for key in keys:
    t = []
    for _ in range(50):
        spec.launch(work, DecodePath.PREPLANNED); torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000); a.record(); spec.graphs.replay(key); b.record(); b.synchronize()
        t.append(a.elapsed_time(b) * 1e3)
    print(f"{key[0]}: span {statistics.median(t):.1f} us (CUDA events, queued)")
for key in keys:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(30):
            torch.cuda._sleep(2_000_000); spec.graphs.replay(key)
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 30, e.count / 30) for e in prof.key_averages() if e.device_time_total > 0 and "spin" not in e.key]
    rows.sort(key=lambda r: -r[1])
    print(f"===== {key[0]}: kernels by GPU time per replay (sum {sum(r[1] for r in rows):.1f} us)")
    for name, us, n in rows[:30]:
        print(f"  {us:8.1f} us  x{n:4.1f}  {name[:110]}")
