"""Reward models as scorers: outcome rewards and per-step (process) rewards from one
Hugging Face sequence-classification checkpoint (``*ForSequenceClassification``, one label).

Invariants:
- the outcome reward of a sample is the checkpoint's score of ``prompt + completion`` exactly as
  transformers computes it for that sequence alone (its score head on the hidden state of the
  sequence's last token); batching pads on the right with an attention mask and reads each row at
  its own last token, so padding never changes a score;
- process rewards come from the same forward: a causal model's hidden state at position t
  depends only on tokens 0..t, so the score read at t is the score of the prefix ending at t.
  A *step* ends at every completion token equal to ``step_token_id`` and at the completion's last
  token. ``token_rewards`` holds each step's score at the token that ends it and 0 elsewhere;
  the scalar reward is the lowest step score (a chain of steps is as good as its worst step).

Worked example (process rewards, step token 7): completion ``[5, 7, 9, 9, 7, 3]`` has steps ending
at completion positions 1, 4 and 5; with prefix scores ``s1, s4, s5`` there,
``token_rewards = [0, s1, 0, 0, s4, s5]`` and ``reward = min(s1, s4, s5)``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.protocol.sample_batch import SampleBatch


class SequenceScorer:
    """A sequence-classification checkpoint evaluated at chosen positions of each sequence."""

    def __init__(self, checkpoint: str | Path, device: str = "cpu", rows_per_forward: int = 16):
        import torch
        from transformers import AutoModelForSequenceClassification

        self.torch = torch
        self.model = AutoModelForSequenceClassification.from_pretrained(
            str(checkpoint), dtype=torch.float32).to(device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"{checkpoint}: a reward model has one label, this one has "
                             f"{self.model.config.num_labels}")
        self.vocab = int(self.model.config.vocab_size)
        self.device, self.rows_per_forward = device, rows_per_forward

    def position_scores(self, sequences: list[np.ndarray], positions: list[np.ndarray]) -> list[np.ndarray]:
        """Score of each sequence's prefix ending at each given position (float32 per sequence)."""
        torch = self.torch
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(sequences)
        order = np.argsort([len(s) for s in sequences], kind="stable")  # similar lengths together
        for start in range(0, len(order), self.rows_per_forward):
            rows = order[start:start + self.rows_per_forward]
            width = max(len(sequences[r]) for r in rows)
            ids = torch.zeros((len(rows), width), dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for i, r in enumerate(rows):
                seq = np.asarray(sequences[r], dtype=np.int64)
                if seq.size and (seq.min() < 0 or seq.max() >= self.vocab):
                    raise ValueError(f"token ids outside the reward model's vocabulary of {self.vocab}")
                ids[i, :len(seq)] = torch.from_numpy(seq)
                mask[i, :len(seq)] = 1
            with torch.no_grad():
                hidden = self.model.model(input_ids=ids.to(self.device),
                                          attention_mask=mask.to(self.device)).last_hidden_state
                scores = self.model.score(hidden)[..., 0].float().cpu().numpy()
            for i, r in enumerate(rows):
                out[r] = scores[i, np.asarray(positions[r], dtype=np.int64)].astype(np.float32)
        return out


def _sequences(group: SampleBatch) -> list[np.ndarray]:
    return [np.concatenate([group.prompt(i), group.tokens("completion_ids", i)]) for i in range(len(group))]


class RewardModelScorer:
    """Outcome reward: the checkpoint's score of each whole sample."""

    fills = ("reward",)

    def __init__(self, checkpoint: str | Path, device: str = "cpu"):
        self.model = SequenceScorer(checkpoint, device)

    def __call__(self, batch: SampleBatch) -> dict[str, np.ndarray]:
        seqs = _sequences(batch)
        scores = self.model.position_scores(seqs, [np.array([len(s) - 1]) for s in seqs])
        return {"reward": np.concatenate(scores).astype(np.float32)}


def step_ends(completion: np.ndarray, step_token_id: int) -> np.ndarray:
    """Completion positions that end a step: every step token, and the last token."""
    ends = np.flatnonzero(np.asarray(completion) == step_token_id)
    last = len(completion) - 1
    return ends if ends.size and ends[-1] == last else np.append(ends, last)


class ProcessRewardScorer:
    """Per-step rewards into ``token_rewards``; the scalar reward is the lowest step score."""

    fills = ("reward", "token_rewards")

    def __init__(self, checkpoint: str | Path, step_token_id: int, device: str = "cpu"):
        self.model = SequenceScorer(checkpoint, device)
        self.step_token_id = step_token_id

    def __call__(self, batch: SampleBatch) -> dict[str, np.ndarray]:
        seqs = _sequences(batch)
        ends = [step_ends(batch.tokens("completion_ids", i), self.step_token_id) for i in range(len(batch))]
        plen = batch.columns["prompt_len"]
        scores = self.model.position_scores(seqs, [int(plen[i]) + e for i, e in enumerate(ends)])
        token_rewards = np.zeros(batch.num_completion_tokens, np.float32)
        offsets = np.concatenate(([0], np.cumsum(batch.columns["completion_len"])[:-1]))
        for i, (e, s) in enumerate(zip(ends, scores)):
            token_rewards[offsets[i] + e] = s
        return {"reward": np.array([s.min() for s in scores], np.float32), "token_rewards": token_rewards}
