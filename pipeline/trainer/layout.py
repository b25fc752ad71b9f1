"""Batch layouts: turn one data-parallel rank's samples into model inputs and loss masks.

A sample is ``prompt_ids + completion_ids``; the model sees ``tokens[:-1]`` and position ``i``
predicts ``tokens[i + 1]``. Completion token ``j`` therefore sits at label position
``P - 1 + j`` (P = prompt length). Worked example, prompt [5, 6, 7], completion [8, 9]::

    input_ids  = [5, 6, 7, 8]        (length P + C - 1 = 4)
    labels     = [6, 7, 8, 9]
    loss_mask  = [0, 0, 1, 1]        (positions P-1 .. P+C-2)
    behaviour  = [0, 0, b0, b1]      (per-completion-token arrays scattered the same way)

Invariants:
- Every real completion token appears in exactly one micro-batch, exactly once, with mask 1; padding
  and prompt positions have mask 0, and so have environment tokens of an episode (a sample's
  ``model_mask`` 0: observations the policy did not sample, `pipeline.generator.episodes`).
- ``BatchLayout.gather`` is the inverse of ``scatter``: it returns one array per sample, in the
  order the samples were given, of length ``len(completion_ids)``.
- Micro-batches never exceed ``micro_batch_tokens`` padded tokens unless one sample alone does
  (then that sample is a micro-batch of its own).

`train_samples` is the one place a step's `SampleBatch` (the record as it travels and is stored,
`pipeline.protocol.record`) becomes `TrainSample`s: the record's ``logprobs`` are the behaviour
logprobs, its routing the rows the trainer feeds (`sequence_routing`), its optional per-token
columns are taken when the batch carries them.

``PaddedLayout`` right-pads rows to a common length (megatron-core's local attention on CPU
cannot pack sequences); a packed (THD) layout for GPU attention kernels would implement the same
interface with ``packed_seq_params``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from pipeline.protocol.record import SampleBatch, sequence_routing

#: Optional per-token columns of a record that a `TrainSample` takes under the same name.
OPTIONAL_TOKEN_FIELDS = ("sampling_mask", "model_mask", "teacher_logprobs", "token_rewards")


@dataclass
class TrainSample:
    """One sample as the trainer consumes it (token ids, never text: `docs/architecture.md`, "Contracts")."""

    prompt_ids: np.ndarray  # int, length P >= 1
    completion_ids: np.ndarray  # int, length C >= 1
    behaviour_logprobs: np.ndarray  # float, length C: logprobs the generator sampled with
    advantage: float | None = None  # scalar advantage; None: computed from reward by group
    reward: float = 0.0  # scalar reward (used when advantage is None)
    group_id: int = 0  # prompt group (GRPO normalises within a group)
    sampling_mask: np.ndarray | None = None  # [C, W] ids top-k/top-p kept per token, -1 padded (sampling_mask.py)
    routed_experts: np.ndarray | None = None  # [P + C - 1, layers, k] generator routing (routing_replay.py)
    model_mask: np.ndarray | None = None  # [C] 1 = sampled by the policy, 0 = environment token (episodes); None: all 1
    teacher_logprobs: np.ndarray | None = None  # float, length C: the teacher's logprobs of the completion (distillation, loss.py)
    token_rewards: np.ndarray | None = None  # float, length C: per-token rewards (process rewards, environment step rewards; loss.py)

    def __post_init__(self):
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int64)
        self.completion_ids = np.asarray(self.completion_ids, dtype=np.int64)
        self.behaviour_logprobs = np.asarray(self.behaviour_logprobs, dtype=np.float32)
        if self.prompt_ids.ndim != 1 or len(self.prompt_ids) < 1:
            raise ValueError("prompt_ids must be a non-empty 1-D array")
        if self.completion_ids.ndim != 1 or len(self.completion_ids) < 1:
            raise ValueError("completion_ids must be a non-empty 1-D array")
        if self.behaviour_logprobs.shape != self.completion_ids.shape:
            raise ValueError(f"behaviour_logprobs has shape {self.behaviour_logprobs.shape}, "
                             f"completion_ids {self.completion_ids.shape}: one logprob per token")
        if self.model_mask is not None and np.shape(self.model_mask) != self.completion_ids.shape:
            raise ValueError(f"model_mask has shape {np.shape(self.model_mask)}, completion_ids "
                             f"{self.completion_ids.shape}: one entry per token")

    @property
    def trained(self) -> np.ndarray:
        """Bool per completion token: the loss covers it (the policy sampled it)."""
        if self.model_mask is None:
            return np.ones(len(self.completion_ids), dtype=bool)
        return np.asarray(self.model_mask) != 0


def train_samples(batch: SampleBatch) -> list[TrainSample]:
    """The trainer's samples of a step's batch, in order (see the module docstring)."""
    optional = [f for f in OPTIONAL_TOKEN_FIELDS if f in batch.columns]
    routed = "routed_experts" in batch.columns
    return [TrainSample(prompt_ids=batch.prompt(i), completion_ids=batch.tokens("completion_ids", i),
                        behaviour_logprobs=batch.tokens("logprobs", i),
                        reward=float(batch.columns["reward"][i]), group_id=int(batch.columns["group_id"][i]),
                        routed_experts=sequence_routing(batch.prompt(i, "prompt_routed_experts"),
                                                        batch.tokens("routed_experts", i)) if routed else None,
                        **{f: batch.tokens(f, i) for f in optional})
            for i in range(len(batch))]


@dataclass
class MicroBatch:
    """Model inputs for one forward/backward, as torch tensors on ``device``."""

    input_ids: "torch.Tensor"  # [rows, S]
    position_ids: "torch.Tensor"  # [rows, S]
    labels: "torch.Tensor"  # [rows, S]
    loss_mask: "torch.Tensor"  # [rows, S] float 0/1
    sample_index: list[int]  # which of the rank's samples each row is (-1: dummy row)
    starts: list[int]  # label position of each row's first completion token
    lengths: list[int]  # completion length of each row
    attention_mask: "torch.Tensor | None" = None  # None: causal
    packed_seq_params: object | None = None  # THD layouts only
    extras: dict = field(default_factory=dict)  # scattered per-token arrays, e.g. "behaviour"

    @property
    def tokens(self) -> int:
        return int(self.loss_mask.sum().item())


class BatchLayout(ABC):
    """Splits a rank's samples into micro-batches and maps per-token arrays in and out."""

    def __init__(self, micro_batch_tokens: int, pad_multiple: int = 1, device: str = "cpu"):
        if micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
        self.micro_batch_tokens = micro_batch_tokens
        self.pad_multiple = pad_multiple
        self.device = device

    @abstractmethod
    def micro_batches(self, samples: Sequence[TrainSample]) -> list[MicroBatch]:
        """Micro-batches covering every sample once, with ``extras['behaviour']`` and
        ``extras['advantage']`` (per row; NaN for a sample whose advantage is still None)."""

    @abstractmethod
    def dummy(self) -> MicroBatch:
        """A micro-batch with no trained tokens (keeps collective counts equal across ranks)."""

    @abstractmethod
    def scatter(self, mb: MicroBatch, per_sample: Sequence[np.ndarray]) -> "torch.Tensor":
        """Per-completion-token arrays (indexed like the rank's samples) -> ``[rows, S]``."""

    @abstractmethod
    def gather(self, mb: MicroBatch, values: "torch.Tensor") -> list[np.ndarray]:
        """``[rows, S]`` per-position values -> one completion-length array per real row."""


