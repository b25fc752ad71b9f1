"""Channels that carry a weight update (a version's packed buckets) from trainer ranks to generators.

`WeightChannel` is the interface: each sending trainer rank streams its buckets of a plan
(``send_stream``), every generator worker calls ``receive()`` and iterates ``(name, tensor)``
pairs as the buckets arrive. `TorchDistChannel` implements it with broadcasts over private
torch.distributed process groups (gloo on CPU, NCCL on GPU) created from one TCP store; it does not
touch torch.distributed's default group, so it lives beside vLLM's or megatron's own groups.

Ranks: ``0 .. senders-1`` are sending trainer ranks (0 is the leader; with expert parallelism one
sender per expert-parallel rank, each streaming the experts it owns), ``senders ..`` generator
workers. Each sender s has its own group ``{s} + every receiver`` (s is rank 0 there), so senders
never receive each other's buckets and never wait for each other except through the receivers.

Protocol of one update (plan order; bucket i travels on the group of ``plan.sources[i]``):
  1. leader: an int64[1] tensor holding the metadata length L;
  2. leader: a uint8[L] tensor: the `UpdateHeader` record (`pipeline.protocol.weight_stream`);
  3. each bucket of the plan, in order, from its source, as its `segments` (byte ranges of the
     flat uint8 bucket, one broadcast each: a tensor of at least `ALONE_BYTES` alone, the smaller
     ones between them together), received at their offsets in one bucket-sized buffer.
Streaming: a sender packs bucket k+1 while bucket k is in flight (asynchronous broadcast, two
buffers, `BufferRing`); a streamed receiver has two buffers too and, when bucket k is asked for,
starts receiving bucket k+1 into the buffer of bucket k-1 before it waits for bucket k. So bucket
k+1 is on the wire while bucket k is handed out (gloo moves no byte of a broadcast before the
receiver has posted it: posting only once bucket k+1 was asked for idled the link between
buckets, 825 against 591 ms for 1.2 GB in 64 MiB buckets; docs/weight-sync.md, "Bandwidth").
Bucket k-1's tensors are therefore valid until bucket k is asked for. A consumer that holds views
longer (vLLM's layerwise reload keeps a module's tensors until the module is complete, and a module
may straddle buckets) passes ``release``: it is called with the buffer about to be reused, copies
the views it still holds, and returns the bytes copied (``ReceivedWeights.carried``). Example,
buckets 0..4: while bucket 2 is loaded, buffer 0 holds bucket 2 and bucket 3 arrives in buffer 1;
asking for bucket 3 first releases buffer 0, then starts bucket 4 into it. Plans keep a fused
module's tensors in one bucket where they fit (`BucketPlan.from_specs`), so a layerwise reload
usually has nothing to copy.
A staged receive keeps every bucket (one copy of the weights), posting bucket k+1 the same way.
No copy of a large tensor on the sender: a segment that is one tensor's bytes is broadcast from the
tensor's own memory (``pack(borrow=True)``), only runs of small tensors are packed (copying a 1.3 B
model's 24 MB projections into buckets occupied a core that the transfer itself needed, on two
cores). A receiver receives a bucket that is one piece of a split tensor straight into that
tensor's reassembly memory (`Assembly.target`), not into a buffer. E.g. a 622 MB embedding in
64 MiB buckets: nine whole-bucket pieces go uncopied on both ends; the last piece, sharing its
bucket with the next tensors, is copied out of the bucket on the receiver. A streamed receive
reassembles in the memory of the channel's previous streamed receive (an assembled tensor stays
valid until the next `receive`), so no update page-faults fresh memory in under gloo's writes.
Counted bytes: each end counts what it moves in `WireBytes` (``channel.wire``), at every
broadcast it starts, as the root (``sent``) or a receiver (``received``): the metadata (8 bytes of
length, then the msgpack document) and each bucket's segments. So an update's counted bytes are
the tensors' bytes, plus the alignment padding inside packed runs, plus the metadata; every
receiver counts what the senders together counted (tests/test_weights.py, test_weight_layouts.py).
Failures (`pipeline.weights.guarded_groups`, the same code for gloo and NCCL): a group is formed
only once every member connected and one handshake broadcast went through; every broadcast is
bounded by ``timeout_s`` from its start by a watchdog thread; a peer that never joins, dies or hangs
makes the survivors raise `WeightSyncError` (naming the step that failed) within that time, the
groups are aborted (never ``shutdown()``, never a teardown of the process), and the caller forms
the next group of the survivors.

The rendezvous store (`pipeline.launch.rendezvous.open_store`) listens only on ``host``'s address (torch's TCPStore given
127.0.0.1 listens on every interface; here rank 0 binds the socket itself and hands it over as
``master_listen_fd``). Every value in it is signed with the run secret (`SignedStore`): a user who
reaches the address cannot plant a rendezvous value. The broadcasts carry no authentication: the
cluster fabric is trusted with the weights (docs/security.md).
"""
from __future__ import annotations

