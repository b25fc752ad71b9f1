#!/usr/bin/env bash
# Download the cp312 manylinux wheels scripts/gpu_check.sh needs on a GPU machine without a
# package registry (it has Python 3.12, a CUDA torch and transformers; the check imports the
# trainer, the weight channels and tests/support, which need megatron-core and msgpack beyond
# those: no ZeroMQ, Hydra or h5py) into .gpu-wheels/
# (ignored by git; carried to the machine; at most 64 MiB in all). Run where PyPI is reachable.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.gpu-wheels
mkdir -p "$DIR"
python3 -m pip download -q --only-binary :all: --no-deps --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --implementation cp -d "$DIR" \
  "megatron-core==0.16.1" "msgpack>=1.0,<2"
du -sh "$DIR"
size=$(du -sm "$DIR" | cut -f1)
[ "$size" -le 64 ] || { echo "gpu_wheels: $DIR is ${size} MiB, more than one call carries (64)" >&2; exit 1; }
