#!/usr/bin/env bash
# The tests marked `sglang` (tests/test_sglang.py): DIFF V2 served by SGLang through its Transformers backend, as
# remote code, against transformers' own generate. They run in their own virtual environment, .venv-sglang (created
# when missing, reused when present), because SGLang pins its own torch and transformers:
#
#   bash scripts/run_sglang_tests.sh [pytest arguments]
#
# What setup_env.sh installs there, beyond what every venv gets (the real SmolLM2's GGUF):
# - torch==2.14.1 first, which sglang 0.5.23 pins: a CUDA build (on this project's machines it lies on disk; elsewhere
#   pip downloads it, gigabytes), whose CUDA libraries load without a GPU;
# - sglang==0.5.23 with this package and its test dependencies, resolved together: SGLang pins transformers 5.19.0,
#   inside this package's range; torchvision 0.29.1 is the release built for torch 2.14.1 (SGLang imports it).
# SGLang then runs on the CPU with the attention written in torch (tests/test_sglang.py says with which options).
# A second run installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-sglang
if ! bash scripts/setup_env.sh "$venv" test --torch 2.14.1 --with sglang==0.5.23 --with torchvision==0.29.1; then
    echo "run_sglang_tests.sh: could not install sglang==0.5.23 here ($(uname -sm)); see docs/serving.md" >&2
    exit 1
fi
export HF_HUB_OFFLINE=1
"$venv/bin/python" -c 'import sglang, torch, transformers
print(f"sglang {sglang.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, tests marked sglang")'
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m sglang "$@"
