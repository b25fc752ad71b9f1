"""Same-GPU weight hand-over through CUDA IPC handles (NCCL refuses two ranks on one device).

When a trainer rank and a generator share one GPU, the trainer packs the new weights into CUDA
buckets (`pipeline.weights.buckets.pack`) and exports each bucket's memory as a CUDA IPC handle;
the generator opens the handles and reads the buckets in place, without a copy through the host.

A handle is an `IpcHandle` record (`pipeline.protocol.weight_stream`, packed by `codec`: no pickle): the
fields of ``UntypedStorage._share_cuda_()`` (device, IPC handle bytes, sizes, offsets, ref-counter
and event handles) plus the view's offset and length. The receiver rebuilds each storage with
``UntypedStorage._new_shared_cuda(...)``.

Two forms:
- `export_buckets` / `import_buckets`: one document for a whole set of buckets (a check script);
- `CudaIpcChannel`: a `WeightChannel` (``generator.weight_channel = "cuda_ipc"``) that streams one
  bucket at a time through the sender's two `BufferRing` buffers, with a TCP store (listening on
  the given address only, `open_store`; every value signed with the run secret, `SignedStore`)
  carrying the records and the receiver's acknowledgements:
  update n's `UpdateHeader` under ``u{n}/meta``, bucket k's `IpcHandle` under ``u{n}/b{k}``; the
  receiver acknowledges bucket k (``u{n}/ack{k}``) when it asks for bucket k + 2, and the sender packs bucket k + 2 into bucket k's buffer only after that
  acknowledgement. So at most two buckets of GPU memory are used, on the sender only, and a
  received tensor stays valid until the next bucket but one is requested; views the consumer
  holds longer are copied by the receive's ``release`` before the acknowledgement.

Invariants:
- the sender keeps every exported bucket alive until the receiver is done with it (CUDA IPC memory
  must outlive its mappings): `CudaIpcExport.hold` / the acknowledgements above;
- a document whose plan does not match its buckets' sizes is refused with `WeightSyncError`;
- every wait has the channel's timeout; a peer that dies makes the other raise `WeightSyncError`;
- ``wire`` counts at each store call the bytes of the value written (sent) or read (received), and
  each bucket's bytes once where it changes hands: sent when its handle is published, received
  when it is opened; so the receiver counts what the sender sent, and the other way round (acks);
- the receiver synchronises its stream before each acknowledgement: the copies reading a bucket
  have finished before the sender may pack the next bucket but one into its memory.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from pipeline.protocol import codec
from pipeline.protocol import weight_stream as records
from pipeline.weights.bucket_plan import BucketPlan
from pipeline.weights.buckets import Assembly, BufferRing, pack, unpack
from pipeline.launch.rendezvous import open_store
from pipeline.weights.group import ReceivedWeights, Release, WeightChannel, WeightSyncError, WireBytes, cuda_device

if TYPE_CHECKING:
    import torch


def _share(bucket: "torch.Tensor", what: str) -> records.IpcHandle:
    """The IPC handle of one CUDA uint8 bucket."""
    import torch

    if not bucket.is_cuda or bucket.dtype != torch.uint8 or bucket.dim() != 1:
        raise WeightSyncError(f"{what} must be a flat CUDA uint8 tensor, got {bucket.dtype}"
                              f"{list(bucket.shape)} on {bucket.device}")
    fields = bucket.untyped_storage()._share_cuda_()
    return records.IpcHandle([f if not isinstance(f, torch.device) else f.index for f in fields],
                     bucket.storage_offset(), bucket.numel())


def _open(handle: records.IpcHandle) -> "torch.Tensor":
    """The bucket a `_share` handle describes, mapped into this process."""
    import torch

    storage = torch.UntypedStorage._new_shared_cuda(*handle.fields)
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{handle.fields[0]}")
    flat.set_(storage, handle.offset, (handle.numel,))
    return flat


@dataclass
class CudaIpcExport:
    """The sender's side of one whole-set hand-over: the document to send and the buckets to keep alive."""

    document: bytes
    hold: list[Any] = field(default_factory=list)

    def release(self) -> None:
        """Drop the sender's references once the receiver has read every bucket."""
        self.hold.clear()


