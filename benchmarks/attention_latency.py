"""Decode attention latency per backend, side by side in one run.

    python benchmarks/attention_latency.py [--json PATH] [--batches 1 16 128] [--seq-lens 512 4096 32768]
    python benchmarks/attention_latency.py --latent [--json PATH]
    python benchmarks/attention_latency.py --flashinfer [--json PATH]

GQA (default): triton_attn, fa3 and reference; 16 query / 4 KV heads of size 128.
``--flashinfer``: the two FlashInfer adapters on the GQA layer, split KV (``flashinfer``,
CUDA-core decode) against none (``flashinfer_fixed_plan``, tensor-core decode, whose plan
ignores the lengths); each forward is captured in a CUDA graph and its replays are timed
(``triton.testing.do_bench_cudagraph``), so the wrappers' Python does not hide the kernels.
``--latent``: triton_mla and sparse_swa (window 128, its ``verify_defaults``) against the
reference backend on the same latent cache (full, and with the same window); 16 heads,
``kv_lora_rank`` 512 + rope 64, batches 1/32/128, contexts 1k/8k/32k by default.

One query token per request, bf16, KV cache filled with noise. Times one backend forward
(KV write + attention) with ``triton.testing.do_bench`` (median of repeated launches, ms) and
prints a rich table with the ratios. Needs CUDA; the reference backend is skipped where its
gathered fp32 K/V would not fit.
"""

from __future__ import annotations

import argparse
import enum
import json
import math
from pathlib import Path

import numpy as np
import torch
import triton
from rich.console import Console
from rich.table import Table

from speccheck.backends.availability import BackendUnavailable
from speccheck.contract.builder import AttentionLayerSpec, BuilderLimits
from speccheck.contract.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.matrix_model import KvLayout
from speccheck.contract.metadata import AttentionInputBuffers
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.contract.token_count import build_uniform_attention_metadata
from speccheck.speculator.attention_setup import builder_class

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 16, 4, 128, 16
KV_LORA_RANK, ROPE = 512, 64
WINDOW = 128
REFERENCE_MEMORY_BUDGET = 48 * 2**30


class Mode(enum.Enum):
    """Which backends a run compares."""

    GQA = "gqa"
    LATENT = "latent"
    FLASHINFER = "flashinfer"


def bench(backend: str, batch: int, seq_len: int, *, latent: bool = False,
          window: int = 0, replay: bool = False,
          device: torch.device = torch.device("cuda")) -> float | str:
    """Median milliseconds of one forward, or why it was not measured. ``latent``: an MLA
    layer (one latent entry per token); ``window``: its sliding window (0: none);
    ``replay``: time replays of the forward captured in a CUDA graph."""
    paged = backend != "fa3"
    block_size = BLOCK_SIZE if paged else seq_len
    if backend == "reference" and not latent:
        gathered = batch * seq_len * HEADS * HEAD_SIZE * 4 * 3
        if gathered > REFERENCE_MEMORY_BUDGET:
            return f"skipped: needs ~{gathered / 2**30:.0f} GiB"
    kv_heads = 1 if latent else KV_HEADS
    layer = AttentionLayerSpec(HEADS, kv_heads, HEAD_SIZE, torch.bfloat16, block_size, seq_len,
                               kv_layout=KvLayout.LATENT if latent else KvLayout.NHD,
                               kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=ROPE,
                               sliding_window=window)
    config = RuntimeConfig(block_size=block_size, max_model_len=seq_len, head_size=HEAD_SIZE,
                           num_heads=HEADS, num_kv_heads=kv_heads, cudagraph_mode="none",
                           kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=ROPE,
                           sliding_window=window)
    limits = BuilderLimits(batch, batch)
    try:
        builder = builder_class(backend, load_matrix())(layer, config, device, limits)
    except BackendUnavailable as exc:
        return f"skipped: {exc.package} not installed"
    blocks_per_req = layer.max_blocks_per_req
    num_blocks = batch * blocks_per_req + 1
    first, second = layer.kv_cache_shapes(num_blocks)
    key_cache = torch.randn(first, device=device, dtype=torch.bfloat16)
    value_cache = torch.randn(second, device=device, dtype=torch.bfloat16)
    buffers = AttentionInputBuffers.allocate(batch, batch, blocks_per_req, device)
    table = 1 + np.random.default_rng(0).permutation(num_blocks - 1)[: batch * blocks_per_req]
    buffers.block_table.copy_(torch.from_numpy(table.reshape(batch, blocks_per_req).astype(np.int32)))
    buffers.seq_lens[:batch].fill_(seq_len)
    positions = torch.full((batch,), seq_len - 1, device=device)
    rows = buffers.block_table[:, -1].long()
    buffers.slot_mapping[:batch].copy_(rows * block_size + (positions % block_size))
    common = build_uniform_attention_metadata(
        buffers=buffers, batch_desc=BatchExecutionDescriptor(CUDAGraphMode.NONE, batch, None, 1),
        num_reqs=batch, num_query_per_req=1, base_seq_lens_np=np.full(batch, seq_len - 1),
        step=1, max_model_len=seq_len,
    )
    metadata = builder.build(common)
    width = layer.latent_size if latent else HEAD_SIZE
    impl = builder.make_impl(1 / math.sqrt(HEAD_SIZE + (ROPE if latent else 0)))
    q = torch.randn(batch, HEADS, width, device=device, dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, width, device=device, dtype=torch.bfloat16)
    v = k[..., :KV_LORA_RANK] if latent else torch.randn_like(k)
    out = torch.empty(batch, HEADS, KV_LORA_RANK if latent else HEAD_SIZE, device=device,
                      dtype=torch.bfloat16)

    def run() -> None:
        impl.forward(q, k, v, key_cache, value_cache, metadata, out)

    if replay:
        return float(triton.testing.do_bench_cudagraph(run, rep=100))
    return float(triton.testing.do_bench(run, warmup=25, rep=100))


