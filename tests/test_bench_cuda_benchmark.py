"""scripts/run_cuda_checks.sh and bench/cuda_benchmark.py run on a GPU lent for minutes: they must work the first time.
These run their code on the CPU: the script's dry run (the benchmark on its tiny shape, every figure and model), the
time budget, and the table's rules on samples made up to test them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import cuda_benchmark  # noqa: E402
import suite  # noqa: E402
from conftest import needs_fullgraph_compile  # noqa: E402

SCRIPT = REPO / "scripts" / "run_cuda_checks.sh"
EAGER_ROWS = ("train step (ms)", "prefill (ms)", "decode b1 eager (tokens/s)", "decode b2 eager (tokens/s)")
GRAPH_ROWS = ("decode b1 graphs (tokens/s)", "decode b2 graphs (tokens/s)")
# What a dry run on the CPU measures: every model but the Triton probe, which needs a GPU.
ON_CPU_COMPILED = cuda_benchmark.models_on("cpu", cuda_benchmark.COMPILE_ORDER)
UNCOMPILED_ON_CPU = set(cuda_benchmark.models_on("cpu", cuda_benchmark.MODELS)) - {
    *cuda_benchmark.TRAIN_ONLY_MODELS, *cuda_benchmark.GRAPHS_ONLY_MODELS}


def run_script(*args, cwd):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env={**os.environ, "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The script's dry run, OUT given relative to the caller's directory."""
    caller = tmp_path_factory.mktemp("caller")
    return run_script("--dry-run", "checks", cwd=caller), caller / "checks"


def table_rows(text: str, shape: str = "tiny") -> dict:
    """{figure: cells} of the table's rows of one shape."""
    rows = {}
    for line in text.splitlines():
        if line.startswith(f"| {shape} | "):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[cells[1]] = cells[2:]
    return rows


@needs_fullgraph_compile
def test_the_dry_run_measures_every_figure_of_every_model_and_ends_with_the_table(dry_run):
    result, out = dry_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = result.stdout[result.stdout.rindex("==== summary"):]
    assert "skipped" in summary and "benchmark exit 0" in summary and str(out) in summary
    rows = table_rows(summary)
    assert set(rows) == {*EAGER_ROWS, *GRAPH_ROWS, "train peak memory (GiB)"}
    # Columns: llama, llama 2x heads, diff-llama v2, diff-llama, diff-llama paired, then the four ratios to llama.
    for row in (*EAGER_ROWS, *GRAPH_ROWS):
        # The paired training kernel: the train step only.
        measured = [0, 1, 2, 3] + [4] * (row == "train step (ms)")
        assert [index for index, cell in enumerate(rows[row][:5]) if cell.endswith("n=2)")] == measured, row
        assert all(cell.endswith("x") or cell.endswith("unreadable") for cell in
                   (rows[row][5 + index - 1] for index in measured if index)), row
    assert rows["train peak memory (GiB)"][:5] == ["–"] * 5  # no allocator statistics on the CPU
    assert "Targets (issue 40):" in summary
    assert {path.name for path in out.iterdir()} >= {"cuda-device.txt", "cuda-tests.log", "memory.md",
                                                     "cuda-bench.log", "cuda.json", "cuda.md"}
    memory = result.stdout[result.stdout.index("==== memory"):result.stdout.index("==== summary")]
    assert "(exit 0)" in memory and "| version 1, generic |" in memory and "| diff v2 |" in memory


@needs_fullgraph_compile
def test_the_dry_runs_json_has_the_suites_metadata_and_one_compilation_per_compiled_step(dry_run):
    result, out = dry_run
    saved = json.loads((out / "cuda.json").read_text())
    meta = saved["meta"]
    assert meta["benchmark"] == "cuda_benchmark" and "--dry-run" in meta["command"]
    assert meta["versions"]["torch"] and meta["machine"]["cores"]
    assert saved["plan"]["max_seconds"] > 0  # the script passed the budget left after the tests
    figures = saved["shapes"]["tiny"]["figures"]
    for key in ("graphs b1", "graphs b2"):
        record = figures[key]
        assert record["errors"] == {} and record["left_out"] == []
        # Each model's step compiles once, in its first sample's warm-up, and never again.
        assert record["graphs_compiled"] == {name: [1, 0] for name in ON_CPU_COMPILED}
    # The markdown is the JSON's: rendered again, it is the same file.
    before = (out / "cuda.md").read_text()
    suite.render_file(out / "cuda.json", echo=False)
    assert (out / "cuda.md").read_text() == before


