"""Channels that carry a weight update (a version's packed buckets) from the trainer to generators.

`WeightChannel` is the interface: the trainer leader calls ``send(version, plan, buckets)``, every
generator worker calls ``receive()`` and iterates ``(name, tensor)`` pairs. `TorchDistChannel`
implements it as broadcasts over a private torch.distributed process group (gloo on CPU, NCCL on
GPU) created from a TCP store; rank 0 is the trainer leader, ranks 1..N-1 generator workers. It does
not touch torch.distributed's default group, so it lives beside vLLM's or megatron's own groups.

Protocol of one update (all broadcasts from rank 0):
  1. an int64[1] tensor holding the metadata length L;
  2. a uint8[L] tensor: msgpack ``{"version": v, "plan": BucketPlan.to_wire()}``;
  3. each bucket of the plan, in order, as a flat uint8 tensor of the plan's size.
Every call waits at most ``timeout_s``; a peer that dies mid-update makes the survivors raise
`WeightSyncError` (naming the step that failed) within that time instead of hanging.
"""
from __future__ import annotations

import abc
import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator

import msgpack

from pipeline.weights.buckets import BucketPlan, pack, reusable, unpack

if TYPE_CHECKING:
    import torch


class WeightSyncError(RuntimeError):
    """A weight update could not be sent or received (peer died, timeout, malformed metadata)."""


@dataclass
class ReceivedWeights:
    """One version's update as it arrives: iterate to receive buckets and get ``(name, tensor)``.

    The tensors are views into freshly received buckets; copy them before keeping them.
    """

    version: int
    plan: BucketPlan
    _buckets: Iterator["torch.Tensor"]

    def __iter__(self) -> Iterator[tuple[str, "torch.Tensor"]]:
        for slots, bucket in zip(self.plan.buckets, self._buckets):
            yield from unpack(slots, bucket)


class WeightChannel(abc.ABC):
    """Carries versioned weight updates from one sender to many receivers."""

    device: "torch.device | None" = None
    _pool: list | None = None
    """Bucket buffers reused from one update to the next (a subclass sets a list)."""
    """Where buckets must live to be sent (None: wherever the tensors are)."""

    @abc.abstractmethod
    def send(self, version: int, plan: BucketPlan, buckets: Iterable["torch.Tensor"]) -> None:
        """Send `plan` with `version`, then each bucket (flat uint8 tensors matching the plan)."""

    @abc.abstractmethod
    def receive(self) -> ReceivedWeights:
        """Receive the next update's metadata; its buckets arrive while the result is iterated."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the channel's resources; further calls fail."""

    def send_tensors(self, version: int, named: Iterable[tuple[str, "torch.Tensor"]],
                     bucket_bytes: int) -> BucketPlan:
        """Plan, pack and send a list of named tensors; returns the plan used."""
        named = list(named)
        plan = BucketPlan.for_tensors(named, bucket_bytes)
        self.send(version, plan, pack(plan, named, device=self.device, pool=self._pool))
        return plan


class TorchDistChannel(WeightChannel):
    """Broadcasts over a private process group (see the module docstring for the protocol)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 60.0,
                 backend: str = "gloo", epoch: int = 0):
        import torch
        import torch.distributed as dist

        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a weight group of {world_size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
        try:
            store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=self.timeout,
                                  wait_for_workers=False)
            store = dist.PrefixStore(f"tokenflow/weights/epoch{epoch}", store)
            if backend == "gloo":
                self._pg = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
            else:
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = self.timeout
                self._pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        except (RuntimeError, OSError) as e:
            raise WeightSyncError(f"rank {rank} could not join the weight group at {host}:{port} "
                                  f"(world {world_size}, epoch {epoch}) within {timeout_s:.0f} s: {e}") from e
        self._store = store
        self._closed = False
        self._pool = []

    def _broadcast(self, tensor: "torch.Tensor", what: str) -> None:
        import torch.distributed as dist

        if self._closed:
            raise WeightSyncError("the weight channel is closed")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        try:
            self._pg.broadcast([tensor], opts).wait(self.timeout)
        except RuntimeError as e:
            raise WeightSyncError(f"rank {self.rank}: broadcast of {what} failed (timeout "
                                  f"{self.timeout.total_seconds():.0f} s; did a peer die?): {e}") from e

    def send(self, version: int, plan: BucketPlan, buckets: Iterable["torch.Tensor"]) -> None:
        import torch

        if self.rank != 0:
            raise WeightSyncError(f"only rank 0 sends weights; this is rank {self.rank}")
        meta = msgpack.packb({"version": int(version), "plan": plan.to_wire()})
        self._broadcast(torch.tensor([len(meta)], dtype=torch.int64, device=self.device), "metadata length")
        self._broadcast(torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self.device), "metadata")
        sent = 0
        for i, (size, bucket) in enumerate(zip(plan.sizes, buckets)):
            if bucket.numel() != size or bucket.dtype != torch.uint8:
                raise WeightSyncError(f"bucket {i} is {bucket.dtype}[{bucket.numel()}], plan says uint8[{size}]")
            self._broadcast(bucket, f"bucket {i}/{len(plan.sizes)} of version {version}")
            sent += 1
        if sent != len(plan.sizes):
            raise WeightSyncError(f"only {sent} of {len(plan.sizes)} buckets were given to send")

    def receive(self) -> ReceivedWeights:
        import torch

        if self.rank == 0:
            raise WeightSyncError("rank 0 is the sender; it cannot receive")
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(length, "metadata length")
        n = int(length.item())
        if not 0 < n < 1 << 31:
            raise WeightSyncError(f"metadata length {n} is not plausible")
        raw = torch.empty(n, dtype=torch.uint8, device=self.device)
        self._broadcast(raw, "metadata")
        try:
            meta = msgpack.unpackb(raw.cpu().numpy().tobytes())
            version, plan = int(meta["version"]), BucketPlan.from_wire(meta["plan"])
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
            raise WeightSyncError(f"malformed weight metadata: {e}") from e
        return ReceivedWeights(version, plan, self._receive_buckets(plan, version))

    def _receive_buckets(self, plan: BucketPlan, version: int) -> Iterator["torch.Tensor"]:
        for i, size in enumerate(plan.sizes):
            bucket = reusable(self._pool, i, size, self.device)
            self._broadcast(bucket, f"bucket {i}/{len(plan.sizes)} of version {version}")
            yield bucket

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            shutdown = getattr(self._pg, "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()
                except RuntimeError:
                    pass  # a group whose peer already died may refuse a clean shutdown
            self._pg = None
