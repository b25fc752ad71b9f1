"""Configuration of the orchestrator (registered as a Hydra structured config by pipeline.config)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.protocol.transport import TransportConfig


@dataclass
class OrchestratorConfig:
    group_size: int = 8
    """Samples per prompt group (G in GRPO)."""
    groups_per_step: int = 8
    """Prompt groups in each optimizer step's global batch."""
    max_async: int = 1
    """How many steps generation may run ahead of training (0 = synchronous)."""
    max_staleness: int | None = None
    """Drop a group when trainer_step - its oldest token version exceeds this; None = max_async."""
    lease_timeout_s: float = 300.0
    """A group not returned within this many seconds is re-issued."""
    generator_dead_after_s: float = 20.0
    """A generator silent this long is dropped: its leases are re-issued at once."""
    max_restarts: int = 3
    """Times trainer rank 0 restarts a dead orchestrator (from the log) before the run stops."""
    memory_token_budget: int = 4_000_000
    """Tokens of buffered samples held in memory; beyond it they are read back from the log."""
    group_filter: str = "none"
    """Group filter: "none" or "zero_variance" (drop groups whose rewards are all equal)."""
    scorer_threads: int = 0
    """Threads scoring groups beside the event loop; 0 scores inline (right for exact verifiers)."""
    flush_interval_s: float = 0.02
    """Longest time a received result waits for the flush that lets it be acknowledged."""
    log_seal_interval_s: float = 60.0
    """How often the rollout log's journal is sealed into an immutable HDF5 segment: each seal
    is ~8 namespace operations on the run directory's filesystem (docs/rollout-log.md); a
    restart re-reads at most this much journal."""
    log_seal_bytes: int = 256 << 20
    """Seal earlier once the journal holds this many bytes (bounds the writer's memory)."""
    metrics_interval_s: float = 2.0
    """How often buffer/admission metrics are written to the run's JSONL stream."""
    seed: int = 0
    """Run seed: prompt order and per-request sampling seeds derive from it."""
    step_cost_per_token: float | None = None
    """Training seconds per token of a sample, measured on the trainer's hardware
    (`bench/dp_balance.py` fits and prints it); None: FLOPs from the model's shape
    (`pipeline.orchestrator.batching`) balance the data-parallel split."""
    step_cost_per_token_pair: float = 0.0
    """Seconds per token pair of a sample (attention's quadratic term), with step_cost_per_token."""
    step_cost_per_sample: float = 0.0
    """Seconds of a sample whatever its length, with step_cost_per_token."""
    transport: TransportConfig = field(default_factory=TransportConfig)

    def staleness_limit(self) -> int:
        if self.max_staleness is None:
            return self.max_async
        if self.max_staleness < self.max_async:
            raise ValueError(f"max_staleness ({self.max_staleness}) may not be below max_async "
                             f"({self.max_async}): admitted groups would be dropped by design")
        return self.max_staleness

    def validate(self) -> None:
        if min(self.step_cost_per_token or 0.0, self.step_cost_per_token_pair, self.step_cost_per_sample) < 0:
            raise ValueError("orchestrator.step_cost_per_token, step_cost_per_token_pair and "
                             "step_cost_per_sample must be >= 0")
        if self.scorer_threads < 0:
            raise ValueError(f"orchestrator.scorer_threads must be >= 0, got {self.scorer_threads}")
        for name in ("group_size", "groups_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"orchestrator.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_async < 0:
            raise ValueError(f"orchestrator.max_async must be >= 0, got {self.max_async}")
        if self.log_seal_interval_s <= 0 or self.log_seal_bytes <= 0 or self.flush_interval_s <= 0:
            raise ValueError("orchestrator.log_seal_interval_s, log_seal_bytes and flush_interval_s "
                             "must be > 0")
        if self.transport.max_groups_per_result < 1:
            raise ValueError("orchestrator.transport.max_groups_per_result must be >= 1, got "
                             f"{self.transport.max_groups_per_result}")
        if self.lease_timeout_s <= 0 or self.memory_token_budget < 0:
            raise ValueError("orchestrator.lease_timeout_s must be > 0 and memory_token_budget >= 0")
        from pipeline.orchestrator.scoring import GROUP_FILTERS
        if self.group_filter not in GROUP_FILTERS:
            raise ValueError(f"orchestrator.group_filter {self.group_filter!r} is not one of "
                             f"{sorted(GROUP_FILTERS)}")
        self.staleness_limit()
