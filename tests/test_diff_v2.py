"""What only DIFF V2 (`diff_version=2`) has: its layout rules, parameter shapes and checkpoint names, its per-token
λ, and a save/load round trip through the Auto classes. Every property it shares with version 1 (the float64
reference, FlexAttention, caches and left padding, compiled generation, half precision, gradient checkpointing, LoRA)
is tested once for both versions, parametrised over `diff_version`, in test_reference.py, test_generation.py,
test_training_and_loading.py and test_finetuning.py."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import bytes_saved_for_backward, differential_model, random_batch, tiny_config
from diff_llama import DiffLlamaConfig, DiffLlamaForCausalLM


# Also run on the oldest supported transformers (scripts/run_oldest_transformers_tests.sh).
pytestmark = pytest.mark.oldest_transformers


def test_layout_rules_are_checked_when_a_model_is_built():
    config = tiny_config(diff_version=2, num_attention_heads=6, num_key_value_heads=2)  # G must divide H/2 = 3
    with pytest.raises(ValueError, match="`num_key_value_heads`.*divide"):
        DiffLlamaForCausalLM(config)
    with pytest.raises(ValueError, match="`diff_version`"):
        DiffLlamaForCausalLM(tiny_config(diff_version=3))


def test_parameters_have_the_spec_shapes_and_names(tmp_path):
    model = differential_model(2, torch.float32, heads=18, kv_heads=3)
    attention, d, hidden = model.model.layers[0].self_attn, 8, 48
    assert attention.q_proj.weight.shape == (18 * d, hidden)
    assert attention.k_proj.weight.shape == attention.v_proj.weight.shape == (3 * d, hidden)
    assert attention.o_proj.weight.shape == (hidden, 9 * d)
    model.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.self_attn.lambda_proj.weight").shape == (9, hidden)
    assert not any("differential_lambda" in key or "head_norm" in key for key in keys)


def test_per_token_lambda_needs_the_hidden_states_and_has_no_per_layer_value():
    model = differential_model(2)
    model.set_attn_implementation("eager")
    input_ids, _ = random_batch()
    with pytest.raises(ValueError, match="output_hidden_states"):
        model.differential_lambdas(model(input_ids, output_attentions=True))
    with pytest.raises(ValueError, match="per token"):
        model.get_lambdas()


def test_auto_classes_and_save_load_round_trip(tmp_path):
    model = differential_model(2, torch.float32)
    model.save_pretrained(tmp_path)
    config = DiffLlamaConfig.from_pretrained(tmp_path)
    assert config.diff_version == 2
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, DiffLlamaForCausalLM)
    input_ids = random_batch()[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits, rtol=0, atol=0)


def test_bf16_lambda_projection_keeps_its_bf16_rows_for_backward():
    """In half-precision training λ's float32 product keeps its input rows as they are (q/k/v_proj keep them anyway),
    not a float32 copy, and its gradients are the float64 ones rounded."""
    from diff_llama.lambda_diff_llama import Float32ProductOfHalfRows

    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(12, 32, generator=generator).to(torch.bfloat16).requires_grad_()
    weight = (0.3 * torch.randn(3, 32, generator=generator)).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(12, 3, generator=generator)
    products = Float32ProductOfHalfRows.apply(rows, weight)
    assert products.dtype == torch.float32
    torch.testing.assert_close(products.double(), rows.double() @ weight.double().t(), rtol=1e-6, atol=1e-6)
    assert [saved.dtype for saved in products.grad_fn.saved_tensors] == [torch.bfloat16, torch.bfloat16]
    products.backward(grad)
    torch.testing.assert_close(rows.grad, (grad.double() @ weight.double()).to(torch.bfloat16), rtol=8e-3, atol=1e-3)
    torch.testing.assert_close(weight.grad, (grad.double().t() @ rows.double()).to(torch.bfloat16), rtol=8e-3,
                               atol=1e-3)


def test_bf16_training_keeps_about_what_a_llama_with_its_query_heads_keeps():
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=16,
                 num_key_value_heads=2, head_dim=32)
    torch.manual_seed(0)
    llama = bytes_saved_for_backward(LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16))
    model = DiffLlamaForCausalLM(tiny_config(**shape, diff_version=2)).to(torch.bfloat16)
    assert bytes_saved_for_backward(model) <= 1.05 * llama  # 1.03x; 1.10x with a float32 copy of λ's input
