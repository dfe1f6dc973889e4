"""Known-bad builders that re-create historical bugs (:mod:`.mutants`) and the self-test
that proves the verifier catches each one with the check meant for it (:mod:`.run`)."""
