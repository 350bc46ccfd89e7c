"""RULER's needle tasks (`diff-llama ruler`): cases built by lm-eval's own RULER code, offline, scored and paired like
`evaluate`'s. Needs lm-eval with its RULER extra (`pip install 'diff-llama[ruler]'`, part of the test extra)."""

import json
import random

import pytest

from conftest import tiny_model
from diff_llama.cli import main
from diff_llama.options import RULER_OFFLINE_TASKS

pytest.importorskip("lm_eval", reason="needs lm-eval: pip install 'diff-llama[ruler]'")
pytest.importorskip("wonderwords", reason="needs lm-eval's RULER extra: pip install 'diff-llama[ruler]'")

from diff_llama.retrieval.ruler import (  # noqa: E402
    markdown_ruler_report,
    score_ruler_output,
    stated_values,
)
from diff_llama.retrieval.ruler_cases import (  # noqa: E402
    TASK_PARAMETERS,
    build_cell,
    lm_eval_ruler,
    read_case_file,
    ruler_prompt,
)

LENGTH = 1024  # the tiny byte-level tokenizer spends about one token per 2 characters


def test_the_offline_tasks_are_lm_evals_own(tokenizer, tmp_path):
    """Each offline task's cases are the first ones lm-eval's own task function builds from the same random seed."""
    assert set(TASK_PARAMETERS) == set(RULER_OFFLINE_TASKS)
    niah_utils, _ = lm_eval_ruler()
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    for task in RULER_OFFLINE_TASKS:
        random.seed(3)
        theirs = getattr(niah_utils, task)(max_seq_lengths=[LENGTH], tokenizer=str(tmp_path / "tokenizer"))["test"]
        state = random.getstate()
        ours = build_cell(tokenizer, task, LENGTH, 3, seed=3)
        assert random.getstate() == state  # the caller's random state is left alone
        assert [(c["input"], c["gen_prefix"], c["outputs"]) for c in ours] == [
            (d["input"], d["gen_prefix"], d["outputs"]) for d in theirs.select(range(3))]
        assert all(len(tokenizer(c["input"]).input_ids) + 128 <= LENGTH for c in ours)
        assert all(c["outputs"][0] in c["input"] for c in ours)
    assert build_cell(tokenizer, "niah_single_1", LENGTH, 2, seed=4) != build_cell(tokenizer, "niah_single_1",
                                                                                   LENGTH, 2, seed=3)


def test_scoring_counts_the_first_values_stated_and_not_the_queried_key():
    key, value = "0f3c2a1e-8b7d-4c6e-9a5f-1d2e3f4a5b6c", "7d161f29-eb8f-4056-b2d3-cc5d4a31b243"
    uuid_case = {"value_type": "uuids", "outputs": [value],
                 "gen_prefix": f"The special magic uuid for {key} mentioned in the provided text is"}
    assert score_ruler_output(f" {value.upper()}.", uuid_case) == [True]
    assert score_ruler_output(f" for {key} is {value}", uuid_case) == [True]
    assert score_ruler_output(f" {value[:-1]}", uuid_case) == [False]
    assert stated_values(f"{key} and {value}", uuid_case) == [value]
    number_case = {"value_type": "numbers", "outputs": ["6057437"],
                   "gen_prefix": "The special magic number for clumsy-teller mentioned in the provided text is"}
    assert score_ruler_output(": 6057437.", number_case) == [True]
    assert score_ruler_output(": 60574371", number_case) == [False]  # a whole number, not a prefix of one


def test_the_prompt_continues_the_answer_as_lm_eval_does(chatml_tokenizer, tokenizer):
    case = {"input": "Some text.\nWhat is it?", "gen_prefix": "The special magic number for x-y is"}
    plain = tokenizer.decode(ruler_prompt(tokenizer, case))
    assert plain == "Some text.\nWhat is it? The special magic number for x-y is"
    chat = chatml_tokenizer.decode(ruler_prompt(chatml_tokenizer, case))
    assert chat.endswith("<|im_start|>user\nSome text.\nWhat is it?<|im_end|>\n<|im_start|>assistant\n"
                         "The special magic number for x-y is")
    assert chatml_tokenizer.decode(ruler_prompt(chatml_tokenizer, case, chat_template=False)) == plain


