"""Built-in `diffllama` checkpoints load into diff-llama with the same logits, and export back."""

import pytest
import torch
import transformers

from conftest import tiny_model
from diff_llama import DiffLlamaForCausalLM
from diff_llama.builtin_interop import export_to_builtin, load_builtin_checkpoint


def builtin_model(kv_heads=2, tie=False):
    torch.manual_seed(0)
    config = transformers.DiffLlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=kv_heads, tie_word_embeddings=tie, lambda_std_dev=0.3,
    )
    return transformers.DiffLlamaForCausalLM(config).eval()


@pytest.mark.parametrize("kv_heads,tie", [(2, False), (8, True), (4, False)])
def test_builtin_checkpoint_gives_same_logits(tmp_path, kv_heads, tie):
    builtin = builtin_model(kv_heads, tie)
    builtin.save_pretrained(tmp_path)
    ours = load_builtin_checkpoint(tmp_path).eval()
    assert type(ours) is DiffLlamaForCausalLM and ours.config.model_type == "diff_llama"
    input_ids = torch.randint(0, 128, (2, 11))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    with torch.no_grad():
        expected = builtin(input_ids, attention_mask=attention_mask).logits
        got = ours(input_ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(got[attention_mask.bool()], expected[attention_mask.bool()], rtol=0, atol=1e-5)


def test_export_to_builtin_round_trip(tmp_path):
    ours = tiny_model(num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    export_to_builtin(ours, tmp_path)
    builtin = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(builtin) is transformers.DiffLlamaForCausalLM
    input_ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(builtin(input_ids).logits, ours(input_ids).logits, rtol=0, atol=1e-5)


def test_export_refuses_odd_kv_heads(tmp_path):
    with pytest.raises(ValueError, match="num_key_value_heads"):
        export_to_builtin(tiny_model(num_attention_heads=6, num_key_value_heads=3), tmp_path)
    assert not any(tmp_path.iterdir())


def test_diff_v2_is_refused_in_one_line():
    import pytest

    from conftest import tiny_config
    from diff_llama.builtin_interop import to_builtin_config

    with pytest.raises(ValueError, match="version 1 only"):
        to_builtin_config(tiny_config(diff_version=2))


def test_export_folds_a_head_norm_eps_of_its_own_into_the_values(tmp_path):
    """A converted LLaMA keeps its values at their scale and sets head_norm_eps; the built-in model has no such field,
    so export scales the values instead: RMSNorm(s x; s² eps) = RMSNorm(x; eps)."""
    ours = tiny_model(num_attention_heads=8, num_key_value_heads=4, head_dim=8, head_norm_eps=[0.3, 2.0, 40.0])
    export_to_builtin(ours, tmp_path)
    builtin = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not hasattr(builtin.config, "head_norm_eps")
    input_ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(builtin(input_ids).logits, ours(input_ids).logits, rtol=0, atol=1e-5)
    back = load_builtin_checkpoint(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids).logits, ours(input_ids).logits, rtol=0, atol=1e-5)
