"""Launching a run: a JobPlan of components (roles) started locally or as one Slurm heterogeneous job.

Light to import (no torch/vllm). See plan.py (what to launch), task.py (what runs in each task),
rendezvous.py (how roles find each other), local.py / slurm.py (where it runs), slurm_checks.py
(what the cluster can give), batch.py (the steps of slurm/train.sbatch, for jobs submitted by hand),
generator_jobs.py (generators joining a running run from their own job).
"""
from pipeline.launch.base import Launcher, Run, TaskFailed
from pipeline.launch.local import LocalLauncher
from pipeline.launch.plan import ComponentSpec, JobPlan, LaunchError
from pipeline.launch.slurm import SlurmLauncher, SlurmRun
from pipeline.launch.rendezvous import Rendezvous, RendezvousTimeout, free_port, mpi_broadcast, under_mpi
from pipeline.launch.task import TaskInfo

__all__ = ["ComponentSpec", "JobPlan", "LaunchError", "Launcher", "LocalLauncher", "Rendezvous", "RendezvousTimeout",
           "Run", "SlurmLauncher", "SlurmRun", "TaskFailed", "TaskInfo", "free_port", "mpi_broadcast", "under_mpi"]
