"""The ``tokenflow`` console command: one subcommand per user action, each imported on demand.

    tokenflow train [OVERRIDES...]                      train (no arguments: the built-in demo)
    tokenflow doctor [--probe] [OVERRIDES...]           what that run would use; its contradictions
                                                        (--probe: every task reaches every other)
    tokenflow plan --model M [--gpus N --gpu-memory 80GB --tokens T...]   trainer memory per rank; layouts that fit
    tokenflow replay LOG [OVERRIDES...]                 train from a recorded rollout log
    tokenflow inspect PATH [--plot OUT.png] [--json]   summarise (and plot) a rollout log
    tokenflow compare PATH... [--json|--csv] [--plot OUT.png]   runs / a sweep side by side
    tokenflow export RUN [--step K] [--out DIR]        a checkpoint as a Hugging Face directory
    tokenflow generators RUN --count N [OVERRIDES...]   add generators to a running run (own job)
    tokenflow orchestrate RUN_DIR                       serve a run's orchestrator (a role process)

Subcommands are thin: they parse arguments and call the module that does the work, so that
``tokenflow --help`` never imports torch, vLLM or megatron-core.
"""
from __future__ import annotations

import importlib
import os
import sys

#: subcommand -> (module with ``main(argv) -> int``, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("pipeline.apps.train", "train a policy (no arguments: the built-in CPU demo); Hydra overrides, -m sweeps"),
    "doctor": ("pipeline.apps.doctor", "what `tokenflow train` with the same overrides would use (GPUs, placement, "
               "engine, megatron, checkpoint); refuses contradictions, starts nothing"),
    "plan": ("pipeline.apps.plan", "trainer memory per rank (parameters, gradients, optimizer, activations, logits, "
             "peak) of a layout, or the layouts of N GPUs that fit, best first"),
    "replay": ("pipeline.apps.replay", "train from a recorded rollout log (off-policy, IS-corrected)"),
    "status": ("pipeline.apps.ops.status", "a run's components and Slurm states, step, versions, buffer, last error; --json"),
    "compare": ("pipeline.apps.ops.compare", "runs or a sweep side by side: differing overrides, accuracy, reward, "
                "state; --json, --csv, --plot"),
    "cancel": ("pipeline.apps.ops.cancel", "stop every component of a run (scancel or local processes)"),
    "inspect": ("pipeline.apps.inspect_log", "summarise a rollout log: counts, rewards, staleness; --plot, --json"),
    "export": ("pipeline.apps.export", "write a run's checkpoint as a Hugging Face directory (RUN [--step K])"),
    "generators": ("pipeline.apps.generators", "add generators to a running run from their own job (RUN --count N "
                   "[cluster=slurm] [cluster.generator.*=...]); they leave on scancel / SIGTERM"),
    "orchestrate": ("pipeline.apps.orchestrator", "run the orchestrator of RUN_DIR (role process)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: tokenflow COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "tokenflow COMMAND --help shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    os.umask(0o077)  # every file a command and the processes it starts create is private to the user
    if name not in COMMANDS:
        print(f"tokenflow: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
