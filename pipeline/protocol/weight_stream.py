"""The records of the weight stream's side channels: update headers, CUDA IPC handles, receive posts.

A weight update travels as buckets over a `pipeline.weights` channel; what travels beside the
buckets is one of the records below, packed as msgpack (no pickle) by `pack` and read back by
`unpack`, which checks every field's type and raises `WeightRecordError` naming the record and
the field:

- `UpdateHeader` (leader -> receivers, first of every update: broadcast by `TorchDistChannel`,
  under ``u<n>/meta`` in `CudaIpcChannel`'s store): the version and the `BucketPlan` wire form;
- `IpcHandle` (`CudaIpcChannel`, under ``u<n>/b<k>``): the fields of
  ``UntypedStorage._share_cuda_()`` and the view's offset and length;
- `IpcExport` (`pipeline.weights.cuda_ipc.export_buckets`): a whole update's plan and handles in
  one document, for a hand-over outside a channel;
- `ReceivePost` / `ReceivePostAnswer` (generator driver <-> engine worker,
  `pipeline.generator.receive_post`).

None of them is authenticated: they travel on the weight group's store and broadcasts (trusted
fabric) or a Unix socket in a 0700 directory (docs/security.md).

Example: ``pack(ReceivePost(version=7))`` is the msgpack of ``{"kind": "receive_post",
"version": 7}``; ``unpack(ReceivePost, packb({"kind": "receive_post", "version": "7"}))`` raises
``WeightRecordError("receive_post: version: expected int or None, got str")``.
"""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, ClassVar, TypeVar

import msgpack


class WeightRecordError(ValueError):
    """Bytes that are not the expected record."""


@dataclass(frozen=True)
class UpdateHeader:
    KIND: ClassVar[str] = "update_header"
    TYPES: ClassVar[dict] = {"version": (int,), "plan": (list,)}
    version: int
    plan: list
    """`BucketPlan.to_wire()`."""


@dataclass(frozen=True)
class IpcHandle:
    KIND: ClassVar[str] = "ipc_handle"
    TYPES: ClassVar[dict] = {"fields": (list,), "offset": (int,), "numel": (int,)}
    fields: list
    """``UntypedStorage._share_cuda_()`` with the device as its index."""
    offset: int
    numel: int


@dataclass(frozen=True)
class IpcExport:
    KIND: ClassVar[str] = "ipc_export"
    TYPES: ClassVar[dict] = {"version": (int,), "plan": (list,), "buckets": (list,)}
    version: int
    plan: list
    """`BucketPlan.to_wire()`."""
    buckets: list
    """Each bucket's `IpcHandle`, packed."""


@dataclass(frozen=True)
class ReceivePost:
    KIND: ClassVar[str] = "receive_post"
    TYPES: ClassVar[dict] = {"version": (int, type(None))}
    version: int | None
    """The version about to be broadcast (None: not told)."""


@dataclass(frozen=True)
class ReceivePostAnswer:
    KIND: ClassVar[str] = "receive_post_answer"
    TYPES: ClassVar[dict] = {"ok": (bool,), "error": (str,)}
    ok: bool
    error: str = ""


R = TypeVar("R")


def pack(record: Any) -> bytes:
    return msgpack.packb({"kind": record.KIND, **asdict(record)}, use_bin_type=True)


def unpack(cls: type[R], raw: bytes) -> R:
    """The record of class ``cls`` in ``raw``, or `WeightRecordError`."""
    try:
        doc = msgpack.unpackb(raw, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise WeightRecordError(f"{cls.KIND}: not msgpack ({type(exc).__name__}, {len(raw)} bytes)") from None
    if not isinstance(doc, dict) or doc.get("kind") != cls.KIND:
        raise WeightRecordError(f"{cls.KIND}: got {str(doc)[:80]}")
    optional = {f.name for f in fields(cls) if f.default is not MISSING}
    extra = set(doc) - {f.name for f in fields(cls)} - {"kind"}
    if extra:
        raise WeightRecordError(f"{cls.KIND}: unknown field(s) {sorted(map(str, extra))}")
    for name, types in cls.TYPES.items():
        if name not in doc:
            if name in optional:
                continue
            raise WeightRecordError(f"{cls.KIND}: missing field {name}")
        value = doc[name]
        if not isinstance(value, types) or (int in types and isinstance(value, bool)):
            raise WeightRecordError(f"{cls.KIND}: {name}: expected "
                                    f"{' or '.join('None' if t is type(None) else t.__name__ for t in types)}, "
                                    f"got {type(value).__name__}")
    return cls(**{k: v for k, v in doc.items() if k != "kind"})
