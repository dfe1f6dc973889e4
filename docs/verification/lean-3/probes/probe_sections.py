"""Probe: host time per section of a propose launch (perf_counter wrappers)."""
import collections, statistics, sys, time
import torch
import speccheck.speculator.autoregressive as ar
from speccheck.checks.bench import workload
from speccheck.checks.verify.context import MatrixContext
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.autoregressive import DecodePath

times = collections.defaultdict(list)
def wrap(owner, name, label):
    original = getattr(owner, name)
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            times[label].append(time.perf_counter() - t)
    setattr(owner, name, timed)

wrap(ar, "build_uniform_attention_metadata", "common build")
for batch in (1, 8):
    times.clear()
    config = RuntimeConfig(platform="cuda", cudagraph_mode="full", dtype="bfloat16", num_speculative_steps=4)
    spec = workload.build_speculator(sys.argv[1], config, batch, 200, MatrixContext.load(None).matrix, torch.device("cuda"))
    workload.capture(spec)
    work = workload.bench_batch(config, batch, 200)
    for name in ("_validate", "_prefill", "_write_pass_inputs", "_compute_slot_mappings", "_prepare_decode_inputs",
                 "_fused_multi_step_decode", "_multi_step_decode", "_build_decode_metadata"):
        wrap(spec, name, name)
    wrap(spec.graphs, "replay", "graph replay")
    for i, g in enumerate(spec.groups):
        wrap(g, "build", f"group build")
    wrap(spec.staging, "stage", "staging.stage") if hasattr(spec, "staging") else None
    for path in (DecodePath.PER_STEP, DecodePath.FUSED):
        hosts = []
        times_before = {k: len(v) for k, v in times.items()}
        for i in range(60):
            torch.cuda.synchronize()
            t = time.perf_counter(); r = spec.launch(work, path); hosts.append(time.perf_counter() - t)
            spec.draft_tokens[:r].cpu()
        print(f"b{batch} {path.value}: launch median {statistics.median(hosts[10:])*1e6:.0f} us", flush=True)
        for label, ts in sorted(times.items()):
            new = ts[times_before.get(label, 0):]
            if new:
                per_call = sum(new) / 60 * 1e6
                print(f"    {label:28s} calls/propose {len(new)/60:.1f}  median {statistics.median(new)*1e6:7.1f} us  per propose {per_call:7.1f} us", flush=True)
    del spec; torch.cuda.empty_cache()
