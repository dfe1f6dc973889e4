"""flashinfer K=4 preplanned: the P span (first-pass replay returned .. preplanned replay
launched) line by line, and a lean variant (host lengths straight into the staging rows,
no commons or metadata objects) interleaved with the current code and per_step on one
speculator: wall/host medians and ratios, tokens compared. Scratch."""
import statistics, sys, time
import numpy as np
import torch
from speccheck.checks.api import plan_verification
from speccheck.checks.bench.workload import bench_batch, build_speculator, context_for
from speccheck.checks.verify.context import MatrixContext
from speccheck.speculator.autoregressive import DecodePath
import speccheck.speculator.autoregressive as AR
import speccheck.backends.flashinfer.builder as FB
from speccheck.backends.flashinfer.page_indices import stage_paged_kv_lengths
from speccheck.contract.stream_events import record_on_current_stream

pc = time.perf_counter_ns
backend, k = sys.argv[1], int(sys.argv[2])
for batch in map(int, sys.argv[3].split(",")):
    config = plan_verification(backend, config={"num_speculative_steps": k}).config_for(backend)
    context = context_for(config, k)
    spec = build_speculator(backend, config, batch, context, MatrixContext.load(None).matrix, torch.device("cuda"))
    spec.capture(); torch.cuda.synchronize()
    work = bench_batch(config, batch, context)
    orig = AR.AutoregressiveSpeculator._preplanned_multi_step_decode
    lines = {}
    mode = {"v": "old"}
    def instrumented(self, desc, r, base, replay):
        n = desc.num_tokens
        T = [pc()]
        first = AR.build_uniform_attention_metadata(buffers=self.buffers, batch_desc=desc, num_reqs=r, num_query_per_req=1,
            base_seq_lens_np=base, step=1, max_model_len=self.max_model_len, offsets_on_device=True)
        T.append(pc())
        commons = [first] + [AR.at_later_draft_step(first, base, s) for s in range(2, self.num_steps)]
        T.append(pc())
        b = self.groups[0].builder
        sizes = {c.num_reqs for c in commons}; (num_reqs,) = sizes; b._check_batch_size(num_reqs)
        bt = commons[0].block_table
        for c in commons:
            assert FB._is_decode(c) and (c.block_table is bt or FB._same_view(c.block_table, bt))
        T.append(pc())
        group = b._draft_step_wrappers(num_reqs, len(commons))
        seq_lens = np.stack([c.seq_lens_cpu_upper_bound.numpy()[:num_reqs] for c in commons])
        T.append(pc())
        FB._wait_for_upload(group.uploaded)
        T.append(pc())
        pages = stage_paged_kv_lengths(seq_lens, b.layer.block_size, bt.shape[1], group.staged_rows)
        FB._check_capacity(max(pages), group.indices.shape[1])
        T.append(pc())
        group.lengths.copy_(group.staged, non_blocking=True)
        T.append(pc())
        group.block_table = bt
        for schedule, ind in zip(group.schedulers, group.staged_indptr):
            schedule(ind, num_reqs)
        T.append(pc())
        record_on_current_stream(group.uploaded, b._device_index)
        T.append(pc())
        mds = [b._metadata(c, group.wrappers[s].run, use_decode=True, paged_kv_indptr=group.indptr_views[s],
               paged_kv_indices=group.index_rows[s][:np_], paged_kv_last_page_len=group.last_page_len_views[s],
               qo_indptr=None, draft_step=s) for s, (c, np_) in enumerate(zip(commons, pages))]
        per_step = [list(x) for x in zip(mds)]
        T.append(pc())
        self.graphs.replay((DecodePath.PREPLANNED, n)); self.counters.graph_replays += 1
        T.append(pc())
        names = ["build_uniform", "at_later", "checks", "group+stack", "wait", "stage+cap", "H2D copy", "schedulers", "record", "metadata", "replay"]
        for nm, a, c in zip(names, T, T[1:]):
            lines.setdefault(nm, []).append((c - a) / 1e3)
    def lean(self, desc, r, base, replay):
        n = desc.num_tokens
        b = self.groups[0].builder
        group = b._draft_step_wrappers(n, self.num_steps - 1)
        steps = np.arange(1, self.num_steps, dtype=np.int64)[:, None]
        seq = np.zeros((self.num_steps - 1, n), dtype=np.int64)
        np.minimum(base[:r].astype(np.int64)[None, :] + steps, self.max_model_len, out=seq[:, :r])
        FB._wait_for_upload(group.uploaded)
        pages = stage_paged_kv_lengths(seq, b.layer.block_size, self.buffers.block_table.shape[1], group.staged_rows)
        FB._check_capacity(max(pages), group.indices.shape[1])
        group.lengths.copy_(group.staged, non_blocking=True)
        for schedule, ind in zip(group.schedulers, group.staged_indptr):
            schedule(ind, n)
        record_on_current_stream(group.uploaded, b._device_index)
        self.graphs.replay((DecodePath.PREPLANNED, n)); self.counters.graph_replays += 1
    variants = {"per_step": (DecodePath.PER_STEP, orig), "old": (DecodePath.PREPLANNED, orig),
                "instr": (DecodePath.PREPLANNED, instrumented), "lean": (DecodePath.PREPLANNED, lean)}
    toks = {}
    for v, (p, f) in variants.items():
        AR.AutoregressiveSpeculator._preplanned_multi_step_decode = f
        for _ in range(3): spec.launch(work, p)
        toks[v] = spec.propose_tokens(work, p).clone()
    print(f"b{batch} tokens equal to per_step:", {v: bool(torch.equal(t, toks['per_step'])) for v, t in toks.items()})
    hs, ws = {}, {}
    for i in range(300):
        for v, (p, f) in variants.items():
            AR.AutoregressiveSpeculator._preplanned_multi_step_decode = f
            torch.cuda.synchronize(); s = time.perf_counter(); r = spec.launch(work, p); m = time.perf_counter()
            spec.draft_tokens[:r].cpu(); e = time.perf_counter()
            if i >= 50:
                hs.setdefault(v, []).append(m - s); ws.setdefault(v, []).append(e - s)
    AR.AutoregressiveSpeculator._preplanned_multi_step_decode = orig
    ref = statistics.median(ws["per_step"]); refh = statistics.median(hs["per_step"])
    for v in variants:
        w = statistics.median(ws[v]); h = statistics.median(hs[v])
        print(f"  {v}: wall {w*1e3:.3f} ms host {h*1e3:.3f} ms (wall ratio {w/ref:.3f}, host {h/refh:.3f})")
    print("  instr lines (median us): " + "; ".join(f"{k_} {statistics.median(v[50:]):.1f}" for k_, v in lines.items())
          + f"; sum {sum(statistics.median(v[50:]) for v in lines.values()):.0f}")
    del spec; torch.cuda.empty_cache()
