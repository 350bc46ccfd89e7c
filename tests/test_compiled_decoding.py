"""A decoding step compiled with `fullgraph=True` over a static cache: one graph for every step, no graph break, no
recompilation, for version 1 and DIFF V2. That is what lets `torch.compile(mode="reduce-overhead")` replay the step
as one CUDA graph (bench/cuda_benchmark.py times it on a GPU).

The backend is `aot_eager`: graph breaks and recompilations are decided by dynamo, before any backend runs, and
aot_eager still functionalises the in-place cache updates as inductor does, without inductor's minutes of C++
compilation on a small CPU.
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from transformers import StaticCache

from conftest import differential_model
from diff_llama.differential_kernels import _MATCHING_KERNELS
from diff_llama.compat_diff_llama import CACHE_NAME

PROMPT, STEPS, BATCH = 5, 24, 2


def decoding_step(model):
    def step(token, position, cache):
        return model(input_ids=token, position_ids=position, use_cache=True, logits_to_keep=1,
                     **{CACHE_NAME: cache}).logits[:, -1]

    return step


def teacher_forced_logits(model, step, prompt, tokens) -> torch.Tensor:
    """Logits of each of `tokens`' steps after an eager prefill of `prompt` into a new static cache."""
    cache = StaticCache(config=model.config, max_cache_len=PROMPT + STEPS)
    with torch.no_grad():
        model(input_ids=prompt, use_cache=True, **{CACHE_NAME: cache})
        position = torch.full((prompt.shape[0], 1), PROMPT)
        logits = []
        for token in tokens.unbind(1):
            logits.append(step(token[:, None], position, cache).clone())
            position = position + 1
    return torch.stack(logits, dim=1)


@pytest.mark.parametrize("version", [1, 2])
def test_a_compiled_decoding_step_runs_24_steps_as_one_graph_with_the_eager_logits(version):
    model = differential_model(version, torch.float32, layers=2)
    model.set_attn_implementation("sdpa")
    generator = torch.Generator().manual_seed(version)
    prompt = torch.randint(3, model.config.vocab_size, (BATCH, PROMPT), generator=generator)
    tokens = torch.randint(3, model.config.vocab_size, (BATCH, STEPS), generator=generator)

    # Compiled first, as in a fresh process: state the model fills on its first decoding step (the kernel choice's
    # memo) is then filled while dynamo traces, where a guard on it would recompile the next step.
    _MATCHING_KERNELS.clear()
    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(decoding_step(model), backend=backend, fullgraph=True, dynamic=False)
    logits = teacher_forced_logits(model, compiled, prompt, tokens)
    expected = teacher_forced_logits(model, decoding_step(model), prompt, tokens)

    assert dict(counters["graph_break"]) == {}
    assert backend.frame_count == 1, f"{backend.frame_count} compilations for {STEPS} steps: a recompilation"
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
