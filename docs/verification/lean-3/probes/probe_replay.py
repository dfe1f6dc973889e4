"""Probe: how long each graph replay call takes inside propose, GPU busy vs idle."""
import collections, statistics, sys, time
import torch
from speccheck.checks.bench import workload
from speccheck.checks.verify.context import MatrixContext
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.autoregressive import DecodePath

dev = "cuda"
for backend in sys.argv[1:]:
    for batch in (1, 8):
        config = RuntimeConfig(platform="cuda", cudagraph_mode="full", dtype="bfloat16", num_speculative_steps=4)
        spec = workload.build_speculator(backend, config, batch, 200, MatrixContext.load(None).matrix, torch.device(dev))
        workload.capture(spec)
        work = workload.bench_batch(config, batch, 200)
        manager = spec.graphs
        original = manager.replay
        times = collections.defaultdict(list)
        mode = {"sync": False}
        def timed(key, original=original, times=times, mode=mode):
            if mode["sync"]:
                torch.cuda.synchronize()
            t = time.perf_counter(); original(key); times[(mode["sync"], key)].append(time.perf_counter() - t)
        manager.replay = timed
        for sync in (False, True):
            mode["sync"] = sync
            for path in (DecodePath.PER_STEP, DecodePath.FUSED):
                hosts = []
                for i in range(60):
                    torch.cuda.synchronize()
                    t = time.perf_counter(); r = spec.launch(work, path); hosts.append(time.perf_counter() - t)
                    spec.draft_tokens[:r].cpu()
                print(f"{backend} b{batch} sync-before-replay={sync} {path.value}: launch host median {statistics.median(hosts[10:])*1e6:.0f} us", flush=True)
        for (sync, key), ts in sorted(times.items(), key=str):
            print(f"   sync={sync} replay {key}: median {statistics.median(ts[10:])*1e6:.1f} us over {len(ts)}", flush=True)
        del spec; torch.cuda.empty_cache()
