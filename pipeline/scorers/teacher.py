"""The teacher: a vLLM engine on a frozen checkpoint that scores given completions.

For a sample with prompt ``p`` and completion ``c``, the teacher's logprob of completion token
``c[j]`` is the engine's prompt logprob at position ``len(p) + j`` of the sequence ``p + c``
(vLLM ``prompt_logprobs``: the log-softmax of the raw logits, temperature 1, at the actual next
token). One engine request per sample, ``max_tokens=1``; the one generated token is discarded.

Invariants:
- ``teacher_logprobs`` has one finite float32 per completion token, in the batch's token order;
- prefix caching is off (cached prefixes would come back without prompt logprobs) and, on CPU,
  prefills are never chunked (`pipeline.generator.engine` has the reason);
- the teacher and the policy share a tokenizer: completion token ids are scored as they are;
- a lagged teacher (`use_version`) holds one policy snapshot at a time in its engine: version 0
  is the checkpoint it started from, version N > 0 the snapshot its `WeightFollower` received over
  the weight channel (``source`` "channel"), or, for a version broadcast before this process was
  a member of the weight group (it restarted, started late or the run resumed), the trainer's
  checkpoint ``RUN/checkpoints/step-N`` (``source`` "checkpoint"; its ``model-r*.safetensors``);
  either is loaded in place through the generator's worker extension. Asked for a version older
  than the one it holds (a request queued across a refresh), it keeps the newer one, which lies
  in the window too. ``version`` is the snapshot the last answer was computed with.

Worked example: prompt ``[5, 9]``, completion ``[4, 2]``: the request is ``[5, 9, 4, 2]``; prompt
logprobs come back as ``[None, lp(9|5), lp(4|5 9), lp(2|5 9 4)]`` and the teacher logprobs are
the last two.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from pipeline.protocol.sample_batch import SampleBatch

#: Tokens per engine step on CPU (every prompt prefilled whole).
_CPU_BATCHED_TOKENS = 8192


class TeacherScorer:
    """``SampleBatch -> {"teacher_logprobs": float32[completion tokens]}`` with a vLLM engine."""

    fills = ("teacher_logprobs",)

    def __init__(self, checkpoint: str | Path, run_dir: str | Path | None = None,
                 max_model_len: int | None = None, kv_cache_gib: int = 1, dtype: str = "float32",
                 snapshot_wait_s: float = 120.0):
        """``max_model_len``: longest prompt + completion scored (None: min(the checkpoint's
        max_position_embeddings, 4096))."""
        from transformers import AutoConfig
        from vllm import LLM
        from vllm.platforms import current_platform

        if max_model_len is None:
            max_model_len = min(int(AutoConfig.from_pretrained(str(checkpoint)).max_position_embeddings), 4096)

        extra = {}
        if current_platform.is_cpu():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
            extra = {"enable_chunked_prefill": False,
                     "max_num_batched_tokens": max(max_model_len, _CPU_BATCHED_TOKENS)}
        from pipeline.generator.vllm_args import EXTENSION
        from pipeline.generator.owner_watch import mark_owner, private_engine_temp

        self.max_model_len = max_model_len
        self.checkpoint, self.run_dir, self.snapshot_wait_s = Path(checkpoint), run_dir, snapshot_wait_s
        self.version = 0
        self.follower = None  # a lagged teacher's WeightFollower (set by the role)
        self.refreshes: dict[str, int] = {"channel": 0, "checkpoint": 0, "initial": 0}
        mark_owner()  # the engine's processes end when this one dies, SIGKILL included
        with private_engine_temp():  # their temp files go with the engine's socket directory
            self.llm = LLM(model=str(checkpoint), dtype=dtype, max_model_len=max_model_len, enforce_eager=True,
                           enable_prefix_caching=False, seed=0, disable_log_stats=True,
                           worker_extension_cls=EXTENSION, **extra)

    def use_version(self, version: int) -> int:
        """Hold policy snapshot ``version`` (load it unless held; a newer one held is kept);
        returns the version held."""
        if 0 <= version <= self.version:
            return self.version
        snap = self.follower.take(version) if self.follower is not None and version > 0 else None
        if snap is not None:
            self._load_tensors(snap)
            source = "channel"
        elif version == 0:
            self._load_files([self.checkpoint])
            source = "initial"
        else:
            self._load_files(self._checkpoint_files(version))
            source = "checkpoint"
        self.version = version
        self.refreshes[source] += 1
        return version

    def _checkpoint_files(self, version: int) -> list[Path]:
        from pipeline.run_files import CHECKPOINTS_DIR, checkpoint_name

        if self.run_dir is None:
            raise ValueError("a lagged teacher needs the run directory")
        snap = Path(self.run_dir) / CHECKPOINTS_DIR / checkpoint_name(version)
        deadline = time.monotonic() + self.snapshot_wait_s
        while not (snap / "COMPLETE").exists():  # written last, after every shard
            if time.monotonic() > deadline:
                raise FileNotFoundError(f"policy version {version} was not received over the weight "
                                        f"channel and {snap} is not complete after {self.snapshot_wait_s:.0f}s")
            time.sleep(0.2)
        return sorted(snap.glob("model-r*.safetensors"))

    def _load_files(self, files: list[Path]) -> None:
        self.version = -1  # a failed load leaves mixed weights: held version unknown
        for f in files:
            self.llm.collective_rpc("load_weights_from_safetensors", args=(str(f),))

    def _load_tensors(self, named: dict) -> None:
        """Load a received snapshot: written to a private safetensors file in host memory
        (/dev/shm where there is one), loaded like a checkpoint shard, removed."""
        import shutil
        import tempfile

        from safetensors.torch import save_file

        where = tempfile.mkdtemp(prefix="tokenflow-teacher-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            path = Path(where) / "snapshot.safetensors"
            save_file({k: t.contiguous() for k, t in named.items()}, str(path))
            self._load_files([path])
        finally:
            shutil.rmtree(where, ignore_errors=True)

    def close(self) -> None:
        """The role is ending: its engine's socket directory goes now (`owner_watch`; the engine's
        processes end with the role's process tree, which leaves through ``os._exit``)."""
        from pipeline.generator.owner_watch import release_rpc_dir

        release_rpc_dir()

    def __call__(self, batch: SampleBatch) -> dict[str, np.ndarray]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts, plens = [], []
        for i in range(len(batch)):
            p, c = batch.prompt(i), batch.tokens("completion_ids", i)
            if len(p) + len(c) >= self.max_model_len:
                raise ValueError(f"sample {i}: {len(p) + len(c)} tokens exceed the teacher's "
                                 f"max_model_len {self.max_model_len}")
            prompts.append(TokensPrompt(prompt_token_ids=np.concatenate([p, c]).astype(int).tolist()))
            plens.append(len(p))
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        parts = []
        for out, plen, prompt in zip(outs, plens, prompts):
            ids = prompt["prompt_token_ids"]
            parts.append(np.array([out.prompt_logprobs[k][ids[k]].logprob for k in range(plen, len(ids))],
                                  np.float32))
        lp = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        if not np.isfinite(lp).all():
            raise ValueError("the teacher returned a non-finite logprob")
        return {"teacher_logprobs": lp}
