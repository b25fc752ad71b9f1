"""`pipeline.launch.network.bind_gloo_groups`: gloo groups created after it listen on
``cluster.network.address``, which no interface variable can name (127.0.0.2 on ``lo``)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from pipeline.launch.network import NetworkConfig, network_env
from support.child_env import child_env

# One process (bind_gloo_groups changes torch for the rest of the process): the default group is
# built before the binding (gloo's default device: the host name's address), a megatron-style
# subgroup after it; the listeners each added, as (address, port) lists.
GROUPS = textwrap.dedent("""
    import json, psutil, torch, torch.distributed as dist
    from pipeline.launch.network import bind_gloo_groups
    from pipeline.launch.rendezvous import listen_on, open_store
    import datetime
    def listening():
        return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN"}
    listener = listen_on("127.0.0.2")
    store = open_store("127.0.0.2", listener.getsockname()[1], 1, True, datetime.timedelta(seconds=30), listener)
    before = listening()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    unbound = listening() - before
    bind_gloo_groups()
    group = dist.new_group([0], backend="gloo")
    value = torch.ones(1)
    dist.all_reduce(value, group=group)
    bound = listening() - before - unbound
    dist.destroy_process_group()
    print(json.dumps({"unbound": sorted(unbound), "bound": sorted(bound), "sum": float(value)}))
""")


def test_gloo_groups_created_after_binding_listen_on_the_address_only():
    env = network_env(NetworkConfig(address="127.0.0.2"))
    assert env["TOKENFLOW_NETWORK_ADDRESS"] == env["VLLM_HOST_IP"] == "127.0.0.2"
    out = subprocess.run([sys.executable, "-c", GROUPS], capture_output=True, text=True, timeout=120,
                         env=child_env(**env))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["sum"] == 1.0
    # torch's own choice (the reference): the host name's address, not the configured one
    assert got["unbound"] and {a for a, _ in got["unbound"]} != {"127.0.0.2"}, got
    assert got["bound"] and {a for a, _ in got["bound"]} == {"127.0.0.2"}, got


def test_without_an_address_nothing_changes(monkeypatch):
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from pipeline.launch.network import bind_gloo_groups

    monkeypatch.delenv("TOKENFLOW_NETWORK_ADDRESS", raising=False)
    bind_gloo_groups()
    assert c10d.ProcessGroupGloo is dist.ProcessGroupGloo
