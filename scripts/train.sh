#!/usr/bin/env bash
# Set up (or update) .venv and run `tokenflow train` (no arguments: the built-in CPU demo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
exec .venv/bin/tokenflow train "$@"