def test_the_script_refuses_a_missing_or_cited_output_folder_in_one_line(tmp_path):
    results = REPO / "bench" / "results"
    listing = sorted(results.iterdir())
    for args, problem in ((["--dry-run"], "the output folder OUT is missing"),
                          (["--dry-run", str(results / "new")], "OUT is inside bench/results"),
                          (["--budget", "soon", "x"], "--budget needs whole seconds"),
                          (["--rounds", "3", "x"], "unknown option --rounds before OUT")):
        result = run_script(*args, cwd=tmp_path)
        assert result.returncode == 2 and problem in result.stderr and len(result.stderr.splitlines()) == 1, args
    assert sorted(results.iterdir()) == listing and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("too_long", [
    dict(compile_estimate=86400),  # a compilation assumed to take a day
    dict(min_rounds=10**6),  # a compilation must leave time for a million rounds of the eager figures
])
def test_the_budget_leaves_out_what_would_not_fit_and_writes_what_was_measured(tmp_path, too_long):
    plan = cuda_benchmark.Plan.dry_run("cpu", figures=("eager", "graphs"), batches=(1,), max_seconds=300, **too_long)
    cuda_benchmark.run(plan, tmp_path, "budget")
    figures = json.loads((tmp_path / "budget.json").read_text())["shapes"]["tiny"]["figures"]
    assert set(figures["eager b1"]["samples"]) == UNCOMPILED_ON_CPU
    assert figures["graphs b1"]["samples"] == {} and figures["graphs b1"]["left_out"] == list(plan.graph_models)
    table = (tmp_path / "budget.md").read_text()
    assert "| tiny | decode b1 eager (tokens/s) |" in table and "graphs (tokens/s)" not in table
    assert ("tiny, graphs b1: left out for the time budget: llama, diff-llama v2, llama 2x heads, diff-llama."
            in table)
    # No time at all: nothing starts, and the file still says what was left out.
    cuda_benchmark.run(cuda_benchmark.Plan.dry_run("cpu", figures=("prefill",), max_seconds=0), tmp_path, "none")
    record = json.loads((tmp_path / "none.json").read_text())["shapes"]["tiny"]["figures"]["prefill"]
    assert record["samples"] == {} and set(record["left_out"]) == UNCOMPILED_ON_CPU


def made_up_results(figures: dict) -> dict:
    plan = cuda_benchmark.Plan(max_seconds=480)
    shape = {"rounds": 3, "build_seconds": 1.0, "figures": {}}
    for key, samples in figures.items():
        record = cuda_benchmark.new_record()
        record["samples"] = samples
        shape["figures"][key] = record
    return {"device": "test", "torch": "x", "plan": cuda_benchmark.dataclasses.asdict(plan), "command": "test",
            "shapes": {"llama-3.2-1b": shape}, "seconds": 400.0}


def column(values, label):
    return [{label: value} for value in values]


def test_a_ratio_inside_either_sides_spread_is_unreadable_and_the_targets_say_so(tmp_path):
    eager, graphs, memory = "decode b1 eager (tokens/s)", "decode b1 graphs (tokens/s)", "train peak memory (GiB)"
    results = made_up_results({
        "eager b1": {"llama": column([100, 102, 101], eager), "llama 2x heads": column([95, 96, 97], eager),
                     "diff-llama v2": column([90, 91, 92], eager), "diff-llama": column([99, 120, 100], eager)},
        "graphs b1": {"llama": column([200, 200, 200], graphs), "diff-llama v2": column([195, 196, 196], graphs),
                      "diff-llama v2 fused": column([180, 181, 182], graphs), "diff-llama": column([150], graphs)},
        "train": {"llama": column([5.0, 5.0], memory), "diff-llama": column([6.0, 6.0], memory),
                  "diff-llama paired": column([5.5, 5.5], memory)},
    })
    results["shapes"]["llama-3.2-1b"]["figures"]["graphs b1"]["errors"] = {"llama 2x heads": "RuntimeError: boom"}
    suite.write_result("cuda_benchmark", tmp_path / "t", results, cuda_benchmark.render, echo=False)
    table = (tmp_path / "t.md").read_text()
    rows = table_rows(table, "llama-3.2-1b")
    # 91/101 = 0.90x outside both spreads (1.02); 100/101 = 0.99x inside v1's 120/99; 95/101 inside nobody's.
    # Columns: llama, llama 2x heads, diff-llama v2, diff-llama v2 fused, diff-llama, diff-llama paired, then the
    # ratios of all but llama.
    assert rows[eager][6:] == ["0.95x", "0.90x", "–", "0.99x unreadable", "–"]
    assert rows[eager][0] == "101 (1.02, n=3)"
    assert rows[graphs] == ["200 (1.00, n=3)", "error", "196 (1.01, n=3)", "181 (1.01, n=3)", "150 (1.00, n=1)", "–",
                            "–", "0.98x", "0.91x", "0.75x unreadable", "–"]  # n = 1: no spread, so no reading
    assert rows[memory][9:] == ["1.20x", "1.10x"]
    assert "- llama-3.2-1b, decode b1 graphs (tokens/s): DIFF V2 0.98x of llama, target ≥ 0.95x: met" in table
    assert ("- llama-3.2-1b, decode b1 graphs (tokens/s): probe, DIFF V2 with λ, both maps and the subtraction in one "
            "kernel 0.91x of llama, ≥ 0.95x: not met") in table
    assert ("- llama-3.2-1b, decode b1 eager (tokens/s): DIFF V2 0.90x of llama, target ≥ llama 2x heads' 0.95x: "
            "not met") in table
    assert ("- llama-3.2-1b, train peak memory (GiB): version 1 (diff-llama) 1.20x of llama, target ≤ 1.15x: not met"
            in table)
    assert ("- llama-3.2-1b, train peak memory (GiB): version 1 (diff-llama paired) 1.10x of llama, target ≤ 1.15x: "
            "met") in table
    assert "llama-3.2-1b, graphs b1, llama 2x heads: error RuntimeError: boom" in table


