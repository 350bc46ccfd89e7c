"""transformers' continuous batching (`model.generate_batch`, and `diff-llama serve --continuous-batching`): requests
of different lengths packed into shared forward passes over a paged cache, prefills split across passes, requests
joining while others decode. Each request's tokens and log-probabilities are the float64 reference's for its own
sequence alone."""

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from conftest import differential_model
from reference import checkpoint_state_dict, reference_forward


NEW_TOKENS = 6


def _prompts():
    generator = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 128, (8,), generator=generator).tolist()
    alone = [torch.randint(3, 128, (length,), generator=generator).tolist() for length in (3, 11, 5, 9)]
    return [*alone, shared + [7], shared + [9, 4]]  # the last two share two 4-token pages of prefix


@pytest.mark.parametrize("version,heads,kv_heads", [(1, 6, 3), (1, 6, 1), (2, 6, 3), (2, 6, 1)])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_each_request_of_a_continuous_batch_gets_the_references_greedy_tokens(version, heads, kv_heads, attn):
    model = differential_model(version, torch.float64, heads=heads, kv_heads=kv_heads)
    model.set_attn_implementation(attn)
    prompts = _prompts()
    # 16 tokens a pass: fewer than the 47 prompt tokens, so prefills are split and requests join mid-decoding.
    batching = ContinuousBatchingConfig(page_size=4, max_batch_tokens=16, num_blocks=64, return_logprobs=True)
    generation = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    outputs = list(model.generate_batch(prompts, generation_config=generation,
                                        continuous_batching_config=batching).values())
    assert sorted(output.prompt_ids for output in outputs) == sorted(prompts)
    for output in outputs:
        assert output.error is None and len(output.generated_tokens) == NEW_TOKENS
        sequence = torch.tensor([output.prompt_ids + output.generated_tokens])
        log_probs = reference_forward(model.config, checkpoint_state_dict(model), sequence[:, :-1])[0].log_softmax(-1)
        steps = log_probs[len(output.prompt_ids) - 1:]
        assert output.generated_tokens == steps.argmax(-1).tolist()
        expected = steps.gather(-1, torch.tensor(output.generated_tokens)[:, None])[:, 0]
        # transformers returns them in float32
        torch.testing.assert_close(torch.tensor(output.logprobs, dtype=torch.float64), expected, rtol=0, atol=1e-5)
