"""A side channel from the generator driver to its engine workers that starts a staged receive at once.

A weight broadcast completes only when every receiver has posted its receive. The driver's calls
into the engine's workers (``collective_rpc``) are handled by vLLM's engine core between engine
steps, so a staged generator posted its receive only after the step in progress ended; the
trainer's broadcast waited for that step. A step is milliseconds on a warm engine, but a
generator that just joined a run and shares a core runs its first leased steps slowly: measured in
the local generator-job test (bench/results/2026-12-02-generator-jobs-runs.md, runs 13 and 14), the push two or three
versions after a join waited 0.31-0.33 s for the newcomer while the old generator had its bytes
in 0.06 s. Through this channel the driver asks each worker's listener thread directly; the thread
calls the worker's ``start_receiving`` (which only starts the background receive) and answers.

Invariants (imports neither vLLM nor torch):
- the worker's listener is a daemon thread of the worker process with one ZeroMQ REP socket on a
  Unix socket inside a fresh directory of mode 0700 (`tempfile.mkdtemp`), started once
  (`ReceivePostListener.address`): no other user can connect (an abstract socket has no
  permissions: any local user could trigger a receive); it is removed at exit, and is made in the
  worker's temp directory, which is the engine's own (``TMPDIR`` while the engine starts,
  `pipeline.generator.owner_watch.private_engine_temp`), so a killed worker's goes with it;
- a request is a `ReceivePost` record, the answer a `ReceivePostAnswer`
  (`pipeline.protocol.weight_stream`, packed by `pipeline.protocol.codec`: no pickle); a malformed request gets an error
  answer;
- the driver waits at most ``timeout_s`` for each answer (`ReceivePoster.post`), raising
  `TimeoutError` naming the worker; its socket is then replaced, so a late answer is never read as
  the answer to a later request;
- ordering: the driver posts only after its earlier calls into the workers (a group switch)
  returned, and polls the receive (``received``) only after every worker answered, so the
  worker's staging state is never touched by two calls at once.
"""
from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from typing import Callable

from pipeline.protocol.codec import pack, unpack
from pipeline.protocol.weight_stream import ReceivePost, ReceivePostAnswer


class ReceivePostListener:
    """The worker's end: answers each request by calling ``start`` (the worker's start_receiving)."""

    def __init__(self, start: Callable[[], None]):
        import zmq

        self._start = start
        directory = tempfile.mkdtemp(prefix="tokenflow-receive-post-")  # mode 0700, ours
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        self.address = f"ipc://{directory}/socket"
        self._socket = zmq.Context.instance().socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.address)
        threading.Thread(target=self._serve, name="tokenflow-receive-post", daemon=True).start()

    def _serve(self) -> None:
        while True:
            raw = self._socket.recv()
            try:
                unpack(ReceivePost, raw)
                self._start()
                answer = ReceivePostAnswer(True)
            except Exception as e:  # answered, never raised: the driver decides
                answer = ReceivePostAnswer(False, f"{type(e).__name__}: {e}")
            self._socket.send(pack(answer))


class ReceivePoster:
    """The driver's end: posts the receive on every worker of one engine and waits for their answers."""

    def __init__(self, addresses: list[str], timeout_s: float):
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context.instance()
        self.addresses, self.timeout_s = addresses, timeout_s
        self._sockets = [self._connect(a) for a in addresses]

    def _connect(self, address: str):
        import zmq

        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        return sock

    async def post(self, version: int | None) -> None:
        """Start the receive of ``version`` on every worker; raises `RuntimeError` with a worker's
        error, or `TimeoutError` when a worker does not answer within ``timeout_s``."""
        import asyncio

        async def one(i: int) -> None:
            sock = self._sockets[i]
            try:
                await sock.send(pack(ReceivePost(version)))
                reply = unpack(ReceivePostAnswer, await asyncio.wait_for(sock.recv(), self.timeout_s))
            except asyncio.TimeoutError:
                sock.close()
                self._sockets[i] = self._connect(self.addresses[i])
                raise TimeoutError(f"engine worker {i} did not answer the receive post of version {version} "
                                   f"within {self.timeout_s:.0f} s") from None
            if not reply.ok:
                raise RuntimeError(f"engine worker {i} could not start receiving version {version}: "
                                   f"{reply.error}")

        await asyncio.gather(*(one(i) for i in range(len(self._sockets))))

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()
        self._sockets = []