@pytest.fixture
def two_models(tmp_path, tokenizer):
    """A tiny LLaMA and a tiny DiffLlama, each in a folder with the tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folders = []
    for name in ("llama", "diff"):
        if name == "llama":
            model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96,
                                                 num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
                                                 max_position_embeddings=LENGTH, bos_token_id=1, eos_token_id=2,
                                                 pad_token_id=0))
        else:
            model = tiny_model(vocab_size=len(tokenizer), max_position_embeddings=LENGTH)
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        folders.append(str(tmp_path / name))
    return folders


def test_ruler_command_pairs_models_saves_cases_and_resumes(tmp_path, two_models, capsys):
    out = tmp_path / "ruler"
    common = ["--tasks", "niah_single_1", "niah_multikey_3", "--lengths", "600", str(LENGTH), "--cases", "2",
              "--max_new_tokens", "3", "--threads", "0"]
    assert main(["ruler", *two_models, "--output", str(out), *common]) == 0
    report = json.loads((out / "ruler.json").read_text())
    assert [m["name"] for m in report["models"]] == ["llama", "diff"]
    ids = [c["id"] for c in report["models"][0]["cases"]]
    assert len(ids) == 2 * 2 * 2 == len(set(ids)) and ids == [c["id"] for c in report["models"][1]["cases"]]
    # RULER leaves 128 tokens for the answer, of which the start of the answer takes some.
    assert all(c["prompt_tokens"] < c["length"] for c in report["models"][0]["cases"])
    table = (out / "ruler.md").read_text()
    assert table == markdown_ruler_report(report)
    assert "McNemar" in table and "| llama | diff | niah_multikey_3 | 600 |" in table
    assert "| llama | diff | all | all | " in table and "| diff | all |" in table
    assert "Wrote" in capsys.readouterr().out
    assert len((out / "cases.jsonl").read_text().splitlines()) == 2 * 8

    # Cases built once (--cases-only), scored later elsewhere (--cases-file), in batches of 3: the same cases and
    # answers.
    saved = tmp_path / "cases"
    assert main(["ruler", two_models[0], "--output", str(saved), "--cases-only", *common]) == 0
    assert "--cases-file" in capsys.readouterr().out
    assert sorted(p.name for p in saved.iterdir()) == [".diff-llama-output", "ruler_cases.json"]
    assert read_case_file(saved / "ruler_cases.json")["cases"] == read_case_file(out / "ruler_cases.json")["cases"]
    later = tmp_path / "later"
    assert main(["ruler", *two_models[::-1], "--output", str(later), "--cases-file", str(saved / "ruler_cases.json"),
                 "--max_new_tokens", "3", "--threads", "0", "--batch-size", "3"]) == 0
    rescored = json.loads((later / "ruler.json").read_text())
    for first, second in zip(report["models"], rescored["models"][::-1]):
        assert [(c["id"], c["output"]) for c in first["cases"]] == [(c["id"], c["output"]) for c in second["cases"]]

    # An interrupted run resumes from cases.jsonl: the cases there are kept, the rest scored.
    lines = (out / "cases.jsonl").read_text().splitlines()
    for name in ("ruler.json", "ruler.md"):
        (out / name).unlink()
    (out / "cases.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:10])  # the fourth cut short
    assert main(["ruler", *two_models, "--output", str(out), *common]) == 0
    assert "Resuming" in capsys.readouterr().err
    resumed = json.loads((out / "ruler.json").read_text())
    for first, second in zip(report["models"], resumed["models"]):
        assert [(c["id"], c["output"]) for c in first["cases"]] == [(c["id"], c["output"]) for c in second["cases"]]
    # A finished run is not written over.
    assert main(["ruler", *two_models, "--output", str(out), *common]) == 2
    assert "not empty" in capsys.readouterr().err


def test_bad_ruler_input_is_refused_in_one_line_and_writes_nothing(tmp_path, two_models, capsys):
    out = tmp_path / "out"
    bad_file = tmp_path / "notes.json"
    bad_file.write_text('{"cases": []}')
    refused = {
        "Paul Graham's essays": ["--tasks", "niah_multikey_1"],
        "not a RULER needle task": ["--tasks", "niah_single_9"],
        "does not exist": ["--cases-file", str(tmp_path / "missing.json")],
        "is not a RULER case file": ["--cases-file", str(bad_file)],
        "give one of the two": ["--cases-file", str(bad_file), "--cases-only"],
        "at least 1 case": ["--cases", "0"],
    }
    for message, options in refused.items():
        assert main(["ruler", two_models[0], "--output", str(out), *options]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
    assert main(["ruler", *two_models, "--output", str(out), "--cases-only"]) == 2
    assert "give one" in capsys.readouterr().err
    assert main(["ruler", two_models[0], "--output", str(out), "--lengths", "130", "--cases", "1"]) == 2
    err = capsys.readouterr().err  # the option to change is this command's, not lm-eval's max_seq_lengths
    assert "130 tokens" in err and "give a longer --lengths" in err and "max_seq_lengths" not in err, err
    assert not out.exists() and bad_file.read_text() == '{"cases": []}'


@pytest.mark.slow
def test_ruler_on_smollm2_and_its_exact_conversion(tmp_path):
    """A few RULER cases end to end on the real SmolLM2-135M-Instruct and its DIFF V2 conversion: the conversion is
    exact, so the two give the same verdict on every case, and SmolLM2 finds a passkey at 2K tokens."""
    from diff_llama.conversion.converter import ConversionOptions, convert_llama_to_diff_llama
    from diff_llama.smollm2 import smollm2_gguf_path

    converted = tmp_path / "diff"
    convert_llama_to_diff_llama(str(smollm2_gguf_path()), str(converted), ConversionOptions(evaluate=False),
                                progress=False)
    out = tmp_path / "ruler"
    assert main(["ruler", "smollm2", str(converted), "--output", str(out), "--tasks", "niah_single_1",
                 "niah_multikey_2", "--lengths", "2048", "--cases", "2"]) == 0
    source, diff = json.loads((out / "ruler.json").read_text())["models"]
    assert all(c["prompt_tokens"] < 2048 for c in source["cases"])
    assert [c["correct"] for c in source["cases"]] == [c["correct"] for c in diff["cases"]]
    assert source["summary"]["accuracy_by_cell"]["niah_single_1/2048"] > 0
    assert "| SmolLM2-135M-Instruct | diff | all | all | " in (out / "ruler.md").read_text()


@pytest.mark.slow
def test_the_documented_lm_eval_command_runs_on_a_converted_model(tmp_path, chatml_tokenizer):
    """docs/adaptation.md's `lm_eval` line for a converted model, as a reader runs it (a tiny DIFF V2 with a real
    tokenizer in its place, one case a task and length instead of 20): lm-eval loads it as remote code and scores it."""
    import os
    import re
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    docs = (Path(__file__).parents[1] / "docs" / "adaptation.md").read_text(encoding="utf-8")
    line = next(line for line in docs.splitlines()
                if line.startswith("lm_eval ") and "pretrained=outputs/SmolLM2-135M-Instruct-diff," in line)
    model = tiny_model(vocab_size=len(chatml_tokenizer), diff_version=2, max_position_embeddings=8192)
    folder = tmp_path / "outputs" / "SmolLM2-135M-Instruct-diff"
    model.save_pretrained(folder)
    chatml_tokenizer.save_pretrained(folder)
    arguments = shlex.split(re.sub(r"--limit \d+", "--limit 1", line))[1:]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, "-m", "lm_eval", *arguments], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=1200)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    tasks = re.findall(r"--tasks (\S+)", line)[0].split(",")
    for task in tasks:  # lm-eval's results table has a row per task it scored
        assert re.search(rf"^\|\s*{task}\s*\|", done.stdout, flags=re.MULTILINE), output[-3000:]
