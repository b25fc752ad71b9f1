"""Configuration of model scorers and the teacher (the ``scorers`` section of the run config).

Light to import (no torch, no transformers). The default, ``reward=verifier`` with
``teacher=none``, keeps scoring inside the orchestrator (`pipeline.orchestrator.scoring`); any
other value starts scorer processes (`pipeline.scorers.role`) that the orchestrator sends groups to.
"""
from __future__ import annotations

from dataclasses import dataclass

#: Reward sources: the task's exact verifier (in the orchestrator), or a scorer role.
REWARD_KINDS = ("verifier", "reward_model", "process_reward")
#: Teacher kinds: none, a frozen checkpoint, or the policy's own snapshot some versions back.
TEACHER_KINDS = ("none", "frozen", "lagged")


@dataclass
class ScorersConfig:
    """Which scorers a run uses, their checkpoints, and how the orchestrator talks to them."""

    reward: str = "verifier"
    """Where rewards come from: "verifier" (the task's verifier, inside the orchestrator),
    "reward_model" (a Hugging Face sequence-classification checkpoint scoring prompt +
    completion), "process_reward" (the same kind of checkpoint scoring every step prefix; fills
    ``token_rewards``)."""
    reward_model: str = ""
    """Checkpoint directory of the reward model (reward_model and process_reward)."""
    step_token_id: int = -1
    """process_reward: the token id that ends a step (e.g. the id of "\\n"); a completion's last
    token always ends its last step. Required (>= 0) with process_reward."""
    teacher: str = "none"
    """"none"; "frozen": a vLLM engine on ``teacher_model`` fills ``teacher_logprobs``;
    "lagged": the teacher is the policy's own snapshot ``teacher_lag`` versions back, refreshed
    every ``run.checkpoint_every`` steps from the versions it receives over the weight channel
    (docs/scorers.md)."""
    teacher_model: str = ""
    """Checkpoint directory of the frozen teacher (same tokenizer as the policy); "lagged": the
    policy's initial checkpoint (version 0), empty = the run's model."""
    teacher_lag: int = 1
    """lagged: K, how many versions the teacher trails the policy (>= 1: the snapshot of version
    v - K was received before the policy reaches v)."""
    reward_scorers: int = 1
    """Reward scorer processes (with reward != verifier)."""
    teachers: int = 1
    """Teacher processes (with teacher != none)."""
    batch_groups: int = 4
    """Most groups per scoring request sent to one scorer process."""
    inflight_batches: int = 2
    """Requests a scorer process may hold at once (one computing, one queued)."""
    timeout_s: float = 60.0
    """A request unanswered this long is re-sent to another (or the restarted) scorer."""
    dead_after_s: float = 10.0
    """A scorer silent this long (it sends a heartbeat every second) is dropped and its requests
    re-sent at once."""
    max_attempts: int = 8
    """Sends of one group to scorers before its scoring counts as failed (group dropped as
    ``score_error``)."""
    device: str = "cpu"
    """Torch device of the reward model ("cpu", "cuda")."""

    @property
    def remote(self) -> bool:
        """True if any scoring runs in scorer processes."""
        return self.reward != "verifier" or self.teacher != "none"

    def services(self) -> list[str]:
        """The scorer services a group must pass through: "reward", "teacher"."""
        return ([] if self.reward == "verifier" else ["reward"]) + \
            ([] if self.teacher == "none" else ["teacher"])

    def validate(self) -> None:
        if self.reward not in REWARD_KINDS:
            raise ValueError(f"scorers.reward {self.reward!r} is not one of {REWARD_KINDS}")
        if self.teacher not in TEACHER_KINDS:
            raise ValueError(f"scorers.teacher {self.teacher!r} is not one of {TEACHER_KINDS}")
        if self.reward != "verifier" and not self.reward_model:
            raise ValueError(f"scorers.reward={self.reward} needs scorers.reward_model (a checkpoint)")
        if self.reward == "process_reward" and self.step_token_id < 0:
            raise ValueError("scorers.reward=process_reward needs scorers.step_token_id >= 0")
        if self.teacher == "lagged" and self.teacher_lag < 1:
            raise ValueError(f"scorers.teacher_lag must be >= 1, got {self.teacher_lag}")
        if self.teacher == "frozen" and not self.teacher_model:
            raise ValueError(f"scorers.teacher={self.teacher} needs scorers.teacher_model")
        for name in ("reward_scorers", "teachers", "batch_groups", "inflight_batches", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"scorers.{name} must be >= 1, got {getattr(self, name)}")
        if self.timeout_s <= 0 or self.dead_after_s <= 0:
            raise ValueError("scorers.timeout_s and scorers.dead_after_s must be > 0")
