"""Does a torch.profiler session (or the bench's host-sync recorder) leave host overhead in
the process? Times the launch of the fused and per-step paths (rotating, the device drained
before each, 100 rounds) on one captured speculator: clean, after the sync recorder, after
one profile_calls run (torch.profiler with CUDA activity, then cProfile).

    python probe_profiler_residue.py triton_attn 8 64   # backend, K, batch; CUDA only
"""
import statistics, sys, time
from functools import partial
import torch
from speccheck.checks.api import plan_verification
from speccheck.checks.bench.workload import bench_batch, build_speculator, context_for
from speccheck.checks.bench.profiling import profile_calls, launch_sync_sites
from speccheck.checks.verify.context import MatrixContext
from speccheck.speculator.autoregressive import DecodePath

backend, k, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
config = plan_verification(backend, config={"num_speculative_steps": k}).config_for(backend)
context = context_for(config, k)
spec = build_speculator(backend, config, batch, context, MatrixContext.load(None).matrix, torch.device("cuda"))
spec.capture(); torch.cuda.synchronize()
work = bench_batch(config, batch, context)
paths = (DecodePath.FUSED, DecodePath.PER_STEP)
def rounds(label, n=100):
    t = {p: [] for p in paths}
    for i in range(n):
        for p in paths[i % 2:] + paths[:i % 2]:
            torch.cuda.synchronize(); s = time.perf_counter(); spec.launch(work, p); t[p].append(time.perf_counter() - s)
            spec.draft_tokens[:batch].cpu()
    f, ps = statistics.median(t[paths[0]]) * 1e6, statistics.median(t[paths[1]]) * 1e6
    print(f"{label:40s} fused {f:7.1f} us  per_step {ps:7.1f} us  ratio {f/ps:.3f}", flush=True)
rounds("warm-up", 20); rounds("clean"); rounds("clean again")
launch_sync_sites(partial(spec.launch, work, DecodePath.FUSED)); rounds("after sync recorder")
profile_calls(partial(spec.launch, work, DecodePath.FUSED), 20); rounds("after torch.profiler+cProfile")
rounds("after torch.profiler, again")
