"""``speccheck mutate``: how much of an adapter its gate really exercises. Mutation
operators on the AST (:mod:`.operators`), the adapter's target modules (:mod:`.targets`),
mutant generation (:mod:`.mutants`), a mutated copy of the adapter's package shadowing the
installed one for a ``speccheck verify`` subprocess (:mod:`.shadow`), the line coverage of
an unmutated run (:mod:`.line_tracer`, :mod:`.coverage_run`), the parallel runner with its
budget (:mod:`.runner`) and the report: score, kill kinds, survivors, code never executed
and candidates for equivalence (:mod:`.report`)."""
