"""Median host time of the parts of a flashinfer launch per path (validate, pass inputs,
first-pass metadata, replays, preplanned plans, per-step builds); and the wall time.
CUDA only: python probe_preplanned_parts.py flashinfer 4 1,8,64"""
import statistics, sys, time
import torch
from speccheck.checks.api import plan_verification
from speccheck.checks.bench.workload import bench_batch, build_speculator, context_for, decode_paths
from speccheck.checks.verify.context import MatrixContext
import speccheck.speculator.autoregressive as AR, speccheck.speculator.base as BA
import speccheck.speculator.cudagraph_manager as CM
import speccheck.backends.flashinfer.builder as FB

backend, k = sys.argv[1], int(sys.argv[2])
parts: dict = {}
def wrap(owner, name, label):
    f = getattr(owner, name)
    def g(*a, **kw):
        s = time.perf_counter(); r = f(*a, **kw); parts.setdefault(label, []).append(time.perf_counter() - s); return r
    setattr(owner, name, g)
    return lambda: setattr(owner, name, f)
for batch in map(int, sys.argv[3].split(",")):
    config = plan_verification(backend, config={"num_speculative_steps": k}).config_for(backend)
    context = context_for(config, k)
    spec = build_speculator(backend, config, batch, context, MatrixContext.load(None).matrix, torch.device("cuda"))
    spec.capture(); torch.cuda.synchronize()
    work = bench_batch(config, batch, context)
    paths = decode_paths(spec)
    def launches(path, n):
        hs, ws = [], []
        for _ in range(n):
            torch.cuda.synchronize(); s = time.perf_counter(); r = spec.launch(work, path); m = time.perf_counter()
            spec.draft_tokens[:r].cpu(); e = time.perf_counter(); hs.append(m - s); ws.append(e - s)
        return hs, ws
    for p in paths: launches(p, 30)
    for p in paths:
        hs, ws = launches(p, 200)
        print(f"b{batch} {p.value}: host {statistics.median(hs)*1e6:.0f} us wall {statistics.median(ws)*1e6:.0f} us")
    undo = [wrap(BA.DraftModelSpeculator, "_validate", "validate"),
            wrap(BA.DraftModelSpeculator, "_write_pass_inputs", "write_pass_inputs"),
            wrap(AR.AutoregressiveSpeculator, "_first_pass_metadata", "first_pass_metadata"),
            wrap(AR.AutoregressiveSpeculator, "_build_preplanned_metadata", "preplanned_metadata"),
            wrap(AR.AutoregressiveSpeculator, "_build_decode_metadata", "decode_metadata"),
            wrap(AR.AutoregressiveSpeculator, "_compute_slot_mappings", "slot_mappings"),
            wrap(FB.FlashInferMetadataBuilder, "_upload_plan", "fi._upload_plan"),
            wrap(FB, "write_paged_kv_indices", "fi.write_paged_kv_indices"),
            wrap(FB.FlashInferMetadataBuilder, "_metadata", "fi._metadata"),
            wrap(FB._DecodeScheduler, "__call__", "fi.scheduler"),
            wrap(torch.cuda.CUDAGraph, "replay", "graph.replay")]
    for p in paths:
        parts.clear()
        hs, _ = launches(p, 200)
        print(f"  {p.value} with timers: host {statistics.median(hs)*1e6:.0f} us; per launch (us):",
              {k2: round(sum(v) / 200 * 1e6, 1) for k2, v in parts.items()})
    for u in undo: u()
    del spec; torch.cuda.empty_cache()
