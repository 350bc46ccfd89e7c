"""The model, either `diff_version`, against the independent float64 reference of the equations
(tests/reference.py): logits, cached decoding with left padding, FlexAttention, and the attention maps and λ."""

import math

import pytest
import torch

from conftest import LAYOUTS, V2_LAYOUTS, differential_model, prefill_then_decode, random_batch, tiny_model
from diff_llama import differential_attention_maps
from reference import checkpoint_state_dict, reference_forward


# Also run on the oldest supported transformers (scripts/run_oldest_transformers_tests.sh).
pytestmark = pytest.mark.oldest_transformers


VERSION_LAYOUTS = [(1, h, g) for h, g in LAYOUTS] + [(2, h, g) for h, g in V2_LAYOUTS]


@pytest.mark.parametrize("version,heads,kv_heads", VERSION_LAYOUTS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_float64_logits_match_reference(version, heads, kv_heads, attn):
    model = differential_model(version, heads=heads, kv_heads=kv_heads, layers=4 if version == 1 else 3)
    model.set_attn_implementation(attn)
    input_ids, attention_mask = random_batch()
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask).logits
    expected = reference_forward(model.config, checkpoint_state_dict(model), input_ids, attention_mask)
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=1e-12)


@pytest.mark.parametrize("version,heads,kv_heads", [(1, 4, 4), (2, 4, 2)])
def test_reference_detects_a_wrong_pairing(version, heads, kv_heads):
    """Guards the reference itself: swapping query heads 1 and 2 pairs maps (i, i + 1) instead of version 1's
    (i, i + H/2), and (i, i + H/2) instead of DIFF V2's (2i, 2i + 1); either must be visible."""
    model = differential_model(version, heads=heads, kv_heads=kv_heads, layers=1)
    input_ids, _ = random_batch()
    expected = reference_forward(model.config, checkpoint_state_dict(model), input_ids)
    q = model.model.layers[0].self_attn.q_proj.weight
    q.data = q.data.view(4, 8, -1)[[0, 2, 1, 3]].reshape(32, -1)
    with torch.no_grad():
        assert (model(input_ids).logits - expected).abs().max() > 1e-3


@pytest.mark.parametrize("version,heads,kv_heads", [(1, 6, 3), (1, 8, 2), (1, 4, 1), (2, 6, 3), (2, 8, 1)])
def test_flex_attention_matches_reference(version, heads, kv_heads):
    # FlexAttention on CPU runs float32 only and without autograd.
    model = differential_model(version, torch.float32, heads=heads, kv_heads=kv_heads)
    model.set_attn_implementation("flex_attention")
    input_ids, attention_mask = random_batch()
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask).logits
    expected = reference_forward(model.config, checkpoint_state_dict(model), input_ids, attention_mask)
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real].double(), expected[real], rtol=0, atol=2e-5)


