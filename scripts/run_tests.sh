#!/usr/bin/env bash
# The README's second command: set up .venv (see setup_env.sh), then run the test suite with its Python.
# By default the slow tests (the real SmolLM2-135M, a few minutes) are left out; `--slow` runs everything.
set -euo pipefail
cd "$(dirname "$0")/.."
# transformers as setup.cfg's `serving` extra bounds it: the server `diff-llama serve` extends, which its tests start
bash scripts/setup_env.sh .venv test --with "transformers>=5.25,<6"
export HF_HUB_OFFLINE=1
marker=(-m "not slow")
if [ "${1:-}" = "--slow" ]; then
    marker=()
    shift
fi
# One worker per core (pytest-xdist), each test file on one worker so that its module fixtures are made once; pass
# -n 0 to run in this process (a debugger, or reading one test's output).
.venv/bin/python -m pytest -q -p no:cacheprovider -n auto --dist loadfile "${marker[@]}" "$@"
