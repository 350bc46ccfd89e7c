"""DIFF V2 (`diff_version=2`) against the independent float64 reference of its equations (tests/reference.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

from conftest import tiny_config, tiny_model
from diff_llama import DiffLlamaConfig, DiffLlamaForCausalLM
from reference import checkpoint_state_dict, reference_forward

# (H, G) with G dividing H/2: h = H/2 odd (the SmolLM2 conversion has h = 9), G = 1, G = H/2, several groups.
LAYOUTS = [(6, 3), (6, 1), (2, 1), (8, 4), (8, 2), (18, 3), (12, 2)]


def v2_model(dtype=torch.float64, heads=6, kv_heads=3, layers=3, seed=0):
    model = tiny_model(dtype, seed=seed, diff_version=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       num_hidden_layers=layers)
    # λ well away from 0.5 and different per token and head: a layout mistake in λ then shows in the logits.
    generator = torch.Generator().manual_seed(seed + 7)
    for layer in model.model.layers:
        weight = layer.self_attn.differential_lambda.lambda_proj.weight
        weight.data = torch.randn(weight.shape, generator=generator, dtype=weight.dtype)
    return model


def random_batch(seed=1, batch=3, length=9, vocab=128):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (batch, length), generator=generator)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    attention_mask[1, :4] = 0  # left padding
    attention_mask[2, :1] = 0
    return input_ids, attention_mask


def test_layout_rules_are_checked_when_a_model_is_built():
    config = tiny_config(diff_version=2, num_attention_heads=6, num_key_value_heads=2)  # G must divide H/2 = 3
    with pytest.raises(ValueError, match="`num_key_value_heads`.*divide"):
        DiffLlamaForCausalLM(config)
    with pytest.raises(ValueError, match="`diff_version`"):
        DiffLlamaForCausalLM(tiny_config(diff_version=3))


def test_parameters_have_the_spec_shapes_and_names(tmp_path):
    model = v2_model(torch.float32, heads=18, kv_heads=3)
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


@pytest.mark.parametrize("heads,kv_heads", LAYOUTS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_float64_logits_match_reference(heads, kv_heads, attn):
    model = v2_model(heads=heads, kv_heads=kv_heads, layers=3)
    model.set_attn_implementation(attn)
    input_ids, attention_mask = random_batch()
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask).logits
    expected = reference_forward(model.config, checkpoint_state_dict(model), input_ids, attention_mask)
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=1e-12)


def test_reference_detects_half_split_pairing():
    """Guards the reference: pairing maps (i, i + H/2), version 1's rule, instead of (2i, 2i + 1) must show."""
    model = v2_model(heads=4, kv_heads=2, layers=1)
    input_ids, _ = random_batch()
    expected = reference_forward(model.config, checkpoint_state_dict(model), input_ids)
    q = model.model.layers[0].self_attn.q_proj.weight
    q.data = q.data.view(4, 8, -1)[[0, 2, 1, 3]].reshape(32, -1)
    with torch.no_grad():
        assert (model(input_ids).logits - expected).abs().max() > 1e-3


@pytest.mark.parametrize("heads,kv_heads", [(6, 3), (8, 1)])
def test_flex_attention_matches_reference(heads, kv_heads):
    model = v2_model(torch.float32, heads=heads, kv_heads=kv_heads)  # FlexAttention on CPU: float32, no autograd
    model.set_attn_implementation("flex_attention")
    input_ids, attention_mask = random_batch()
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask).logits
    expected = reference_forward(model.config, checkpoint_state_dict(model), input_ids, attention_mask)
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real].double(), expected[real], rtol=0, atol=2e-5)


@pytest.mark.parametrize("heads,kv_heads", [(6, 3), (18, 3), (8, 1)])
def test_per_token_differential_maps_match_reference(heads, kv_heads):
    model = v2_model(heads=heads, kv_heads=kv_heads)
    model.set_attn_implementation("eager")
    input_ids, attention_mask = random_batch()
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, output_attentions=True, output_hidden_states=True)
        maps = model.differential_maps(out)
        lambdas = model.differential_lambdas(out)
    assert out.attentions[0].shape == (3, heads, 9, 9)
    _, reference_maps = reference_forward(model.config, checkpoint_state_dict(model), input_ids, attention_mask,
                                          return_maps=True)
    for b in range(3):
        real = attention_mask[b].bool()
        for layer in range(3):
            for i, (a1, a2, lam) in enumerate(reference_maps[b][layer]):
                expected = a1 - lam[:, None] * a2
                torch.testing.assert_close(maps[layer][b, i][real][:, real], expected[real][:, real], rtol=0, atol=1e-12)
                torch.testing.assert_close(lambdas[layer][b, real, i], lam[real], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="output_hidden_states"):
        model.differential_lambdas(model(input_ids, output_attentions=True))
    with pytest.raises(ValueError, match="per token"):
        model.get_lambdas()


