"""DeepSeek-style sparse sliding-window attention over an MLA latent cache, in Triton of our
own: per-token window indices through the block table, a split-KV tile schedule and a
lazily filled sparse index cache, all in persistent buffers refreshed in-graph between
draft steps. Runs on CPU under ``TRITON_INTERPRET=1``."""
