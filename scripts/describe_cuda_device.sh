#!/usr/bin/env bash
# What a GPU run ran on, for the head of its results: the GPU (or that there is none), and the Python, torch and
# transformers versions of PYTHON. Called by run_cuda_checks.sh and run_cuda_retrieval.sh.
#
#   bash scripts/describe_cuda_device.sh PYTHON
python=${1:?usage: bash scripts/describe_cuda_device.sh PYTHON}
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
else
    echo "no nvidia-smi: no CUDA device"
fi
"$python" -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__,
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
