"""bench/ as a suite: the registry behind `python -m bench`, the metadata every result records, and markdown
rendered from the result's JSON (bench/suite.py). Real files in tmp_path."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import suite  # noqa: E402

NOT_BENCHMARKS = {"__init__", "__main__", "suite", "fused_v2_decode"}  # the last: cuda_benchmark's Triton probe
RETIRED = {"v2_fused_probe", "kernel_profile", "calibration_cost"}  # answered one-off probes, code and results in git
RESULTS = BENCH / "results"
# One current result per benchmark and machine; earlier ones live in git and the journals (bench/results/README.md).
MAX_RESULT_FILES = 48  # grows with the benchmarks, a few files each: serve_load and vllm_startup came in at 41


def test_every_script_is_registered_with_a_description_and_defines_main_and_render():
    scripts = {path.stem for path in BENCH.glob("*.py")} - NOT_BENCHMARKS
    assert scripts == set(suite.BENCHMARKS)
    assert not RETIRED & scripts
    for name, description in suite.BENCHMARKS.items():
        assert description and "\n" not in description
        defined = {node.name for node in ast.parse((BENCH / f"{name}.py").read_text()).body
                   if isinstance(node, ast.FunctionDef)}
        assert {"main", "render"} <= defined, name
        source = (BENCH / f"{name}.py").read_text()
        assert "suite.write_result(" in source, f"{name} writes its results some other way"
        # no result .md or .json written beside the shared writer (a scratch file in the work folder is fine)
        assert not re.search(r'(\.md"\)|"\.md"\)|results.*\.json"\))\.write_text', source), name


def result_files() -> list[Path]:
    return sorted(path for path in RESULTS.rglob("*") if path.is_file())


def test_every_result_json_carries_the_metadata_block_the_suite_writes():
    written_now = suite.metadata("model_benchmark")
    jsons = [path for path in result_files() if path.suffix == ".json"]
    assert jsons
    for path in jsons:
        result = json.loads(path.read_text())
        meta = result.get("meta") if isinstance(result, dict) else None
        assert isinstance(meta, dict), f"{path.name} has no meta block (see bench/suite.py)"
        assert set(written_now) <= set(meta), f"{path.name} lacks {set(written_now) - set(meta)}"
        assert set(written_now["machine"]) <= set(meta["machine"]), path.name
        assert set(written_now["versions"]) <= set(meta["versions"]), path.name
        assert meta["benchmark"] in suite.BENCHMARKS and meta["command"] and meta["date"].startswith("20"), path.name
        assert meta["machine"]["cpu"] or meta["machine"]["gpu"], f"{path.name} names no machine"
        if "recorded_afterwards" not in meta:  # written by the suite, which knows every version
            assert all(meta["versions"][name] for name in ("torch", "transformers", "diff-llama")), path.name


def test_bench_results_holds_a_few_indexed_results_and_no_logs():
    files = result_files()
    assert len(files) <= MAX_RESULT_FILES, (
        f"bench/results holds {len(files)} files (at most {MAX_RESULT_FILES}): a new run replaces the result it "
        "supersedes, which git keeps")
    strays = [path.name for path in files if path.suffix not in {".json", ".md", ".png"}]
    assert not strays, f"logs and scratch files go under outputs/, not bench/results: {strays}"
    index = (RESULTS / "README.md").read_text()
    unindexed = [path.relative_to(RESULTS).as_posix() for path in files if path.name != "README.md"
                 and f"({path.relative_to(RESULTS).as_posix()})" not in index]
    assert not unindexed, f"not in bench/results/README.md: {unindexed}"


def test_list_names_every_benchmark_with_its_description():
    out = subprocess.run([sys.executable, "-m", "bench", "list"], cwd=BENCH.parent, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == len(suite.BENCHMARKS)
    for line, (name, description) in zip(lines, suite.BENCHMARKS.items()):
        assert line.split()[0] == name and line.endswith(description)
    unknown = subprocess.run([sys.executable, "-m", "bench", "no_such_benchmark"], cwd=BENCH.parent,
                             capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and "python -m bench list" in unknown.stderr


CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse4_2 avx avx2 fma f16c avx512f avx512_bf16 amx_bf16 amx_tile
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse4_2 avx avx2 fma f16c avx512f avx512_bf16 amx_bf16 amx_tile
"""


