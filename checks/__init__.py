"""Everything that checks a backend against its claims; may import every other layer.

- :mod:`~speccheck.checks.verify`: the verify engine (one backend, one runtime config, in
  one process), its worker and runner (a process per backend, crash and hang containment),
  the report, the comparisons, the batch strategies and the data-parallel run;
- :mod:`~speccheck.checks.probes`: capture-safety probes (host syncs, replaced tensors,
  guard bands, zero tails);
- :mod:`~speccheck.checks.selftest`: known-bad builders and the self-test that proves the
  verifier catches each one;
- :mod:`~speccheck.checks.docgen`: documents generated from the matrix;
- :mod:`~speccheck.checks.bench`: ``speccheck bench``, propose latency per decode path;
- :mod:`~speccheck.checks.cli`: the ``speccheck`` command line, one module per command;
- :mod:`~speccheck.checks.api`: the same verification as a Python API (``speccheck.verify``),
  and :mod:`~speccheck.checks.pytest_plugin`, which turns it into one test item per check.
"""
