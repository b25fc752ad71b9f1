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
- ``BatchLayout.gather`` is the inverse of ``scatter``: it returns one array per real sample of
  the micro-batch, in placement order (``sample_index``), of length ``len(completion_ids)``.
- Micro-batches never exceed ``micro_batch_tokens`` padded tokens unless one sample alone does
  (then that sample is a micro-batch of its own).

`train_samples` is the one place a step's `SampleBatch` (the record as it travels and is stored,
`pipeline.protocol.record`) becomes `TrainSample`s: the record's ``logprobs`` are the behaviour
logprobs, its routing the rows the trainer feeds (`sequence_routing`), its optional per-token
columns are taken when the batch carries them.

Two layouts implement ``BatchLayout`` (``trainer.layout``; the interface: ``micro_batches`` (with
a token budget), ``dummy``, ``scatter``, ``gather``, ``completions`` (the ``[samples, completion]``
view the loss sees), and a `MicroBatch`'s placements ``sample_index``/``rows``/``offsets``/
``starts``/``lengths`` and per-row ``real_lengths``):

- ``PackedLayout`` (the default) concatenates samples into ONE row ``[1, T]`` (THD): segment
  boundaries go to megatron as ``packed_seq_params`` (``cu_seqlens``), attention runs per segment
  (`pipeline.trainer.attention`), rotary positions restart at 0 in every segment. The row is padded
  at the end to ``pad_multiple`` (the TP size under sequence parallelism) with one padding segment.
  No padding between samples: a micro-batch holds at most ``micro_batch_tokens`` tokens. Under
  context parallelism (``segment_multiple`` = 2 cp) every segment is padded at its end to a
  multiple of ``segment_multiple`` so it splits into 2 cp chunks (`pipeline.trainer.context_parallel`);
  ``micro_batch_tokens`` then bounds the whole row, each rank holding ``1 / cp`` of it.
- ``PaddedLayout`` right-pads rows to a common length; the rows' real lengths go to the same
  attention as ``packed_seq_params`` with ``qkv_format="sbhd"`` (row i's first ``n_i`` positions
  are one sequence, its padding never attended), so both layouts run identical attention calls;
  padding waste is ``1 - real / (rows x width)``.

Worked example (packed, pad_multiple 4): samples of 3 and 2 fed positions (prompt + completion - 1)
give input_ids ``[a0 a1 a2 b0 b1 0 0 0]``, cu_seqlens ``[0, 3, 5, 8]``, rows ``[0, 0]``, offsets
``[0, 3]``, real_lengths ``[5]`` (real tokens always form a prefix of each row).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from pipeline.protocol.record import sequence_routing
from pipeline.protocol.sample_batch import SampleBatch

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
    sample_index: list[int]  # per placed sample: which of the rank's samples it is (-1: dummy)
    rows: list[int]  # per placed sample: the row it sits in
    offsets: list[int]  # per placed sample: position of its first token in its row
    starts: list[int]  # per placed sample: label position of its first completion token in its row
    lengths: list[int]  # per placed sample: completion length
    real_lengths: list[int]  # per row: positions holding real tokens (a prefix of the row; with segment padding, up to the last segment's end)
    attention_mask: "torch.Tensor | None" = None  # None: causal
    packed_seq_params: object | None = None  # megatron PackedSeqParams: THD segments (packed) or the rows' real lengths (padded, "sbhd")
    real: "torch.Tensor | None" = None  # [rows, S] bool: positions holding real tokens, where they are no prefix (context parallelism); None: real_lengths
    extras: dict = field(default_factory=dict)  # scattered per-token arrays, e.g. "behaviour"

    @property
    def tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def real_mask(self) -> "torch.Tensor":
        """``[rows, S]`` bool on the CPU: the positions holding real tokens."""
        import torch

        if self.real is not None:
            return self.real
        return torch.arange(self.input_ids.shape[1])[None] < torch.as_tensor(self.real_lengths)[:, None]


