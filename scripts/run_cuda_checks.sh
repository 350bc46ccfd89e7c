#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one command that ends within a time budget (default 8 minutes): the CUDA tests
# against the float64 reference (tests/test_cuda.py), the compiled-decoding test and the fused DIFF V2 probe's
# (tests/test_fused_v2_decode.py), then the CUDA benchmark
# (bench/cuda_benchmark.py) with what time is left, then its table. Runs from a checkout without installing it
# (PYTHONPATH=src), under $PYTHON (default python3): torch with CUDA and the package's requirements must be there.
#
# Usage: bash scripts/run_cuda_checks.sh [--dry-run] [--budget SECONDS] OUT [benchmark options...]
#   OUT          folder for the logs and results (created; relative to the current directory); never bench/results,
#                which holds the results the docs cite.
#   --dry-run    the same steps on the CPU in about a minute: the benchmark on its tiny shape (CUDA tests skip
#                themselves without a GPU). Run it before spending GPU time.
#   --budget S   wall-clock seconds for everything (default 480).
#   benchmark options: --shapes, --figures, --models, --graph-models, --rounds, ... (python -m bench cuda_benchmark
#                --help).
# Writes OUT/cuda-device.txt, cuda-tests.log, memory.md (what one training layer keeps and peaks at, by kernel),
# cuda-bench.log, cuda.json (with the run's metadata) and cuda.md.
set -uo pipefail
usage="usage: bash scripts/run_cuda_checks.sh [--dry-run] [--budget SECONDS] OUT [benchmark options...]"
dry_run=()
budget=480
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=(--dry-run); shift ;;
        --budget)
            if ! [[ "${2:-}" =~ ^[0-9]+$ ]]; then
                echo "run_cuda_checks.sh: --budget needs whole seconds. $usage" >&2
                exit 2
            fi
            budget=$2; shift 2 ;;
        -*) echo "run_cuda_checks.sh: unknown option $1 before OUT. $usage" >&2; exit 2 ;;
        *) break ;;
    esac
done
if [ $# -lt 1 ]; then
    echo "run_cuda_checks.sh: the output folder OUT is missing. $usage" >&2
    exit 2
fi
started=$SECONDS
checkout="$(cd "$(dirname "$0")/.." && pwd)"
out="$(realpath -m -- "$1")"
shift
case "$out/" in
    "$checkout/bench/results/"*)
        echo "run_cuda_checks.sh: OUT is inside bench/results, which holds the cited results; give another folder" >&2
        exit 2 ;;
esac
mkdir -p "$out" || exit 2
cd "$checkout"
python=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"

{
    bash "$checkout/scripts/describe_cuda_device.sh" "$python"
} 2>&1 | tee "$out/cuda-device.txt"

# At most half the budget: a hang in the tests must not eat the benchmark's time.
tests=(tests/test_cuda.py tests/test_compiled_decoding.py tests/test_fused_v2_decode.py)
[ ${#dry_run[@]} -gt 0 ] && tests=(tests/test_cuda.py)  # skipped without CUDA; the compile test runs in the suite
timeout -k 10 $(( budget / 2 )) "$python" -m pytest "${tests[@]}" -q -p no:cacheprovider -rfEs 2>&1 \
    | tee "$out/cuda-tests.log"
tests_status=${PIPESTATUS[0]}

# Seconds: what one layer keeps for backward against its measured peak, per kernel, at the benchmark's 4,096 tokens;
# the gap between the two is what the count of saved tensors cannot explain of the training memory.
memory_args=(--device cuda --tokens 4096)
[ ${#dry_run[@]} -gt 0 ] && memory_args=(--device cpu --tokens 64)
timeout -k 10 60 "$python" -m bench saved_for_backward "${memory_args[@]}" > "$out/memory.md" 2>&1
memory_status=$?

# The benchmark gets what is left, less a margin for its last figure's overrun and the final write; the hard
# limit behind it still leaves every round written before it (results are saved after each round).
left=$(( budget - (SECONDS - started) - 30 ))
if [ "$left" -lt 30 ]; then
    echo "run_cuda_checks.sh: ${left} s left of the budget after the tests: the benchmark does not start" \
        | tee "$out/cuda-bench.log"
    bench_status=1
else
    timeout -k 10 $(( left + 20 )) "$python" -m bench cuda_benchmark "${dry_run[@]}" --max-seconds "$left" \
        --output "$out" --name cuda "$@" 2>&1 | tee "$out/cuda-bench.log"
    bench_status=${PIPESTATUS[0]}
fi

echo
echo "==== memory of one training layer (exit $memory_status):"
if [ "$memory_status" -eq 0 ]; then grep '^|' "$out/memory.md"; else tail -n 5 "$out/memory.md"; fi
echo "==== summary: $(tail -n 1 "$out/cuda-tests.log") (exit $tests_status); benchmark exit $bench_status;" \
    "$(( SECONDS - started )) s of $budget s; files in $out"
if [ -f "$out/cuda.md" ]; then
    awk '/^\| shape \|/ {show = 1} /^---$/ {show = 0} show' "$out/cuda.md"  # the table, targets and notes
else
    echo "no benchmark table: see $out/cuda-bench.log"
fi
exit $(( tests_status || bench_status ))
