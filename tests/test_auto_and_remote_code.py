"""Auto-class registration next to the built-in `diffllama`, and loading as remote code without the package."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

import diff_llama
from conftest import tiny_config, tiny_model

HEADS = {
    AutoModel: diff_llama.DiffLlamaModel,
    AutoModelForCausalLM: diff_llama.DiffLlamaForCausalLM,
    AutoModelForSequenceClassification: diff_llama.DiffLlamaForSequenceClassification,
    AutoModelForTokenClassification: diff_llama.DiffLlamaForTokenClassification,
    AutoModelForQuestionAnswering: diff_llama.DiffLlamaForQuestionAnswering,
}


@pytest.mark.parametrize("auto_class", list(HEADS))
def test_auto_classes_build_ours_and_builtin_stays_builtin(auto_class):
    assert type(auto_class.from_config(tiny_config())) is HEADS[auto_class]
    builtin_config = transformers.DiffLlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2,
    )
    built = auto_class.from_config(builtin_config)
    assert type(built).__module__.startswith("transformers.models.diffllama")


def test_auto_config_resolves_both_model_types():
    assert AutoConfig.for_model("diff_llama") .__class__ is diff_llama.DiffLlamaConfig
    assert type(AutoConfig.for_model("diffllama")) is transformers.DiffLlamaConfig


def test_save_pretrained_writes_code_and_full_auto_map(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "diff_llama"
    assert set(config["auto_map"]) == {
        "AutoConfig", "AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification",
        "AutoModelForTokenClassification", "AutoModelForQuestionAnswering",
    }
    assert (tmp_path / "modeling_diff_llama.py").exists()
    assert (tmp_path / "configuration_diff_llama.py").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is diff_llama.DiffLlamaForCausalLM


REMOTE_SCRIPT = textwrap.dedent(
    """
    import os, sys
    sys.modules["diff_llama"] = None  # the package is NOT importable in this process
    try:
        import diff_llama
        raise SystemExit("diff_llama was importable")
    except ImportError:
        pass
    import torch, transformers
    folder, auto_name, inputs_path, outputs_path = sys.argv[1:]
    auto_class = getattr(transformers, auto_name)
    model = auto_class.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    with torch.no_grad():
        out = model(torch.load(inputs_path))
    first = out.logits if hasattr(out, "logits") else out[0]
    torch.save(first, outputs_path)
    """
)


@pytest.mark.parametrize(
    "auto_class,diff_version",
    [(AutoModelForCausalLM, 1), (AutoModelForSequenceClassification, 1), (AutoModel, 1),
     (AutoModelForQuestionAnswering, 1), (AutoModelForTokenClassification, 1), (AutoModelForCausalLM, 2),
     (AutoModelForSequenceClassification, 2)],
)
def test_remote_code_loads_in_fresh_process_without_package(tmp_path, auto_class, diff_version):
    torch.manual_seed(0)
    model = auto_class.from_config(tiny_config(num_labels=3, diff_version=diff_version)).eval()
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    input_ids = torch.randint(3, 128, (2, 7))
    torch.save(input_ids, tmp_path / "inputs.pt")
    with torch.no_grad():
        out = model(input_ids)
    expected = out.logits if hasattr(out, "logits") else out[0]

    script = tmp_path / "load_remote.py"
    script.write_text(REMOTE_SCRIPT)
    env = {"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, str(script), str(folder), auto_class.__name__, str(tmp_path / "inputs.pt"),
         str(tmp_path / "out.pt")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), expected, rtol=0, atol=0)
