"""flashinfer K=4 preplanned: host time from the call's start to the first-pass replay (A),
from it to the preplanned replay (P span), the first pass's GPU time (F) and the wall;
and the host time of the parts inside P. Scratch."""
import statistics, sys, time
import torch
from speccheck.checks.api import plan_verification
from speccheck.checks.bench.workload import bench_batch, build_speculator, context_for, decode_paths
from speccheck.checks.verify.context import MatrixContext
from speccheck.speculator.autoregressive import DecodePath, FIRST_PASS
import speccheck.speculator.autoregressive as AR
import speccheck.backends.flashinfer.builder as FB
import speccheck.contract.token_count as TC

backend, k = sys.argv[1], int(sys.argv[2])
for batch in map(int, sys.argv[3].split(",")):
    config = plan_verification(backend, config={"num_speculative_steps": k}).config_for(backend)
    context = context_for(config, k)
    spec = build_speculator(backend, config, batch, context, MatrixContext.load(None).matrix, torch.device("cuda"))
    spec.capture(); torch.cuda.synchronize()
    work = bench_batch(config, batch, context)
    for _ in range(50):
        for p in decode_paths(spec): spec.launch(work, p)
    torch.cuda.synchronize()
    stamps = []
    orig_replay = spec.graphs.replay
    def replay(key):
        stamps.append((key[0], time.perf_counter())); orig_replay(key)
        stamps.append((str(key[0]) + ".end", time.perf_counter()))
    spec.graphs.replay = replay
    parts = {}
    def wrap(owner, name, label):
        f = getattr(owner, name)
        def g(*a, **kw):
            s = time.perf_counter(); r = f(*a, **kw); parts.setdefault(label, []).append(time.perf_counter() - s); return r
        setattr(owner, name, g)
    rows = []
    for i in range(300):
        stamps.clear()
        torch.cuda.synchronize(); s = time.perf_counter(); r = spec.launch(work, DecodePath.PREPLANNED); m = time.perf_counter()
        spec.draft_tokens[:r].cpu(); e = time.perf_counter()
        d = dict(stamps)
        if i >= 50:
            rows.append((d[FIRST_PASS] - s, d["preplanned"] - d[FIRST_PASS + ".end"], m - s, e - s))
    med = [statistics.median(c) * 1e6 for c in zip(*rows)]
    key = (FIRST_PASS, spec.bucket_for(batch), 2)
    spec.graphs.replay = orig_replay
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = []
    for _ in range(50):
        spec.launch(work, DecodePath.PREPLANNED); torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000); a.record(); spec.graphs.replay(key); b.record(); b.synchronize(); t.append(a.elapsed_time(b) * 1e3)
    print(f"b{batch} preplanned: A (start to first-pass replay) {med[0]:.0f} us; P span (first-pass replay returned to preplanned replay) {med[1]:.0f} us; host {med[2]:.0f} us; wall {med[3]:.0f} us; F (first-pass graph GPU, queued) {statistics.median(t):.0f} us")
    spec.graphs.replay = replay
    wrap(AR, "build_uniform_attention_metadata", "build_uniform_attention_metadata")
    wrap(AR, "at_later_draft_step", "at_later_draft_step")
    wrap(FB.FlashInferMetadataBuilder, "plan_draft_steps", "plan_draft_steps")
    wrap(FB, "stage_paged_kv_lengths", "  stage_paged_kv_lengths")
    wrap(FB, "_wait_for_upload", "  _wait_for_upload")
    wrap(FB._DecodeScheduler, "__call__", "  scheduler")
    wrap(FB.FlashInferMetadataBuilder, "_metadata", "  _metadata")
    wrap(FB.FlashInferMetadataBuilder, "_draft_step_wrappers", "  _draft_step_wrappers")
    wrap(AR.AutoregressiveSpeculator, "_build_preplanned_metadata", "P: _build_preplanned_metadata")
    wrap(AR.AutoregressiveSpeculator, "_first_pass_metadata", "A: _first_pass_metadata")
    wrap(FB.FlashInferMetadataBuilder, "_upload_plan", "A:   _upload_plan")
    wrap(FB, "write_paged_kv_indices", "A:   write_paged_kv_indices")
    wrap(FB, "paged_kv_lengths", "A:   paged_kv_lengths")
    wrap(AR.AutoregressiveSpeculator, "_write_pass_inputs", "A: _write_pass_inputs")
    wrap(AR.AutoregressiveSpeculator, "_validate", "A: _validate")
    parts.clear()
    for _ in range(200):
        torch.cuda.synchronize(); spec.launch(work, DecodePath.PREPLANNED)
    torch.cuda.synchronize()
    for label, v in sorted(parts.items(), key=lambda kv: kv[0].strip()[:2]):
        print(f"  {label}: {sum(v) / 200 * 1e6:.1f} us per launch ({len(v) // 200} calls)")
    del spec; torch.cuda.empty_cache()
