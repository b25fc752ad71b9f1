"""Environments in separate processes: a pool of environment servers and the episode's client side.

With ``episode.env_processes = N > 0`` the generator starts N `pipeline.envs.server` processes
(`EnvironmentPool`) and each episode's environment is a `RemoteEnvironment` on one of them, chosen
round-robin; the episode loop (`pipeline.generator.episodes`) drives it exactly like an environment
in its own process, under the same step timeout (the records: `pipeline.protocol.environment`).
Invariants:

- an environment process that dies (killed, crashed) is restarted at once, up to
  ``episode.env_restarts`` times; the episodes it was serving fail their step (an ``env_error`` after
  their retries, `pipeline.envs.base`), never the run; the others carry on;
- a step waits at most the step timeout (+1 s for the socket itself), then the client's socket is
  closed and the episode abandoned: a late answer is dropped by the server;
- the pool ends its processes on `close`, at interpreter exit, and (parent-death signal, set in the
  server) when the generator is killed.

Worked example: ``env_processes=2``, a group of 4 episodes: episodes 0 and 2 talk to process 0,
1 and 3 to process 1; ``kill -9`` of process 1 mid-step fails episodes 1 and 3 (retried per
``episode.env_retries``, on the restarted process 1) while 0 and 2 finish normally.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile

from pipeline.envs.base import Environment, Step
from pipeline.envs.server import MAX_BYTES, OWNER_ENV, SECRET_ENV
from pipeline.protocol.environment import (ENV_ANSWERS, EnvClose, EnvError, EnvOk, EnvReset, EnvStep,
                                           EnvStepped)
from pipeline.protocol.codec import MessageError, encode
from pipeline.protocol.wire import decode
from pipeline.protocol.wire import encode as wire_frames

log = logging.getLogger(__name__)


class RemoteEnvironment(Environment):
    """One episode's environment, living in an environment process (see the module docstring)."""

    def __init__(self, address: str, secret: bytes, kind: str, timeout_s: float):
        import zmq

        self.kind, self.secret, self.timeout_s = kind, secret, timeout_s
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 100)  # long enough for a last `close` to leave
        self.sock.connect(address)

    def _call(self, request: EnvReset | EnvStep, answer: type):
        """Send ``request``; its answer, which must be an ``answer`` record."""
        if self.sock.closed:
            raise RuntimeError("this episode's environment was abandoned after a timeout")
        self.sock.send_multipart(wire_frames(self.secret, *encode(request)))
        if not self.sock.poll(int((self.timeout_s + 1.0) * 1000)):
            self.sock.close()  # by the thread that used it; the late answer goes nowhere
            raise TimeoutError(f"the environment process did not answer {request.KIND} within "
                               f"{self.timeout_s + 1.0:g} s")
        try:
            msg = ENV_ANSWERS.decode(decode(self.secret, self.sock.recv_multipart(), MAX_BYTES))
        except MessageError as exc:
            raise RuntimeError(f"environment process answered {request.KIND} badly: {exc}") from None
        if isinstance(msg, EnvError):
            raise RuntimeError(f"environment process: {msg.error}")
        if not isinstance(msg, answer):
            raise RuntimeError(f"environment process answered {request.KIND} with {msg.KIND}")
        return msg

    def reset(self, prompt_text: str) -> None:
        self._call(EnvReset(self.kind, prompt_text), EnvOk)

    def step(self, message: str) -> Step:
        stepped = self._call(EnvStep(message), EnvStepped)
        return Step(stepped.observation, stepped.reward, stepped.done)

    def close(self) -> None:
        if not self.sock.closed:
            self.sock.send_multipart(wire_frames(self.secret, *encode(EnvClose())))
            self.sock.close()


class EnvironmentPool:
    """``processes`` environment servers kept alive; `environment` hands out their environments."""

    def __init__(self, processes: int, step_timeout_s: float, max_restarts: int, start_timeout_s: float = 60.0):
        """Starts the processes and waits (at most ``start_timeout_s``) until each serves."""
        import time

        from pipeline.supervise import KeptProcess

        if processes < 1:
            raise ValueError(f"an environment pool needs at least one process, got {processes}")
        self.timeout_s = step_timeout_s
        self.secret = os.urandom(32)
        self.dir = tempfile.mkdtemp(prefix="tokenflow-env-")
        self.addresses = [f"ipc://{self.dir}/env-{i}" for i in range(processes)]
        self.kept = [KeptProcess(f"environment process {i}", lambda a=a: self._start(a), max_restarts,
                                 lambda why: log.error("%s: its episodes fail from now on", why))
                     for i, a in enumerate(self.addresses)]
        self._turn = itertools.count()
        atexit.register(self.close)
        deadline = time.monotonic() + start_timeout_s
        for k, address in zip(self.kept, self.addresses):
            while not os.path.exists(address[len("ipc://"):]):  # bound: it serves
                if k.failure or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"the {k.name} did not start serving within {start_timeout_s:g} s"
                                       + (f": {k.failure}" if k.failure else ""))
                time.sleep(0.05)

    def _start(self, address: str) -> subprocess.Popen:
        # the server imports environments the way this process can (user classes "module:Class")
        path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        env = {**os.environ, SECRET_ENV: self.secret.hex(), OWNER_ENV: str(os.getpid()), "PYTHONPATH": path}
        return subprocess.Popen([sys.executable, "-m", "pipeline.envs.server", address], env=env)

    @property
    def restarts(self) -> int:
        """Environment processes restarted so far, over the pool."""
        return sum(k.restarts for k in self.kept)

    def environment(self, kind: str) -> RemoteEnvironment:
        """A fresh environment of ``kind`` for one episode, on the next process in turn."""
        return RemoteEnvironment(self.addresses[next(self._turn) % len(self.addresses)], self.secret, kind,
                                 self.timeout_s)

    def close(self) -> None:
        """End the processes (idempotent)."""
        for k in self.kept:
            k.stop(grace_s=5.0)
        shutil.rmtree(self.dir, ignore_errors=True)
        atexit.unregister(self.close)
