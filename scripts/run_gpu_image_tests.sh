#!/usr/bin/env bash
# The GPU runs' code on this CPU, under the versions of the lent GPU machines' image, so that a scarce GPU minute is
# not lost to an API that only the newer torch or transformers of .venv has. The image (docs/development.md, "The
# checks on a GPU"): Python 3.12, torch 2.11.0, transformers 5.17.0, nothing installed from this repository (the GPU
# scripts run with PYTHONPATH=src) and no gguf (the retrieval payload carries its wheel).
#
#   bash scripts/run_gpu_image_tests.sh [pytest arguments]
#
# In its own virtual environment .venv-gpu-image (created when missing, with python3.12 where this machine has it,
# else python3; reused when present: a second run installs nothing), then:
# - scripts/run_cuda_checks.sh --dry-run: the GPU checks' tests and benchmark, on the CPU's tiny shape;
# - the tests of what those checks run on the GPU (compiled decoding and training, export, the kernels, DIFF V2, the op counts, the
#   benchmark's own), and the benchmark's Triton probe under Triton's interpreter (the image's torch brings Triton).
# Not through setup_env.sh, which installs this package and torch 2.13.0: the image has neither.
# PyPI's torch 2.11.0 is a CUDA build: the first run downloads about 3 GB of CUDA libraries, which load here without
# a GPU. The retrieval run's dry run (scripts/run_cuda_retrieval.sh --dry-run with a payload) can use the same venv:
# PYTHON=.venv-gpu-image/bin/python.
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
cd "$(dirname "$0")/.."
venv=.venv-gpu-image
# As `pip list` read them on the image (2026-11); torch's own CUDA dependencies come with it.
image_packages=(torch==2.11.0 transformers==5.17.0 accelerate==1.15.0 safetensors==0.8.0 huggingface_hub==1.33.0
                tokenizers==0.23.2 numpy==2.5.2 peft tqdm matplotlib pytest)
stamp="$venv/.gpu-image-setup"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "${image_packages[*]}" ]; then
    python=python3
    for candidate in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
        if "$candidate" -c "" 2>/dev/null; then python=$candidate; break; fi  # a pyenv shim may exist and refuse
    done
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
    rm -f "$stamp"
    "$venv/bin/python" -m pip install -q "${image_packages[@]}"
    echo "${image_packages[*]}" > "$stamp"
fi
"$venv/bin/python" -c 'import sys, torch, transformers
print(f"GPU image versions: Python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")'
export HF_HUB_OFFLINE=1 PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
out=outputs/gpu-image-dry-run
rm -rf "$out"
PYTHON="$venv/bin/python" bash scripts/run_cuda_checks.sh --dry-run "$out"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_compiled_decoding.py tests/test_kernels.py \
    tests/test_diff_v2.py tests/test_decode_op_counts.py tests/test_bench_cuda_benchmark.py \
    tests/test_fused_v2_decode.py tests/test_compile_and_export.py "$@"
