"""A decoding step compiled with `fullgraph=True` over a static cache: one graph for every step, no graph break, no
recompilation, for version 1 and DIFF V2. That is what lets `torch.compile(mode="reduce-overhead")` replay the step
as one CUDA graph (bench/cuda_benchmark.py times it on a GPU).

The backend is `aot_eager`: graph breaks and recompilations are decided by dynamo, before any backend runs, and
aot_eager still functionalises the in-place cache updates as inductor does, without inductor's minutes of C++
compilation on a small CPU.

DIFF V2's graph also never holds the cached keys or values repeated to all query heads: under the static cache's mask,
transformers' SDPA would copy them every step, and DIFF V2 has twice a LLaMA's query heads.
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from transformers import StaticCache

from conftest import differential_model, needs_fullgraph_compile
from diff_llama.differential_kernels import _MATCHING_KERNELS
from diff_llama.compat_diff_llama import CACHE_NAME

pytestmark = needs_fullgraph_compile

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


def repeated_cache_nodes(graph, heads, cache_len) -> list:
    """Nodes of a dynamo graph whose value holds `heads` heads of the whole cache: (batch, heads, cache_len, d)."""
    return [node.name for node in graph.graph.nodes
            if isinstance(value := node.meta.get("example_value"), torch.Tensor) and value.dim() == 4
            and tuple(value.shape[1:3]) == (heads, cache_len)]


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
    if version == 2:  # (version 1 repeats odd G's key/value heads up to H on purpose: see DiffLlamaAttention)
        heads, cache_len = model.config.num_attention_heads, PROMPT + STEPS
        assert repeated_cache_nodes(backend.graphs[0], heads, cache_len) == []
        assert repeated_cache_nodes(backend.graphs[0], model.config.num_key_value_heads, cache_len)  # guards the check