class BatchLayout(ABC):
    """Splits a rank's samples into micro-batches and maps per-token arrays in and out."""

    def __init__(self, micro_batch_tokens: int, pad_multiple: int = 1, device: str = "cpu"):
        if micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
        self.micro_batch_tokens = micro_batch_tokens
        self.pad_multiple = pad_multiple
        self.device = device

    @abstractmethod
    def micro_batches(self, samples: Sequence[TrainSample], budget: int | None = None) -> list[MicroBatch]:
        """Micro-batches covering every sample once, each of at most ``budget`` tokens (None:
        ``micro_batch_tokens``), with ``extras['behaviour']`` (scattered) and
        ``extras['advantage']`` (per placed sample; NaN for a sample whose advantage is None)."""

    @abstractmethod
    def dummy(self) -> MicroBatch:
        """A micro-batch with no trained tokens (keeps collective counts equal across ranks)."""

    def scatter(self, mb: MicroBatch, per_sample: Sequence[np.ndarray]) -> "torch.Tensor":
        """Per-completion-token arrays (indexed like the rank's samples) -> ``[rows, S]``."""
        import torch

        out = torch.zeros(mb.loss_mask.shape, dtype=torch.float32)
        for i, row, start, c in zip(mb.sample_index, mb.rows, mb.starts, mb.lengths):
            if i >= 0:
                values = np.asarray(per_sample[i], dtype=np.float32)
                if len(values) != c:
                    raise ValueError(f"sample {i}: {len(values)} per-token values for {c} "
                                     f"completion tokens")
                out[row, start:start + c] = torch.from_numpy(values)
        return out.to(self.device)

    def gather(self, mb: MicroBatch, values: "torch.Tensor") -> list[np.ndarray]:
        """``[rows, S]`` per-position values -> one completion-length array per real placed
        sample, in placement order."""
        values = values.detach().float().cpu().numpy()
        return [values[row, start:start + c].copy()
                for i, row, start, c in zip(mb.sample_index, mb.rows, mb.starts, mb.lengths) if i >= 0]

    def completions(self, mb: MicroBatch, values: "torch.Tensor") -> "torch.Tensor":
        """``[rows, S]`` per-position values -> ``[placed samples, longest completion]``: row j
        holds placed sample j's completion positions, zero-filled past its length (differentiable;
        the loss sees every layout in this one shape, so its per-sequence sums never mix samples)."""
        import torch

        width = values.shape[1]
        longest = max(mb.lengths)
        j = torch.arange(longest)
        index = torch.stack([row * width + start + j.clamp(max=c - 1)
                             for row, start, c in zip(mb.rows, mb.starts, mb.lengths)]).to(values.device)
        inside = (j[None, :] < torch.tensor(mb.lengths)[:, None]).to(values.device)
        picked = values.reshape(-1)[index]
        return torch.where(inside, picked, torch.zeros_like(picked))

    def _finish(self, mb: MicroBatch, samples: Sequence[TrainSample]) -> MicroBatch:
        """Attach ``behaviour`` and ``advantage`` (the extras every micro-batch carries)."""
        import torch

        mb.extras["behaviour"] = self.scatter(mb, [s.behaviour_logprobs for s in samples])
        mb.extras["advantage"] = torch.tensor(
            [np.nan if samples[i].advantage is None else float(samples[i].advantage)
             for i in mb.sample_index], dtype=torch.float32, device=self.device)
        return mb


class PaddedLayout(BatchLayout):
    """Rows right-padded to the longest sample of the micro-batch (rounded up to
    ``pad_multiple``, e.g. the TP size under sequence parallelism); samples are taken longest
    first so rows of similar length share a micro-batch."""

    def _rows(self, samples, order):
        import torch

        lengths = [fed_length(samples[i]) for i in order]
        width = _round_up(max(lengths), self.pad_multiple)
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
        return MicroBatch(ids.to(self.device), positions.to(self.device), labels.to(self.device),
                          mask.to(self.device), list(order), list(range(len(order))), [0] * len(order),
                          starts, clens, lengths, packed_seq_params=self._row_lengths(lengths, width))

    def _row_lengths(self, lengths, width):
        """The rows' real lengths for the attention (``qkv_format="sbhd"``, `pipeline.trainer.attention`)."""
        import torch
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=self.device)
        return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=width,
                               max_seqlen_kv=width)

    def micro_batches(self, samples, budget=None):
        budget = budget or self.micro_batch_tokens
        order = sorted(range(len(samples)), key=lambda i: -fed_length(samples[i]))
        groups, current, width = [], [], 0
        for i in order:
            n = _round_up(fed_length(samples[i]), self.pad_multiple)
            if current and (len(current) + 1) * max(width, n) > budget:
                groups.append(current)
                current, width = [], 0
            current.append(i)
            width = max(width, n)
        if current:
            groups.append(current)
        return [self._finish(self._rows(samples, group), samples) for group in groups]

    def dummy(self):
        import torch

        sample = TrainSample(np.zeros(1), np.zeros(self.pad_multiple), np.zeros(self.pad_multiple),
                             advantage=0.0)
        mb = self._rows([sample], [0])
        mb.loss_mask.zero_()
        mb.sample_index = [-1]
        mb.real_lengths = [0]
        mb.packed_seq_params = self._row_lengths([0], mb.input_ids.shape[1])
        mb.extras["behaviour"] = torch.zeros_like(mb.loss_mask)
        mb.extras["advantage"] = torch.zeros(1, device=self.device)
        return mb


