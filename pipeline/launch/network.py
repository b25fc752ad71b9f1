"""The network a run's tasks reach each other on: chosen in ``cluster.network``, not guessed.

`NetworkConfig` names the interface (or one address) every listener of the run binds and
publishes: the weight group's store (`pipeline.roles.weight_push`), the gloo groups of the weight
channel (`pipeline.weights.guarded_groups`), the trainer's process-group master and the
orchestrator's socket (unless ``orchestrator.transport`` names its own). `network_env` is exported
to every task of every launch, locally and on Slurm (``JobPlan.env``: `pipeline.apps.train`,
`pipeline.launch.generator_jobs`), so NCCL and gloo pick the same network in every process,
vLLM's workers included; `tokenflow doctor` checks it (`pipeline.doctor.network_checks`).

Worked example: ``cluster.network.interface=ib0 cluster.network.ib_hca=mlx5_0,mlx5_1
cluster.network.nccl_env='{NCCL_IB_GID_INDEX: "3"}'`` exports NCCL_SOCKET_IFNAME=ib0,
GLOO_SOCKET_IFNAME=ib0, NCCL_IB_HCA=mlx5_0,mlx5_1 and NCCL_IB_GID_INDEX=3 (RoCE v2) to every task;
trainer rank 0 publishes the weight store at ib0's IPv4 address. ``cluster.network.address=127.0.0.2``
(one node: the test cluster) makes every listener bind 127.0.0.2 and exports
TOKENFLOW_NETWORK_ADDRESS=127.0.0.2 and VLLM_HOST_IP=127.0.0.2: an interface variable cannot name
one address of an interface, so `bind_gloo_groups` (the trainer role, vLLM's workers) makes every
gloo group a process creates listen there (tests/apps/test_slurm_network.py reads each listener of
a Slurm run from its processes).
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from pipeline.weights.guarded_groups import ADDRESS_ENV

_INTERFACE = re.compile(r"^[=^]?[A-Za-z0-9_.:-]{1,15}(,[A-Za-z0-9_.:-]{1,15})*$")
_NCCL_NAME = re.compile(r"^(TORCH_)?NCCL_[A-Z0-9_]+$")


@dataclass
class NetworkConfig:
    """Which network the run's tasks use to reach each other (docs/weight-sync.md, "The network")."""

    interface: Optional[str] = None
    """Network interface (ib0, eth0, ...) whose IPv4 address every listener binds and publishes;
    exported as NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME. None: loopback locally, the node's
    name on Slurm, NCCL and gloo choose for themselves."""
    address: Optional[str] = None
    """One IPv4 address every listener binds and publishes instead of the interface's (a run on
    one node, e.g. 127.0.0.2; every node of a Slurm run must own it, so only a one-node run)."""
    ib_hca: Optional[str] = None
    """NCCL_IB_HCA: the InfiniBand / RoCE adapters NCCL uses (e.g. "mlx5_0,mlx5_1", "=mlx5_0")."""
    nccl_env: Dict[str, str] = field(default_factory=dict)
    """Further NCCL variables exported to every task as given (e.g. NCCL_IB_GID_INDEX: "3" for
    RoCE v2, NCCL_NET_GDR_LEVEL, NCCL_DEBUG: INFO); names must start with NCCL_ or TORCH_NCCL_."""


def problems(net: NetworkConfig) -> List[str]:
    """What is wrong with ``net`` as written (no node needed), each naming its field."""
    found = []
    if net.interface is not None and not _INTERFACE.match(net.interface):
        found.append(f"cluster.network.interface={net.interface!r} is not an interface name (or NCCL's "
                     f"comma list of them)")
    if net.address is not None:
        try:
            ipaddress.IPv4Address(net.address)
        except ValueError:
            found.append(f"cluster.network.address={net.address!r} is not an IPv4 address")
    for name, value in net.nccl_env.items():
        if not _NCCL_NAME.match(str(name)):
            found.append(f"cluster.network.nccl_env: {name!r} is not an NCCL variable (NCCL_* or TORCH_NCCL_*)")
        elif any(c in str(value) for c in "\n\r\x00"):
            found.append(f"cluster.network.nccl_env: {name}'s value holds a control character")
    return found


def network_env(net: NetworkConfig) -> Dict[str, str]:
    """The variables every task of the run gets (see the module docstring)."""
    env: Dict[str, str] = {}
    if net.interface:
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = net.interface
    if net.address:
        env[ADDRESS_ENV] = env["VLLM_HOST_IP"] = net.address
    if net.ib_hca:
        env["NCCL_IB_HCA"] = net.ib_hca
    env.update({str(k): str(v) for k, v in net.nccl_env.items()})
    return env


def listen_address(net: NetworkConfig, fallback: str) -> str:
    """The address this node's listeners bind and publish: ``net.address``, else the first
    interface's IPv4 address, else ``fallback`` (loopback locally, the node's name on Slurm)."""
    if net.address:
        return net.address
    if net.interface:
        from pipeline.protocol.transport import interface_address

        return interface_address(net.interface.lstrip("=^").split(",")[0])
    return fallback


def bind_gloo_groups() -> None:
    """Make every gloo group this process creates from now on listen on TOKENFLOW_NETWORK_ADDRESS
    (``cluster.network.address``) where it is set; nothing changes where it is not.

    torch's ``init_process_group`` and ``new_group`` (megatron's groups, vLLM's) build gloo's
    default device, bound to GLOO_SOCKET_IFNAME's first address or else the host name's: neither
    can name 127.0.0.2 on ``lo``. They construct the class ``distributed_c10d.ProcessGroupGloo``,
    so that name is given a subclass that passes a device bound to the address."""
    address = os.environ.get(ADDRESS_ENV)
    if not address:
        return
    import torch.distributed.distributed_c10d as c10d

    gloo = c10d.ProcessGroupGloo
    if getattr(gloo, "bound_address", None) == address:
        return

    class ProcessGroupGlooOnAddress(gloo):
        bound_address = address

        def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta) -> None:
            options = gloo._Options()
            options._timeout = timeout
            options._devices = [gloo.create_device(hostname=address)]
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = ProcessGroupGlooOnAddress