COLUMNS = {
    Mode.GQA: (("triton_attn", "triton_attn", 0), ("fa3", "fa3", 0),
               ("reference", "reference", 0)),
    Mode.LATENT: (("triton_mla", "triton_mla", 0), ("reference", "reference", 0),
                  (f"sparse_swa W={WINDOW}", "sparse_swa", WINDOW),
                  (f"reference W={WINDOW}", "reference", WINDOW)),
    Mode.FLASHINFER: (("flashinfer", "flashinfer", 0),
                      ("flashinfer_fixed_plan", "flashinfer_fixed_plan", 0)),
}
"""Per mode: (column, backend, window)."""
RATIOS = {
    Mode.GQA: (("triton_attn / fa3", "triton_attn", "fa3"),
               ("reference / fa3", "reference", "fa3")),
    Mode.LATENT: (("triton_mla / reference", "triton_mla", "reference"),
                  ("sparse_swa / reference W", f"sparse_swa W={WINDOW}", f"reference W={WINDOW}")),
    Mode.FLASHINFER: (("fixed_plan / flashinfer", "flashinfer_fixed_plan", "flashinfer"),),
}
TITLES = {
    Mode.GQA: "decode attention latency",
    Mode.LATENT: "MLA decode attention latency",
    Mode.FLASHINFER: "FlashInfer decode attention latency, graph replays",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--latent", action="store_true",
                       help="MLA backends (triton_mla, sparse_swa) against the reference")
    modes.add_argument("--flashinfer", action="store_true",
                       help="FlashInfer with split KV against flashinfer_fixed_plan")
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--seq-lens", type=int, nargs="+")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention_latency.py needs a CUDA device")
    mode = Mode.LATENT if args.latent else Mode.FLASHINFER if args.flashinfer else Mode.GQA
    latent = mode is Mode.LATENT
    batches = args.batches or ([1, 32, 128] if latent else [1, 16, 128])
    seq_lens = args.seq_lens or ([1024, 8192, 32768] if latent else [512, 4096, 32768])
    columns = COLUMNS[mode]
    results = []
    for batch in batches:
        for seq_len in seq_lens:
            row: dict[str, object] = {"batch": batch, "seq_len": seq_len}
            for column, backend, window in columns:
                row[column] = bench(backend, batch, seq_len, latent=latent, window=window,
                                    replay=mode is Mode.FLASHINFER)
                torch.cuda.empty_cache()
            results.append(row)
            print(json.dumps(row), flush=True)
    table = Table(title=f"{TITLES[mode]}, ms ({torch.cuda.get_device_name()})")
    ratios = RATIOS[mode]
    for column in ("batch", "seq_len", *(c for c, _, _ in columns), *(r for r, _, _ in ratios)):
        table.add_column(column, justify="right")
    for row in results:
        cells = [f"{row[c]:.4f}" if isinstance(row[c], float) else str(row[c]) for c, _, _ in columns]
        shown = [
            f"{row[a] / row[b]:.2f}" if isinstance(row[a], float) and isinstance(row[b], float) else "-"
            for _, a, b in ratios
        ]
        table.add_row(str(row["batch"]), str(row["seq_len"]), *cells, *shown)
    Console(width=200).print(table)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                         "torch": torch.__version__, "mode": mode.value,
                                         "results": results}, indent=2))


if __name__ == "__main__":
    main()
