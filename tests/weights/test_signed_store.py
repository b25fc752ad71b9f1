"""The weight group's store signs every value (`pipeline.weights.signed_store`): torch's own
rendezvous values included, so a planted gloo address is refused before any connection is made.
(Another user planting a value over the network: tests/protocol/test_shared_node.py.)"""
from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from pipeline.launch.rendezvous import free_port, open_store
from pipeline.protocol.weight_stream import StoreSignatureError
from pipeline.weights.group import TorchDistChannel, WeightSyncError
from pipeline.weights.signed_store import SignedStore

SECRET = bytes(range(32))


def test_a_planted_rendezvous_address_is_refused_at_once():
    """A process holding the store's port writes rank 0's gloo address before rank 0 does: the
    joining rank refuses it (naming the key) instead of connecting where it points."""
    port = free_port("127.0.0.1")
    store = open_store("127.0.0.1", port, 2, True, datetime.timedelta(seconds=10))
    store.set("tokenflow/weights/epoch0/src0/0/0", b"an address of someone else's choosing")
    with pytest.raises(WeightSyncError, match="epoch0/src0/0/0: a value of 37 bytes not signed"):
        TorchDistChannel("127.0.0.1", port, 1, 2, timeout_s=10, secret=SECRET)


def test_a_signed_value_verifies_only_under_its_own_key_and_secret():
    store = dist.HashStore()
    signed = SignedStore(store, SECRET)
    signed.set("u0/meta", b"plan")
    assert signed.get("u0/meta") == b"plan" and store.get("u0/meta") != b"plan"
    store.set("u0/b0", store.get("u0/meta"))  # moved to another key
    with pytest.raises(StoreSignatureError, match="u0/b0"):
        signed.get("u0/b0")
    with pytest.raises(StoreSignatureError, match="u0/meta"):
        SignedStore(store, bytes(32)).get("u0/meta")  # another run's secret
