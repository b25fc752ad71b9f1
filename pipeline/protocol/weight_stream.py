"""The records of the weight stream's side channels, and the signature of every weight-store value.

A weight update travels as buckets over a `pipeline.weights` channel; what travels beside the
buckets is one of the records below, packed by `pipeline.protocol.codec` (``codec.pack`` /
``codec.unpack(cls, raw)``: msgpack, no pickle, every field's type checked, `MessageError` naming
the record and the field):

- `UpdateHeader` (leader -> receivers, first of every update: broadcast by `TorchDistChannel`
  among the group's members, whose addresses come from the signed store; under ``u<n>/meta`` in
  `CudaIpcChannel`'s store): the version and the `BucketPlan` wire form;
- `IpcHandle` (`CudaIpcChannel`, under ``u<n>/b<k>``): the fields of
  ``UntypedStorage._share_cuda_()`` and the view's offset and length;
- `IpcExport` (`pipeline.weights.cuda_ipc.export_buckets`): a whole update's plan and handles in
  one document, for a hand-over outside a channel;
- `ReceivePost` / `ReceivePostAnswer` (generator driver <-> engine worker,
  `pipeline.generator.receive_post`: a Unix socket in a 0700 directory).

Signatures: the weight group's TCP store is reachable by anyone who can connect to its address
(another user on the node). Every value written to it (the records above and torch's own
rendezvous values: gloo addresses, NCCL ids) goes through `pipeline.weights.signed_store.SignedStore`,
which stores ``signed(key, name, value)``: HMAC-SHA256 under `store_key` (derived from the run
secret) of the value *and the store key name it is written under*, then the value; a read checks it
with `verified`, which raises `StoreSignatureError` for a value not signed with the run's secret or
moved to another name. The MAC gives integrity and origin, not confidentiality (the store holds no
secret) and not availability (whoever reaches the store can still delete or overwrite a value: the
reader then fails with a clear error instead of using it).

Example: ``codec.pack(ReceivePost(version=7))`` is the msgpack of ``{"kind": "receive_post",
"version": 7}``; ``signed(k, "u0/meta", b"x")`` is 32 bytes of MAC followed by ``b"x"``, and
``verified(k, "u0/b0", signed(k, "u0/meta", b"x"))`` raises `StoreSignatureError`.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any, ClassVar

#: Bytes of the MAC in front of every signed value.
SIGNATURE_BYTES = 32


class StoreSignatureError(ValueError):
    """A weight-store value (or update header) that is not signed with the run's secret."""


def store_key(secret: bytes) -> bytes:
    """The key that signs weight-store values, derived from the run secret (a MAC made with it is
    never one of another channel's)."""
    return hmac.new(secret, b"tokenflow weight store signature v1", hashlib.sha256).digest()


def _mac(key: bytes, name: str, value: bytes | memoryview) -> bytes:
    mac = hmac.new(key, name.encode(), hashlib.sha256)
    mac.update(b"\0")
    mac.update(value)
    return mac.digest()


def signed(key: bytes, name: str, value: bytes | memoryview) -> bytes:
    """``value`` signed for the store key (or message name) ``name``: MAC, then the value."""
    return _mac(key, name, value) + bytes(value)


def verified(key: bytes, name: str, raw: bytes | memoryview) -> bytes:
    """The value `signed` put in ``raw`` for ``name``, or `StoreSignatureError`."""
    raw = bytes(raw)
    if len(raw) < SIGNATURE_BYTES or not hmac.compare_digest(
            raw[:SIGNATURE_BYTES], _mac(key, name, memoryview(raw)[SIGNATURE_BYTES:])):
        raise StoreSignatureError(f"{name}: a value of {len(raw)} bytes not signed with this run's "
                                  "secret (written by another process than the run's own?)")
    return raw[SIGNATURE_BYTES:]


@dataclass(frozen=True)
class UpdateHeader:
    KIND: ClassVar[str] = "update_header"
    version: int
    plan: list[Any]
    """`BucketPlan.to_wire()`."""


@dataclass(frozen=True)
class IpcHandle:
    KIND: ClassVar[str] = "ipc_handle"
    fields: list[Any]
    """``UntypedStorage._share_cuda_()`` with the device as its index."""
    offset: int
    numel: int


@dataclass(frozen=True)
class IpcExport:
    KIND: ClassVar[str] = "ipc_export"
    version: int
    plan: list[Any]
    """`BucketPlan.to_wire()`."""
    buckets: list[bytes]
    """Each bucket's `IpcHandle`, packed."""


@dataclass(frozen=True)
class ReceivePost:
    KIND: ClassVar[str] = "receive_post"
    version: int | None
    """The version about to be broadcast (None: not told)."""


@dataclass(frozen=True)
class ReceivePostAnswer:
    KIND: ClassVar[str] = "receive_post_answer"
    ok: bool
    error: str = ""
