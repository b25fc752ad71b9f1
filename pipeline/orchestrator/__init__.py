"""The orchestrator role: admission, leases, scoring, the rollout buffer and its durable log."""