class PackedLayout(BatchLayout):
    """Samples concatenated into one row per micro-batch (THD, module docstring); samples are
    placed longest first into the first micro-batch with room (first-fit decreasing); every
    segment is padded at its end to a multiple of ``segment_multiple``."""

    def __init__(self, micro_batch_tokens: int, pad_multiple: int = 1, device: str = "cpu",
                 segment_multiple: int = 1):
        super().__init__(micro_batch_tokens, pad_multiple, device)
        self.segment_multiple = segment_multiple

    def _pack(self, samples, order, dummy_length: int = 0):
        import torch
        from megatron.core.packed_seq_params import PackedSeqParams

        pieces, labels, masks, positions = [], [], [], []
        offsets, starts, clens, bounds = [], [], [], [0]
        for i in order:
            s = samples[i]
            tokens = np.concatenate([s.prompt_ids, s.completion_ids])
            n = len(tokens) - 1
            padded = _round_up(n, self.segment_multiple)
            offsets.append(bounds[-1])
            starts.append(bounds[-1] + len(s.prompt_ids) - 1)
            clens.append(len(s.completion_ids))
            pieces.append(np.pad(tokens[:-1], (0, padded - n)))
            labels.append(np.pad(tokens[1:], (0, padded - n)))
            mask = np.zeros(padded, np.float32)
            mask[len(s.prompt_ids) - 1:n] = s.trained
            masks.append(mask)
            positions.append(np.arange(padded))
            bounds.append(bounds[-1] + padded)
        real = bounds[-1]
        width = _round_up(max(real, dummy_length, 1), self.pad_multiple)
        if width > real:  # one padding segment at the end
            pad = width - real
            pieces.append(np.zeros(pad, np.int64))
            labels.append(np.zeros(pad, np.int64))
            masks.append(np.zeros(pad, np.float32))
            positions.append(np.arange(pad))
            bounds.append(width)
        cu = torch.tensor(bounds, dtype=torch.int32, device=self.device)
        longest = int(np.diff(bounds).max())
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=longest, max_seqlen_kv=longest)

        def row(parts, dtype):
            return torch.from_numpy(np.concatenate(parts).astype(dtype))[None].to(self.device)

        exact = None  # segment padding: real positions are no prefix of the row
        if self.segment_multiple > 1:
            exact = torch.zeros(1, width, dtype=torch.bool)
            for i, offset in zip(order, offsets):
                exact[0, offset:offset + fed_length(samples[i])] = True
        return MicroBatch(row(pieces, np.int64), row(positions, np.int64), row(labels, np.int64),
                          row(masks, np.float32), list(order), [0] * len(order), offsets, starts, clens,
                          [real], packed_seq_params=params, real=exact)

    def micro_batches(self, samples, budget=None):
        budget = budget or self.micro_batch_tokens
        order = sorted(range(len(samples)), key=lambda i: -fed_length(samples[i]))
        bins: list[list[int]] = []
        used: list[int] = []
        for i in order:
            n = _round_up(fed_length(samples[i]), self.segment_multiple)
            fit = next((b for b, u in enumerate(used) if _round_up(u + n, self.pad_multiple) <= budget), None)
            if fit is None:
                bins.append([i])
                used.append(n)
            else:
                bins[fit].append(i)
                used[fit] += n
        return [self._finish(self._pack(samples, group), samples) for group in bins]

    def dummy(self):
        import torch

        mb = self._pack([], [], dummy_length=self.pad_multiple)
        width = mb.input_ids.shape[1]
        mb.sample_index, mb.rows, mb.offsets, mb.starts, mb.lengths = [-1], [0], [0], [0], [width]
        mb.extras["behaviour"] = torch.zeros_like(mb.loss_mask)
        mb.extras["advantage"] = torch.zeros(1, device=self.device)
        return mb


LAYOUTS = {"packed": PackedLayout, "padded": PaddedLayout}


def make_layout(name: str, micro_batch_tokens: int, pad_multiple: int = 1, device: str = "cpu",
                segment_multiple: int = 1) -> BatchLayout:
    """The layout ``trainer.layout`` names (``segment_multiple`` > 1: packed only)."""
    if name not in LAYOUTS:
        raise ValueError(f"trainer.layout must be one of {sorted(LAYOUTS)}, got {name!r}")
    if segment_multiple > 1:
        if name != "packed":
            raise ValueError(f"trainer.layout={name!r} cannot split sequences over context-parallel ranks: "
                             "use trainer.layout=packed with trainer.parallel.cp > 1")
        return PackedLayout(micro_batch_tokens, pad_multiple, device, segment_multiple)
    return LAYOUTS[name](micro_batch_tokens, pad_multiple=pad_multiple, device=device)


def fed_length(sample: TrainSample) -> int:
    """Positions the model is fed for ``sample``: prompt + completion - 1."""
    return len(sample.prompt_ids) + len(sample.completion_ids) - 1


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
