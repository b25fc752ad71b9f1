"""What a test prints when a run it started is not done in time.

CI keeps only the beginning and the end of a long failure text, so the report puts the facts that
name the culprit first and keeps every part short: the command's own last words, which tasks wrote
no result yet, what slurmctld logged about the run's jobs (submission, start, completion: where the
time went), the processes still running for the run (state, kernel wait channel, age, command),
Slurm's queue, and only then each log's first lines (when its task started) and last lines, those
of the tasks without a result first.

Example (a run whose trainer rank 0 never returned):
    no result yet: trainer.0 (results of generator.0, trainer.1, trainer.2, trainer.3)
    pid 8123 S hrtimer_nanosleep 612s python -u -m pipeline.apps.launch_task /tmp/.../run 0
    ...
"""
from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path


def _processes_of(run: Path) -> list[str]:
    """One line per live process whose command line names `run`, and each of their descendants."""
    from pipeline.supervise import _pids, _stat, descendants, start_time, wait_channel

    def cmdline(pid: int) -> str:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")

    tick = os.sysconf("SC_CLK_TCK")
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    roots = []
    for pid in _pids():
        try:
            if str(run) in cmdline(pid):
                roots.append(pid)
        except OSError:
            continue
    me = {os.getpid(), os.getppid()}  # this report's own process names `run` too
    pids = [p for p in dict.fromkeys(p for r in roots for p in [r, *descendants(r)]) if p not in me]
    lines = []
    for pid in pids:
        st, started = _stat(pid), start_time(pid)
        try:
            cmd = cmdline(pid)
        except OSError:
            continue
        wchan = wait_channel(pid)
        if st is None or started is None:
            continue
        lines.append(f"pid {pid} ppid {st[0]} {st[1]} {wchan} {uptime - started / tick:.0f}s {cmd[:160]}")
    return lines


def _slurmctld_lines(run: Path) -> list[str]:
    """slurmctld's log lines about the Slurm jobs of `run` (ids from submitit's ``N_submission.sh``)."""
    jobs = {p.name.split("_")[0] for p in (run / "submitit").glob("*_submission.sh")}
    if not jobs:
        return []
    try:
        config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout
        path = Path(next(line.split("=", 1)[1].strip() for line in config.splitlines()
                         if line.startswith("SlurmctldLogFile")))
        text = path.read_text(errors="replace")
    except (OSError, subprocess.TimeoutExpired, StopIteration) as e:
        return [f"slurmctld log not readable: {e}"]
    pattern = re.compile(r"JobId=(%s)\b" % "|".join(sorted(jobs)))
    return [line[:200] for line in text.splitlines() if pattern.search(line)][-12:]


def stuck_run_report(run: Path | None, output: str = "", log_lines: int = 8) -> str:
    """The report (see the module docstring) for run directory `run` (None: the queue only);
    `output`: what the command printed (its last lines come first)."""
    parts = ["command's last lines: " + "\n".join(output.splitlines()[-6:])] if output else []
    if run is not None and run.exists():
        logs = sorted((run / "logs").glob("*.out")) if (run / "logs").exists() else []
        tasks = [log.name[:-len(".out")] for log in logs if log.name.count(".") == 2]  # role.rank.out
        done = {p.stem for p in (run / "results").glob("*.json")} if (run / "results").exists() else set()
        missing = [t for t in tasks if t not in done]
        parts.append(f"no result yet: {', '.join(missing) or 'none'} (results of {', '.join(sorted(done)) or 'none'})"
                     f" at {time.strftime('%H:%M:%S')}")
        parts += _slurmctld_lines(run)
        parts += _processes_of(run) or ["no process of the run is left on this machine"]
    for cmd in (["squeue", "-o", "%i %T %M %R %j"], ["sinfo", "-N", "-h", "-o", "%N %T %E"]):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.splitlines()
            parts.append("\n".join(dict.fromkeys(out)))  # sinfo -N: a node once per partition
        except (OSError, subprocess.TimeoutExpired) as e:
            parts.append(f"{cmd[0]}: {e}")
    if run is not None and (run / "logs").exists():
        logs = sorted((run / "logs").glob("*"), key=lambda p: (p.name[:-len(".out")] not in missing, p.name))
        for log in logs:
            lines = log.read_text(errors="replace").splitlines()
            shown = lines if len(lines) <= log_lines + 2 else [*lines[:2], "...", *lines[-log_lines:]]
            parts.append(f"--- {log.name}\n" + "\n".join(line[:240] for line in shown))
    return "\n".join(parts)