import abc
import datetime
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from pipeline.launch.rendezvous import open_store
from pipeline.protocol import codec
from pipeline.protocol import weight_stream as records
from pipeline.weights.guarded_groups import GuardedGroups, WeightSyncError
from pipeline.weights.bucket_plan import BucketPlan
from pipeline.weights.buckets import Assembly, BufferRing, lone, pack, segments, unpack

if TYPE_CHECKING:
    import socket

    import torch


Release = Callable[["torch.Tensor"], int]
"""Called with a streaming buffer about to be reused: copy the views of it still held; returns bytes copied."""


@dataclass
class WireBytes:
    """Bytes one end of a weight channel moved, counted at each broadcast or store call it made
    (not computed from a plan); cumulative over the channel's life, an update's are the difference
    of two readings (`since`)."""

    sent: int = 0
    """Bytes this end sent: broadcast as the root, or written to the channel's store."""
    received: int = 0
    """Bytes this end received: by broadcast, or read from the channel's store."""

    def since(self, before: "WireBytes") -> "WireBytes":
        """The bytes moved after the reading `before`."""
        return WireBytes(self.sent - before.sent, self.received - before.received)

    def reading(self) -> "WireBytes":
        """A copy of the counts now."""
        return WireBytes(self.sent, self.received)


@dataclass
class ReceivedWeights:
    """One version's update as it arrives: iterate to receive buckets and get ``(name, tensor)``.

    The tensors are views into received buckets: in a streamed receive bucket k's stay valid until
    bucket k + 1 is asked for (the receive's ``release`` copies what the consumer holds longer;
    ``carried`` counts its bytes); in a staged one, for good. A tensor split over buckets is handed out whole, from
    ``assembly`` (memory of its own, counted there), after its last piece; in a streamed receive
    that memory is reused by the channel's next streamed receive (valid until then).
    """

    version: int
    plan: BucketPlan
    _buckets: Iterator["torch.Tensor"]
    buckets_received: int = field(default=0)
    assembly: Assembly = field(default_factory=Assembly)
    carried: int = field(default=0)
    """Bytes the receive's ``release`` copied out of buffers about to be reused."""

    def __iter__(self) -> Iterator[tuple[str, "torch.Tensor"]]:
        for i, bucket in enumerate(self._buckets):  # runs the channel's iterator to its end
            self.buckets_received += 1
            yield from unpack(self.plan.buckets[i], bucket, self.assembly)
        self.assembly.check_complete()


def cuda_device(device: "torch.device | None") -> "torch.device":
    """The GPU a CUDA channel end uses, made this thread's current device. It must be given: a
    group is often opened on a new thread (`group_build`), where ``torch.cuda.current_device()``
    is 0 whatever the rank or engine worker set on its own thread (every TP worker would land
    on GPU 0: NCCL's "Duplicate GPU detected")."""
    import torch

    if device is None or torch.device(device).type != "cuda":
        raise WeightSyncError(f"a CUDA weight channel needs its GPU given explicitly, got {device!r}")
    device = torch.device(device)
    torch.cuda.set_device(device)
    return device


