"""The ROCm variant of sparse sliding-window attention: declared, and refused when built,
because the ROCm ragged window indices and indptrs are not adapted (see :mod:`.builder`)."""
