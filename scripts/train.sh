#!/usr/bin/env bash
# Set up (or update) .venv and run `tokenflow train` (no arguments: the built-in demo; on a GPU node
# the GPU build, trainer and generator on their own GPUs, or sharing the only one).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
exec .venv/bin/tokenflow train "$@"
