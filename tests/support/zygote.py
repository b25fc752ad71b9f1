"""A preloaded process that forks workers: one import of torch and megatron-core for many processes.

A harness that starts many processes of the same code (the trainer ranks and receivers of
`support.layout_check`) pays their imports again in each: ~6 CPU s for torch and megatron-core on
the 2-core CI machine, most of a tiny model's rank. ``Zygote(preload, ...)`` starts one process
that imports the modules ``preload`` names once and then forks one worker per `Zygote.start`
request; the worker calls ``module:function(**kwargs)``. Nine layout-check processes: one import
of ~6 CPU s instead of nine (bench/results/2026-12-06-smoke.md, "Session 5").

Invariants:
- requests and replies are JSON lines over the zygote's stdin and stdout (no pickle); the zygote
  answers every request with one line, in order, and writes nothing else there (what the imports
  print goes to its stderr);
- the zygote forks only while it is one thread (checked before every fork, which refuses
  otherwise: a fork copies no other thread, and a lock one held stays held in the worker). It only
  imports: torch's intra-op pool and gloo are started by the workers, each its own;
- a worker dies with the zygote and the zygote with the thread that started it (PR_SET_PDEATHSIG,
  SIGKILL); when its stdin closes the zygote kills its workers and exits;
- a worker's stdout and stderr go to its own file; its exit status is what a process running the
  function would have: 0 when it returned, 1 when it raised (the traceback in its file), -N when
  signal N killed it (as `subprocess.Popen.returncode`); the worker exits as a process does
  (``sys.exit``: at-exit handlers run).
"""
from __future__ import annotations

import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent

TRAINER_PRELOAD = ["torch", "megatron.core.parallel_state", "megatron.core.tensor_parallel",
                   "megatron.core.distributed", "megatron.core.pipeline_parallel.schedules", "megatron.core.models.gpt",
                   "megatron.core.models.gpt.gpt_layer_specs", "megatron_patches", "pipeline.trainer.engine",
                   "pipeline.trainer.model", "pipeline.trainer.lora", "pipeline.trainer.conversion",
                   "pipeline.trainer.grouped_experts", "pipeline.trainer.layout", "pipeline.weights.shards",
                   "transformers"]
"""What a megatron-core `Trainer` rank imports (~6 CPU s, most of a tiny model's rank): a zygote's
``preload`` for harnesses of trainer ranks (with `TRAINER_ENV`: torch reads ``OMP_NUM_THREADS`` when
imported)."""
TRAINER_ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
"""The environment a zygote of trainer ranks adds: one OpenMP thread per rank, warnings off."""


