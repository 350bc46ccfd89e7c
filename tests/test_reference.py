"""The model against the independent float64 reference of the equations (tests/reference.py)."""

import math

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_model
from diff_llama import differential_attention_maps
from reference import checkpoint_state_dict, reference_forward

# (H, G): odd G, G = 1 (multi-query), H/2 odd, G = H, even G with H/2 odd.
LAYOUTS = [(6, 3), (6, 1), (2, 1), (8, 4), (8, 1), (6, 6), (12, 3), (10, 2)]


def random_batch(seed=1, batch=3, length=9, vocab=128):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (batch, length), generator=generator)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    attention_mask[1, :4] = 0  # left padding
    if batch > 2:
        attention_mask[2, :1] = 0
    return input_ids, attention_mask


def padded_labels(input_ids, attention_mask):
    """Labels with no loss on padded positions or on the outputs of padded query rows: a fully masked row has no
    defined output, and transformers' backends differ there (eager averages every value, SDPA does not)."""
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, 1:].masked_fill_(attention_mask[:, :-1] == 0, -100)
    return labels


def randomise_lambdas(model, seed=3):
    """Non-trivial λ vectors, so that λ differs from λ_init and from layer to layer."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lambda_" in name:
            param.data = torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.4

def prefill_then_decode(model, input_ids, attention_mask, prefix=5):
    """Logits (batch, length, vocab) of a padded prefill of `prefix` tokens, then one token at a time with a cache."""
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = [model(input_ids[:, :prefix], attention_mask=attention_mask[:, :prefix],
                        position_ids=positions[:, :prefix], cache=cache, use_cache=True).logits]
        for t in range(prefix, input_ids.shape[1]):
            logits.append(model(input_ids[:, t : t + 1], attention_mask=attention_mask[:, : t + 1],
                                position_ids=positions[:, t : t + 1], cache=cache, use_cache=True).logits)
    return torch.cat(logits, dim=1)



@pytest.mark.parametrize("heads,kv_heads", LAYOUTS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_float64_logits_match_reference(heads, kv_heads, attn):
    model = tiny_model(torch.float64, num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=4)
    randomise_lambdas(model)
    model.set_attn_implementation(attn)
    input_ids, attention_mask = random_batch()
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask).logits
    expected = reference_forward(model.config, checkpoint_state_dict(model), input_ids, attention_mask)
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=1e-12)


def test_reference_detects_a_wrong_pairing():
    """Guards the reference itself: pairing heads (i, i+1) instead of (i, i + H/2) must be visible."""
    model = tiny_model(torch.float64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1)
    input_ids, _ = random_batch()
    expected = reference_forward(model.config, checkpoint_state_dict(model), input_ids)
    state = dict(model.state_dict())
    q = state["model.layers.0.self_attn.q_proj.weight"].view(4, 8, -1)
    state["model.layers.0.self_attn.q_proj.weight"] = q[[0, 2, 1, 3]].reshape(32, -1)
    model.load_state_dict(state)
    with torch.no_grad():
        logits = model(input_ids).logits
    assert (logits - expected).abs().max() > 1e-3


@pytest.mark.parametrize("heads,kv_heads", [(6, 3), (8, 2), (4, 1)])
def test_flex_attention_matches_reference(heads, kv_heads):
    # FlexAttention on CPU runs float32 only and without autograd.
    model = tiny_model(torch.float32, num_attention_heads=heads, num_key_value_heads=kv_heads)
    randomise_lambdas(model)
    model.set_attn_implementation("flex_attention")
    input_ids, attention_mask = random_batch()
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask).logits
    expected = reference_forward(model.config, checkpoint_state_dict(model), input_ids, attention_mask)
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real].double(), expected[real], rtol=0, atol=2e-5)


@pytest.mark.parametrize("heads,kv_heads", [(6, 3), (8, 1)])
def test_output_attentions_and_differential_maps(heads, kv_heads):
    model = tiny_model(torch.float64, num_attention_heads=heads, num_key_value_heads=kv_heads)
    randomise_lambdas(model)
    model.set_attn_implementation("eager")
    input_ids, attention_mask = random_batch(batch=2)
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, output_attentions=True)
    _, maps = reference_forward(model.config, checkpoint_state_dict(model), input_ids, attention_mask, return_maps=True)
    lambdas = model.get_lambdas()
    assert len(out.attentions) == model.config.num_hidden_layers
    diff_maps = differential_attention_maps(out.attentions, lambdas)
    for layer, layer_attn in enumerate(out.attentions):
        assert layer_attn.shape == (2, heads, 9, 9)
        assert diff_maps[layer].shape == (2, heads // 2, 9, 9)
        for b in range(2):
            real = attention_mask[b].bool()
            head_maps, lam = maps[b][layer]
            assert lambdas[layer].item() == pytest.approx(lam, abs=1e-12)
            for i, (a1, a2) in enumerate(head_maps):
                torch.testing.assert_close(layer_attn[b, i][real], a1[real], rtol=0, atol=1e-12)
                torch.testing.assert_close(layer_attn[b, i + heads // 2][real], a2[real], rtol=0, atol=1e-12)
                torch.testing.assert_close(diff_maps[layer][b, i][real], (a1 - lam * a2)[real], rtol=0, atol=1e-12)


def test_differential_maps_need_eager_attention():
    model = tiny_model()
    input_ids, _ = random_batch()
    with pytest.raises(ValueError, match="eager"):
        differential_attention_maps((None,) * 3, model.get_lambdas())


def test_lambda_follows_equation_and_layer_depth():
    model = tiny_model(torch.float64, num_hidden_layers=5)
    randomise_lambdas(model)

    for layer, attn in enumerate(layer.self_attn for layer in model.model.layers):
        expected = (
            math.exp((attn.differential_lambda.lambda_q1 @ attn.differential_lambda.lambda_k1).item())
            - math.exp((attn.differential_lambda.lambda_q2 @ attn.differential_lambda.lambda_k2).item())
            + 0.8
            - 0.6 * math.exp(-0.3 * layer)
        )
        assert attn.differential_lambda().item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("heads,kv_heads", LAYOUTS)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_decoding_steps_match_reference_with_left_padding(heads, kv_heads, attn):
    """Token-by-token decoding with a cache (SDPA runs its own one-token kernel, eager the generic path)."""
    model = tiny_model(torch.float64, num_attention_heads=heads, num_key_value_heads=kv_heads)
    randomise_lambdas(model)
    model.set_attn_implementation(attn)
    input_ids, attention_mask = random_batch()
    logits = prefill_then_decode(model, input_ids, attention_mask)
    expected = reference_forward(model.config, checkpoint_state_dict(model), input_ids, attention_mask)
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=1e-12)

