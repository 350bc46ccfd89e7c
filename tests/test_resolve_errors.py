"""Folders that are not whole models: every command that loads a model names what is missing and the fix, in one line
(transformers alone blames a missing sentencepiece or tiktoken)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_model
from diff_llama.cli import main
from diff_llama.resolve import (
    AdapterFolderError,
    MissingTokenizerError,
    ModelNotFoundError,
    NotAModelFolderError,
    load_causal_lm,
    load_config,
    load_tokenizer,
)


def _not_a_model(tmp_path) -> Path:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "notes.txt").write_text("not a model")
    return folder


def _model_without_tokenizer(tmp_path) -> Path:
    folder = tmp_path / "my-diff-llama"
    tiny_model().save_pretrained(folder)  # what the README's first snippet does: weights and config only
    return folder


def _adapter(tmp_path) -> Path:
    from peft import LoraConfig, get_peft_model

    folder = tmp_path / "adapter"
    model = tiny_model()
    model.name_or_path = "outputs/SmolLM2-diff"
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).save_pretrained(folder)
    assert (folder / "adapter_config.json").is_file() and not (folder / "config.json").exists()
    return folder


def _fails_in_one_line(capsys, argv) -> str:
    capsys.readouterr()  # drop what making the folders printed
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert "sentencepiece" not in err and "tiktoken" not in err
    return err


@pytest.mark.parametrize("loader", [load_config, load_tokenizer, load_causal_lm])
def test_a_folder_without_config_is_not_a_model(tmp_path, loader):
    with pytest.raises(NotAModelFolderError, match="has no config.json"):
        loader(_not_a_model(tmp_path))


def test_a_model_folder_without_tokenizer_names_where_to_get_one(tmp_path, tokenizer):
    folder = _model_without_tokenizer(tmp_path)
    with pytest.raises(MissingTokenizerError, match=r"no tokenizer.*AutoTokenizer\.from_pretrained\(SOURCE\)"):
        load_tokenizer(folder)
    assert load_config(folder).model_type == "diff_llama"  # the model itself is fine
    tokenizer.save_pretrained(folder)  # the fix the message names
    assert load_tokenizer(folder)("The quick").input_ids == tokenizer("The quick").input_ids


@pytest.mark.parametrize("loader", [load_config, load_tokenizer, load_causal_lm])
def test_an_adapter_folder_names_peft_and_its_base(tmp_path, loader):
    folder = _adapter(tmp_path)
    with pytest.raises(AdapterFolderError, match=r"LoRA adapter folder.*`outputs/SmolLM2-diff`.*PeftModel"):
        loader(folder)


def test_errors_are_model_not_found_errors():
    """The CLI prints OSErrors (ModelNotFoundError is one) as one line with no traceback."""
    for error in (NotAModelFolderError, MissingTokenizerError, AdapterFolderError):
        assert issubclass(error, ModelNotFoundError) and issubclass(error, OSError)


@pytest.mark.parametrize("case", ["not-a-model", "no-tokenizer", "adapter"])
def test_train_and_evaluate_name_what_is_missing(tmp_path, capsys, case):
    folder = {"not-a-model": _not_a_model, "no-tokenizer": _model_without_tokenizer, "adapter": _adapter}[case](tmp_path)
    expected = {"not-a-model": "has no config.json", "no-tokenizer": "no tokenizer",
                "adapter": "LoRA adapter folder"}[case]
    data = tmp_path / "data.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 50)
    for argv in (["train", str(folder), "--data", str(data), "--output", str(tmp_path / "trained")],
                 ["evaluate", str(folder), "--output", str(tmp_path / "evaluation")]):
        err = _fails_in_one_line(capsys, argv)
        assert err.startswith(f"diff-llama {argv[0]}: error:") and expected in err, err
    assert not (tmp_path / "trained").exists() and not (tmp_path / "evaluation").exists()


def test_generate_through_the_installed_cli(tmp_path):
    """The real `diff-llama` entry point in a fresh process: each case is one line naming the fix, exit code 2."""
    executable = shutil.which("diff-llama", path=str(Path(sys.executable).parent)) or shutil.which("diff-llama")
    assert executable, "the diff-llama entry point is not installed"
    cases = {
        _not_a_model(tmp_path): "has no config.json",
        _model_without_tokenizer(tmp_path): "AutoTokenizer.from_pretrained(SOURCE).save_pretrained(",
        _adapter(tmp_path): "LoRA adapter folder (adapter_config.json)",
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("DIFF_LLAMA_TRACEBACK", None)
    for folder, expected in cases.items():
        result = subprocess.run([executable, "generate", str(folder), "Hello"], capture_output=True, text=True,
                                env=env, stdin=subprocess.DEVNULL, timeout=300)
        err = result.stderr.strip()
        assert result.returncode == 2, err[-2000:]
        assert err.count("\n") == 0 and err.startswith("diff-llama generate: error:") and expected in err, err
        assert "sentencepiece" not in err and "tiktoken" not in err


def test_adapter_config_without_a_base_still_names_peft(tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    with pytest.raises(AdapterFolderError, match="adapter_config.json names none"):
        load_causal_lm(folder)