def test_the_memory_probe_measures_each_paired_kernel_on_its_own_device_and_renders_the_peak():
    """bench/saved_for_backward.py, which the GPU run calls before its benchmark: the CUDA paired kernel is measured
    on CUDA only (and the CPU one on the CPU only), and a result with measured peaks gets their columns."""
    import saved_for_backward

    assert "version 1, paired_sdpa_cuda" in saved_for_backward.models_for("cuda:0")
    assert "version 1, paired_sdpa_cpu" not in saved_for_backward.models_for("cuda")
    assert "version 1, paired_sdpa_cuda" not in saved_for_backward.models_for("cpu")
    saved, memory = saved_for_backward.saved_storages(saved_for_backward.build("llama", 1), 8, "cpu")
    assert memory == {} and sum(entry["bytes"] for entry in saved) > 0
    entry = {"shape": [1], "dtype": "bfloat16", "bytes": 2**20}
    result = {"dtype": "bfloat16", "tokens": 8, "layers": 1, "device": "cuda",
              "models": {"llama": [entry], "diff v2": [entry, entry]},
              "memory": {"llama": {"after_forward": 2**20, "peak": 4 * 2**20},
                         "diff v2": {"after_forward": 2 * 2**20, "peak": 6 * 2**20}}}
    assert "| diff v2 | 2.00 | 2.000x | 2.00 | 6.00 | 1.500x |" in saved_for_backward.render(result)


@needs_fullgraph_compile
def test_eager_decoding_stops_at_its_rounds_and_the_graphs_targets_give_the_bound(tmp_path):
    """Eager decoding takes `eager_rounds` samples while the graphs figures take every round; the graphs targets read
    DIFF V2 against llama beside its bound, llama 2x heads."""
    plan = cuda_benchmark.Plan.dry_run("cpu", figures=("eager", "graphs"), batches=(1,), rounds=3, eager_rounds=2)
    cuda_benchmark.run(plan, tmp_path, "capped")
    figures = json.loads((tmp_path / "capped.json").read_text())["shapes"]["tiny"]["figures"]
    assert {name: len(samples) for name, samples in figures["eager b1"]["samples"].items()} == dict.fromkeys(
        UNCOMPILED_ON_CPU, 2)
    assert {name: len(samples) for name, samples in figures["graphs b1"]["samples"].items()} == dict.fromkeys(
        ON_CPU_COMPILED, 3)
    table = (tmp_path / "capped.md").read_text()
    assert "4 greedy steps timed" in table  # the dry run times as many eager steps as compiled ones
    (target,) = [line for line in table.splitlines() if line.startswith("- tiny, decode b1 graphs (tokens/s): DIFF V2")]
    assert "target ≥ 0.95x" in target and "(its bound, llama 2x heads: " in target


def test_a_models_first_eager_sample_decodes_its_timed_steps_once_untimed_first():
    """One slow early sample made every eager ratio of a GPU run unreadable: the first eager sample of a model runs
    its timed steps once before timing them; later samples and compiled steps do not."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    plan = cuda_benchmark.Plan.dry_run("cpu")
    model = LlamaForCausalLM(LlamaConfig(**cuda_benchmark.SHAPES["tiny"])).eval()
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    decoder = cuda_benchmark.Decoder(model, False, 1, plan)
    prompt = torch.randint(0, 256, (1, plan.prompt_tokens))
    first = [decoder.tokens_per_second(prompt, torch.device("cpu")), len(calls)]
    decoder.tokens_per_second(prompt, torch.device("cpu"))
    prefill = 1
    assert first[1] == prefill + plan.warmup_steps + 2 * plan.eager_decode_steps and first[0] > 0
    assert len(calls) - first[1] == prefill + plan.warmup_steps + plan.eager_decode_steps
