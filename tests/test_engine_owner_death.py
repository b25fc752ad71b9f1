"""vLLM's engine processes die with their owner, however it dies (`pipeline/generator/owner_watch.py`).

The case measured under Slurm: a generator role owns a vLLM engine and runs under its task
supervisor (a child subreaper that would end the role's leftovers); both are SIGKILLed (Slurm's
KillWait), so nobody is left to end EngineCore and its worker. They must end by themselves within a
few seconds. Without the owner watch they live on, reparented to init (checked once: the test then
fails with both listed). One tiny dense engine, eager: ~40 s alone on 2 cores.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.engine

OWNER = textwrap.dedent("""
    import asyncio, json, os, sys

    async def main():
        from pipeline.generator.config import GeneratorConfig
        from pipeline.generator.engine import Generator
        from pipeline.supervise import descendants

        cfg = GeneratorConfig(model=sys.argv[1], max_model_len=128, max_tokens=8, enforce_eager=True,
                              dtype="float32", kv_cache_gib=1, max_num_seqs=4, seed=0)
        gen = await Generator(cfg).start()
        done = await gen.complete([0, 17, 30, 41], lambda segment: 7)
        assert len(done.token_ids) == 8, done.token_ids
        with open(sys.argv[2] + ".tmp", "w") as f:
            json.dump({"owner": os.getpid(), "engine": descendants(os.getpid())}, f)
        os.replace(sys.argv[2] + ".tmp", sys.argv[2])
        await asyncio.sleep(600)

    if __name__ == "__main__":
        asyncio.run(main())
""")

SUPERVISOR = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from pipeline.launch.supervisor import TaskSupervisor

    if __name__ == "__main__":
        argv = [sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]]
        sys.exit(TaskSupervisor(argv, os.environ, Path(sys.argv[4]), max_restarts=0, optional=False,
                                stop_grace_s=5, requeue=None, wait_for_requeue=False).run(()))
""")


def _alive(pid: int) -> bool:
    from pipeline.supervise import alive

    return alive(pid)


def test_engine_processes_end_when_their_owner_and_its_supervisor_are_sigkilled(tmp_path):
    from pipeline.models.tiny import ensure_tiny_model
    from pipeline.supervise import MARKER_ENV, leftovers

    model = ensure_tiny_model("dense")
    pids_file = tmp_path / "pids.json"
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR, OWNER, str(model), str(pids_file),
                            str(tmp_path / "result.json")])
    engine: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not pids_file.exists():
            assert sup.poll() is None, f"the supervisor exited ({sup.returncode}) before the engine was up"
            assert time.monotonic() < deadline, "the owner's engine did not start within 300 s"
            time.sleep(0.5)
        pids = json.loads(pids_file.read_text())
        engine = pids["engine"]  # EngineCore, its worker, the owner's multiprocessing resource tracker
        titles = {p: open(f"/proc/{p}/cmdline").read().replace("\0", " ").strip() for p in engine}
        assert sum("VLLM::" in t for t in titles.values()) >= 2, f"no EngineCore and worker under the owner: {titles}"
        os.kill(sup.pid, signal.SIGKILL)  # the subreaper that would have ended the role's leftovers
        os.kill(pids["owner"], signal.SIGKILL)
        sup.wait(timeout=10)
        t0 = time.monotonic()
        while any(_alive(p) for p in engine) and time.monotonic() - t0 < 15:
            time.sleep(0.1)
        survivors = {p: titles[p] for p in engine if _alive(p)}
        print(f"\nengine processes {titles} gone {time.monotonic() - t0:.1f} s after their owner's SIGKILL")
        assert not survivors, f"engine processes outlived their SIGKILLed owner by 15 s: {survivors}"
        left = leftovers(os.environ[MARKER_ENV], wait_s=0.0)
        assert not left, f"processes of this test left behind: {left}"
    finally:
        for p in [sup.pid] + engine:  # a failed run must not leave a 2 GB engine behind
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        sup.wait(timeout=10)
