#!/usr/bin/env bash
# Set up (or update) .venv and run the test suite, one test at a time, slowest 40 listed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
exec .venv/bin/python -m pytest --durations=40 "$@"