class PaddedLayout(BatchLayout):
    """Rows right-padded to the longest sample of the micro-batch (rounded up to
    ``pad_multiple``, e.g. the TP size under sequence parallelism); samples are taken longest
    first so rows of similar length share a micro-batch."""

    def _rows(self, samples, order):
        import torch

        lengths = [len(samples[i].prompt_ids) + len(samples[i].completion_ids) - 1 for i in order]
        width = -(-max(lengths) // self.pad_multiple) * self.pad_multiple
        ids = torch.zeros(len(order), width, dtype=torch.long)
        labels = torch.zeros(len(order), width, dtype=torch.long)
        mask = torch.zeros(len(order), width, dtype=torch.float32)
        starts, clens = [], []
        for row, i in enumerate(order):
            s = samples[i]
            tokens = torch.from_numpy(np.concatenate([s.prompt_ids, s.completion_ids]))
            n = len(tokens) - 1
            ids[row, :n] = tokens[:-1]
            labels[row, :n] = tokens[1:]
            start, c = len(s.prompt_ids) - 1, len(s.completion_ids)
            mask[row, start:start + c] = torch.from_numpy(s.trained.astype(np.float32))
            starts.append(start)
            clens.append(c)
        positions = torch.arange(width, dtype=torch.long).expand(len(order), width).contiguous()
        mb = MicroBatch(ids.to(self.device), positions.to(self.device), labels.to(self.device),
                        mask.to(self.device), list(order), starts, clens)
        return mb

    def micro_batches(self, samples):
        import torch

        order = sorted(range(len(samples)),
                       key=lambda i: -(len(samples[i].prompt_ids) + len(samples[i].completion_ids)))
        groups, current, width = [], [], 0
        for i in order:
            n = len(samples[i].prompt_ids) + len(samples[i].completion_ids) - 1
            n = -(-n // self.pad_multiple) * self.pad_multiple
            if current and (len(current) + 1) * max(width, n) > self.micro_batch_tokens:
                groups.append(current)
                current, width = [], 0
            current.append(i)
            width = max(width, n)
        if current:
            groups.append(current)
        out = []
        for group in groups:
            mb = self._rows(samples, group)
            mb.extras["behaviour"] = self.scatter(mb, [s.behaviour_logprobs for s in samples])
            mb.extras["advantage"] = torch.tensor(
                [np.nan if samples[i].advantage is None else float(samples[i].advantage)
                 for i in group], dtype=torch.float32, device=self.device)
            out.append(mb)
        return out

    def dummy(self):
        import torch

        sample = TrainSample(np.zeros(1), np.zeros(self.pad_multiple), np.zeros(self.pad_multiple),
                             advantage=0.0)
        mb = self._rows([sample], [0])
        mb.loss_mask.zero_()
        mb.sample_index = [-1]
        mb.extras["behaviour"] = torch.zeros_like(mb.loss_mask)
        mb.extras["advantage"] = torch.zeros(1, device=self.device)
        return mb

    def scatter(self, mb, per_sample):
        import torch

        out = torch.zeros(mb.loss_mask.shape, dtype=torch.float32)
        for row, (i, start, c) in enumerate(zip(mb.sample_index, mb.starts, mb.lengths)):
            if i >= 0:
                values = np.asarray(per_sample[i], dtype=np.float32)
                if len(values) != c:
                    raise ValueError(f"sample {i}: {len(values)} per-token values for {c} "
                                     f"completion tokens")
                out[row, start:start + c] = torch.from_numpy(values)
        return out.to(self.device)

    def gather(self, mb, values):
        values = values.detach().float().cpu().numpy()
        return [values[row, start:start + c].copy()
                for row, (i, start, c) in enumerate(zip(mb.sample_index, mb.starts, mb.lengths))
                if i >= 0]