def export_buckets(version: int, plan: BucketPlan, buckets: Iterable["torch.Tensor"]) -> CudaIpcExport:
    """Export CUDA buckets (uint8, one per plan bucket) as IPC handles."""
    hold, shared = [], []
    for i, (size, bucket) in enumerate(zip(plan.sizes, buckets)):
        if bucket.numel() != size:
            raise WeightSyncError(f"bucket {i} has {bucket.numel()} bytes, the plan says {size}")
        shared.append(_share(bucket, f"bucket {i}"))
        hold.append(bucket)
    if len(shared) != len(plan.sizes):
        raise WeightSyncError(f"{len(shared)} buckets given for a plan of {len(plan.sizes)}")
    doc = codec.pack(records.IpcExport(int(version), plan.to_wire(), [codec.pack(h) for h in shared]))
    return CudaIpcExport(doc, hold)


def import_buckets(document: bytes) -> tuple[int, BucketPlan, Iterator[tuple[str, "torch.Tensor"]]]:
    """Open an export on this process's GPU: (version, plan, iterator of (name, tensor view))."""
    try:
        doc = codec.unpack(records.IpcExport, document)
        version, plan = doc.version, BucketPlan.from_wire(doc.plan)
        entries = [codec.unpack(records.IpcHandle, raw) for raw in doc.buckets]
    except (ValueError, KeyError, TypeError) as exc:
        raise WeightSyncError(f"malformed CUDA IPC document: {exc}") from exc
    if [e.numel for e in entries] != list(plan.sizes):
        raise WeightSyncError("CUDA IPC document: bucket sizes differ from its plan")

    def tensors() -> Iterator[tuple[str, "torch.Tensor"]]:
        assembly = Assembly()  # a tensor split over buckets is handed out whole
        for slots, entry in zip(plan.buckets, entries):
            yield from unpack(slots, _open(entry), assembly)

    return version, plan, tensors()


