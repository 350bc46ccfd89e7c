#!/usr/bin/env bash
# The tests marked `oldest_transformers` on the oldest transformers that setup.cfg declares (the floor of its
# `transformers>=X,<Y` line), in their own virtual environment .venv-oldest (set up by setup_env.sh: created when
# missing, reused when present, a second run installs nothing). The full suite runs on the newest version in .venv
# (run_tests.sh); this proves the other end of the range: what serving engines that pin older transformers (vLLM)
# get, and what a saved model's remote code meets there.
#
#   bash scripts/run_oldest_transformers_tests.sh [pytest arguments]
#
# The selection covers the model against the float64 reference, cached generation against uncached (static cache
# included), saving, loading and remote code in a process without the package, the DIFF V2 conversion of the real
# SmolLM2 and a Trainer and a LoRA step.
set -euo pipefail
cd "$(dirname "$0")/.."
oldest="$(sed -n 's/^[[:space:]]*transformers>=\([0-9][0-9.]*\),.*/\1/p' setup.cfg)"
if [ -z "$oldest" ]; then
    echo "run_oldest_transformers_tests.sh: no 'transformers>=X,<Y' line in setup.cfg" >&2
    exit 2
fi
venv=.venv-oldest
# The package with its test dependencies, transformers pinned to the floor (the resolver picks what fits it).
bash scripts/setup_env.sh "$venv" test --transformers "$oldest"
installed="$("$venv/bin/python" -c 'import transformers; print(transformers.__version__)')"
if [ "$installed" != "$oldest" ]; then
    echo "run_oldest_transformers_tests.sh: $venv has transformers $installed, not the declared floor $oldest" >&2
    exit 1
fi
export HF_HUB_OFFLINE=1
echo "transformers $installed (the oldest setup.cfg declares), tests marked oldest_transformers"
"$venv/bin/python" -m pytest -q -p no:cacheprovider -n auto --dist loadfile -m oldest_transformers "$@"  # as run_tests.sh
