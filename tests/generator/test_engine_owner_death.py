"""vLLM's engine processes die with their owner, however it dies (`pipeline/generator/owner_watch.py`).

The case measured under Slurm: a generator role owns a vLLM engine and runs under its task
supervisor (a child subreaper that would end the role's leftovers); both are SIGKILLed (Slurm's
KillWait), so nobody is left to end EngineCore and its worker. They must end by themselves within a
few seconds. Without the owner watch they live on, reparented to init (checked once: the engine test
then fails with both listed). Before that, a SIGTERM to the worker (as ``kill -TERM -PGID`` sends)
is ignored: only the owner ends its engine (`pipeline.generator.engine`). One tiny dense engine,
eager: ~50 s alone on 2 cores (`engine`).

Two cheap tests (~1 s each) check the watch's bounds with plain processes in vLLM's places: an
"engine core" child of the owner and a "worker" below it that imports our worker extension, as vLLM
does; and that a watch never ends a parent outside the owner's tree.
"""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from support.chaos import wait_for
from pipeline.supervise import alive


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
            json.dump({"owner": os.getpid(), "engine": descendants(os.getpid()),
                       "rpc": os.environ["VLLM_RPC_BASE_PATH"],
                       "post": (await gen.engine.collective_rpc("receive_post_address"))[0]}, f)
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


SLEEPER = "import time; time.sleep(120)"
WORKER = ("import sys, time, pipeline.generator.worker_extension\n"  # vLLM imports it in each worker
          "open(sys.argv[1], 'w').close()\ntime.sleep(120)")
SPAWN = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from pipeline.generator.owner_watch import OWNER_ENV, RPC_DIR_ENV, mark_owner

    mode, out, child_argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    if mode == "owner":
        mark_owner()
        open(os.path.join(os.environ[RPC_DIR_ENV], "socket"), "w").close()  # as vLLM binds one there
    env = dict(os.environ)
    if mode.startswith("token="):  # the child alone gets an owner's token
        env[OWNER_ENV] = mode[len("token="):]
    child = subprocess.Popen([sys.executable, *child_argv], env=env)
    with open(out + ".tmp", "w") as f:
        json.dump({"me": os.getpid(), "child": child.pid, "rpc": os.environ.get(RPC_DIR_ENV)}, f)
    os.replace(out + ".tmp", out)
    child.wait()
    time.sleep(120)  # outlives its child: only a kill ends it
""")


def _ignored(pid: int, sig: int) -> bool:
    """Whether process ``pid`` ignores ``sig`` (no handler, no default action)."""
    status = dict(line.split(":\t", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":\t" in line)
    return bool(int(status["SigIgn"], 16) >> (sig - 1) & 1)


def _kill_all(pids: list[int]) -> None:
    for p in pids:
        if alive(p):
            os.kill(p, signal.SIGKILL)


def test_the_watch_ends_the_worker_and_its_engine_core_parent_when_the_owner_is_sigkilled(tmp_path):
    """owner (mark_owner) -> core (inherits the token) -> worker (imports the extension)."""
    core_json, watching = tmp_path / "core.json", tmp_path / "watching"
    owner = subprocess.Popen([sys.executable, "-c", SPAWN, "owner", str(tmp_path / "owner.json"),
                              "-c", SPAWN, "core", str(core_json), "-c", WORKER, str(watching)])
    tree = [owner.pid]
    try:
        wait_for(watching.exists, 60, f"{watching} written")
        core = json.loads(core_json.read_text())
        tree += [core["me"], core["child"]]
        assert all(alive(p) for p in tree)
        rpc = Path(json.loads((tmp_path / "owner.json").read_text())["rpc"])
        assert core["rpc"] == str(rpc) and (rpc / "socket").exists()  # the engine's sockets: inherited place
        assert stat.S_IMODE(rpc.stat().st_mode) == 0o700 and rpc.stat().st_uid == os.getuid()
        owner.kill()
        owner.wait(timeout=10)
        wait_for(lambda: not any(alive(p) for p in tree[1:]), 10,
                 f"core {core['me']} and worker {core['child']} ended after the owner")
        assert not rpc.exists(), "the dead owner's socket directory was left behind"
    finally:
        _kill_all(tree)
        owner.wait(timeout=10)


def test_an_owner_keeps_its_socket_directory_until_released_and_a_user_chosen_one_untouched(
        tmp_path, monkeypatch):
    """`mark_owner` makes one private directory per owner for vLLM's sockets (a new one in a child
    that inherited its parent's), reuses it for a later engine, and `release_rpc_dir` removes it;
    a directory the user chose is used as it is and never removed; under a temp directory too deep
    for a socket's path it is made in /tmp."""
    from pipeline.generator.owner_watch import (KEEP_ENVIRON_ENV, OWNER_ENV, RPC_DIR_ENV, mark_owner,
                                                private_engine_temp, release_rpc_dir)

    monkeypatch.delenv(OWNER_ENV, raising=False)  # restored after the test, as RPC_DIR_ENV is
    monkeypatch.delenv(KEEP_ENVIRON_ENV, raising=False)
    parents = tmp_path / f"tf-engine-{os.getpid() + 1}-x"  # another owner's, inherited
    parents.mkdir()
    monkeypatch.setenv(RPC_DIR_ENV, str(parents))
    mark_owner()
    mine = Path(os.environ[RPC_DIR_ENV])
    assert mine != parents and mine.name.startswith(f"tf-engine-{os.getpid()}-")
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    mark_owner()  # a second engine of the same owner
    assert os.environ[RPC_DIR_ENV] == str(mine)
    monkeypatch.setenv("TMPDIR", "/var/tmp")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    with private_engine_temp():  # what the engine's processes inherit while it starts
        assert os.environ["TMPDIR"] == str(mine)
        inductor = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        assert inductor.startswith(os.path.join(tempfile.gettempdir(), "torchinductor_"))
        link = mine / os.path.basename(inductor)  # inductor's default place under the engine's TMPDIR
        assert link.is_symlink() and os.readlink(link) == inductor
    assert os.environ["TMPDIR"] == "/var/tmp" and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    release_rpc_dir()
    assert not mine.exists() and RPC_DIR_ENV not in os.environ and parents.is_dir()
    assert os.path.isdir(inductor)  # the link went with the directory, the cache stayed
    users = tmp_path / "sockets"
    users.mkdir()
    monkeypatch.setenv(RPC_DIR_ENV, str(users))
    mark_owner()
    with private_engine_temp():
        assert os.environ["TMPDIR"] == "/var/tmp"  # not ours: the engine's temp files stay where they were
    release_rpc_dir()
    assert os.environ[RPC_DIR_ENV] == str(users) and users.is_dir()
    monkeypatch.delenv(RPC_DIR_ENV)
    deep = tmp_path / ("d" * 80)  # its sockets' paths would pass a Unix socket address's 107 bytes
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    mark_owner()  # in /tmp instead
    fallback = Path(os.environ[RPC_DIR_ENV])
    assert fallback.parent == Path("/tmp") and not list(deep.iterdir())
    release_rpc_dir()
    assert not fallback.exists()


