"""Rebuild the orchestrator's state from the run's rollout log (`docs/architecture.md`, "Crash resume").

Invariants:
- resolved groups (any outcome) are never issued again; unresolved ids below the cursor are;
- ``kept`` is what admission would count had the orchestrator never stopped: every group ever
  stored minus every stored group released since (evicted as stale or dropped by a rollback),
  consumed groups included; it is derived from the log's group rows, never from the buffer;
- the buffer gets back exactly the stored groups that no recorded step consumed, that were not
  released (evicted as stale, dropped by a rollback) and none of whose rows is damaged or withheld
  (a lost step record may have consumed it: `ResumeState.withheld_rows`), oldest first, as spilled rows (read back from the log when a step takes them);
- the step record (step -> rows, DP ranks) is restored so a trainer asking again for a recorded
  step receives the same samples.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.rollout_log.format import RELEASE_OUTCOMES, LogNotFoundError
from pipeline.rollout_log.reader import RolloutLog
from pipeline.orchestrator.buffer import BufferedGroup


@dataclass
class RestoredState:
    resolved: list[int] = field(default_factory=list)
    attempts: dict[int, int] = field(default_factory=dict)
    buffered: list[BufferedGroup] = field(default_factory=list)
    step_rows: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    last_trainer_step: int = 0
    kept: int = 0
    """Groups stored and not released since (see the module invariants)."""
    outcome_counts: dict[str, int] = field(default_factory=dict)
    damage: list[str] = field(default_factory=list)
    """Damage the log holds (the orchestrator logs it); what it cost is in ``outcome_counts``
    (``log_lost_rows``, ``log_withheld_rows``, ...)."""


def restore_from_log(log_dir: Path) -> RestoredState:
    try:
        log = RolloutLog.open(log_dir)
    except LogNotFoundError:
        return RestoredState()
    with log:
        rs = log.resume_state()
        groups = log.groups(intact_only=True)
        steps = log.steps(intact_only=True)
        state = RestoredState()
        state.resolved = [int(g) for g in np.unique(groups["group_id"])]
        state.attempts = {int(g): int(a) for g, a in zip(groups["group_id"], groups["attempt"])}
        state.outcome_counts = {f"restored_{k}": v for k, v in rs.counts.items() if v}
        state.outcome_counts.update({f"log_{k}": v for k, v in rs.lost.items() if v})
        state.damage = log.damage
        released = set().union(*(rs.resolved[o].tolist() for o in RELEASE_OUTCOMES))
        consumed = rs.consumed_rows
        never = np.union1d(rs.damaged_rows, rs.withheld_rows)  # lost, or maybe consumed
        st = rs.stored
        state.kept = len(st["group_id"]) - len(released & set(st["group_id"].tolist()))
        order = np.argsort(st["first_row"], kind="stable")
        all_rows = log.rows(intact_only=True)
        tokens = (log.column("samples/prompt_len", intact_only=True).astype(np.int64)
                  + log.column("samples/completion_len", intact_only=True))
        for i in order:
            gid, first, n = int(st["group_id"][i]), int(st["first_row"][i]), int(st["n_samples"][i])
            rows = np.arange(first, first + n, dtype=np.int64)
            if gid in released or np.isin(rows, consumed).any() or np.isin(rows, never).any():
                continue
            n_tokens = int(tokens[np.searchsorted(all_rows, rows)].sum())
            state.buffered.append(BufferedGroup(gid, int(st["attempt"][i]), rows,
                                                int(st["min_version"][i]), n_tokens, None))
        rank_of = dict(zip(steps["row"].tolist(), steps["dp_rank"].tolist()))
        for step, rows in rs.step_rows.items():
            state.step_rows[step] = (rows, np.array([rank_of[int(r)] for r in rows], np.int16))
        state.last_trainer_step = max(0, rs.last_trainer_step)
        return state