class WeightChannel(abc.ABC):
    """Carries versioned weight updates from one or more senders to many receivers."""

    device: "torch.device | None" = None
    """Where buckets must live to be sent (None: wherever the tensors are)."""
    buffers: BufferRing
    """This end's streaming buffers (bytes allocated: ``buffers.allocated``)."""
    wire: WireBytes
    """Bytes this end sent and received so far, counted at each call (see `WireBytes`)."""

    @abc.abstractmethod
    def send_stream(self, version: int, plan: BucketPlan, named: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        """Pack and send this sender's buckets of `plan` from `named` (their tensors, in plan order);
        the leader sends the plan first."""

    @abc.abstractmethod
    def receive(self, stage: bool = False, release: "Release | None" = None) -> ReceivedWeights:
        """Receive the next update's metadata; its buckets arrive while the result is iterated
        (``stage``: each into its own buffer, kept; else into this end's two streaming buffers,
        ``release`` called with each before it is reused: see the module docstring)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the channel's resources; further calls fail."""

    def send_tensors(self, version: int, named: Iterable[tuple[str, "torch.Tensor"]],
                     bucket_bytes: int) -> BucketPlan:
        """Plan and stream a list of named tensors from this (only) sender; returns the plan used."""
        named = list(named)
        plan = BucketPlan.for_tensors(named, bucket_bytes)
        self.send_stream(version, plan, named)
        return plan


class TorchDistChannel(WeightChannel):
    """Broadcasts over private process groups (see the module docstring for ranks and protocol)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 60.0,
                 backend: str = "gloo", epoch: int = 0, senders: int = 1, device: "torch.device | None" = None,
                 listener: "socket.socket | None" = None, *, secret: bytes):
        """``secret``: the run secret, which signs every value of the group's store (`SignedStore`)."""
        import torch

        from pipeline.weights.signed_store import SignedStore

        if not 0 <= rank < world_size or not 1 <= senders < world_size:
            raise ValueError(f"rank {rank} with {senders} sender(s) does not fit a weight group of {world_size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.rank, self.world_size, self.backend, self.senders = rank, world_size, backend, senders
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = torch.device("cpu") if backend == "gloo" else cuda_device(device)
        self.buffers = BufferRing(self.device, slots=2)
        self.wire = WireBytes()
        receivers = world_size - senders
        mine = [rank] if rank < senders else range(senders)
        # rank in sender s's group: 0 for s, 1 + i for receiver i
        members = {s: (0 if rank == s else rank - senders + 1, receivers + 1) for s in mine}
        try:
            self._groups = GuardedGroups(lambda: SignedStore(open_store(host, port, world_size, rank == 0, self.timeout,
                                                                        listener), secret),
                                         members, f"tokenflow/weights/epoch{epoch}", backend, self.device,
                                         timeout_s, handshake=epoch)
        except (RuntimeError, OSError, ValueError) as e:  # WeightSyncError included; ValueError: an unsigned store value
            if listener is not None:
                listener.close()  # a no-op once the store took it over
            raise WeightSyncError(f"rank {rank} could not join the weight group at {host}:{port} "
                                  f"(world {world_size}, {senders} sender(s), epoch {epoch}) within "
                                  f"{timeout_s:.0f} s: {e}") from e
        self._assembled: dict[str, "torch.Tensor"] = {}  # split tensors' memory, reused by streamed receives
        self._closed = False

    # -- collectives ----------------------------------------------------------------------------
    def _start(self, tensor: "torch.Tensor", source: int, what: str):
        if self._closed:
            raise WeightSyncError("the weight channel is closed")
        work = self._groups.start(source, tensor, f"rank {self.rank}: {what}")
        nbytes = tensor.numel() * tensor.element_size()
        if self.rank == source:  # the root of its own group
            self.wire.sent += nbytes
        else:
            self.wire.received += nbytes
        return work

    def _wait_all(self, works: list, what: str) -> None:
        for work in works:
            self._groups.wait(work)

    def _broadcast(self, tensor: "torch.Tensor", what: str, source: int = 0) -> None:
        self._groups.wait(self._start(tensor, source, what))

    # -- sending -------------------------------------------------------------------------------
    def send_stream(self, version: int, plan: BucketPlan, named: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        mine = plan.of_source(self.rank) if self.rank < self.senders else []
        self._send(version, plan, pack(plan, named, self.device, self.buffers, mine, borrow=True))

    def _send(self, version: int, plan: BucketPlan, buckets: Iterable[list["torch.Tensor"]]) -> None:
        """The protocol's sending side: metadata (leader), then each bucket's segments."""
        import torch

        if self.rank >= self.senders:
            raise WeightSyncError(f"rank {self.rank} is a receiver; senders are ranks 0..{self.senders - 1}")
        if self.rank == 0:
            meta = codec.pack(records.UpdateHeader(int(version), plan.to_wire()))
            self._broadcast(torch.tensor([len(meta)], dtype=torch.int64, device=self.device), "metadata length")
            self._broadcast(torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self.device), "metadata")
        mine = plan.of_source(self.rank)
        in_flight: list[tuple[list[Any], str]] = []
        sent = 0
        for index, pieces in zip(mine, buckets):
            what = f"bucket {index}/{len(plan.sizes)} of version {version}"
            in_flight.append(([self._start(piece, self.rank, what) for piece in pieces], what))
            sent += 1
            if len(in_flight) == 2:  # the next bucket reuses the buffer of the one before this
                self._wait_all(*in_flight.pop(0))
        for works, what in in_flight:
            self._wait_all(works, what)
        if sent != len(mine):
            raise WeightSyncError(f"only {sent} of this sender's {len(mine)} buckets were given to send")

    # -- receiving -----------------------------------------------------------------------------
    def receive(self, stage: bool = False, release: Release | None = None) -> ReceivedWeights:
        import torch

        if self.rank < self.senders:
            raise WeightSyncError(f"rank {self.rank} is a sender; it cannot receive")
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(length, "metadata length")
        n = int(length.item())
        if not 0 < n < 1 << 31:
            raise WeightSyncError(f"metadata length {n} is not plausible")
        raw = torch.empty(n, dtype=torch.uint8, device=self.device)
        self._broadcast(raw, "metadata")
        try:
            header = codec.unpack(records.UpdateHeader, raw.cpu().numpy().tobytes())
            version, plan = header.version, BucketPlan.from_wire(header.plan)
        except ValueError as e:  # MessageError, or a plan that does not parse
            raise WeightSyncError(f"malformed weight metadata: {e}") from e
        if any(not 0 <= s < self.senders for s in plan.sources):
            raise WeightSyncError(f"the plan of version {version} names senders {sorted(set(plan.sources))} "
                                  f"but the group has {self.senders}")
        update = ReceivedWeights(version, plan, iter(()), assembly=Assembly(keep=None if stage else self._assembled))
        update._buckets = self._receive_buckets(update, stage, release)
        return update

    def _receive_buckets(self, update: ReceivedWeights, stage: bool,
                         release: Release | None) -> Iterator["torch.Tensor"]:
        import torch

        plan, version = update.plan, update.version

        def target(i: int) -> "torch.Tensor":
            piece = lone(plan.buckets[i], plan.sizes[i])
            if piece is not None and piece.is_piece:  # straight into the split tensor's memory
                return update.assembly.target(piece, self.device)
            if stage:
                return torch.empty(plan.sizes[i], dtype=torch.uint8, device=self.device)
            reused = self.buffers.held(i)
            if reused is not None and release is not None:
                update.carried += release(reused)
            return self.buffers.get(i, plan.sizes[i])

        def what(i: int) -> str:
            return f"bucket {i}/{len(plan.sizes)} of version {version}"

        def start(i: int) -> tuple[list[Any], "torch.Tensor"]:
            buf = target(i)
            return [self._start(buf[begin:end], plan.sources[i], what(i))
                    for begin, end, _ in segments(plan.buckets[i], plan.sizes[i])], buf

        count = len(plan.sizes)
        if not count:
            return
        if not stage:  # buckets that are one piece of a split tensor never pass through the buffers
            self.buffers.reserve(max((size for slots, size in zip(plan.buckets, plan.sizes)
                                      if not getattr(lone(slots, size), "is_piece", False)), default=0))
        pending = start(0)
        for i in range(count):  # bucket i is asked for: streamed, bucket i - 1's buffer is released now
            following = start(i + 1) if i + 1 < count else None
            works, buf = pending
            self._wait_all(works, what(i))
            yield buf
            pending = following

    def close(self) -> None:
        """Abort the groups (`GuardedGroups.close`: never a ``shutdown`` waiting for a dead peer)."""
        if not self._closed:
            self._closed = True
            self._groups.close()
            self.buffers.release()
            self._assembled.clear()
