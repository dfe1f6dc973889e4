"""Attention backend adapters over real kernels. Each imports only ``speccheck.contract``;
speculators find them through ``matrix.yaml``, never by direct import."""
