"""A small but real drafter and the speculators that run it: the per-step and fused
multi-step draft loops, the CUDA-graph manager, and DP agreement on padded sizes.

Backends are found through ``matrix.yaml`` (:mod:`speccheck.speculator.attention_setup`),
never imported by name.
"""
