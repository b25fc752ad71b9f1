"""Scorer roles: reward models, process rewards and the teacher, as processes the orchestrator
sends groups to (`pool`: the orchestrator's side; `role`: a scorer process; `models`, `teacher`:
what they compute). `docs/scorers.md`."""
