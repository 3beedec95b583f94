#!/usr/bin/env bash
# The GPU check: builds, tests and benchmarks every GPU path in one run of under 6 minutes, on a
# CUDA machine's own python3, where nothing can be installed or fetched (docs/gpu.md).
#
#   bash hack/gpu-check.sh --prepare   # here, with a package index: .whl/ gets the wheels that the
#                                      # GPU machine's image lacks (hack/gpu-wheels.txt)
#   bash hack/gpu-check.sh             # there, with .whl/ carried: one line per part, results in
#                                      # $OUT (default gpu-out/)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --prepare ]; then
  exec python3 hack/gpu_wheels.py prepare .whl
fi
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
python3 hack/gpu_wheels.py install .whl "$site"
export PYTHONPATH="$site:$PWD/runtime${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 hack/gpu_check.py "$@"
