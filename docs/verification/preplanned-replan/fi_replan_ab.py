"""flashinfer K=4 preplanned replays: the shipped re-plan (replan_draft_steps, no metadata)
against the previous one (_build_preplanned_metadata before the replay), interleaved with
per_step on one speculator: wall/host medians, ratios, tokens compared; and the P span
(first-pass replay returned .. preplanned replay launched) of each. Scratch."""
import statistics, sys, time
import torch
from speccheck.checks.api import plan_verification
from speccheck.checks.bench.workload import bench_batch, build_speculator, context_for
from speccheck.checks.verify.context import MatrixContext
from speccheck.speculator.autoregressive import DecodePath, FIRST_PASS
import speccheck.speculator.autoregressive as AR

backend, k = sys.argv[1], int(sys.argv[2])
shipped = AR.AutoregressiveSpeculator._replan_preplanned
def previous(self, desc, r, base):
    self._build_preplanned_metadata(desc, r, base)
for batch in map(int, sys.argv[3].split(",")):
    config = plan_verification(backend, config={"num_speculative_steps": k}).config_for(backend)
    context = context_for(config, k)
    spec = build_speculator(backend, config, batch, context, MatrixContext.load(None).matrix, torch.device("cuda"))
    spec.capture(); torch.cuda.synchronize()
    work = bench_batch(config, batch, context)
    stamps = {}
    replay = spec.graphs.replay
    def stamped(key):
        if key[0] == DecodePath.PREPLANNED: stamps["pre"] = time.perf_counter()
        replay(key)
        if key[0] == FIRST_PASS: stamps["fp_end"] = time.perf_counter()
    spec.graphs.replay = stamped
    variants = {"per_step": (DecodePath.PER_STEP, shipped), "previous": (DecodePath.PREPLANNED, previous),
                "replan": (DecodePath.PREPLANNED, shipped)}
    toks = {}
    for v, (p, f) in variants.items():
        AR.AutoregressiveSpeculator._replan_preplanned = f
        for _ in range(3): spec.launch(work, p)
        toks[v] = spec.propose_tokens(work, p).clone()
    print(f"b{batch} tokens equal to per_step:", {v: bool(torch.equal(t, toks['per_step'])) for v, t in toks.items()})
    hs, ws, ps = {}, {}, {}
    for i in range(400):
        for v, (p, f) in variants.items():
            AR.AutoregressiveSpeculator._replan_preplanned = f
            torch.cuda.synchronize(); s = time.perf_counter(); r = spec.launch(work, p); m = time.perf_counter()
            spec.draft_tokens[:r].cpu(); e = time.perf_counter()
            if i >= 50:
                hs.setdefault(v, []).append(m - s); ws.setdefault(v, []).append(e - s)
                if p is DecodePath.PREPLANNED: ps.setdefault(v, []).append(stamps["pre"] - stamps["fp_end"])
    AR.AutoregressiveSpeculator._replan_preplanned = shipped
    ref = statistics.median(ws["per_step"]); refh = statistics.median(hs["per_step"])
    for v in variants:
        w = statistics.median(ws[v]); h = statistics.median(hs[v])
        span = f", P span {statistics.median(ps[v])*1e6:.0f} us" if v in ps else ""
        print(f"  {v}: wall {w*1e3:.3f} ms host {h*1e3:.3f} ms (wall ratio {w/ref:.3f}, host {h/refh:.3f}){span}")
    del spec; torch.cuda.empty_cache()
