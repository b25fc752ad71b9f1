"""The doctor's checks of how weights travel and on which network (registered after `checks`).

- weights: the channel and backend (gloo on CPU, NCCL on GPU), the receive mode the generators
  will use (`pipeline.generator.vllm_args.resolve_weight_sync`, for the plan's platform) and the
  deadline of every weight-group call; refuses a staged receive over NCCL beside an engine's own
  TP collectives (docs/weight-sync.md, "No communicator deadlock");
- network: the address every listener binds and publishes (`pipeline.launch.network`) and the
  variables exported to every task; on this node the address must be one a socket can listen on
  and reach. Whether every node of a Slurm run reaches it is what ``tokenflow doctor --probe``
  checks (`pipeline.apps.doctor`: the run's job with every role replaced by the probe).

Example (``cluster.network.address=127.0.0.2`` on this CPU machine)::

    [weights] broadcast over gloo, streamed/staged receive: staged, every call bounded by 120 s
    [network] listeners bind and publish 127.0.0.2 (cluster.network.address); exported: TOKENFLOW_NETWORK_ADDRESS=127.0.0.2
    [network] this node listens on 127.0.0.2 and reaches it
"""
from __future__ import annotations

import socket

from pipeline.doctor.registry import Run, check
from pipeline.launch.gpus import gpus_per_task
from pipeline.launch.network import listen_address, network_env


@check("weights")
def weights(run: Run) -> None:
    from pipeline.generator.vllm_args import resolve_weight_sync

    cfg, plan = run.cfg, run.plan
    if "generator" not in plan.components:
        return
    gpu = plan.components["trainer"].gpus_per_node > 0
    engine_gpu = gpus_per_task(plan.components["generator"]) > 0
    g = cfg.generator
    mode = resolve_weight_sync(g, "cuda" if engine_gpu else "cpu")
    backend = "CUDA IPC" if g.weight_channel == "cuda_ipc" else ("NCCL" if gpu else "gloo")
    run.uses(f"{g.weight_channel} over {backend}, {mode} receive, every weight-group call bounded by "
             f"{g.weight_timeout_s:g} s")
    if backend == "NCCL" and mode == "staged" and g.tensor_parallel_size > 1:
        run.refuse(f"generator.weight_sync=staged over NCCL with tensor_parallel_size="
                   f"{g.tensor_parallel_size}: the staged receive's NCCL broadcasts would run beside the "
                   f"engine's TP collectives on the same GPUs, which nothing orders (a deadlock risk not "
                   f"shown safe: docs/weight-sync.md); use weight_sync=streamed or auto")


@check("network")
def network(run: Run) -> None:
    c = run.cfg.cluster
    net = c.network
    fallback = "127.0.0.1" if c.launcher == "local" else "each node's name"
    chosen = "cluster.network.address" if net.address else "cluster.network.interface" if net.interface else None
    try:
        address = listen_address(net, fallback)
    except RuntimeError as exc:  # TransportError: the interface has no IPv4 address here
        run.refuse(f"cluster.network.interface={net.interface}: {exc}")
        return
    env = network_env(net)
    exported = ", ".join(f"{k}={v}" for k, v in env.items()) or "nothing (NCCL and gloo choose for themselves)"
    run.uses(f"listeners bind and publish {address}{f' ({chosen})' if chosen else ''}; exported: {exported}")
    if chosen is None or (c.launcher == "slurm" and not net.address):
        return  # nothing chosen, or an interface each node resolves for itself (`--probe` checks them)
    problem = reach(address)
    if problem:
        run.refuse(f"{chosen}: {problem}")
    else:
        run.uses(f"this node listens on {address} and reaches it")


def reach(address: str, timeout_s: float = 5.0) -> str | None:
    """None when a socket can listen on ``address`` and a connection to it succeeds; else why not."""
    try:
        with socket.create_server((address, 0)) as server:
            with socket.create_connection(server.getsockname()[:2], timeout=timeout_s):
                return None
    except OSError as exc:
        return f"cannot listen on and reach {address} from this node ({exc})"