class Zygote:
    """The parent's end: start workers, wait for them, kill them. Thread-safe (one request at a time)."""

    def __init__(self, preload: list[str], log: Path, env: dict[str, str] | None = None, timeout_s: float = 300.0):
        """Start the zygote: it imports ``preload`` with ``env`` added to this process's environment,
        its stderr to ``log``."""
        from pipeline.supervise import die_with_parent

        self.timeout_s = timeout_s  # the longest a request may take (the first: the imports)
        self.exited: dict[int, int] = {}  # pid -> exit status of every worker that ended
        self._lock = threading.Lock()
        self._ready = False  # read with the first request: the caller goes on while the zygote imports
        with open(log, "w") as err:
            self._proc = subprocess.Popen([sys.executable, __file__, *preload], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=err, env={**os.environ, **(env or {})}, text=True,
                                          preexec_fn=lambda: die_with_parent(signal.SIGKILL))

    @property
    def pid(self) -> int:
        """The zygote's process id (its workers' parent)."""
        return self._proc.pid

    def _reply(self) -> dict:
        ready, _, _ = select.select([self._proc.stdout], [], [], self.timeout_s)
        line = self._proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"the zygote (pid {self._proc.pid}) did not answer within {self.timeout_s:.0f} s "
                               f"(exit status {self._proc.poll()}; its stderr file says why)")
        return json.loads(line)

    def _ask(self, **request) -> dict:
        with self._lock:
            if not self._ready:
                self._ready = self._reply()["ready"]  # the imports are done
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            return self._reply()

    def start(self, target: str, kwargs: dict, log: Path, env: dict[str, str] | None = None) -> int:
        """Fork a worker that runs ``target`` ('module:function') with ``kwargs``, its output to ``log``,
        ``env`` added to its environment; its pid."""
        reply = self._ask(op="start", target=target, kwargs=kwargs, log=str(log), env=env or {})
        if "error" in reply:
            raise RuntimeError(f"the zygote refused to start {target}: {reply['error']}")
        return reply["pid"]

    def wait(self, pids: list[int], timeout_s: float) -> dict[int, int]:
        """pid -> exit status once every one of ``pids`` ended; TimeoutError naming those left after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.exited.update({int(pid): rc for pid, rc in self._ask(op="poll")["exited"].items()})
            left = [pid for pid in pids if pid not in self.exited]
            if not left:
                return {pid: self.exited[pid] for pid in pids}
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers {left} did not end within {timeout_s:.0f} s")
            time.sleep(0.05)

    def kill(self, pid: int) -> None:
        """SIGKILL to worker ``pid`` unless it ended."""
        self._ask(op="kill", pid=pid)

    def kill_left(self, pids: list[int]) -> None:
        """SIGKILL to those of ``pids`` that have not ended (a harness's clean-up after a failure)."""
        for pid in pids:
            if pid not in self.exited:
                self.kill(pid)

    def close(self) -> None:
        """End the zygote and every worker it still has."""
        if self._proc.poll() is None:
            self._proc.stdin.close()  # the zygote kills its workers and exits
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc.stdout.close()

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _serve(preload: list[str]) -> dict | None:
    """The zygote: import ``preload``, then answer requests; returns a worker's request in the worker,
    None in the zygote once its stdin closed."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the imports print goes to stderr, not into the replies
    for name in preload:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # the imports' objects stay out of the workers' collections (fewer copied pages)
    workers: set[int] = set()
    exited: dict[int, int] = {}

    def reply(**fields) -> None:
        replies.write(json.dumps(fields) + "\n")
        replies.flush()

    reply(ready=True, pid=os.getpid())
    for line in sys.stdin:
        request = json.loads(line)
        for pid in list(workers):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                workers.discard(pid)
                exited[pid] = os.waitstatus_to_exitcode(status)
        if request["op"] == "start":
            if _threads() != 1:
                reply(error=f"the zygote has {_threads()} threads; it forks only with one")
                continue
            zygote = os.getpid()
            pid = os.fork()
            if pid == 0:
                replies.close()
                return {**request, "zygote": zygote}
            workers.add(pid)
            reply(pid=pid)
        elif request["op"] == "poll":
            reply(exited=exited)
        elif request["op"] == "kill":
            if request["pid"] in workers:
                os.kill(request["pid"], signal.SIGKILL)
            reply()
    for pid in workers:  # the parent closed our stdin (or died)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return None


def _work(request: dict) -> int:
    """In a forked worker: die with the zygote, output to the request's file, run the function."""
    import traceback

    from pipeline.supervise import die_with_parent

    die_with_parent(signal.SIGKILL)
    if os.getppid() != request["zygote"]:  # it died before the prctl (die_with_parent saw our new parent)
        os.kill(os.getpid(), signal.SIGKILL)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(os.devnull)
    os.environ.update(request["env"])
    module, function = request["target"].split(":")
    try:
        getattr(importlib.import_module(module), function)(**request["kwargs"])
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.path[0:1] = [str(REPO), str(TESTS)]  # the package and the tests' helpers, not this script's folder
    job = _serve(sys.argv[1:])
    sys.exit(0 if job is None else _work(job))
