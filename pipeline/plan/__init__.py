"""The trainer's memory planner (`tokenflow plan`, and the doctor's ``memory`` check).

- `pipeline.plan.shape`: a model's dimensions from a ``config.json`` (no torch);
- `pipeline.plan.memory`: per-rank bytes of one layout (state, activations, logits, peak, bubble);
- `pipeline.plan.search`: the layouts of N GPUs that fit, best first, and the refusal naming what binds.
"""
