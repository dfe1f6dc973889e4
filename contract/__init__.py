"""The contract every attention backend and speculator agrees on.

Imports nothing else of speccheck. Holds the runtime configuration, the capability matrix
models and condition language, the CUDA-graph modes and batch descriptor, the common
attention metadata, the attention token-count rule, and the metadata-builder protocol.
"""
