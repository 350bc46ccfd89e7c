"""The model under every transformers version setup.cfg declares (compat_diff_llama.py): run on the newest in .venv
and on the oldest by scripts/run_oldest_transformers_tests.sh. The trap it guards: a KV cache passed under a name the
forward does not take lands in `**kwargs` and is dropped, and only the tokens after the first one go wrong."""

import pytest
import torch
from transformers import DynamicCache

from conftest import differential_model, random_batch, tiny_config
from diff_llama import DiffLlamaConfig, DiffLlamaForCausalLM, DiffLlamaForSequenceClassification
from diff_llama.compat_diff_llama import CACHE_NAME, output_cache


pytestmark = pytest.mark.oldest_transformers


def _greedy(model, input_ids, attention_mask, **kwargs):
    return model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False, pad_token_id=0, **kwargs
    )


@pytest.mark.parametrize("version", [1, 2])
def test_cached_generation_equals_uncached_dynamic_and_static(version):
    model = differential_model(version, torch.float64)
    input_ids, attention_mask = random_batch(length=7)
    uncached = _greedy(model, input_ids, attention_mask, use_cache=False)
    assert _greedy(model, input_ids, attention_mask).tolist() == uncached.tolist()
    assert _greedy(model, input_ids, attention_mask, cache_implementation="static").tolist() == uncached.tolist()


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # the newest's own warning
@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_either_cache_name_reaches_every_layer(name):
    """Both names fill the cache and give the logits of the whole sequence, and the output carries the cache under
    the name the installed transformers reads."""
    model = differential_model(2, torch.float64)
    input_ids = torch.randint(3, 128, (1, 6))
    with torch.no_grad():
        full = model(input_ids).logits
        cache = DynamicCache(config=model.config)
        outputs = model(input_ids[:, :5], use_cache=True, **{name: cache})
        assert output_cache(outputs) is cache and cache.get_seq_length() == 5
        assert getattr(outputs, CACHE_NAME) is cache
        last = model(input_ids[:, 5:], use_cache=True, **{name: cache}).logits
    assert cache.get_seq_length() == 6
    torch.testing.assert_close(last, full[:, 5:], rtol=0, atol=1e-12)


def test_generic_heads_pass_the_cache_through():
    # transformers' generic task heads call the backbone with their own version's name for the cache.
    model = DiffLlamaForSequenceClassification(tiny_config(num_labels=3)).eval()
    with torch.no_grad():
        outputs = model(torch.randint(3, 128, (2, 5)), use_cache=True)
    assert output_cache(outputs).get_seq_length() == 5


@pytest.mark.parametrize("tie", [True, False])
def test_tensor_parallel_plan_follows_the_version_with_tied_embeddings(tie):
    # Older transformers add the tied embedding's style to the plan while constructing the config.
    config = DiffLlamaConfig(hidden_size=64, num_attention_heads=4, tie_word_embeddings=tie)
    assert "layers.*.self_attn.differential_lambda" in config.base_model_tp_plan
    config.diff_version = 2
    assert "layers.*.self_attn.differential_lambda.lambda_proj" in config.base_model_tp_plan
    assert "base_model_tp_plan" not in config.to_dict()
    assert DiffLlamaForCausalLM(tiny_config(tie_word_embeddings=tie)) is not None
