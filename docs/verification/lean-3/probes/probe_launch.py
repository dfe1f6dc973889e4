"""Probe: what makes cudaGraphLaunch cost scale (node kinds), and the speculator's graphs."""
import collections, re, sys, time
import torch, triton, triton.language as tl

dev = "cuda"
x = torch.zeros(4096, device=dev); y = torch.zeros(4096, device=dev)
a = torch.randn(8, 2048, device=dev, dtype=torch.bfloat16); w = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
idx = torch.arange(8, device=dev)

@triton.jit
def _inc(p, n, B: tl.constexpr):
    o = tl.arange(0, B); m = o < n
    tl.store(p + o, tl.load(p + o, mask=m) + 1, mask=m)

def graph_of(body):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s): body()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): body()
    torch.cuda.synchronize()
    return g

def launch_us(g, n=300):
    for _ in range(20): g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter(); g.replay(); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[n // 2] * 1e6

ops = {
    "aten add_": lambda: x.add_(1),
    "D2D copy_": lambda: y.copy_(x),
    "zero_": lambda: y.zero_(),
    "triton": lambda: _inc[(1,)](x, 4096, B=4096),
    "index_copy_": lambda: y.view(-1, 512).index_copy_(0, idx, x.view(-1, 512)[:8]),
    "mm bf16 M=8": lambda: torch.mm(a, w.t()),
}
for name, op in ops.items():
    row = []
    for n in (1, 10, 50, 150):
        g = graph_of(lambda: [op() for _ in range(n)])
        row.append(f"{n}:{launch_us(g):.1f}")
    print(f"launch us by node count, {name}: {' '.join(row)}", flush=True)

# the speculator's graphs: launch time of each, then of pieces of a decode step
import warnings
warnings.simplefilter("always")
from speccheck.checks.bench import workload
from speccheck.checks.verify.context import MatrixContext
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.autoregressive import DecodePath
for backend in sys.argv[1:] or ["triton_attn"]:
    config = RuntimeConfig(platform="cuda", cudagraph_mode="full", dtype="bfloat16", num_speculative_steps=4)
    spec = workload.build_speculator(backend, config, 1, 200, MatrixContext.load(None).matrix, torch.device(dev))
    workload.capture(spec)
    work = workload.bench_batch(config, 1, 200)
    spec.propose_tokens(work, DecodePath.FUSED)
    for key, g in spec.graphs._graphs.items():
        print(f"{backend} graph {key}: launch {launch_us(g):.1f} us", flush=True)
    md = spec._captured_metadata[("step", 1)]
    h = torch.randn(1, spec.model.cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    layer = spec.model.layers[0]
    pieces = {
        "lm_head x10": lambda: [spec.model.compute_logits(h) for _ in range(10)],
        "embed x10": lambda: [spec.model.embed(spec.input_ids[:1]) for _ in range(10)],
        "slot_mapping x10": lambda: [spec._compute_slot_mappings(1, 2) for _ in range(10)],
        "refresh x10": lambda: [grp.update_draft_decode_metadata(m) for _ in range(10) for grp, m in zip(spec.groups, md)],
        "input_norm x10": lambda: [layer.input_norm(h) for _ in range(10)],
        "run_model x1": lambda: spec._run_model(1, md),
        "run_model x3": lambda: [spec._run_model(1, md) for _ in range(3)],
        "generate_draft x1": lambda: spec._generate_draft(1, md, 1, observe=False),
        "generate_draft x3": lambda: [spec._generate_draft(1, md, 1, observe=False) for _ in range(3)],
    }
    for name, body in pieces.items():
        try:
            g = graph_of(body)
            print(f"{backend} piece {name}: launch {launch_us(g):.1f} us", flush=True)
        except Exception as exc:
            print(f"{backend} piece {name}: {type(exc).__name__}: {exc}", flush=True)
    # the attention call alone
