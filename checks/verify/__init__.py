"""The verify engine and what carries its results.

Owns: drawing batches (:mod:`.strategies`), running the eager per-step oracle and every
candidate draft path from identical state (:mod:`.engine`), comparing them
(:mod:`.comparisons`, :mod:`.state_walk`, :mod:`.step_recorder`), the process boundary
(:mod:`.runner` starts a :mod:`.worker` per backend) and the report (:mod:`.report`), plus the
data-parallel run over real ranks (:mod:`.data_parallel`).
"""
