"""Role processes of a training run: trainer (with the orchestrator beside its rank 0) and generators.

Each role's ``main(task)`` is the entry a launcher calls in every task of that role; it reads the
run's resolved ``config.yaml`` from the run directory, builds its components and runs them.
"""
