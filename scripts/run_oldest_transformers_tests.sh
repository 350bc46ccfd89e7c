#!/usr/bin/env bash
# The tests marked `oldest_transformers` on the oldest transformers and torch that setup.cfg declares (the floors of
# its `transformers>=X,<Y` and `torch>=X,<Y` lines), in their own virtual environment .venv-oldest (set up by
# setup_env.sh: created when missing, reused when present, a second run installs nothing). The full suite runs on the
# newest versions in .venv (run_tests.sh); this proves the other end of the range: what serving engines that pin
# older transformers (vLLM) get, what a saved model's remote code meets there, and what a user whose torch is as old
# as we declare gets. PyPI's torch for the floor is a CUDA build (about 3 GB, downloaded once per venv); it runs here
# without a GPU. Python is python3 (not the 3.10 floor: transformers before 5.23 reads no GGUF file on 3.10).
#
#   bash scripts/run_oldest_transformers_tests.sh [pytest arguments]
#
# The selection covers the model against the float64 reference, cached generation against uncached (static cache
# included), the training kernels against the generic path, saving, loading and remote code in a process without the
# package, the DIFF V2 conversion of the real SmolLM2 and a Trainer and a LoRA step.
set -euo pipefail
cd "$(dirname "$0")/.."
# The floor in the package's own install_requires (an extra may ask for a later version, as `serving` does).
floor() { sed -n "/^install_requires =/,/^[^[:space:]]/ s/^[[:space:]]*$1>=\([0-9][0-9.]*\),.*/\1/p" setup.cfg; }
transformers_floor="$(floor transformers)"
torch_floor="$(floor torch)"
if [ -z "$transformers_floor" ] || [ -z "$torch_floor" ]; then
    echo "run_oldest_transformers_tests.sh: setup.cfg needs 'transformers>=X,<Y' and 'torch>=X,<Y' lines" >&2
    exit 2
fi
venv=.venv-oldest
# The package with its test dependencies, transformers and torch pinned to their floors (the resolver picks the rest).
bash scripts/setup_env.sh "$venv" test --transformers "$transformers_floor" --torch "$torch_floor"
read -r python_installed torch_installed transformers_installed < <("$venv/bin/python" -c '
import sys, torch, transformers
print(sys.version.split()[0], torch.__version__.split("+")[0], transformers.__version__)')
at_floor() {  # NAME INSTALLED FLOOR: torch's floor "2.6" is its release 2.6.0
    if [ "$2" != "$3" ] && [ "$2" != "$3.0" ]; then
        echo "run_oldest_transformers_tests.sh: $venv has $1 $2, not the declared floor $3" >&2
        exit 1
    fi
}
at_floor transformers "$transformers_installed" "$transformers_floor"
at_floor torch "$torch_installed" "$torch_floor"
export HF_HUB_OFFLINE=1
echo "torch $torch_installed and transformers $transformers_installed (the oldest setup.cfg declares), Python" \
     "$python_installed, tests marked oldest_transformers"
"$venv/bin/python" -m pytest -q -p no:cacheprovider -n auto --dist loadfile -m oldest_transformers "$@"  # as run_tests.sh
