"""The typed runtime configuration that matrix conditions are evaluated against."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Platform = Literal["cuda", "rocm", "cpu"]
CudaGraphModeName = Literal["none", "piecewise", "full"]
DtypeName = Literal["bfloat16", "float16", "float32"]
KvCacheDtypeName = Literal["auto", "bfloat16", "float16", "float32", "fp8_e4m3"]

MAX_WORLD_SIZE = 1024
"""Most ranks of a parallel dimension (DCP, DP)."""
MAX_SPECULATIVE_STEPS = 64
MAX_TOKENS = 2**24
"""Most tokens of a length field (``max_model_len``, ``block_size``, ``sliding_window``): past
this, int32 positions and page indices of a real engine are no longer the question."""
MAX_HEAD_FIELD = 8192
"""Most heads, or elements of a head (``head_size``, ``kv_lora_rank``, ...)."""


class RuntimeConfig(BaseModel):
    """Everything a capability condition in ``matrix.yaml`` may refer to.

    Field names are the condition language's vocabulary; their annotations give each name's
    type, which conditions are checked against at load time.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    platform: Platform = Field("cuda", description="Device platform the backend runs on.")
    compute_capability: int = Field(
        90, ge=0, le=1000, description="GPU compute capability as major*10+minor (90 = Hopper)."
    )
    dcp_world_size: int = Field(1, ge=1, le=MAX_WORLD_SIZE, description="Decode context-parallel world size.")
    dp_size: int = Field(1, ge=1, le=MAX_WORLD_SIZE, description="Data-parallel world size.")
    cudagraph_mode: CudaGraphModeName = Field("full", description="CUDA-graph mode of draft decode.")
    num_speculative_steps: int = Field(4, ge=1, le=MAX_SPECULATIVE_STEPS, description="Draft tokens per request (K).")
    advance_draft_positions: bool = Field(
        True, description="Whether each draft step advances positions (False for Q-only MTP)."
    )
    block_size: int = Field(16, ge=1, le=MAX_TOKENS, description="KV-cache block (page) size in tokens.")
    max_model_len: int = Field(4096, ge=1, le=MAX_TOKENS, description="Longest sequence the engine serves.")
    kv_cache_dtype: KvCacheDtypeName = Field("auto", description="KV-cache storage dtype.")
    dtype: DtypeName = Field("bfloat16", description="Activation dtype.")
    head_size: int = Field(128, ge=1, le=MAX_HEAD_FIELD, description="Attention head size.")
    num_heads: int = Field(16, ge=1, le=MAX_HEAD_FIELD, description="Query heads per layer.")
    num_kv_heads: int = Field(4, ge=1, le=MAX_HEAD_FIELD, description="KV heads per layer.")
    kv_lora_rank: int = Field(
        512, ge=1, le=MAX_HEAD_FIELD, description="Latent (compressed KV) width of MLA layers (`kv_lora_rank`)."
    )
    qk_rope_head_dim: int = Field(
        64, ge=2, le=MAX_HEAD_FIELD, multiple_of=2,
        description="Rotary part of each MLA query and key head, stored with the latent.",
    )
    sliding_window: int = Field(
        0, ge=0, le=MAX_TOKENS,
        description="Sliding attention window W: a query at position p sees positions "
        "p-W+1..p; 0 is full causal attention.",
    )
