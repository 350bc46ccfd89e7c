"""Auto-class registration next to the built-in `diffllama`, and loading as remote code without the package."""

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.dynamic_module_utils import get_relative_import_files

import diff_llama
from conftest import tiny_config, tiny_model
from diff_llama.configuration_diff_llama import REMOTE_CODE_FILES


# Also run on the oldest supported transformers (scripts/run_oldest_transformers_tests.sh).
pytestmark = pytest.mark.oldest_transformers


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


LLAMA_HEADS = {
    AutoModel: transformers.LlamaModel,
    AutoModelForCausalLM: transformers.LlamaForCausalLM,
    AutoModelForSequenceClassification: transformers.LlamaForSequenceClassification,
    AutoModelForTokenClassification: transformers.LlamaForTokenClassification,
    AutoModelForQuestionAnswering: transformers.LlamaForQuestionAnswering,
}


@pytest.mark.parametrize("auto_class", list(HEADS))
@pytest.mark.parametrize("head_fields", [{}, {"token_classification_bias": False, "hidden_dropout": 0.3},
                                         {"classifier_dropout": 0.2, "hidden_dropout": 0.3}])
def test_each_head_reads_the_config_as_llamas_does(auto_class, head_fields):
    """The same head fields give the same head parameters, dropout and pipeline-parallel plan as Llama's class (a
    checkpoint saved without the token classifier's bias must not load with a fresh one)."""
    fields = dict(vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=3, head_dim=8, num_labels=3, pad_token_id=0, **head_fields)
    ours = HEADS[auto_class](tiny_config(**fields))
    llama = LLAMA_HEADS[auto_class](transformers.LlamaConfig(**fields))

    def head(model):  # Llama's question-answering head calls its backbone "transformer", ours "model"
        backbone, prefix = {id(p) for p in model.base_model.parameters()}, model.base_model_prefix + "."
        return ({name: tuple(p.shape) for name, p in model.named_parameters() if id(p) not in backbone},
                getattr(getattr(model, "dropout", None), "p", None),
                {name.removeprefix(prefix): plan for name, plan in (model._pp_plan or {}).items()})

    assert head(ours) == head(llama)


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
    assert sorted(path.name for path in tmp_path.glob("*.py")) == sorted(REMOTE_CODE_FILES)
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
    folder, auto_name, inputs_path, outputs_path, code_files = sys.argv[1:]
    auto_class = getattr(transformers, auto_name)
    model = auto_class.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    # Every code file ran from the saved folder's copy (the modeling file's siblings included).
    loaded = {name.rsplit(".", 1)[-1] for name in sys.modules if name.startswith("transformers_modules.")}
    missing = {name.removesuffix(".py") for name in code_files.split(",")} - loaded
    assert not missing, f"not loaded from the saved folder: {missing}"
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

    result = _load_remote(tmp_path, folder, auto_class)
    assert result.returncode == 0, result.stderr[-3000:]
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), expected, rtol=0, atol=0)


def _load_remote(tmp_path, folder, auto_class):
    """Run REMOTE_SCRIPT on `folder` in a fresh process where diff_llama cannot be imported."""
    script = tmp_path / "load_remote.py"
    script.write_text(REMOTE_SCRIPT)
    env = {"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, str(script), str(folder), auto_class.__name__, str(tmp_path / "inputs.pt"),
         str(tmp_path / "out.pt"), ",".join(REMOTE_CODE_FILES)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )


def test_remote_code_files_are_what_the_modeling_file_imports():
    """REMOTE_CODE_FILES (what saving, converting and pushing ship) is the configuration, the modeling file and every
    file the modeling file imports relatively: what transformers copies and loads as remote code."""
    package = Path(diff_llama.__file__).parent
    needed = {Path(path).name for path in get_relative_import_files(package / "modeling_diff_llama.py")}
    assert set(REMOTE_CODE_FILES) == {"configuration_diff_llama.py", "modeling_diff_llama.py"} | needed
    assert len(REMOTE_CODE_FILES) == len(set(REMOTE_CODE_FILES))


