"""The fused DIFF V2 decoding probe of the CUDA benchmark (bench/fused_v2_decode.py, issue 40) against the float64
equations: on a GPU where there is one, else on the CPU under Triton's interpreter, so that the GPU run never meets
its first bug. Needs Triton (the GPU machines' image has it: scripts/run_gpu_image_tests.sh runs this file there);
skipped without it."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import differential_model, prefill_then_decode, random_batch, V2_LAYOUTS
from reference import checkpoint_state_dict, grouped_query_attention, reference_forward

pytest.importorskip("triton")
PROBE = Path(__file__).parents[1] / "bench" / "fused_v2_decode.py"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Without a GPU the kernel runs under Triton's interpreter, which must be on before Triton is first imported (its own
# library functions are kernels too): this file's tests then run in a pytest of their own with TRITON_INTERPRET=1.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_a_kernel_runner = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRETED,
                                           reason="run by test_every_check_passes_under_the_interpreter")


@pytest.mark.skipif(DEVICE == "cuda" or INTERPRETED, reason="the checks run directly here")
def test_every_check_passes_under_the_interpreter():
    root = Path(__file__).parents[1]
    this_file = Path(__file__).relative_to(root).as_posix()
    not_here = ("test_every_check_passes_under_the_interpreter",  # this test
                "test_the_fused_step_compiles_as_one_graph_with_the_eager_logits")  # GPU only
    deselect = [argument for name in not_here for argument in ("--deselect", f"{this_file}::{name}")]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", this_file, *deselect],
                            env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                            cwd=root)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, result.stdout[-2000:]


@pytest.fixture(scope="module")
def fused():
    spec = importlib.util.spec_from_file_location("fused_v2_decode_under_test", PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_token_inputs(heads, kv_heads, keys, head_dim=16, hidden=40, seed=0):
    """float64 inputs of one decoding step: queries (3, H, 1, d), a cache (3, G, keys, d), the layer's input
    (3, 1, hidden), lambda_proj's weight (H/2, hidden), and a mask (3, 1, 1, keys) with left padding (row 1 loses
    its first 70 keys: whole blocks of the kernel masked) and a static cache's empty tail (row 2)."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator, dtype=torch.float64) * scale

    query = draw(3, heads, 1, head_dim)
    key, value = draw(3, kv_heads, keys, head_dim), draw(3, kv_heads, keys, head_dim)
    hidden_states, weight = draw(3, 1, hidden), draw(heads // 2, hidden, scale=0.3)
    mask = torch.ones(3, 1, 1, keys, dtype=torch.bool)
    mask[1, ..., : min(70, keys - 1)] = False
    mask[2, ..., keys // 2 :] = False
    return query, key, value, hidden_states, weight, mask


def expected_heads(query, key, value, hidden_states, weight, mask):
    """O_{2i} − λ_i·O_{2i+1} from the equations, float64: (batch, 1, H/2, d)."""
    maps_outputs = grouped_query_attention(query, key, value, mask)
    lambdas = torch.sigmoid(hidden_states.double() @ weight.double().T)
    return maps_outputs[..., 0::2, :] - lambdas[..., None] * maps_outputs[..., 1::2, :]


def run(fused, dtype, query, key, value, hidden_states, weight, mask):
    query, key, value, hidden_states = (tensor.to(DEVICE, dtype) for tensor in (query, key, value, hidden_states))
    mask = None if mask is None else mask.to(DEVICE)
    return fused.fused_v2_decode(query, key, value, mask, hidden_states, weight.to(DEVICE, torch.float32),
                                 query.shape[-1] ** -0.5).cpu()


@needs_a_kernel_runner
@pytest.mark.parametrize("heads,kv_heads", [(heads, kv) for heads, kv in V2_LAYOUTS if heads // kv % 2 == 0])
@pytest.mark.parametrize("keys", [11, 150])
def test_the_kernel_gives_the_equations_heads_in_float32(fused, heads, kv_heads, keys):
    inputs = one_token_inputs(heads, kv_heads, keys)
    assert fused.supports(inputs[0], inputs[1], inputs[5])
    torch.testing.assert_close(run(fused, torch.float32, *inputs).double(), expected_heads(*inputs), rtol=0,
                               atol=2e-6)


@needs_a_kernel_runner
def test_a_head_dim_off_the_powers_of_two_and_a_layer_wider_than_one_block_of_lambda(fused):
    inputs = one_token_inputs(8, 2, 150, head_dim=12, hidden=1100)
    torch.testing.assert_close(run(fused, torch.float32, *inputs).double(), expected_heads(*inputs), rtol=0,
                               atol=2e-6)


@needs_a_kernel_runner
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_as_close_to_the_equations_as_the_shipped_forward(fused, dtype):
    """The shipped forward's step in half precision: SDPA on the rounded inputs, its output in half precision, then
    the subtraction with λ in float32, rounded once more. The kernel keeps its maps' outputs in float32 until the
    end, so it may be closer, never much further."""
    heads, kv_heads = 18, 3
    inputs = one_token_inputs(heads, kv_heads, 150)
    query, key, value, hidden_states, weight, mask = inputs
    expected = expected_heads(*inputs)
    rounded = [tensor.to(dtype) for tensor in (query, key, value)]
    outputs = torch.nn.functional.scaled_dot_product_attention(*rounded, attn_mask=mask, enable_gqa=True)
    outputs = outputs.transpose(1, 2)
    lambdas = torch.sigmoid(hidden_states.to(dtype).float() @ weight.float().T)
    shipped = torch.addcmul(outputs[..., 0::2, :], lambdas[..., None], outputs[..., 1::2, :], value=-1).to(dtype)
    shipped_error = (shipped.double() - expected).abs().max().item()
    fused_error = (run(fused, dtype, *inputs).double() - expected).abs().max().item()
    assert fused_error <= 1.25 * shipped_error, (fused_error, shipped_error)


@needs_a_kernel_runner
def test_no_mask_attends_to_every_key(fused):
    inputs = one_token_inputs(8, 2, 150)
    everything = torch.ones_like(inputs[5])
    torch.testing.assert_close(run(fused, torch.float32, *inputs[:5], None),
                               run(fused, torch.float32, *inputs[:5], everything), rtol=0, atol=0)


@needs_a_kernel_runner
def test_shapes_outside_the_probe_are_refused(fused):
    query, key, _, _, _, mask = one_token_inputs(8, 2, 20)
    assert not fused.supports(query.repeat(1, 1, 2, 1), key, mask)  # two query tokens
    assert not fused.supports(query[:, :6], key, mask)  # 3 query heads a group: a pair would straddle two groups
    assert not fused.supports(query, key, mask.float())  # an additive mask


@needs_a_kernel_runner
def test_a_model_with_the_fused_forward_decodes_the_references_logits(fused, monkeypatch):
    """A left-padded prefill (the shipped forward: several tokens), then one token at a time over a static cache (the
    fused kernel), float32: the reference's logits at every real position."""
    from transformers import StaticCache

    model = differential_model(2, dtype=torch.float32, heads=12, kv_heads=2, head_dim=16).to(DEVICE)
    model.set_attn_implementation("sdpa")
    input_ids, attention_mask = random_batch()
    expected = reference_forward(model.config, checkpoint_state_dict(model), input_ids, attention_mask)
    calls = []
    kernel = fused.fused_v2_decode
    monkeypatch.setattr(fused, "fused_v2_decode", lambda *args: calls.append(1) or kernel(*args))
    assert fused.install(model) == model.config.num_hidden_layers
    cache = StaticCache(config=model.config, max_cache_len=input_ids.shape[1] + 3)
    logits = prefill_then_decode(model, input_ids.to(DEVICE), attention_mask.to(DEVICE), cache=cache).cpu()
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real].double(), expected[real], rtol=0, atol=1e-5)
    decoded_tokens = input_ids.shape[1] - 5
    assert len(calls) == decoded_tokens * model.config.num_hidden_layers


@needs_a_kernel_runner
def test_without_padding_the_fused_forward_decodes_the_shipped_models_logits(fused):
    """No attention mask at all, as a benchmark's prompt has: the static cache's empty tail must still be masked."""
    from transformers import StaticCache

    from diff_llama.compat_diff_llama import CACHE_NAME

    model = differential_model(2, dtype=torch.float32, heads=8, kv_heads=2, head_dim=16).to(DEVICE)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4)).to(DEVICE)

    def decode():
        cache = StaticCache(config=model.config, max_cache_len=32)
        with torch.no_grad():
            logits = [model(ids[:, :4], use_cache=True, **{CACHE_NAME: cache}).logits]
            for t in range(4, ids.shape[1]):
                position = torch.full((2, 1), t, device=DEVICE)
                logits.append(model(ids[:, t : t + 1], position_ids=position, use_cache=True,
                                    **{CACHE_NAME: cache}).logits)
        return torch.cat(logits, dim=1)

    shipped = decode()
    fused.install(model)
    torch.testing.assert_close(decode(), shipped, rtol=0, atol=1e-5)


