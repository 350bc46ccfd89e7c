#!/usr/bin/env bash
# Installs diff-llama and what it needs into the current Python environment.
# torch==2.13.0 comes first: it is the CPU build on this machine's disk, and any unpinned torch requirement
# would otherwise pull gigabytes of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
"$PYTHON" -m pip install --quiet --disable-pip-version-check -e ".[test]"
