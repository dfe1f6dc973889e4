"""Is a FlashInfer decode plan independent of the KV lengths when split-KV is off? Plan for
lengths A, run with lengths B's page tables written into the fixed buffers, compare with a
fresh plan for B. CUDA + FlashInfer only."""
import math, traceback
import torch, flashinfer

torch.manual_seed(0)
dev, B, H, KVH, D, P = "cuda", 64, 16, 4, 128, 16
MAXLEN = 3000
per_req = math.ceil(MAXLEN / P)
kv = torch.randn(B * per_req + 1, 2, P, KVH, D, dtype=torch.bfloat16, device=dev)
q = torch.randn(B, H, D, dtype=torch.bfloat16, device=dev)
lens = {"A (200 each)": [200] * B,
        "B (1..3000 mixed)": torch.randint(1, MAXLEN + 1, (B,), generator=torch.Generator().manual_seed(1)).tolist(),
        "C (3000 each)": [MAXLEN] * B,
        "D (1 each)": [1] * B}

def tables(ls):
    pages = [math.ceil(l / P) for l in ls]
    indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0).tolist()), dtype=torch.int32)
    indices = torch.cat([torch.arange(1 + r * per_req, 1 + r * per_req + n, dtype=torch.int32) for r, n in enumerate(pages)])
    last = torch.tensor([l - (n - 1) * P for l, n in zip(ls, pages)], dtype=torch.int32)
    return indptr, indices, last

for tc, kwargs in [(True, {"disable_split_kv": True}), (True, {}), (False, {})]:
    label = f"tensor_cores={tc} {kwargs}"
    try:
        ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
        ip_buf = torch.zeros(B + 1, dtype=torch.int32, device=dev)
        idx_buf = torch.zeros(B * per_req, dtype=torch.int32, device=dev)
        last_buf = torch.zeros(B, dtype=torch.int32, device=dev)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, use_tensor_cores=tc, paged_kv_indptr_buffer=ip_buf,
            paged_kv_indices_buffer=idx_buf, paged_kv_last_page_len_buffer=last_buf)
        def plan(ls):
            ip, idx, last = tables(ls)
            w.plan(ip.to(dev), idx.to(dev), last.to(dev), H, KVH, D, P,
                   q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, **kwargs)
            torch.cuda.synchronize()
            return repr(w._plan_info), w._int_workspace_buffer.clone()
        fresh = {}
        infos = {}
        for name, ls in lens.items():
            infos[name] = plan(ls)
            fresh[name] = w.run(q, kv).clone()
        print(f"== {label}: backend {getattr(w, 'resolved_backend', None)}")
        base = "A (200 each)"
        for name in lens:
            same_info = infos[name][0] == infos[base][0]
            same_ws = torch.equal(infos[name][1][:1 << 16], infos[base][1][:1 << 16])
            # stale: A's plan, then name's page tables (and lengths) written in place
            plan(lens[base])
            ip, idx, last = tables(lens[name])
            ip_buf.copy_(ip); idx_buf[: idx.numel()].copy_(idx); last_buf.copy_(last)
            kvl = getattr(w, "_kv_lens_buffer", None)
            if kvl is not None:
                kvl[:B].copy_(torch.tensor(lens[name], dtype=kvl.dtype))
            stale = w.run(q, kv)
            torch.cuda.synchronize()
            err = (stale.float() - fresh[name].float()).abs().max().item()
            print(f"  {name}: plan_info same as A's {same_info}, int workspace head same {same_ws}, "
                  f"A's plan on {name}'s tables: max |diff| vs a fresh plan {err:.4g}")
    except Exception:
        print(f"== {label}: failed"); traceback.print_exc()
