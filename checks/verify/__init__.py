"""The verify engine and what carries its results.

Owns: drawing batches (:mod:`.strategies`), running the eager per-step oracle and every
candidate draft path from identical state (:mod:`.engine`), comparing them
(:mod:`.comparisons`, :mod:`.step_recorder`, over :mod:`~speccheck.checks.probes.state_walk`),
the run as given (:mod:`.run`), the process boundary (:mod:`.runner` starts a :mod:`.worker`
per backend, each given a :class:`~.run.WorkerTask`) and the report (:mod:`.report`), plus
the data-parallel run over real ranks (:mod:`.data_parallel`).
"""