def reference_pairs(version, heads, layer_maps):
    """(index of map 1, index of map 2, A1, A2, λ) per differential head from the reference's maps of one layer:
    λ a float (version 1) or one value per token (DIFF V2)."""
    if version == 1:
        head_maps, lam = layer_maps
        return [(i, i + heads // 2, a1, a2, lam) for i, (a1, a2) in enumerate(head_maps)]
    return [(2 * i, 2 * i + 1, a1, a2, lam) for i, (a1, a2, lam) in enumerate(layer_maps)]


@pytest.mark.parametrize("version,heads,kv_heads", [(1, 6, 3), (1, 8, 1), (2, 6, 3), (2, 18, 3), (2, 8, 1)])
def test_attention_maps_differential_maps_and_lambdas_match_reference(version, heads, kv_heads):
    model = differential_model(version, heads=heads, kv_heads=kv_heads)
    model.set_attn_implementation("eager")
    input_ids, attention_mask = random_batch()
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, output_attentions=True, output_hidden_states=True)
        maps = model.differential_maps(out)
        lambdas = model.differential_lambdas(out)
    _, reference_maps = reference_forward(model.config, checkpoint_state_dict(model), input_ids, attention_mask,
                                          return_maps=True)
    layers = model.config.num_hidden_layers
    assert len(out.attentions) == len(maps) == len(lambdas) == layers
    if version == 1:  # the public function over `get_lambdas` gives the same maps
        for mine, public in zip(maps, differential_attention_maps(out.attentions, model.get_lambdas())):
            torch.testing.assert_close(public, mine, rtol=0, atol=0)
    for layer in range(layers):
        assert out.attentions[layer].shape == (3, heads, 9, 9)
        assert maps[layer].shape == (3, heads // 2, 9, 9)
        for b in range(3):
            real = attention_mask[b].bool()
            first, second, a1, a2, lam = zip(*reference_pairs(version, heads, reference_maps[b][layer]))
            a1, a2 = torch.stack(a1), torch.stack(a2)  # (H/2, q, k)
            attentions = out.attentions[layer][b]
            torch.testing.assert_close(attentions[list(first)][:, real], a1[:, real], rtol=0, atol=1e-12)
            torch.testing.assert_close(attentions[list(second)][:, real], a2[:, real], rtol=0, atol=1e-12)
            if version == 1:
                assert lambdas[layer].item() == pytest.approx(lam[0], abs=1e-12)
                lam = torch.tensor(lam[0], dtype=torch.float64)
            else:
                lam = torch.stack(lam)  # (H/2, q)
                torch.testing.assert_close(lambdas[layer][b, real], lam[:, real].T, rtol=0, atol=1e-12)
                lam = lam[:, :, None]
            torch.testing.assert_close(maps[layer][b][:, real], (a1 - lam * a2)[:, real], rtol=0, atol=1e-12)


def test_differential_maps_need_eager_attention():
    model = tiny_model()
    with pytest.raises(ValueError, match="eager"):
        differential_attention_maps((None,) * 3, model.get_lambdas())


def test_lambda_follows_equation_and_layer_depth():
    model = differential_model(1, layers=5)
    for layer, attn in enumerate(layer.self_attn for layer in model.model.layers):
        expected = (
            math.exp((attn.differential_lambda.lambda_q1 @ attn.differential_lambda.lambda_k1).item())
            - math.exp((attn.differential_lambda.lambda_q2 @ attn.differential_lambda.lambda_k2).item())
            + 0.8
            - 0.6 * math.exp(-0.3 * layer)
        )
        assert attn.differential_lambda().item() == pytest.approx(expected, abs=1e-12)


# Version 1 on both backends (SDPA decodes with its own one-token kernel); DIFF V2 has no kernel of its own.
DECODE_CASES = ([(1, h, g, attn) for h, g in LAYOUTS for attn in ("sdpa", "eager")]
                + [(2, h, g, "sdpa") for h, g in [(6, 3), (8, 1), (18, 3)]])


@pytest.mark.parametrize("version,heads,kv_heads,attn", DECODE_CASES)
def test_decoding_steps_match_reference_with_left_padding(version, heads, kv_heads, attn):
    """Token-by-token decoding with a cache (SDPA runs its own one-token kernel, eager the generic path) gives the
    reference's logits and the uncached forward's, and the cache is exactly a LLaMA's: G heads of width d."""
    from transformers import DynamicCache

    model = differential_model(version, heads=heads, kv_heads=kv_heads)
    model.set_attn_implementation(attn)
    input_ids, attention_mask = random_batch()
    cache = DynamicCache(config=model.config)
    logits = prefill_then_decode(model, input_ids, attention_mask, cache=cache)
    assert cache.layers[0].keys.shape == cache.layers[0].values.shape == (3, kv_heads, 9, model.config.head_dim)
    expected = reference_forward(model.config, checkpoint_state_dict(model), input_ids, attention_mask)
    with torch.no_grad():
        uncached = model(input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=1e-12)
    torch.testing.assert_close(logits[real], uncached[real], rtol=0, atol=1e-12)