def test_machine_records_the_cpu_model_and_its_vector_and_bf16_flags():
    machine = suite.machine(CPUINFO)
    assert machine["cpu"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert machine["cpu_flags"] == ["amx_bf16", "amx_tile", "avx", "avx2", "avx512_bf16", "avx512f", "f16c", "fma"]
    assert "gpu" in machine and machine["cores"] >= 1
    epyc = suite.machine("model name\t: AMD EPYC 7B13\nflags\t\t: sse2 avx avx2 fma\n")
    assert epyc["cpu"] == "AMD EPYC 7B13" and epyc["cpu_flags"] == ["avx", "avx2", "fma"]


def render_pairs(result):
    # what JSON gives back: lists, not tuples; string keys
    assert isinstance(result["pairs"][0], list) and list(result["by_tokens"]) == ["512"]
    return "| a | b |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in result["pairs"])


def test_write_result_records_the_run_and_renders_the_markdown_from_the_json(tmp_path, monkeypatch):
    monkeypatch.setattr(suite, "COMMAND", "python -m bench demo --rounds 1")
    path = suite.write_result("demo", tmp_path / "out" / "demo", {"pairs": [(1, 2)], "by_tokens": {512: 1.5}},
                              render_pairs)
    assert path == tmp_path / "out" / "demo.json"
    result = json.loads(path.read_text())
    meta = result["meta"]
    assert meta["benchmark"] == "demo" and meta["command"] == "python -m bench demo --rounds 1"
    assert meta["date"][:2] == "20" and "T" in meta["date"]
    assert {"cpu", "cpu_flags", "cores", "gpu"} <= set(meta["machine"])
    assert set(meta["versions"]) >= {"torch", "transformers", "diff-llama"}
    assert all(meta["versions"][name] for name in ("torch", "transformers", "diff-llama"))
    markdown = path.with_suffix(".md").read_text()
    assert markdown.startswith("| a | b |\n|---|---|\n| 1 | 2 |\n")
    assert "python -m bench demo --rounds 1" in markdown and meta["machine"]["cpu"] in markdown
    assert f"torch {meta['versions']['torch']}" in markdown
    # The markdown follows the JSON: edit the JSON, render again, and the table changes with it.
    result["pairs"] = [[3, 4]]
    path.write_text(json.dumps(result))
    suite.render_file(path, render_pairs)
    assert "| 3 | 4 |" in path.with_suffix(".md").read_text() and "| 1 | 2 |" not in path.with_suffix(".md").read_text()


def test_a_bare_name_goes_under_bench_results():
    assert suite.result_path("model", ".json") == BENCH / "results" / "model.json"
    assert suite.result_path("/tmp/x/model.md", ".json") == Path("/tmp/x/model.json")


def test_render_finds_the_benchmark_by_the_name_the_json_records(tmp_path):
    cuda_benchmark = suite.module("cuda_benchmark")
    record = {**cuda_benchmark.new_record(), "samples": {"llama": [{"decode b1 eager (tokens/s)": 100.0}]}}
    results = {"device": "test", "torch": "x", "plan": cuda_benchmark.dataclasses.asdict(cuda_benchmark.Plan()),
               "command": "python -m bench cuda_benchmark", "seconds": 1.0,
               "shapes": {"s": {"rounds": 1, "build_seconds": 0.0, "figures": {"eager b1": record}}}}
    path = suite.write_result("cuda_benchmark", tmp_path / "cuda", results)  # the module's own render
    first = path.with_suffix(".md").read_text()
    path.with_suffix(".md").unlink()
    out = subprocess.run([sys.executable, "-m", "bench", "render", str(path)], cwd=BENCH.parent, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert path.with_suffix(".md").read_text() == first and "| s | decode b1 eager (tokens/s) | 100 (1.00, n=1) |" in first


def test_unknown_benchmark_is_refused_by_name():
    with pytest.raises(KeyError, match="unknown benchmark 'nope'"):
        suite.module("nope")


def test_render_refuses_a_result_older_than_the_suite_and_keeps_its_markdown(tmp_path):
    for name in ("convert.json", "convert.md"):
        (tmp_path / name).write_bytes((RESULTS / name).read_bytes())
    out = subprocess.run([sys.executable, "-m", "bench", "render", str(tmp_path / "convert.json")], cwd=BENCH.parent,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "predates the suite's result format" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert (tmp_path / "convert.md").read_bytes() == (RESULTS / "convert.md").read_bytes()
