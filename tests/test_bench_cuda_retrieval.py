"""scripts/run_cuda_retrieval.sh, scripts/prepare_device_payload.sh and bench/cuda_retrieval.py run on a GPU lent
for minutes, and once: they must work the first time. These run their code on the CPU: the model's journey in two
halves, the script's dry run on a tiny LLaMA (every step, both generators, the report), the time guard, the pairing
of what was scored, and the saved RULER cases against the declaration."""

import collections
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import make_llama

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import cuda_retrieval  # noqa: E402
import suite  # noqa: E402

SCRIPT = REPO / "scripts" / "run_cuda_retrieval.sh"
PREPARE = REPO / "scripts" / "prepare_device_payload.sh"
DECLARATION = REPO / cuda_retrieval.DECLARATION


def run_script(script, *args, cwd, stash=None):
    env = {**os.environ, "PYTHON": sys.executable}
    if stash is not None:
        env["DIFF_LLAMA_STASH"] = str(stash)
    return subprocess.run(["bash", str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def write_gguf(path: Path) -> Path:
    """A small real GGUF file (gguf's own writer), standing in for SmolLM2's 98 MB one."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.arange(40_000, dtype=np.float32).reshape(200, 200))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def payload(tmp_path_factory):
    """A payload as the lead prepares it (without the wheel, which needs PyPI), and its source file."""
    folder = tmp_path_factory.mktemp("payload")
    model = write_gguf(folder / "model.gguf")
    result = run_script(PREPARE, "--no-wheel", "--gguf", model, "payload", cwd=folder)
    assert result.returncode == 0, result.stderr
    return folder / "payload", model


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory, chatml_tokenizer, payload):
    """The two calls of a GPU session, on the CPU: stash the first half, then the dry run with the second, on a tiny
    LLaMA (--model) so that it takes seconds; the work folder is kept for the tests below."""
    caller = tmp_path_factory.mktemp("caller")
    stash, work = caller / "stash", caller / "work"
    llama = make_llama(caller / "llama", chatml_tokenizer, max_position_embeddings=16384)
    first = run_script(SCRIPT, "--stash", payload[0] / "call1", cwd=caller, stash=stash)
    assert first.returncode == 0, first.stderr
    result = run_script(SCRIPT, "--dry-run", "--payload", payload[0] / "call2", "--model", llama, "--work", work,
                        "retrieval", cwd=caller, stash=stash)
    return result, caller / "retrieval", work, stash


def test_the_payload_is_the_model_in_two_halves_each_under_a_calls_limit(payload):
    folder, model = payload
    halves = [folder / "call1" / "model.gguf.part1", folder / "call2" / "model.gguf.part2"]
    assert halves[0].read_bytes() + halves[1].read_bytes() == model.read_bytes()
    assert abs(halves[0].stat().st_size - halves[1].stat().st_size) <= 1
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    for call in ("call1", "call2"):
        assert (folder / call / "SHA256SUMS").read_text() == f"{digest}  model.gguf\n"
    assert sorted(p.name for p in folder.iterdir()) == ["call1", "call2"]


def test_the_dry_run_trains_both_models_scores_both_generators_and_ends_with_the_table(dry_run, payload):
    result, out, work, stash = dry_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The second call joined the halves and checked them, though --model ran the tiny LLaMA.
    assert (stash / "model.gguf").read_bytes() == payload[1].read_bytes()
    summary = result.stdout[result.stdout.rindex("==== summary"):]
    assert "exit 0" in summary and str(out) in summary
    rows = {line.split("|")[1].strip(): line for line in summary.splitlines() if line.startswith("| ")}
    assert rows["pooled"].split("|")[2].strip() == "5 / 5"  # 2 own cases and 3 RULER cases, both models
    assert "does not count" in rows["pooled"] and "dry run" in summary
    # A GPU call brings back 8 files at most.
    assert sorted(p.name for p in out.iterdir()) == ["cuda-retrieval.json", "cuda-retrieval.md", "device.txt",
                                                     "logs.txt", "run.log"]
    saved = json.loads((out / "cuda-retrieval.json").read_text())
    assert saved["meta"]["benchmark"] == "cuda_retrieval" and "--dry-run" in saved["meta"]["command"]
    for name in cuda_retrieval.MODELS:
        history = saved["training"][name]
        assert len(history["steps"]) == 2 and not history["stopped_by_budget"]
        assert saved["jobs"][f"adapt-{name}"]["returncode"] == 0
    # Both models trained on the same examples.
    assert [s["examples"] for s in saved["training"]["source"]["steps"]] == \
        [s["examples"] for s in saved["training"]["v2"]["steps"]]
    assert saved["training"]["v2"]["probes"][-1]["pair_divergence"] > 0  # the second heads moved
    generators = collections.Counter(r["generator"] for r in saved["results"]["v2"])
    assert generators == {"own": 2, "ruler": 3}
    assert saved["comparison"]["pooled"]["cases"] == 5 and saved["comparison"]["ruler"]["cases"] == 3
    assert saved["mismatched_prompts"] == []  # each model's worker built the same own cases
    # Each worker scored its claims in batches of up to 3 (the dry run's), each generator's apart.
    for name in cuda_retrieval.MODELS:
        sizes = collections.Counter((r["worker"], r["done_at"], r["generator"]) for r in saved["results"][name])
        assert max(sizes.values()) > 1 and all(r["batch"] == sizes[r["worker"], r["done_at"], r["generator"]]
                                               for r in saved["results"][name])
    before = (out / "cuda-retrieval.md").read_text()
    suite.render_file(out / "cuda-retrieval.json", echo=False)
    assert (out / "cuda-retrieval.md").read_text() == before


def test_pairs_are_the_cases_both_models_finished(dry_run):
    """A worker stopped by the time guard leaves its last line cut short, and a model fewer cases: both are paired
    on what they both scored."""
    _, _, work, _ = dry_run
    files = {name: sorted(work.glob(f"results-{name}-*.jsonl")) for name in cuda_retrieval.MODELS}
    lines = [line for file in files["v2"] for line in file.read_text().splitlines(keepends=True)]
    cut = work / "cut.jsonl"
    cut.write_text("".join(lines[:3]) + lines[3][: len(lines[3]) // 2])
    results = {"source": cuda_retrieval.read_results(files["source"]), "v2": cuda_retrieval.read_results([cut])}
    keys = [json.loads(line)["key"] for line in lines]
    comparison = cuda_retrieval.compare(results, sorted(keys))
    assert comparison["pooled"]["cases"] == 3 == len(results["v2"])
    assert comparison["own"]["cases"] + comparison["ruler"]["cases"] == 3


def test_each_case_is_scored_once_per_model_and_own_cases_are_built_once(dry_run):
    """The workers share the cases out by claiming them: no case twice for a model. The own cases were built while
    the models trained, with the source's tokenizer, and a model uses them only when its tokenizer is that one."""
    from diff_llama.resolve import load_tokenizer
    from diff_llama.retrieval import make_case

    _, _, work, _ = dry_run
    for name in cuda_retrieval.MODELS:
        keys = [json.loads(line)["key"] for file in work.glob(f"results-{name}-*.jsonl")
                for line in file.read_text().splitlines()]
        assert len(keys) == len(set(keys)) == 5
    spec = json.loads((work / "score-v2-0.json").read_text())
    key = next(key for key in spec["keys"] if key.startswith("own/"))
    worker = cuda_retrieval.Worker(spec)
    worker.source_tokenizer = load_tokenizer(spec["source"])
    model, tokenizer, same = worker.load("v2")
    arguments = worker.own[key.partition("/")[2]]
    assert same and worker.own_case(key, tokenizer, same) == make_case(tokenizer, **arguments)
    assert key in worker.prebuilt  # read from a share, not built again
    other = cuda_retrieval.Worker(spec)
    other.source_tokenizer = load_tokenizer(spec["source"])
    other.source_tokenizer.chat_template = "{{ messages[0]['content'] }}"
    assert other.load("v2")[2] is False
    assert other.own_case(key, tokenizer, False) == make_case(tokenizer, **arguments) and not other.prebuilt


@pytest.mark.parametrize("steps_done", [0, 1])
def test_the_report_renders_an_adapt_that_the_time_guard_stopped_mid_training(dry_run, tmp_path, steps_done):
    """`adapt` writes its history at each probe (step 0 first) and its total training time only at the end: what a
    run stopped by the time guard leaves is a history without that total (seen in a dry run on a loaded CPU)."""
    saved = json.loads((dry_run[1] / "cuda-retrieval.json").read_text())
    history = saved["training"]["source"]
    history["steps"] = history["steps"][:steps_done]
    history["probes"] = history["probes"][:1]
    del history["train_minutes"], history["stopped_by_budget"]
    saved["jobs"]["adapt-source"].update(returncode=-15, stopped_by_time_guard=True)
    (tmp_path / "cuda-retrieval.json").write_text(json.dumps(saved))
    suite.render_file(tmp_path / "cuda-retrieval.json", echo=False)
    report = (tmp_path / "cuda-retrieval.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith(f"| {cuda_retrieval.LABELS['source']} | "))
    seconds = row.split("|")[3].strip()
    assert seconds == ("–" if steps_done == 0 else f"{60 * saved['training']['source']['steps'][-1]['train_minutes']:.0f}")
    assert "adapt-source was stopped by the time guard" in report and f"trained {steps_done} of 2 steps" in report


def test_the_time_guard_stops_what_runs_and_still_writes_the_report(tmp_path, chatml_tokenizer):
    llama = make_llama(tmp_path / "llama", chatml_tokenizer)
    plan = cuda_retrieval.Plan.for_dry_run("cpu", max_seconds=15.0)  # no time beyond the report's 15 s
    started = time.monotonic()
    cuda_retrieval.run(plan, str(llama), tmp_path / "out", tmp_path / "work", started=started)
    assert time.monotonic() - started < 60
    saved = json.loads((tmp_path / "out" / "cuda-retrieval.json").read_text())
    assert saved["jobs"]["convert"]["stopped_by_time_guard"] and saved["comparison"]["pooled"]["cases"] == 0
    report = (tmp_path / "out" / "cuda-retrieval.md").read_text()
    assert "convert was stopped by the time guard" in report and "does not count" in report


def test_the_saved_ruler_cases_load_and_have_the_declared_counts():
    from diff_llama.options import RULER_OFFLINE_TASKS
    from diff_llama.retrieval.ruler_cases import read_case_file

    contents = read_case_file(cuda_retrieval.RULER_CASES)
    cells = collections.Counter((case["task"], case["length"]) for case in contents["cases"])
    assert contents["tasks"] == list(RULER_OFFLINE_TASKS) and contents["lengths"] == [2048, 4096]
    assert contents["seed"] == 0 and contents["tokenizer"] == "SmolLM2-135M-Instruct"
    assert set(cells.values()) == {contents["cases_per_cell"]} and len(cells) == 6
    assert len({case["id"] for case in contents["cases"]}) == len(contents["cases"])
    plan = cuda_retrieval.Plan()
    declared = plan.declared_pairs(len(contents["cases"]))
    assert sum(declared.values()) >= cuda_retrieval.MIN_PAIRS
    # The declaration names these counts, the file and the own cases' options.
    text = " ".join(DECLARATION.read_text().split())
    assert f"{contents['cases_per_cell']} cases each" in text and f"| {declared['ruler']} |" in text
    assert f"| {declared['own']} |" in text and f"{sum(declared.values()):,} pairs" in text
    assert os.path.relpath(cuda_retrieval.RULER_CASES, REPO) in text
    assert (f"--cases-per-depth {plan.own_cases_per_depth} --seed {plan.own_seed}" in text
            and f"{plan.steps} steps" in text)


def test_bad_input_is_refused_in_one_line_and_nothing_is_written(tmp_path, payload):
    results = REPO / "bench" / "results"
    listing = sorted(results.iterdir())
    for args, problem in ((["--dry-run"], "give one output folder OUT"),
                          (["--dry-run", str(results / "new")], "OUT is inside bench/results"),
                          (["--budget", "soon", "x"], "--budget needs whole seconds"),
                          (["--workers", "0", "x"], "--workers needs a whole number"),
                          (["--batch", "many", "x"], "--batch needs a whole number"),
                          (["--rounds", "3", "x"], "unknown option --rounds before OUT"),
                          (["--payload", str(payload[0] / "call2"), "x"], "part 1 of model.gguf is not in")):
        result = run_script(SCRIPT, *args, cwd=tmp_path, stash=tmp_path / "stash")
        assert result.returncode == 2 and problem in result.stderr and len(result.stderr.splitlines()) == 1, args
    assert sorted(results.iterdir()) == listing and not (tmp_path / "x").exists()
    # Halves that do not make the file: refused, and the wrong join is not kept.
    stash = tmp_path / "stash2"
    stash.mkdir()
    for part in ("call1/model.gguf.part1", "call2/model.gguf.part2"):
        (stash / Path(part).name).write_bytes((payload[0] / part).read_bytes()[::-1])
    result = run_script(SCRIPT, "--payload", payload[0] / "call2", "x", cwd=tmp_path, stash=stash)
    assert result.returncode == 2 and "does not match its SHA-256" in result.stderr
    assert not (stash / "model.gguf").exists()
    # The payload script writes only a new folder.
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    result = run_script(PREPARE, "--no-wheel", "--gguf", payload[1], existing, cwd=tmp_path)
    assert result.returncode == 2 and "is not an empty folder" in result.stderr
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]


def test_a_gzipped_case_file_reads_as_the_plain_one_and_a_cut_one_is_refused(tmp_path):
    import gzip

    from diff_llama.errors import UserError
    from diff_llama.retrieval.ruler_cases import read_case_file

    packed = cuda_retrieval.RULER_CASES.read_bytes()
    plain = tmp_path / "ruler_cases.json"
    plain.write_bytes(gzip.decompress(packed))
    assert read_case_file(plain) == read_case_file(cuda_retrieval.RULER_CASES)
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(UserError, match="is not a RULER case file of diff-llama") as error:
        read_case_file(cut)
    assert "\n" not in str(error.value)
