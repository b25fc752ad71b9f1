"""An engine worker that is in a weight group ends within `EXIT_DEADLINE_S` of a stop signal.

Why: a worker's weight-group sockets (gloo, NCCL) stay open until its process ends, and the
trainer's broadcast into the group completes only once every receiver has posted its receive. A
planned departure (scancel, preemption, ``kill -TERM`` of a task's process group) sends SIGTERM to
every process of the task, the engine's worker included. vLLM's worker answers it by raising
SystemExit and shutting down, but that shutdown does not always finish: in the local generator-job
test the leaving worker, in the middle of a load when the signal came, lived 6.2 s more while the
trainer's broadcast of the next version, begun just before the `Leave` reached the orchestrator,
waited for it (docs/generator-jobs.md, "Leaving"); a process with a gloo broadcast pending on a
daemon thread of its own (torch 2.13) was still alive 20 s after its SystemExit, and
`ProcessGroupGloo.abort()` or ``shutdown()`` did not change that. vLLM ends a worker that does not
exit only after its 5 s grace and 4 s more.

How: `bound_exit_after_stop_signal` replaces the SIGTERM handler by one that first arms a one-shot
timer (``setitimer``) whose SIGALRM keeps its default action, and then calls the handler it
replaced (vLLM's). The kernel ends the process when the timer fires, whatever its shutdown is doing
(no Python code runs then, so a blocked finalisation cannot delay it). Its sockets close, the
trainer's broadcast fails, and the trainer retries the version in a group without it
(`pipeline.roles.weight_push`). Measured with the pending broadcast above and a 0.2 s timer: the
process ended 0.21 s after SIGTERM, and the sender's broadcast failed 0.09 s later ("Connection
closed by peer"). The kernel closes a dying process's sockets only after it has freed its memory,
which for an engine worker (gigabytes, on a shared core) takes a while: in local run 20
(docs/generator-jobs.md) the trainer's broadcast failed 0.44 s after a 0.2 s timer fired. A
worker's own teardown (vLLM, torch) takes longer than the deadline, so the timer is what ends it
in practice, and vLLM's engine core logs the worker's death as unexpected
(``exit code: -14``): that is this deadline, on a departure. (Shutting the worker's TCP connections
down at the signal, to tell the peers before the memory is freed, made gloo abort the process.)

Invariants:
- installed at most once per process, from its main thread (where Python runs signal handlers; a
  worker's ``collective_rpc`` methods run there);
- the previous disposition of SIGTERM still applies: a handler is called, the default ends the
  process, an ignored signal stays ignored and arms no timer;
- nothing else in an engine worker uses SIGALRM or the real-time interval timer.
"""
from __future__ import annotations

import os
import signal
import threading

EXIT_DEADLINE_S = 0.05
"""Seconds from SIGTERM to the end of the worker, however its shutdown goes: what a departure that
raced the trainer's push may cost it, besides the kernel's teardown and the rebuild (one train
step is 0.2 s on the local test machine)."""


def bound_exit_after_stop_signal(deadline_s: float = EXIT_DEADLINE_S) -> bool:
    """Install the bounded exit in this process; False if it was installed already, SIGTERM is
    ignored here, or this is not the main thread (Python's signal rule: vLLM's shutdown alone applies)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    previous = signal.getsignal(signal.SIGTERM)
    if getattr(previous, "tokenflow_exit_deadline", False) or previous == signal.SIG_IGN:
        return False

    def on_stop_signal(signum, frame):
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, deadline_s)
        if callable(previous):
            previous(signum, frame)
        else:  # the default disposition (or one set outside Python): end as it would have
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    on_stop_signal.tokenflow_exit_deadline = True
    signal.signal(signal.SIGTERM, on_stop_signal)
    return True
