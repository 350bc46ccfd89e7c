"""A training step under `torch.compile(fullgraph=True)` (what `Trainer(torch_compile=True)` and a GPU user's compiled
training run), and the model exported with `torch.export` for ExecuTorch through transformers' own recipe
(`TorchExportableModuleForDecoderOnlyLM`), for version 1 and DIFF V2, each against the float64 reference.

Version 1 once failed both: its training path asked autograd which node made the pair difference (`grad_fn`), which
the compiler cannot trace; a compiled training step broke its graph at every layer, and `torch.export` (which runs
with autograd on) refused the model.
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from conftest import differential_model, needs_fullgraph_compile, padded_labels, random_batch
from reference import checkpoint_state_dict, reference_forward

pytestmark = needs_fullgraph_compile

# (version, H, G): version 1 with odd G and with G = 1 (its key/value heads repeated), DIFF V2 with odd H/2 and G = 1.
LAYOUTS = [(1, 6, 3), (1, 8, 1), (2, 6, 3), (2, 6, 1)]


def reference_gradients(model, input_ids, attention_mask, weights, labels) -> dict:
    """Gradients of the float64 reference's loss, sum(logits · weights) on the labelled positions, by the model's
    parameter names."""
    checkpoint = checkpoint_state_dict(model)
    state = {name: tensor.detach().clone().requires_grad_() for name, tensor in checkpoint.items()}
    logits = reference_forward(model.config, state, input_ids, attention_mask)
    (logits * weights)[labels != -100].sum().backward()
    names = {param.data_ptr(): name for name, param in model.named_parameters()}
    return {names[tensor.data_ptr()]: state[key].grad for key, tensor in checkpoint.items() if tensor.data_ptr() in names}


@pytest.mark.parametrize("version,heads,kv_heads", LAYOUTS)
def test_a_training_step_compiles_as_one_graph_with_the_reference_gradients(version, heads, kv_heads):
    """A padded batch, forward and backward, compiled whole: no graph break, and every gradient (λ's included) the
    float64 reference's. The backend is `aot_eager`: dynamo decides the graph breaks, and AOTAutograd builds and
    partitions the backward as it does for inductor, without inductor's minutes of C++ compilation here."""
    model = differential_model(version, torch.float64, heads=heads, kv_heads=kv_heads).train()
    model.set_attn_implementation("sdpa")
    input_ids, attention_mask = random_batch(length=10)
    labels = padded_labels(input_ids, attention_mask)
    weights = torch.randn(*input_ids.shape, model.config.vocab_size, generator=torch.Generator().manual_seed(5),
                          dtype=torch.float64)

    def loss_of(model_or_compiled):
        logits = model_or_compiled(input_ids, attention_mask=attention_mask).logits
        return (logits * weights)[labels != -100].sum()

    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    loss_of(torch.compile(model, backend=backend, fullgraph=True)).backward()
    assert dict(counters["graph_break"]) == {} and backend.frame_count == 1
    expected = reference_gradients(model, input_ids, attention_mask, weights, labels)
    assert expected.keys() == {name for name, _ in model.named_parameters()}  # every parameter, λ's too
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("version,heads,kv_heads", LAYOUTS)
def test_exports_for_executorch_with_the_reference_logits(version, heads, kv_heads):
    """transformers' export recipe (a static cache in the exported program, one token a call, as ExecuTorch runs it):
    the exported program, fed a sequence token by token, gives the float64 reference's logits."""
    from transformers import GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model = differential_model(version, torch.float32, heads=heads, kv_heads=kv_heads, layers=2)
    model.generation_config = GenerationConfig(
        use_cache=True, cache_implementation="static", max_length=16, cache_config={"batch_size": 1, "max_cache_len": 16}
    )
    exported = TorchExportableModuleForDecoderOnlyLM(model).export(
        input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0])
    )
    step = exported.module()
    input_ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(version))
    with torch.no_grad():
        logits = torch.cat(
            [step(input_ids=input_ids[:, t : t + 1], cache_position=torch.tensor([t])) for t in range(12)], dim=1
        )
    expected = reference_forward(model.config, checkpoint_state_dict(model), input_ids)
    torch.testing.assert_close(logits.double(), expected, rtol=0, atol=1e-5)
