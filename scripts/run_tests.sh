#!/usr/bin/env bash
# The README's second command: set everything up, then run the test suite (slow tests excluded).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1
"${PYTHON:-python3}" -m pytest -q -m "not slow" -p no:cacheprovider "$@"