@needs_a_kernel_runner
def test_install_refuses_a_model_without_diff_v2_attention(fused):
    with pytest.raises(ValueError, match="no DIFF V2 attention"):
        fused.install(differential_model(1, dtype=torch.float32))


@pytest.mark.skipif(DEVICE != "cuda", reason="compiling a Triton kernel into a graph needs a GPU")
def test_the_fused_step_compiles_as_one_graph_with_the_eager_logits(fused):
    """What the benchmark's graphs figure does with the probe: the step compiled with fullgraph=True and CUDA graphs,
    one compilation for every step, the uncompiled fused model's logits."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters
    from transformers import StaticCache

    from diff_llama.compat_diff_llama import CACHE_NAME

    model = differential_model(2, dtype=torch.bfloat16, heads=12, kv_heads=2, head_dim=16, layers=2).to(DEVICE)
    model.set_attn_implementation("sdpa")
    fused.install(model)
    generator = torch.Generator().manual_seed(2)
    prompt_len, steps = 5, 12
    prompt = torch.randint(3, model.config.vocab_size, (2, prompt_len), generator=generator).to(DEVICE)
    tokens = torch.randint(3, model.config.vocab_size, (2, steps), generator=generator).to(DEVICE)

    def step(token, position, cache):
        return model(input_ids=token, position_ids=position, use_cache=True, logits_to_keep=1,
                     **{CACHE_NAME: cache}).logits[:, -1]

    def logits_of(run_step):
        cache = StaticCache(config=model.config, max_cache_len=prompt_len + steps)
        with torch.no_grad():
            model(input_ids=prompt, use_cache=True, **{CACHE_NAME: cache})
            position = torch.full((2, 1), prompt_len, device=DEVICE)
            logits = []
            for token in tokens.unbind(1):
                logits.append(run_step(token[:, None], position, cache).clone())
                position = position + 1
        return torch.stack(logits, dim=1).float()

    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("inductor")
    compiled = logits_of(torch.compile(step, backend=backend, fullgraph=True, dynamic=False))
    assert dict(counters["graph_break"]) == {} and backend.frame_count == 1
    torch.testing.assert_close(compiled, logits_of(step), rtol=0, atol=2e-2)
