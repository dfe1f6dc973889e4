"""Pure-PyTorch paged attention with fp32 math: the oracle every other backend is compared with."""
