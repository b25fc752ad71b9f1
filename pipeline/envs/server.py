"""An environment process: serves the environments of many episodes over ZeroMQ (`docs/episodes.md`).

Started by `pipeline.envs.remote.EnvironmentPool` (``python -m pipeline.envs.server ADDRESS``, the
pool's wire secret in ``TOKENFLOW_ENV_SECRET``; ADDRESS exists once it serves); each client socket
(one per episode, identified by its ZeroMQ identity) owns one environment here. Requests and answers
are the typed records of `pipeline.protocol.environment` (`pipeline.protocol.wire` messages: an
authenticated msgpack header, no arrays): `EnvReset` (``env``, ``text``), `EnvStep` (``text``) or
`EnvClose`; the answer is `EnvStepped` (``observation``, ``reward``, ``done``), `EnvOk` or `EnvError`
(``error``, naming what failed).

Invariants:
- every request runs in its own daemon thread, so an environment that hangs holds up only its own
  episode: the others are answered meanwhile; the client gives up on it after its step timeout and
  closes the episode (a late answer to a closed episode is dropped);
- a frame that fails authentication or parsing, or that is not a well-formed request record, is
  answered with ``error`` naming the problem and serving goes on; nothing is unpickled;
- the process ends when its parent does (parent-death signal), so a killed generator leaves none;
  on that signal it removes its socket, and the pool's directory once it is empty: the last
  process of a killed owner's pool leaves nothing in the temp directory.

Worked example: a client sends ``reset {env: "calculator", text: "37*48="}`` -> ``ok``; then
``step {text: "calc 37*48"}`` -> ``step {observation: "...=1776...", reward: 0.0, done: false}``;
then ``close`` -> ``ok`` (the environment is dropped).
"""
from __future__ import annotations

import os
import queue
import sys
import threading

from pipeline.protocol.environment import ENV_REQUESTS, EnvClose, EnvError, EnvOk, EnvReset, EnvStep, EnvStepped
from pipeline.protocol.codec import MessageError, encode
from pipeline.protocol.wire import FrameError, decode
from pipeline.protocol.wire import encode as wire_frames

SECRET_ENV = "TOKENFLOW_ENV_SECRET"
#: The pid of the process that started this one (its death ends this one, even before it got here).
OWNER_ENV = "TOKENFLOW_ENV_OWNER"
#: Longest request accepted (environment text only: prompts and model turns).
MAX_BYTES = 1 << 22


def _answer(envs: dict, identity: bytes, request: EnvReset | EnvStep) -> EnvOk | EnvStepped | EnvError:
    """The answer to one request (runs in the request's thread)."""
    from pipeline.envs import Step, make_environment

    try:
        if isinstance(request, EnvReset):
            env = make_environment(request.env)
            env.reset(request.text)
            envs[identity] = env
            return EnvOk()
        env = envs.get(identity)
        if env is None:
            return EnvError("step before reset (or after close) of this episode")
        step = env.step(request.text)
        if not isinstance(step, Step):
            return EnvError(f"{type(env).__name__}.step returned {type(step).__name__}, not Step")
        return EnvStepped(str(step.observation), float(step.reward), bool(step.done))
    except Exception as exc:  # the environment's failure is the episode's, reported to its client
        return EnvError(f"{request.KIND} failed: {exc!r}")


def serve(address: str, secret: bytes) -> None:
    """Serve until killed (see the module docstring)."""
    import zmq

    def frames(identity: bytes, answer) -> list[bytes]:
        return [identity, *wire_frames(secret, *encode(answer))]

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    envs: dict[bytes, object] = {}
    done: queue.Queue = queue.Queue()
    busy: set[bytes] = set()

    def work(identity: bytes, request: EnvReset | EnvStep) -> None:
        done.put((identity, _answer(envs, identity, request)))

    while True:
        while True:  # answers of finished requests; one of a closed episode is dropped
            try:
                identity, answer = done.get_nowait()
            except queue.Empty:
                break
            if identity in busy:
                busy.discard(identity)
                sock.send_multipart(frames(identity, answer))
        if not sock.poll(20):
            continue
        identity, *received = sock.recv_multipart()
        try:
            request = ENV_REQUESTS.decode(decode(secret, received, MAX_BYTES))
        except FrameError as exc:
            sock.send_multipart(frames(identity, EnvError(f"bad request frame: {exc}")))
            continue
        except MessageError as exc:
            sock.send_multipart(frames(identity, EnvError(f"bad request: {exc}")))
            continue
        if isinstance(request, EnvClose):
            busy.discard(identity)  # a hung request of this episode is answered to nobody
            envs.pop(identity, None)
            sock.send_multipart(frames(identity, EnvOk()))
            continue
        busy.add(identity)
        threading.Thread(target=work, args=(identity, request), daemon=True,
                         name=f"env-{request.KIND}").start()


OWNER_EXIT_S = 0.5
"""How long a SIGTERM waits for the owner to be gone: the parent-death signal comes when the owner's
thread that started this process exits, which may be before the owner's other threads have."""


def _leave_on_sigterm(address: str) -> None:
    """On SIGTERM: end; if the owner is gone (the parent-death signal: nobody restarts this process
    or removes the pool), first remove this process's socket and, if it is the pool's last, the
    directory. While the owner lives (a stop signal to the process group), its pool may restart
    the process on the same address, so both stay."""
    import signal
    import time

    from pipeline.supervise import alive

    path, owner = address[len("ipc://"):], os.getppid()

    def leave(signum: int, _frame) -> None:
        deadline = time.monotonic() + OWNER_EXIT_S
        while alive(owner) and time.monotonic() < deadline:
            time.sleep(0.01)
        if not alive(owner):
            for remove, target in ((os.unlink, path), (os.rmdir, os.path.dirname(path))):
                try:
                    remove(target)
                except OSError:  # gone already; the directory: another process's socket is still in it
                    pass
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


def main() -> None:
    from pipeline.supervise import die_with_parent

    if len(sys.argv) == 2:
        _leave_on_sigterm(sys.argv[1])  # before the parent-death signal can arrive
    die_with_parent()
    if len(sys.argv) != 2 or SECRET_ENV not in os.environ:
        raise SystemExit(f"usage: {SECRET_ENV}=HEX python -m pipeline.envs.server ADDRESS")
    if os.environ.get(OWNER_ENV, str(os.getppid())) != str(os.getppid()):
        raise SystemExit("the process that started this environment process is gone")
    serve(sys.argv[1], bytes.fromhex(os.environ[SECRET_ENV]))


if __name__ == "__main__":
    main()
