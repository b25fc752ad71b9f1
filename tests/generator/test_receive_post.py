"""The receive-post side channel (pipeline/generator/receive_post.py) over real ZeroMQ sockets:
a post reaches the worker's listener and returns once it answered, a worker's error comes back
named, a worker that never answers times out, and a malformed request gets an error answer."""
from __future__ import annotations

import asyncio
import threading
import time

import msgpack
import pytest
import zmq

from pipeline.generator.receive_post import ReceivePoster, ReceivePostListener


def test_a_post_starts_the_receive_on_every_worker_and_errors_come_back_named():
    started = []
    fail = threading.Event()

    def start() -> None:
        if fail.is_set():
            raise RuntimeError("an update is already being received")
        started.append(threading.current_thread().name)

    listeners = [ReceivePostListener(start) for _ in range(2)]
    poster = ReceivePoster([lis.address for lis in listeners], timeout_s=5)
    try:
        asyncio.run(poster.post(7))
        assert started == ["tokenflow-receive-post"] * 2  # on the listeners' threads, not the caller's
        fail.set()
        with pytest.raises(RuntimeError, match="could not start receiving version 8: RuntimeError: an update is already"):
            asyncio.run(poster.post(8))
    finally:
        poster.close()


def test_a_worker_that_does_not_answer_times_out_naming_it_and_a_later_post_works():
    gate = threading.Event()
    listener = ReceivePostListener(lambda: gate.wait(30))  # the first post hangs in start
    poster = ReceivePoster([listener.address], timeout_s=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="engine worker 0 did not answer the receive post of version 1"):
            asyncio.run(poster.post(1))
        assert time.monotonic() - t0 < 5
        gate.set()  # the listener answers the stale request to the replaced socket, then serves the next
        asyncio.run(poster.post(2))
    finally:
        poster.close()


def test_a_malformed_request_gets_an_error_answer_and_starts_nothing():
    started = []
    listener = ReceivePostListener(lambda: started.append(1))
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(listener.address)
    try:
        sock.send(b"\xc1 not msgpack")
        answer = msgpack.unpackb(sock.recv())
        assert answer["ok"] is False and "not msgpack" in answer["error"], answer
        sock.send(msgpack.packb([1, 2]))
        answer = msgpack.unpackb(sock.recv())
        assert answer["ok"] is False and "receive_post: got list instead" in answer["error"], answer
        assert started == []
    finally:
        sock.close()
