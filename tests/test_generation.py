"""Caches, generation, padding, compile, half precision and the pipeline."""

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig, DynamicCache, pipeline

from conftest import tiny_model
from reference import checkpoint_state_dict, reference_forward


@pytest.mark.parametrize("heads,kv_heads", [(6, 3), (8, 1), (8, 4)])
def test_cached_logits_equal_uncached(heads, kv_heads):
    model = tiny_model(torch.float64, num_attention_heads=heads, num_key_value_heads=kv_heads)
    input_ids = torch.randint(3, 128, (2, 12))
    with torch.no_grad():
        full = model(input_ids).logits
        cache = DynamicCache(config=model.config)
        prefix = model(input_ids[:, :7], cache=cache, use_cache=True).logits
        steps = [model(input_ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(7, 12)]
    torch.testing.assert_close(torch.cat([prefix, *steps], dim=1), full, rtol=0, atol=1e-12)


def test_the_older_cache_argument_name_still_works():
    """transformers 5.24 renamed `past_key_values` to `cache`; the old name is accepted with a warning, as Llama's."""
    model = tiny_model(torch.float64)
    input_ids = torch.randint(3, 128, (1, 6))
    with torch.no_grad():
        full = model(input_ids).logits
        cache = DynamicCache(config=model.config)
        model(input_ids[:, :5], cache=cache, use_cache=True)
        with pytest.warns(FutureWarning, match="past_key_values"):
            last = model(input_ids[:, 5:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(last, full[:, 5:], rtol=0, atol=1e-12)


def _greedy(model, input_ids, attention_mask=None, **kwargs):
    return model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False, pad_token_id=0, **kwargs
    )


def test_greedy_generation_matches_reference_argmax():
    """Every greedily generated token is the argmax of the float64 reference on the sequence so far."""
    model = tiny_model(torch.float64)
    prompt = torch.randint(3, 128, (1, 5))
    generated = _greedy(model, prompt)
    logits = reference_forward(model.config, checkpoint_state_dict(model), generated[:, :-1])
    expected_next = logits[0, prompt.shape[1] - 1 :].argmax(-1)
    assert generated[0, prompt.shape[1] :].tolist() == expected_next.tolist()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_left_padded_batch_matches_each_prompt_alone(attn):
    model = tiny_model(num_attention_heads=8, num_key_value_heads=1)
    model.set_attn_implementation(attn)
    prompts = [torch.randint(3, 128, (n,)) for n in (9, 4, 6)]
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = prompt
        attention_mask[row, width - len(prompt) :] = 1
    batched = _greedy(model, input_ids, attention_mask)[:, width:]
    for row, prompt in enumerate(prompts):
        alone = _greedy(model, prompt[None])[0, len(prompt) :]
        assert batched[row].tolist() == alone.tolist()


def test_static_cache_matches_dynamic_cache():
    model = tiny_model(num_attention_heads=6, num_key_value_heads=3)
    prompt = torch.randint(3, 128, (2, 6))
    dynamic = _greedy(model, prompt)
    static = _greedy(model, prompt, cache_implementation="static")
    assert static.tolist() == dynamic.tolist()


def test_compiled_static_cache_generation_matches_eager_generation():
    model = tiny_model(num_attention_heads=6, num_key_value_heads=3)
    prompt = torch.randint(3, 128, (1, 6))
    expected = _greedy(model, prompt)
    compile_config = CompileConfig(fullgraph=True)
    compile_config._compile_all_devices = True  # generate compiles on CPU only when forced (see SPEC.md)
    torch._dynamo.reset()
    counters.clear()
    compiled = _greedy(model, prompt, cache_implementation="static", compile_config=compile_config)
    assert compiled.tolist() == expected.tolist()
    assert counters["stats"]["unique_graphs"] >= 1  # the static path really went through torch.compile


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_half_precision_stays_finite_and_close(dtype, attn):
    model32 = tiny_model(num_attention_heads=8, num_key_value_heads=2)
    model = tiny_model(dtype, num_attention_heads=8, num_key_value_heads=2)
    model.set_attn_implementation(attn)
    input_ids = torch.randint(3, 128, (2, 24))
    with torch.no_grad():
        logits = model(input_ids).logits
        expected = model32(input_ids).logits
    assert logits.dtype == dtype and torch.isfinite(logits).all()
    assert (logits.float() - expected).abs().max() < 0.05
    generated = _greedy(model, input_ids[:, :5])
    with torch.no_grad():  # greedy decoding in half precision follows the model's own half-precision logits
        assert generated[:, 5].tolist() == model(input_ids[:, :5]).logits[:, -1].argmax(-1).tolist()
        full = model(generated[:, :-1]).logits.float()
    assert generated.shape == (2, 13) and (full[:, 4:].argmax(-1) == generated[:, 5:]).float().mean() >= 0.75
    assert model.model.layers[0].self_attn.differential_lambda().dtype == torch.float32


def test_text_generation_pipeline(tokenizer):
    model = tiny_model(vocab_size=len(tokenizer))
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    out = generator("The differential transformer", max_new_tokens=6, do_sample=False)
    text = out[0]["generated_text"]
    inputs = tokenizer("The differential transformer", return_tensors="pt")
    expected = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert text == tokenizer.decode(expected[0], skip_special_tokens=True)  # the pipeline runs our model's generate
