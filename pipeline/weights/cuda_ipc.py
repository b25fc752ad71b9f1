"""Same-GPU weight hand-over through CUDA IPC handles (NCCL refuses two ranks on one device).

When a trainer and a generator share one GPU, the trainer packs the new weights into CUDA buckets
(`pipeline.weights.buckets.pack`) and exports each bucket's memory as a CUDA IPC handle; the
generator opens the handles and reads the buckets in place, without a copy through the host.

The export is a small msgpack document (no pickle): per bucket, the fields of
``UntypedStorage._share_cuda_()`` (device, IPC handle bytes, sizes, offsets, ref-counter and
event handles) plus the bucket plan (`BucketPlan.to_wire`). The receiver rebuilds each storage
with ``UntypedStorage._new_shared_cuda(...)``.

Invariants:
- the sender keeps every exported bucket alive (``hold``) until the receiver confirms it has
  finished reading (`CudaIpcExport.release`); CUDA IPC memory must outlive its mappings;
- a handle document names its version and plan; a receiver given a plan that does not match the
  buckets' sizes refuses it with `WeightSyncError`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import msgpack

from pipeline.weights.buckets import BucketPlan, unpack
from pipeline.weights.group import WeightSyncError


@dataclass
class CudaIpcExport:
    """The sender's side of one hand-over: the document to send and the buckets to keep alive."""

    document: bytes
    hold: list[Any] = field(default_factory=list)

    def release(self) -> None:
        """Drop the sender's references once the receiver has read every bucket."""
        self.hold.clear()


def export_buckets(version: int, plan: BucketPlan, buckets: Iterable["torch.Tensor"]) -> CudaIpcExport:
    """Export CUDA buckets (uint8, one per plan bucket) as IPC handles."""
    import torch

    hold, shared = [], []
    for i, (size, bucket) in enumerate(zip(plan.sizes, buckets)):
        if not bucket.is_cuda or bucket.dtype != torch.uint8 or bucket.numel() != size:
            raise WeightSyncError(f"bucket {i} must be a CUDA uint8 tensor of {size} bytes, "
                                  f"got {bucket.dtype}[{bucket.numel()}] on {bucket.device}")
        storage = bucket.untyped_storage()
        fields = storage._share_cuda_()
        hold.append(bucket)
        shared.append({"fields": [f if not isinstance(f, torch.device) else f.index for f in fields],
                       "offset": bucket.storage_offset(), "numel": bucket.numel()})
    if len(shared) != len(plan.sizes):
        raise WeightSyncError(f"{len(shared)} buckets given for a plan of {len(plan.sizes)}")
    doc = msgpack.packb({"version": int(version), "plan": plan.to_wire(), "buckets": shared},
                        use_bin_type=True)
    return CudaIpcExport(doc, hold)


def import_buckets(document: bytes) -> tuple[int, BucketPlan, Iterator[tuple[str, "torch.Tensor"]]]:
    """Open an export on this process's GPU: (version, plan, iterator of (name, tensor view))."""
    import torch

    try:
        doc = msgpack.unpackb(document, raw=False)
        version, plan = int(doc["version"]), BucketPlan.from_wire(doc["plan"])
        entries = doc["buckets"]
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        raise WeightSyncError(f"malformed CUDA IPC document: {exc}") from exc
    if [e["numel"] for e in entries] != list(plan.sizes):
        raise WeightSyncError("CUDA IPC document: bucket sizes differ from its plan")

    def tensors() -> Iterator[tuple[str, "torch.Tensor"]]:
        for slots, entry in zip(plan.buckets, entries):
            storage = torch.UntypedStorage._new_shared_cuda(*entry["fields"])
            flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{entry['fields'][0]}")
            flat.set_(storage, entry["offset"], (entry["numel"],))
            yield from unpack(slots, flat)

    return version, plan, tensors()
