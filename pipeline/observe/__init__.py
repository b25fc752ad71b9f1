"""Seeing a run: live progress, TensorBoard scalars and plots, all fed by the run's metrics JSONL.

Metric kinds written by the roles (one JSON object per line, see `pipeline.metrics`):

- ``train_step`` (trainer): step, version, reward_mean, loss, samples, tokens, tokens_per_s,
  clip_frac, tis_clip_frac, kl, mismatch (|train - behaviour| logprob on same-version tokens),
  staleness_mean, staleness_max, wait_s, step_s, sync_s, trainer_idle_frac;
- ``eval`` (trainer, through the generators): step, version, accuracy, n;
- ``generator`` (each generator): generator_id, version, tokens_per_s, idle_frac, stall_s;
- ``orchestrator``: admission, leases, buffer depth, drops by reason, ingest rate.
"""
