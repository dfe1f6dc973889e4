"""Decode attention latency of triton_attn, fa3 and reference, side by side in one run.

    python benchmarks/attention_latency.py [--json PATH] [--batches 1 16 128] [--seq-lens 512 4096 32768]

One query token per request, bf16, 16 query / 4 KV heads of size 128, KV cache filled with
noise. Times one backend forward (KV write + attention) with ``triton.testing.do_bench``
(median of repeated launches, ms) and prints a rich table with the ratios to fa3. Needs
CUDA; the reference backend is skipped where its gathered fp32 K/V would not fit.
"""

from __future__ import annotations

import argparse
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
from speccheck.contract.metadata import AttentionInputBuffers
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.contract.token_count import build_uniform_attention_metadata
from speccheck.speculator.attention_setup import builder_class

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 16, 4, 128, 16
REFERENCE_MEMORY_BUDGET = 48 * 2**30


def bench(backend: str, batch: int, seq_len: int) -> float | str:
    """Median milliseconds of one forward, or why it was not measured."""
    paged = backend != "fa3"
    block_size = BLOCK_SIZE if paged else seq_len
    if backend == "reference":
        gathered = batch * seq_len * HEADS * HEAD_SIZE * 4 * 3
        if gathered > REFERENCE_MEMORY_BUDGET:
            return f"skipped: needs ~{gathered / 2**30:.0f} GiB"
    device = torch.device("cuda")
    layer = AttentionLayerSpec(HEADS, KV_HEADS, HEAD_SIZE, torch.bfloat16, block_size, seq_len)
    config = RuntimeConfig(block_size=block_size, max_model_len=seq_len, head_size=HEAD_SIZE,
                           num_heads=HEADS, num_kv_heads=KV_HEADS, cudagraph_mode="none")
    limits = BuilderLimits(batch, batch)
    try:
        builder = builder_class(backend, load_matrix())(layer, config, device, limits)
    except BackendUnavailable as exc:
        return f"skipped: {exc.package} not installed"
    blocks_per_req = layer.max_blocks_per_req
    num_blocks = batch * blocks_per_req + 1
    key_cache = torch.randn(num_blocks, block_size, KV_HEADS, HEAD_SIZE, device=device, dtype=torch.bfloat16)
    value_cache = torch.randn_like(key_cache)
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
    impl = builder.make_impl(1 / math.sqrt(HEAD_SIZE))
    q = torch.randn(batch, HEADS, HEAD_SIZE, device=device, dtype=torch.bfloat16)
    k = torch.randn(batch, KV_HEADS, HEAD_SIZE, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = torch.empty_like(q)

    def run() -> None:
        impl.forward(q, k, v, key_cache, value_cache, metadata, out)

    return float(triton.testing.do_bench(run, warmup=25, rep=100))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 4096, 32768])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention_latency.py needs a CUDA device")
    backends = ("triton_attn", "fa3", "reference")
    results = []
    for batch in args.batches:
        for seq_len in args.seq_lens:
            row = {"batch": batch, "seq_len": seq_len}
            for backend in backends:
                row[backend] = bench(backend, batch, seq_len)
                torch.cuda.empty_cache()
            results.append(row)
    table = Table(title=f"decode attention latency, ms ({torch.cuda.get_device_name()})")
    for column in ("batch", "seq_len", *backends, "triton_attn / fa3", "reference / fa3"):
        table.add_column(column, justify="right")
    for row in results:
        cells = [f"{row[b]:.4f}" if isinstance(row[b], float) else str(row[b]) for b in backends]
        ratios = [
            f"{row[b] / row['fa3']:.2f}" if isinstance(row[b], float) and isinstance(row["fa3"], float) else "-"
            for b in ("triton_attn", "reference")
        ]
        table.add_row(str(row["batch"]), str(row["seq_len"]), *cells, *ratios)
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                         "torch": torch.__version__, "results": results}, indent=2))


if __name__ == "__main__":
    main()