class CudaIpcChannel(WeightChannel):
    """Rank 0 (a trainer rank) streams to rank 1 (a generator worker on the same GPU)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int = 2, timeout_s: float = 60.0,
                 epoch: int = 0, senders: int = 1, device: "torch.device | None" = None, listener=None,
                 *, secret: bytes):
        """``secret``: the run secret, which signs every value of the channel's store (`SignedStore`)."""
        import torch
        import torch.distributed as dist

        from pipeline.weights.signed_store import SignedStore

        if world_size != 2 or senders != 1 or rank not in (0, 1):
            raise ValueError(f"a CUDA IPC channel joins one sender and one receiver on one GPU; got rank "
                             f"{rank} of {world_size} with {senders} sender(s)")
        self.rank = rank
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = cuda_device(device)
        self.buffers = BufferRing(self.device)
        self.wire = WireBytes()
        try:
            store = open_store(host, port, 2, rank == 0, self.timeout, listener)
        except (RuntimeError, OSError) as e:
            raise WeightSyncError(f"rank {rank} could not reach the CUDA IPC channel at {host}:{port} "
                                  f"within {timeout_s:.0f} s: {e}") from e
        self._signed = SignedStore(store, secret)  # held: torch calls it through this Python object
        self._store = dist.PrefixStore(f"tokenflow/ipc/epoch{epoch}", self._signed)
        self._updates = 0

    def _get(self, key: str, what: str) -> bytes:
        try:
            value = self._store.get(key)
        except RuntimeError as e:  # DistStoreError (timeout, peer gone) is a RuntimeError
            raise WeightSyncError(f"rank {self.rank}: {what} did not arrive within "
                                  f"{self.timeout.total_seconds():.0f} s (did the peer die?): {e}") from e
        except ValueError as e:  # StoreSignatureError: not written by the run's own processes
            raise WeightSyncError(f"rank {self.rank}: {what} is not signed by this run: {e}") from e
        self.wire.received += len(value)
        return value

    def _set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)
        self.wire.sent += len(value)

    def send_stream(self, version: int, plan: BucketPlan, named: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        import torch

        if self.rank != 0:
            raise WeightSyncError("rank 1 of a CUDA IPC channel receives; it cannot send")
        n = self._updates
        self._updates += 1
        self._set(f"u{n}/meta", codec.pack(records.UpdateHeader(int(version), plan.to_wire())))
        count = 0
        for k, bucket in enumerate(pack(plan, named, self.device, self.buffers)):
            torch.cuda.current_stream(self.device).synchronize()  # written before it is read elsewhere
            self._set(f"u{n}/b{k}", codec.pack(_share(bucket, f"bucket {k}")))
            self.wire.sent += bucket.numel()
            count = k + 1
            if k >= 1:  # the next bucket goes into this one's predecessor's buffer
                self._get(f"u{n}/ack{k - 1}", f"the acknowledgement of bucket {k - 1} of version {version}")
        if count:
            self._get(f"u{n}/ack{count - 1}", f"the acknowledgement of the last bucket of version {version}")

    def receive(self, stage: bool = False, release: Release | None = None) -> ReceivedWeights:
        if self.rank != 1:
            raise WeightSyncError("rank 0 of a CUDA IPC channel sends; it cannot receive")
        n = self._updates
        self._updates += 1
        try:
            header = codec.unpack(records.UpdateHeader, self._get(f"u{n}/meta", "the plan of the next update"))
            version, plan = header.version, BucketPlan.from_wire(header.plan)
        except ValueError as e:  # MessageError, or a plan that does not parse
            raise WeightSyncError(f"malformed CUDA IPC plan: {e}") from e
        update = ReceivedWeights(version, plan, iter(()))
        update._buckets = self._buckets(n, update, stage, release)
        return update

    def _buckets(self, n: int, update: ReceivedWeights, stage: bool,
                 release: Release | None) -> Iterator["torch.Tensor"]:
        version, plan = update.version, update.plan
        count = len(plan.sizes)
        mapped: list["torch.Tensor"] = []  # the sender's buckets k-2 and k-1, mapped here
        for k, size in enumerate(plan.sizes):
            if k >= 2:
                if not stage and release is not None:  # the sender may reuse bucket k-2's memory now
                    update.carried += release(mapped[0])
                mapped = mapped[1:]
                self._acknowledge(n, k - 2)
            try:
                raw = self._get(f"u{n}/b{k}", f"bucket {k}/{count} of version {version}")
                entry = codec.unpack(records.IpcHandle, raw)
            except ValueError as e:
                raise WeightSyncError(f"malformed CUDA IPC handle of bucket {k} of version {version}: {e}") from e
            if entry.numel != size:
                raise WeightSyncError(f"bucket {k} of version {version} has {entry.numel} bytes, plan {size}")
            bucket = _open(entry)
            self.wire.received += size
            mapped.append(bucket)
            yield bucket.clone() if stage else bucket
            if stage:  # copied: the sender may reuse it at once
                self._acknowledge(n, k)
        if not stage:
            for k in range(max(0, count - 2), count):
                self._acknowledge(n, k)

    def _acknowledge(self, n: int, k: int) -> None:
        """Tell the sender it may overwrite bucket ``k`` of update ``n``: only once every kernel
        this process queued on it (the consumer's copies, the staging clone) has run, since the
        acknowledgement is a host-side store write that does not wait for the GPU."""
        import torch

        torch.cuda.current_stream(self.device).synchronize()
        self._set(f"u{n}/ack{k}", b"1")

    def close(self) -> None:
        self.buffers.release()
        self._store = None
