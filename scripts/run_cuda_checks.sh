#!/usr/bin/env bash
# The checks that need a CUDA GPU, for a machine that has one (CI and the 2-core machines skip them): the CUDA tests
# against the float64 reference (tests/test_cuda.py), then the CUDA benchmark (bench/cuda_benchmark.py).
# Needs torch with CUDA and the package's requirements; runs from a checkout without installing it (PYTHONPATH=src).
# Usage: bash scripts/run_cuda_checks.sh [OUTPUT_DIR] [benchmark options...]
# OUTPUT_DIR: absolute, or relative to the checkout (default bench/results). Benchmark options: --rounds, --shapes,
# --figures, --models, --prompt-tokens, --name (bench/cuda_benchmark.py --help).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results}
shift || true
mkdir -p "$out"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/cuda-device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$out/cuda-device.txt"
python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider -rfs 2>&1 | tee "$out/cuda-tests.log"
tests=${PIPESTATUS[0]}
python3 bench/cuda_benchmark.py --output "$out" "$@" 2>&1 | tee "$out/cuda-bench.log"
bench=${PIPESTATUS[0]}
echo "tests exit $tests, benchmark exit $bench"
exit $(( tests || bench ))
