#!/usr/bin/env bash
# The README's first command: set everything up, then run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1
"${PYTHON:-python3}" -m diff_llama.cli demo --output outputs/demo-model "$@"
