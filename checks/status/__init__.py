"""``speccheck status``: the one current truth about each backend, generated.

It runs, on the machine at hand, what a backend's evidence consists of (``verify`` at the
defaults, the self-test rows of that backend and, on CUDA, ``bench``) and overwrites that
tier's record in ``docs/status/<backend>.json``; ``docs/status/README.md`` and the current
table of ``docs/benchmarks/README.md`` are rendered from those files, and the capability
docs' "last verified" column reads them. History lives in git, not in the tree.
"""
