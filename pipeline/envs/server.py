"""An environment process: serves the environments of many episodes over ZeroMQ (`docs/episodes.md`).

Started by `pipeline.envs.remote.EnvironmentPool` (``python -m pipeline.envs.server ADDRESS``, the
pool's wire secret in ``TOKENFLOW_ENV_SECRET``; ADDRESS exists once it serves); each client socket
(one per episode, identified by its ZeroMQ identity) owns one environment here. Requests and answers are `pipeline.protocol.wire` messages
(an authenticated msgpack header, no arrays): kind ``reset`` (meta ``env``, ``text``), ``step``
(meta ``text``) or ``close``; the answer is kind ``step`` (meta ``observation``, ``reward``,
``done``), ``ok`` or ``error`` (meta ``error``, naming what failed).

Invariants:
- every request runs in its own daemon thread, so an environment that hangs holds up only its own
  episode: the others are answered meanwhile; the client gives up on it after its step timeout and
  closes the episode (a late answer to a closed episode is dropped);
- a frame that fails authentication or parsing is answered with ``error`` naming the problem and
  serving goes on; nothing is unpickled;
- the process ends when its parent does (parent-death signal), so a killed generator leaves none.

Worked example: a client sends ``reset {env: "calculator", text: "37*48="}`` -> ``ok``; then
``step {text: "calc 37*48"}`` -> ``step {observation: "...=1776...", reward: 0.0, done: false}``;
then ``close`` -> ``ok`` (the environment is dropped).
"""
from __future__ import annotations

import os
import queue
import sys
import threading

SECRET_ENV = "TOKENFLOW_ENV_SECRET"
#: The pid of the process that started this one (its death ends this one, even before it got here).
OWNER_ENV = "TOKENFLOW_ENV_OWNER"
#: Longest request accepted (environment text only: prompts and model turns).
MAX_BYTES = 1 << 22


def _answer(envs: dict, identity: bytes, kind: str, meta: dict):
    """(kind, meta) of the answer to one request (runs in the request's thread)."""
    from pipeline.envs import Step, make_environment

    try:
        if kind == "reset":
            env = make_environment(str(meta["env"]))
            env.reset(str(meta.get("text", "")))
            envs[identity] = env
            return "ok", {}
        if kind == "step":
            env = envs.get(identity)
            if env is None:
                return "error", {"error": "step before reset (or after close) of this episode"}
            step = env.step(str(meta.get("text", "")))
            if not isinstance(step, Step):
                return "error", {"error": f"{type(env).__name__}.step returned {type(step).__name__}, not Step"}
            return "step", {"observation": step.observation, "reward": float(step.reward), "done": bool(step.done)}
        return "error", {"error": f"unknown request kind {kind!r} (reset, step, close)"}
    except Exception as exc:  # the environment's failure is the episode's, reported to its client
        return "error", {"error": f"{kind} failed: {exc!r}"}


def serve(address: str, secret: bytes) -> None:
    """Serve until killed (see the module docstring)."""
    import zmq

    from pipeline.protocol.wire import FrameError, decode, encode

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    envs: dict[bytes, object] = {}
    done: queue.Queue = queue.Queue()
    busy: set[bytes] = set()

    def work(identity: bytes, kind: str, meta: dict) -> None:
        done.put((identity, *_answer(envs, identity, kind, meta)))

    while True:
        while True:  # answers of finished requests; one of a closed episode is dropped
            try:
                identity, kind, meta = done.get_nowait()
            except queue.Empty:
                break
            if identity in busy:
                busy.discard(identity)
                sock.send_multipart([identity, *encode(secret, kind, meta)])
        if not sock.poll(20):
            continue
        identity, *frames = sock.recv_multipart()
        try:
            msg = decode(secret, frames, MAX_BYTES)
        except FrameError as exc:
            sock.send_multipart([identity, *encode(secret, "error", {"error": f"bad request frame: {exc}"})])
            continue
        if msg.kind == "close":
            busy.discard(identity)  # a hung request of this episode is answered to nobody
            envs.pop(identity, None)
            sock.send_multipart([identity, *encode(secret, "ok", {})])
            continue
        busy.add(identity)
        threading.Thread(target=work, args=(identity, msg.kind, dict(msg.meta)), daemon=True,
                         name=f"env-{msg.kind}").start()


def main() -> None:
    from pipeline.supervise import die_with_parent

    die_with_parent()
    if len(sys.argv) != 2 or SECRET_ENV not in os.environ:
        raise SystemExit(f"usage: {SECRET_ENV}=HEX python -m pipeline.envs.server ADDRESS")
    if os.environ.get(OWNER_ENV, str(os.getppid())) != str(os.getppid()):
        raise SystemExit("the process that started this environment process is gone")
    serve(sys.argv[1], bytes.fromhex(os.environ[SECRET_ENV]))


if __name__ == "__main__":
    main()