@pytest.mark.parametrize("heads,kv_heads", [(6, 3), (8, 1), (18, 3)])
def test_cache_holds_llama_shaped_keys_and_cached_logits_equal_uncached(heads, kv_heads):
    model = v2_model(heads=heads, kv_heads=kv_heads)
    input_ids, attention_mask = random_batch(length=10)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        full = model(input_ids, attention_mask=attention_mask).logits
        first = model(input_ids[:, :6], attention_mask=attention_mask[:, :6], cache=cache, use_cache=True)
        assert cache.layers[0].keys.shape == (3, kv_heads, 6, 8)  # exactly a LLaMA's cache: G heads of width d
        logits = [first.logits]
        for t in range(6, 10):
            step = model(input_ids[:, t : t + 1], attention_mask=attention_mask[:, : t + 1], cache=cache,
                         use_cache=True)
            logits.append(step.logits)
    real = attention_mask.bool()
    torch.testing.assert_close(torch.cat(logits, 1)[real], full[real], rtol=0, atol=1e-12)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_left_padded_generation_matches_each_prompt_alone(attn):
    model = v2_model(torch.float32)
    model.set_attn_implementation(attn)
    input_ids, attention_mask = random_batch()
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    with torch.no_grad():
        batched = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False,
                                 pad_token_id=0)
        for b in range(3):
            prompt = input_ids[b][attention_mask[b].bool()][None]
            alone = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
            assert batched[b, -6:].tolist() == alone[0, -6:].tolist()


def test_static_cache_and_compiled_generation_match_dynamic():
    model = v2_model(torch.float32)
    input_ids = random_batch()[0][:1]
    with torch.no_grad():
        dynamic = model.generate(input_ids, max_new_tokens=5, do_sample=False)
        static = model.generate(input_ids, max_new_tokens=5, do_sample=False, cache_implementation="static")
        compiled = torch.compile(model.forward, fullgraph=True, dynamic=False)
        logits = compiled(input_ids).logits
    assert dynamic.tolist() == static.tolist()
    torch.testing.assert_close(logits, model(input_ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_close_to_float32(dtype):
    model = v2_model(torch.float32)
    input_ids, attention_mask = random_batch()
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask).logits
        half = model.to(dtype)(input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    assert half.dtype == dtype
    assert torch.isfinite(half[real]).all()
    assert (half[real].float() - expected[real]).abs().max() < 0.05 * expected[real].abs().max()


def test_gradient_checkpointing_gives_same_gradients():
    input_ids = random_batch()[0]

    def gradients(checkpointing):
        model = v2_model(torch.float64)
        model.train()
        if checkpointing:
            model.activation_checkpointing_enable()
        model(input_ids, labels=input_ids).loss.backward()
        return {name: p.grad for name, p in model.named_parameters()}

    plain, checkpointed = gradients(False), gradients(True)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-10, atol=1e-12)


def test_auto_classes_and_save_load_round_trip(tmp_path):
    model = v2_model(torch.float32)
    model.save_pretrained(tmp_path)
    config = DiffLlamaConfig.from_pretrained(tmp_path)
    assert config.diff_version == 2
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, DiffLlamaForCausalLM)
    input_ids = random_batch()[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits, rtol=0, atol=0)


def test_lora_trains_the_lambda_projection_and_saves_it_in_the_adapter(tmp_path):
    from peft import PeftModel, get_peft_model

    from diff_llama.training import lora_config

    model = v2_model(torch.float32)
    peft_model = get_peft_model(model, lora_config())
    trainable = [name for name, p in peft_model.named_parameters() if p.requires_grad]
    assert any("lambda_proj" in name for name in trainable)
    input_ids = random_batch()[0]
    before = model.model.layers[0].self_attn.differential_lambda.modules_to_save["default"].lambda_proj.weight.clone()
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    peft_model(input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    after = model.model.layers[0].self_attn.differential_lambda.modules_to_save["default"].lambda_proj.weight
    assert not torch.allclose(before, after)
    peft_model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    adapter = load_file(tmp_path / "adapter_model.safetensors")
    assert any("lambda_proj" in key for key in adapter)
    reloaded = PeftModel.from_pretrained(v2_model(torch.float32), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids).logits, peft_model(input_ids).logits)
