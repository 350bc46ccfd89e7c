"""Caches, generation, padding, compile, half precision and the pipeline; shared properties for both `diff_version`s."""

import copy
from contextlib import nullcontext

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig, DynamicCache, pipeline

from conftest import differential_model, needs_fullgraph_compile, random_batch, tiny_model
from reference import checkpoint_state_dict, reference_forward


# Also run on the oldest supported transformers (scripts/run_oldest_transformers_tests.sh).
pytestmark = pytest.mark.oldest_transformers


def test_the_older_cache_argument_name_still_works():
    """transformers 5.24 renamed `past_key_values` to `cache`; the old name is accepted, with a warning, as Llama's,
    where transformers itself uses `cache` (silently where it still uses `past_key_values`)."""
    from diff_llama.compat_diff_llama import CACHE_NAME

    model = tiny_model(torch.float64)
    input_ids = torch.randint(3, 128, (1, 6))
    with torch.no_grad():
        full = model(input_ids).logits
        cache = DynamicCache(config=model.config)
        model(input_ids[:, :5], cache=cache, use_cache=True)
        with pytest.warns(FutureWarning, match="past_key_values") if CACHE_NAME == "cache" else nullcontext():
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


@pytest.mark.parametrize("version", [1, 2])
def test_a_model_built_under_inference_mode_generates_the_references_tokens(version):
    """Parameters made under `torch.inference_mode()` have no version counter, which version 1's reuse of λ across
    decoding steps reads: such a model must still decode, with the reference's greedy tokens, as Llama's does."""
    with torch.inference_mode():
        model = differential_model(version, heads=6, kv_heads=3)
        assert model.model.layers[0].self_attn.q_proj.weight.is_inference()
        prompt = torch.randint(3, 128, (1, 5))
        generated = _greedy(model, prompt)
    logits = reference_forward(model.config, checkpoint_state_dict(model), generated[:, :-1])
    assert generated[0, prompt.shape[1] :].tolist() == logits[0, prompt.shape[1] - 1 :].argmax(-1).tolist()


@pytest.mark.parametrize("version,heads,kv_heads", [(1, 8, 1), (2, 6, 3)])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_left_padded_batch_matches_each_prompt_alone(version, heads, kv_heads, attn):
    model = differential_model(version, torch.float32, heads=heads, kv_heads=kv_heads)
    model.set_attn_implementation(attn)
    input_ids, attention_mask = random_batch()
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    width = input_ids.shape[1]
    batched = _greedy(model, input_ids, attention_mask)[:, width:]
    for row in range(len(input_ids)):
        prompt = input_ids[row][attention_mask[row].bool()]
        alone = _greedy(model, prompt[None])[0, len(prompt) :]
        assert batched[row].tolist() == alone.tolist()


@pytest.mark.parametrize("version", [1, 2])
def test_static_cache_matches_dynamic_cache(version):
    model = differential_model(version, torch.float32)
    prompt = random_batch(length=6)[0][:2]
    dynamic = _greedy(model, prompt)
    static = _greedy(model, prompt, cache_implementation="static")
    assert static.tolist() == dynamic.tolist()


