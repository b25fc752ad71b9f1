"""``python -m pipeline.apps.launch_task RUN_DIR LAUNCH_INDEX``: run one task of a launched plan (see task.py).

The entry LocalLauncher and slurm/train.sbatch start in every task (under srun the task's global
rank is SLURM_PROCID, locally TOKENFLOW_GLOBAL_RANK); submitit's tasks call the same `run_task`.
The dispatcher is imported under the main guard only: a child that multiprocessing spawns from a
task (vLLM's EngineCore) re-imports this module as ``__mp_main__`` and needs none of it.
"""

if __name__ == "__main__":
    from pipeline.launch.task import main

    main()
