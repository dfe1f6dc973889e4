"""Paged-KV attention through Triton kernels of our own (split-KV, value-independent grids).

Refresh strategy ``none_needed``: lengths, offsets and block ids are read by the kernels
from persistent buffers at run time. Runs on CPU under ``TRITON_INTERPRET=1``.
"""