@pytest.mark.parametrize("sibling", [name for name in REMOTE_CODE_FILES if name != "modeling_diff_llama.py"])
def test_remote_code_needs_every_shipped_file(tmp_path, sibling):
    """Without one of the shipped files the fresh process cannot load the model: the remote-code test above really
    runs the saved copies, not this package."""
    folder = tmp_path / "model"
    tiny_model().save_pretrained(folder)
    torch.save(torch.randint(3, 128, (1, 4)), tmp_path / "inputs.pt")
    (folder / sibling).unlink()
    result = _load_remote(tmp_path, folder, AutoModelForCausalLM)
    assert result.returncode != 0
    assert sibling.removesuffix(".py") in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("diff_version", [1, 2])
@pytest.mark.parametrize("model_class", list(HEADS.values()))
def test_reverse_loading_mapping(tmp_path, model_class, diff_version):
    """What transformers' own `test_reverse_loading_mapping` checks: the model registers checkpoint renamings; saving
    reverts them (the saved keys differ from the model's); every source pattern of every renaming matches a saved key
    of this version's checkpoint; and loading then saving again gives the same state dicts."""
    torch.manual_seed(0)
    model = model_class(tiny_config(num_labels=3, diff_version=diff_version))
    conversions = get_model_conversion_mapping(model, add_legacy=False)
    assert conversions
    model.save_pretrained(tmp_path / "from_init")
    saved = load_file(tmp_path / "from_init" / "model.safetensors")
    assert sorted(saved) != sorted(model.state_dict())
    for conversion in conversions:
        for pattern in conversion.source_patterns:
            assert any(re.search(pattern, key) for key in saved), f"{pattern!r} matches no saved key"

    reloaded = model_class.from_pretrained(tmp_path / "from_init")
    assert list(reloaded.state_dict()) == list(model.state_dict())
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, rtol=0, atol=0)
    reloaded.save_pretrained(tmp_path / "from_pretrained")
    resaved = load_file(tmp_path / "from_pretrained" / "model.safetensors")
    assert sorted(resaved) == sorted(saved)
    for name, tensor in saved.items():
        torch.testing.assert_close(resaved[name], tensor, rtol=0, atol=0)


@pytest.mark.parametrize("version, refused", [("4.57.1", True), ("5.16.0", True), ("5.0.0rc1", True),
                                              ("5.16.1", False), ("5.24.0", False), ("5.30.0.dev0", False),
                                              ("6.0", False), ("unknown", False)])
def test_remote_code_refuses_an_older_transformers_in_one_line(version, refused):
    from diff_llama.configuration_diff_llama import require_transformers

    if not refused:
        require_transformers(version)
        return
    with pytest.raises(ImportError) as error:
        require_transformers(version)
    assert str(error.value) == (f"diff-llama's remote code needs transformers 5.16.1 or newer; you have {version}: "
                                "pip install -U 'transformers>=5.16.1'")


def test_the_version_check_runs_before_any_other_transformers_import(tmp_path):
    """On transformers 4.57 the first import of a name it lacks (`PreTrainedConfig`) would fail with a traceback: in
    the files a saved model ships, the version check comes first."""
    import ast

    folder = tmp_path / "model"
    tiny_model().save_pretrained(folder)

    def statements(name):
        return ast.parse((folder / name).read_text()).body

    def is_check(node):
        return isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) \
            and getattr(node.value.func, "id", None) == "require_transformers"

    configuration = statements("configuration_diff_llama.py")
    check = next(index for index, node in enumerate(configuration) if is_check(node))
    for node in configuration[:check]:  # before it: the standard library and `import transformers` alone
        if isinstance(node, ast.ImportFrom):
            assert not node.module.startswith("transformers"), ast.unparse(node)
        elif isinstance(node, ast.Import):
            assert all(alias.name in ("re", "transformers") for alias in node.names), ast.unparse(node)
    assert any(isinstance(node, ast.ImportFrom) and node.module == "transformers" for node in configuration[check:])
    first_import = next(node for node in statements("modeling_diff_llama.py")
                        if isinstance(node, (ast.Import, ast.ImportFrom)))
    assert isinstance(first_import, ast.ImportFrom) and first_import.module == "configuration_diff_llama" \
        and first_import.level == 1, ast.unparse(first_import)
