import pytest

from conftest import tiny_config
from diff_llama import DiffLlamaConfig, DiffLlamaForCausalLM
from diff_llama.configuration_diff_llama import AUTO_MAP


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(num_attention_heads=5, num_key_value_heads=5, head_dim=8), "num_attention_heads"),
        (dict(num_attention_heads=6, num_key_value_heads=4), "num_key_value_heads"),
        (dict(num_attention_heads=6, num_key_value_heads=0), "num_key_value_heads"),
        (dict(hidden_size=32, head_dim=None, num_attention_heads=32, num_key_value_heads=32), "head_dim"),
        (dict(lambda_std_dev=-0.1), "lambda_std_dev"),
        (dict(attention_dropout=0.1), "attention_dropout"),
        (dict(diff_version=3), "diff_version"),
        (dict(diff_version=2, num_attention_heads=6, num_key_value_heads=2), "num_key_value_heads"),
        (dict(head_norm_eps=0.0), "head_norm_eps"),
        (dict(head_norm_eps=-1e-5), "head_norm_eps"),
        (dict(head_norm_eps=[0.5, 0.5]), "head_norm_eps"),  # 3 layers
        (dict(head_norm_eps=[0.5, float("nan"), 0.5]), "head_norm_eps"),
        (dict(head_norm_eps="1e-3"), "head_norm_eps"),
    ],
)
def test_invalid_layout_is_refused_when_a_model_is_built(overrides, field):
    config = tiny_config(**overrides)  # like LlamaConfig, the config itself constructs (transformers' tests need it)
    with pytest.raises(ValueError, match=f"`{field}`"):
        DiffLlamaForCausalLM(config)


def test_config_constructs_like_llama_config_with_head_dim_one():
    """transformers' common model tests build `Config(hidden_size=32)` with the default 32 heads (head_dim 1)."""
    config = DiffLlamaConfig(hidden_size=32)
    assert config.head_dim == 1


def test_valid_layouts_and_defaults():
    config = DiffLlamaConfig()
    assert config.model_type == "diff_llama"
    assert config.num_key_value_heads == config.num_attention_heads
    assert config.head_dim == config.hidden_size // config.num_attention_heads
    assert config.rope_parameters["rope_theta"] == 10000.0
    for kv in (1, 2, 3, 6):
        assert tiny_config(num_attention_heads=6, num_key_value_heads=kv).num_key_value_heads == kv


def test_round_trip_keeps_fields_and_auto_map(tmp_path):
    config = tiny_config(lambda_std_dev=0.05, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5})
    config.save_pretrained(tmp_path)
    loaded = DiffLlamaConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()
    assert loaded.auto_map == AUTO_MAP
    assert loaded.rope_parameters["rope_type"] == "linear"


def test_invalid_saved_config_is_refused_when_its_model_is_built(tmp_path):
    import json

    tiny_config().save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["num_key_value_heads"] = 4
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        DiffLlamaForCausalLM(DiffLlamaConfig.from_pretrained(tmp_path))


def test_head_norm_eps_defaults_to_rms_norm_eps_and_may_be_per_layer(tmp_path):
    config = tiny_config(rms_norm_eps=1e-6)
    assert config.head_norm_eps is None and [config.head_norm_epsilon(i) for i in range(3)] == [1e-6] * 3
    assert tiny_config(head_norm_eps=0.25).head_norm_epsilon(2) == 0.25
    config = tiny_config(head_norm_eps=[0.5, 2.0, 8.0])
    config.save_pretrained(tmp_path)
    loaded = DiffLlamaConfig.from_pretrained(tmp_path)
    assert [loaded.head_norm_epsilon(i) for i in range(3)] == [0.5, 2.0, 8.0]


def test_a_llama_checkpoint_loaded_as_it_is_says_to_convert_it(tmp_path, tokenizer):
    """`DiffLlamaForCausalLM.from_pretrained(a_llama)` builds a model that does not compute the LLaMA's function: the
    warning names the command that does. A DiffLlama folder, converted or saved by transformers' built-in class, loads
    without it."""
    from transformers import DiffLlamaConfig as BuiltinConfig
    from transformers import DiffLlamaForCausalLM as BuiltinModel
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging

    from conftest import make_llama
    from diff_llama import configuration_diff_llama
    from diff_llama.conversion.converter import ConversionOptions, convert_llama_to_diff_llama

    llama = make_llama(tmp_path / "llama", tokenizer, num_attention_heads=8, num_key_value_heads=2, hidden_size=64)
    convert_llama_to_diff_llama(str(llama), str(tmp_path / "v2"), ConversionOptions(evaluate=False), progress=False)
    BuiltinModel(BuiltinConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "builtin")
    logger = logging.get_logger(configuration_diff_llama.__name__)
    with CaptureLogger(logger) as captured:
        DiffLlamaForCausalLM.from_pretrained(llama)
    assert f"{llama} is a LLaMA checkpoint" in captured.out
    assert f"convert it first (`diff-llama convert {llama} OUT`" in captured.out
    for folder in ("v2", "builtin"):
        with CaptureLogger(logger) as captured:
            DiffLlamaForCausalLM.from_pretrained(tmp_path / folder)
        assert captured.out == "", folder