@needs_fullgraph_compile
@pytest.mark.parametrize("version", [1, 2])
def test_compiled_static_cache_generation_and_compiled_forward_match_eager(version):
    model = differential_model(version, torch.float32, layers=2)
    prompt = random_batch(length=6)[0][:1]
    steps = dict(output_logits=True, return_dict_in_generate=True)
    expected = _greedy(model, prompt, **steps)
    compile_config = CompileConfig(fullgraph=True)
    compile_config._compile_all_devices = True  # generate compiles on CPU only when forced
    torch._dynamo.reset()
    counters.clear()
    compiled = _greedy(model, prompt, cache_implementation="static", compile_config=compile_config, **steps)
    assert compiled.sequences.tolist() == expected.sequences.tolist()
    assert counters["stats"]["unique_graphs"] >= 1  # the static path really went through torch.compile
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(expected.logits), rtol=1e-5, atol=1e-5)
    # a whole prompt in one compiled graph (generate runs the prefill eagerly); one layer keeps the compile short
    single = differential_model(version, torch.float32, layers=1)
    forward = torch.compile(single.forward, fullgraph=True, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(forward(prompt).logits, single(prompt).logits, rtol=1e-5, atol=1e-5)


# Version 1 on both backends (its kernels differ between them); DIFF V2 on SDPA.
HALF_CASES = [(1, 8, 2, attn) for attn in ("eager", "sdpa")] + [(2, 6, 3, "sdpa")]


@pytest.mark.parametrize("version,heads,kv_heads,attn", HALF_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_stays_finite_and_close(version, heads, kv_heads, attn, dtype):
    model32 = differential_model(version, torch.float32, heads=heads, kv_heads=kv_heads)
    model = differential_model(version, torch.float32, heads=heads, kv_heads=kv_heads).to(dtype)
    model.set_attn_implementation(attn)
    input_ids, attention_mask = random_batch(length=24)
    real = attention_mask.bool()
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask).logits
        expected = model32(input_ids, attention_mask=attention_mask).logits
    assert logits.dtype == dtype and torch.isfinite(logits[real]).all()
    error = (logits[real].float() - expected[real]).abs().max()
    assert error < 0.05 and error < 0.05 * expected[real].abs().max()
    prompt = input_ids[[0, 2], 1:6]  # two unpadded prompts
    generated = _greedy(model, prompt)
    with torch.no_grad():  # greedy decoding in half precision follows the model's own half-precision logits
        assert generated[:, 5].tolist() == model(prompt).logits[:, -1].argmax(-1).tolist()
        full = model(generated[:, :-1]).logits.float()
    assert generated.shape == (2, 13) and (full[:, 4:].argmax(-1) == generated[:, 5:]).float().mean() >= 0.75
    if version == 1:
        assert model.model.layers[0].self_attn.differential_lambda().dtype == torch.float32


def test_text_generation_pipeline(tokenizer):
    model = tiny_model(vocab_size=len(tokenizer))
    # A copy: the pipeline pads a decoder-only model's batches on the left, and sets that on the tokenizer it gets.
    generator = pipeline("text-generation", model=model, tokenizer=copy.deepcopy(tokenizer))
    out = generator("The differential transformer", max_new_tokens=6, do_sample=False)
    text = out[0]["generated_text"]
    inputs = tokenizer("The differential transformer", return_tensors="pt")
    expected = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert text == tokenizer.decode(expected[0], skip_special_tokens=True)  # the pipeline runs our model's generate


@pytest.mark.parametrize("version,heads,kv_heads", [(1, 6, 1), (2, 6, 3)])
def test_beam_search_scores_are_the_references_log_probabilities(version, heads, kv_heads):
    """Beam search reorders the cache between steps: every returned beam's score (length_penalty 0: the sum of its
    tokens' log-probabilities) is the float64 reference's for that sequence."""
    model = differential_model(version, torch.float64, heads=heads, kv_heads=kv_heads)
    prompt = random_batch(length=5)[0][:1]
    out = model.generate(prompt, max_new_tokens=6, do_sample=False, num_beams=4, num_return_sequences=4,
                         length_penalty=0.0, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    assert len({tuple(sequence) for sequence in out.sequences.tolist()}) == 4
    for sequence, score in zip(out.sequences, out.sequences_scores):
        log_probs = reference_forward(model.config, checkpoint_state_dict(model), sequence[None, :-1])[0].log_softmax(-1)
        tokens = sequence[prompt.shape[1]:]
        expected = log_probs[prompt.shape[1] - 1 :].gather(-1, tokens[:, None]).sum()
        torch.testing.assert_close(score.double(), expected, rtol=0, atol=1e-5)  # generate keeps them in float32


@pytest.mark.parametrize("version,heads,kv_heads", [(1, 6, 1), (2, 6, 3)])
def test_assisted_and_prompt_lookup_decoding_give_the_greedy_tokens(version, heads, kv_heads):
    """Speculative decoding checks several drafted tokens in one cached call and crops the cache back where a draft
    is rejected: with a draft model (the model with its output layer perturbed, so that it drafts some tokens right
    and some wrong) and with prompt lookup, the tokens are greedy decoding's and the logits the reference's."""
    model = differential_model(version, torch.float64, heads=heads, kv_heads=kv_heads)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        draft.lm_head.weight.add_(torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(0),
                                              dtype=torch.float64), alpha=0.5 * draft.lm_head.weight.std().item())
    prompt = torch.tensor([[5, 9, 11, 5, 9, 11, 5, 9, 20, 5, 9]])  # repeats, for prompt lookup to draft from
    greedy = _greedy(model, prompt)
    logits = reference_forward(model.config, checkpoint_state_dict(model), greedy[:, :-1])[0, prompt.shape[1] - 1:]
    assert greedy[0, prompt.shape[1]:].tolist() == logits.argmax(-1).tolist()
    for drafting in ({"assistant_model": draft}, {"prompt_lookup_num_tokens": 3}):
        out = _greedy(model, prompt, output_logits=True, return_dict_in_generate=True, **drafting)
        assert out.sequences.tolist() == greedy.tolist()
        # The logits too: a cache left holding a rejected draft's keys would shift them, the tokens perhaps not.
        torch.testing.assert_close(torch.cat(out.logits).double(), logits, rtol=0, atol=1e-5)  # float32 from generate
