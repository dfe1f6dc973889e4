"""``speccheck bench``'s measurement: the propose latency of every draft-decode path a
backend allows, side by side in one process, and what is made from it.

- :mod:`.errors`: why a benchmark did not run or did not hold (one line each);
- :mod:`.records`: the rows and the report, their JSON form and the ratios to per-step;
- :mod:`.workload`: the speculator, the batch and the capture cost of one case (K, batch);
- :mod:`.profiling`: host and device time of repeated calls from one ``torch.profiler`` run;
- :mod:`.measure`: the timing loop over the paths, with the draft tokens held equal;
- :mod:`.table`, :mod:`.markdown`, :mod:`.plots`: the report as a rich table or plain
  lines, as a markdown section for ``docs/benchmarks/``, and as PNG plots (matplotlib, an
  optional extra: ``pip install 'speccheck[bench]'``).
"""
