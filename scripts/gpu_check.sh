#!/usr/bin/env bash
# The one prepared GPU check: at most 5.5 minutes on one H100/H200 (Python 3.12, a CUDA torch,
# transformers; no package registry, no vLLM). Runs the sections of scripts/gpu_check.py one
# process each, each under its own time limit, merging its result into the JSON file as soon as it
# ends, so a timeout still returns what ran.
#   bash scripts/gpu_check.sh [JSON]        (default: $OUT/gpu_check.json, else ./gpu_check.json)
# Packages the machine lacks come from .gpu-wheels/ (made here by scripts/gpu_wheels.sh, carried
# along): installed offline, no dependencies resolved. Exit status: 0 all sections ok, 1 some
# failed or timed out, 3 no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
JSON=${1:-${OUT:-.}/gpu_check.json}
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "^GPU "; }; then
  echo "gpu_check: no NVIDIA GPU on this machine (nvidia-smi lists none): nothing to check" >&2
  exit 3
fi
if [ -d .gpu-wheels ] && ! "$PY" -c "import megatron.core, msgpack" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps .gpu-wheels/*.whl 2>&1 | tail -3
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
rm -f "$JSON"
status=0
# section:seconds (sum 315 s, the scratch models built once in /tmp/tokenflow-gpu-check)
for entry in environment:20 megatron_bf16:70 checkpoint:50 cuda_ipc:45 optimizer_offload:30 throughput:100; do
  section=${entry%%:*}; limit=${entry##*:}
  echo "[gpu_check] $section (at most ${limit}s)"
  timeout -k 5 "$limit" "$PY" scripts/gpu_check.py --section "$section" --json "$JSON"
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    "$PY" - "$JSON" "$section" "$limit" <<'PYEOF'
import json, os, sys
path, section, limit = sys.argv[1:]
data = json.load(open(path)) if os.path.exists(path) else {}
data[section] = {"ok": False, "error": f"timed out after {limit} s"}
json.dump(data, open(path, "w"), indent=1)
PYEOF
  fi
  [ "$rc" -eq 3 ] && exit 3
  [ "$rc" -eq 0 ] || status=1
done
echo "[gpu_check] results in $JSON"
cat "$JSON"
exit $status
