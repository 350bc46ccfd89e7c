#!/usr/bin/env bash
# The README's second command: set everything up, then run the test suite.
# By default the slow tests (the real SmolLM2-135M, a few minutes) are left out; `--slow` runs everything.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1
marker=(-m "not slow")
if [ "${1:-}" = "--slow" ]; then
    marker=()
    shift
fi
"${PYTHON:-python3}" -m pytest -q -p no:cacheprovider "${marker[@]}" "$@"
