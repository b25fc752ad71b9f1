"""The weight group's rendezvous store with every value signed by the run secret.

The weight group's TCPStore (`pipeline.launch.rendezvous.open_store`) listens on the configured
address, where any process of the node (another user's job included) can connect to it. What is
written there decides who talks to whom and what is loaded: torch's own rendezvous values (gloo
addresses, NCCL unique ids) and Tokenflow's records (`CudaIpcChannel`'s update headers, IPC
handles and acknowledgements). `SignedStore` stands between the channel (and torch's process
groups, which call it through the `torch.distributed.Store` interface) and the TCPStore:

Invariants:
- every value ``set`` is stored as `weight_stream.signed` under `weight_stream.store_key` of the
  run secret, bound to its full key name (prefixes included: a signed value moved to another key,
  another epoch or another update does not verify);
- every ``get`` verifies the value and raises `StoreSignatureError` (a ValueError) for one that
  was not signed with this run's secret: a planted value is never used. Waiting for a key, checking
  it and counters (``add``) pass through unsigned: they carry no value a reader uses;
- torch reaches it from its own threads (`GroupBuild`), so it holds no state but the two stores;
  torch calls its methods through the Python object, which must outlive every store or process
  group built on it (its owner keeps a reference: torch keeps only the C++ half alive).

Example: ``SignedStore(tcp, secret).set("u0/meta", b"x")`` stores 32 bytes of MAC then ``b"x"``;
another user's ``tcp.set("u0/meta", b"y")`` makes the next ``get("u0/meta")`` raise
``StoreSignatureError("u0/meta: a value of 1 bytes not signed with this run's secret ...")``.
"""
from __future__ import annotations

import torch.distributed as dist

from pipeline.protocol.weight_stream import signed, store_key, verified


class SignedStore(dist.Store):
    """``inner`` (a TCPStore) with every value signed and verified (module docstring)."""

    def __init__(self, inner: dist.Store, secret: bytes):
        super().__init__()
        self.inner = inner
        self._key = store_key(secret)
        self.set_timeout(inner.timeout)

    def set(self, key: str, value) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, signed(self._key, key, value))

    def get(self, key: str) -> bytes:
        return verified(self._key, key, self.inner.get(key))

    def wait(self, keys, timeout=None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys) -> bool:
        return self.inner.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()
