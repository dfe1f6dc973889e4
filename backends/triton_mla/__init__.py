"""Multi-head latent attention (MLA) over a paged latent KV cache through a Triton split-KV
kernel of our own. Refresh strategy: nothing to refresh at ``dcp_world_size == 1`` (lengths
are read from persistent buffers at run time); under decode context parallelism the
DCP-local lengths are derived at build and not advanced, so fused draft decode is not
allowed there. Runs on CPU under ``TRITON_INTERPRET=1`` (small shapes)."""
