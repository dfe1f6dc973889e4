"""Documents generated from data (the capability matrix, the check registry): pure functions
of their inputs, so ``--check`` modes can compare them byte for byte with committed files."""