def test_the_watch_never_ends_a_parent_outside_the_owner_tree(tmp_path):
    """A worker whose parent does not carry the owner's token (say the engine core died first and a
    supervisor adopted the worker) ends only itself."""
    from pipeline.supervise import start_time

    owner = subprocess.Popen([sys.executable, "-c", SLEEPER])
    watching = tmp_path / "watching"
    stranger = subprocess.Popen([sys.executable, "-c", SPAWN, f"token={owner.pid}:{start_time(owner.pid)}",
                                 str(tmp_path / "stranger.json"), "-c", WORKER, str(watching)])
    try:
        wait_for(watching.exists, 60, f"{watching} written")
        worker = json.loads((tmp_path / "stranger.json").read_text())["child"]
        owner.kill()
        owner.wait(timeout=10)
        wait_for(lambda: not alive(worker), 10, "the watched worker ended after its owner")
        time.sleep(0.5)  # a wrong SIGKILL of the parent is sent before the worker's own: let it land
        assert stranger.poll() is None, "the watch ended a parent that does not carry the owner's token"
    finally:
        _kill_all([owner.pid, stranger.pid])
        owner.wait(timeout=10)
        stranger.wait(timeout=10)


@pytest.mark.engine
def test_engine_processes_end_when_their_owner_and_its_supervisor_are_sigkilled(tmp_path):
    from pipeline.models.tiny import ensure_tiny_model
    from pipeline.supervise import MARKER_ENV
    from support.leftovers import leftovers

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
        engine = pids["engine"]  # EngineCore (its worker inside), the owner's multiprocessing resource tracker
        titles = {p: open(f"/proc/{p}/cmdline").read().replace("\0", " ").strip() for p in engine}
        vllm = [t for t in titles.values() if "VLLM::" in t]
        assert len(vllm) == 1 and "VLLM::EngineCore" in vllm[0], \
            f"a one-rank CPU engine is one process, EngineCore running its worker: {titles}"
        rpc = Path(pids["rpc"])  # vLLM's sockets to EngineCore and its file store: in the owner's directory
        assert stat.S_IMODE(rpc.stat().st_mode) == 0o700 and any(stat.S_ISSOCK(p.stat().st_mode)
                                                                 for p in rpc.iterdir()), list(rpc.iterdir())
        assert any(p.name.startswith("vllm_dist_") for p in rpc.iterdir()), list(rpc.iterdir())
        assert pids["post"].startswith(f"ipc://{rpc}/"), pids["post"]  # the worker's temp dir is the engine's
        inductor = [p for p in rpc.iterdir() if p.name.startswith("torchinductor_")]  # its precompiled header:
        assert inductor and all(p.is_symlink() for p in inductor), inductor  # found in the shared cache
        for p in (p for p, t in titles.items() if "VLLM::" in t):  # a group's SIGTERM ends no worker
            os.kill(p, signal.SIGTERM)
            assert alive(p) and _ignored(p, signal.SIGTERM), f"{titles[p]} took a SIGTERM its owner did not send"
        os.kill(sup.pid, signal.SIGKILL)  # the subreaper that would have ended the role's leftovers
        os.kill(pids["owner"], signal.SIGKILL)
        sup.wait(timeout=10)
        t0 = time.monotonic()
        while any(alive(p) for p in engine) and time.monotonic() - t0 < 15:
            time.sleep(0.1)
        survivors = {p: titles[p] for p in engine if alive(p)}
        print(f"\nengine processes {titles} gone {time.monotonic() - t0:.1f} s after their owner's SIGKILL")
        assert not survivors, f"engine processes outlived their SIGKILLed owner by 15 s: {survivors}"
        assert not rpc.exists(), f"the dead owner's socket directory {rpc} was left behind"
        left = leftovers(os.environ[MARKER_ENV], wait_s=0.0)
        assert not left, f"processes of this test left behind: {left}"
    finally:
        for p in [sup.pid] + engine:  # a failed run must not leave a 2 GB engine behind
            if alive(p):
                os.kill(p, signal.SIGKILL)
        sup.wait(timeout=10)
