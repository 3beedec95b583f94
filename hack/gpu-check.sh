#!/usr/bin/env bash
# Builds, tests and benchmarks every GPU path in one short run (< 6 minutes) on a CUDA machine.
#
# It needs torch, cupy-cuda13x, numba, safetensors, rich, typer, pytest and hypothesis there (the
# [gpu] and [test] extras). On a machine without a package index, bring the two small wheels
# that a CUDA image often lacks in .whl/ (git-ignored), made where there is one:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     constriction==0.5.0 zstandard==0.25.0
# then copy the checkout with .whl/ to the CUDA machine and run `bash hack/gpu-check.sh` there.
# Results go to $OUT (default gpu-out/).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/runtime${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__, torch.cuda.get_device_name())"
# GPU tests (tests/test_gpu.py): byte-identical deltas from CUDA inputs, device hash == CPU hash,
# in-place apply into fused CUDA views; and the CPU codec tests beside them
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_roundtrip.py tests/test_layout.py 2>&1 \
  | tee "$OUT/gpu-tests.log"
# the vLLM engine's in-place GPU route, where the device has vLLM (it cannot be carried: too big)
if python3 -c "import vllm" 2>/dev/null; then
  python3 -m pytest -q -p no:cacheprovider tests/engine_vllm -k "not run_with" 2>&1 | tee "$OUT/vllm-gpu-tests.log"
else
  echo "vllm is not installed on this device: the vLLM engine's GPU route is not verified" | tee "$OUT/vllm-gpu-tests.log"
fi
# benchmark: 2^30 bf16 elements (2 GiB per state)
python3 hack/bench_gpu.py --out "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.log"
# the sharded trainer's GPU route: FSDP2 over NCCL, CUDA shards diffed by CuPy, one rank per GPU
# (this device may have one), against the same run's memcpy
python3 hack/bench_shard.py --ranks "$(python3 -c 'import torch; print(",".join(str(n) for n in (1, 2) if n <= torch.cuda.device_count()))')" \
  --json "$OUT/bench_shard_gpu.json" 2>&1 | tee "$OUT/bench_shard_gpu.log"
