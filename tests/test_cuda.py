"""The CUDA paths, against the float64 reference on the CPU. Skipped where no CUDA device is present (CI, the 2-core
machines); run on a lent GPU with `pytest tests/test_cuda.py`.

Version 1 with every kernel that runs on CUDA (generic, blocked, decode, paired_sdpa_cuda) and DIFF V2, on the eager, SDPA and
FlexAttention backends (flash-attention 2 too where `flash_attn` is installed), for odd G, G = 1 and even G, with left
padding, a cache, gradients and bf16. The models are built and randomised in float64 on the CPU, where the reference
runs, then copied to the GPU: the GPU sees exactly the weights the reference saw. Then what users run on a GPU:
mixed precision (autocast) in every kernel, and the train, recover and generate commands.
"""

import importlib.util
from unittest import mock

import pytest
import torch

import diff_llama.differential_kernels as modeling  # BLOCKED_KERNEL_ROWS is read there
from conftest import differential_model, grouped_attention_inputs, padded_labels, prefill_then_decode, random_batch
from diff_llama.differential_kernels import (
    ALL_DIFFERENTIAL_KERNELS,
    folded_gqa_sdpa_attention_forward,
    select_differential_kernel,
)
from reference import checkpoint_state_dict, grouped_query_attention, reference_forward

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICE = "cuda"

BACKENDS = ["eager", "sdpa"] + (["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])
# (query maps, key/value heads): odd G, G = 1, even G; V2 with 18 maps over 3 heads is SmolLM2's converted layout.
V1_LAYOUTS = [(6, 3), (8, 1), (8, 4)]
V2_LAYOUTS = [(6, 3), (8, 1), (18, 3)]
# fp32 on the GPU against float64: reductions in another order, no TF32 (below). A wrong pairing or λ is O(0.1).
FP32_ATOL = 1e-4
HEAD_DIM = 16  # FlexAttention and flash kernels on CUDA want head widths of 16 or more


@pytest.fixture(autouse=True)
def no_tf32():
    # Plain assignment: these flags are module properties that mock.patch cannot delete on the way out.
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def float64_model(version, heads, kv_heads, layers=3):
    return differential_model(version, torch.float64, heads=heads, kv_heads=kv_heads, layers=layers, head_dim=HEAD_DIM)


def on_cuda(model, dtype, backend, kernel=None):
    model = model.to(DEVICE, dtype)
    model.set_attn_implementation(backend)
    if kernel is not None:
        model.set_differential_kernel(kernel)
    return model


def cases():
    for heads, kv_heads in V1_LAYOUTS:
        for kernel in ("generic", "blocked", "decode"):
            yield 1, heads, kv_heads, kernel
    for heads, kv_heads in V2_LAYOUTS:
        yield 2, heads, kv_heads, None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("version,heads,kv_heads,kernel", list(cases()))
def test_fp32_prefill_and_cached_decoding_match_the_reference(version, heads, kv_heads, kernel, backend):
    model = float64_model(version, heads, kv_heads)
    input_ids, attention_mask = random_batch()
    state = checkpoint_state_dict(model)
    expected = reference_forward(model.config, state, input_ids, attention_mask)
    expected_plain = reference_forward(model.config, state, input_ids)
    model = on_cuda(model, torch.float32, backend, kernel)
    logits = prefill_then_decode(model, input_ids.to(DEVICE), attention_mask.to(DEVICE)).cpu().double()
    with torch.no_grad():
        plain = model(input_ids.to(DEVICE)).logits.cpu().double()
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=FP32_ATOL)
    torch.testing.assert_close(plain, expected_plain, rtol=0, atol=FP32_ATOL)


@pytest.mark.parametrize("version,heads,kv_heads", [(1, 6, 3), (1, 8, 1), (2, 6, 3), (2, 8, 1)])
def test_flex_attention_forward_and_gradients_match_the_reference(version, heads, kv_heads):
    """FlexAttention compiles a Triton kernel per shape, so one padded forward and one backward per layout."""
    model = float64_model(version, heads, kv_heads, layers=2)
    input_ids, attention_mask = random_batch(length=16)
    expected = reference_forward(model.config, checkpoint_state_dict(model), input_ids, attention_mask)
    labels = padded_labels(input_ids, attention_mask)
    reference_grads = gradients(model, input_ids, attention_mask, labels)
    model = on_cuda(model, torch.float32, "flex_attention")
    with torch.no_grad():
        logits = model(input_ids.to(DEVICE), attention_mask=attention_mask.to(DEVICE)).logits.cpu().double()
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=FP32_ATOL)
    assert_gradients_close(gradients(model, input_ids, attention_mask, labels), reference_grads, 1e-3)


def gradients(model, input_ids, attention_mask, labels) -> dict:
    device = next(model.parameters()).device
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids.to(device), attention_mask=attention_mask.to(device), labels=labels.to(device)).loss
    loss.backward()
    # Copies: moving the model to another device or dtype later converts its .grad tensors in place.
    grads = {"loss": loss.detach().cpu().double().clone()}
    grads.update({name: param.grad.cpu().double().clone() for name, param in model.named_parameters()})
    model.eval()
    return grads


def relative_error(actual: dict, expected: dict) -> float:
    """The norm of every gradient's error, each entry relative to its gradient's largest."""
    return torch.cat([((actual[name] - want) / (want.abs().max() + 1e-12)).flatten()
                      for name, want in expected.items()]).norm().item()


def causal_training_case(heads, kv_heads):
    """A version 1 model (float64, on the CPU), an unpadded batch, and the relative error of a run's gradients against
    the model's own float64 gradients."""
    model = float64_model(1, heads, kv_heads)
    input_ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    expected = gradients(model, input_ids, attention_mask, input_ids)
    return model, input_ids, attention_mask, lambda actual: relative_error(actual, expected)


def assert_gradients_close(actual: dict, expected: dict, relative: float):
    """Each gradient within `relative` of its largest entry (plus a floor for the all-but-zero ones)."""
    assert actual.keys() == expected.keys()
    for name, want in expected.items():
        error = (actual[name] - want).abs().max().item()
        assert error <= relative * want.abs().max().item() + 1e-7, f"{name}: error {error:.3g}"


@pytest.mark.parametrize("version,backend,kernel", [
    (1, "sdpa", "generic"), (1, "sdpa", "blocked"), (1, "eager", "generic"), (2, "sdpa", None), (2, "eager", None)])
@pytest.mark.parametrize("heads,kv_heads", [(6, 3), (8, 1)])
def test_fp32_training_gradients_match_float64(version, backend, kernel, heads, kv_heads):
    """Loss and every parameter's gradient (λ included) with left padding, on the GPU against the CPU in float64."""
    model = float64_model(version, heads, kv_heads)
    input_ids, attention_mask = random_batch(length=14)
    labels = padded_labels(input_ids, attention_mask)
    expected = gradients(model, input_ids, attention_mask, labels)
    with mock.patch.object(modeling, "BLOCKED_KERNEL_ROWS", 4):  # several blocks, causal ones skipped
        actual = gradients(on_cuda(model, torch.float32, backend, kernel), input_ids, attention_mask, labels)
    assert_gradients_close(actual, expected, 1e-3)


@pytest.mark.parametrize("version", [1, 2])
def test_a_training_step_compiled_by_inductor_matches_float64(version):
    """What `Trainer(torch_compile=True)` runs on a GPU: forward and backward compiled whole by inductor (Triton
    kernels), one graph with no break, left padding, every gradient within the eager path's bound of the reference.
    (tests/test_compile_and_export.py checks the graph on the CPU with aot_eager.)"""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = float64_model(version, 6, 3, layers=2)
    input_ids, attention_mask = random_batch(length=14)
    labels = padded_labels(input_ids, attention_mask)
    expected = gradients(model, input_ids, attention_mask, labels)
    model = on_cuda(model, torch.float32, "sdpa").train()
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    backend = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    loss = compiled(input_ids.to(DEVICE), attention_mask=attention_mask.to(DEVICE), labels=labels.to(DEVICE)).loss
    loss.backward()
    actual = {"loss": loss.detach().cpu().double()}
    actual.update({name: param.grad.cpu().double() for name, param in model.named_parameters()})
    assert backend.frame_count == 1
    assert_gradients_close(actual, expected, 1e-3)


@pytest.mark.parametrize("version,kernel", [(1, "generic"), (1, "blocked"), (2, None)])
def test_bf16_logits_are_as_close_to_the_reference_as_the_cpu_bf16_path(version, kernel):
    """bf16 on the GPU rounds like bf16 anywhere: its error against float64 stays within 1.5x that of the CPU's bf16
    eager path on the same weights (the bf16 rounding of the weights is in both)."""
    model = float64_model(version, 6, 3)
    input_ids, attention_mask = random_batch(length=40)
    expected = reference_forward(model.config, checkpoint_state_dict(model), input_ids, attention_mask)
    real = attention_mask.bool()

    def error(candidate, device):
        with torch.no_grad():
            logits = candidate(input_ids.to(device), attention_mask=attention_mask.to(device)).logits
        return (logits.cpu().double()[real] - expected[real]).abs().max().item()

    model = model.to(torch.bfloat16)
    model.set_attn_implementation("eager")
    cpu_error = error(model, "cpu")
    for backend in ("eager", "sdpa"):
        gpu_error = error(on_cuda(model, torch.bfloat16, backend, kernel), DEVICE)
        assert gpu_error <= 1.5 * cpu_error + 1e-3, (backend, gpu_error, cpu_error)
        model.cpu()


@pytest.mark.parametrize("version,kernel", [(1, "generic"), (1, "blocked"), (2, None)])
def test_bf16_gradients_are_as_close_to_float64_as_the_cpu_bf16_path(version, kernel):
    """A single bf16 gradient can be all rounding (λ's are sums of cancelling terms), so the check is on all of them
    at once: each gradient scaled by its float64 maximum, the error norm within 1.5x that of the CPU's bf16 path."""
    model = float64_model(version, 6, 3)
    input_ids, attention_mask = random_batch(length=40)
    labels = padded_labels(input_ids, attention_mask)
    expected = gradients(model, input_ids, attention_mask, labels)

    def error(actual):
        return torch.cat([((actual[name] - want) / (want.abs().max() + 1e-12)).flatten()
                          for name, want in expected.items()]).norm().item()

    model = model.to(torch.bfloat16)
    model.set_attn_implementation("sdpa")
    cpu_error = error(gradients(model, input_ids, attention_mask, labels))
    gpu_error = error(gradients(on_cuda(model, torch.bfloat16, "sdpa", kernel), input_ids, attention_mask, labels))
    assert gpu_error <= 1.5 * cpu_error, (gpu_error, cpu_error)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generation_logits_equal_a_full_forward_of_the_output(version, cache):
    """Greedy generation with a left-padded batch and a cache: each step's logits are those of one forward pass over
    the whole generated sequence."""
    model = on_cuda(float64_model(version, 6, 3), torch.float32, "sdpa")
    prompt, attention_mask = random_batch(length=7)
    prompt, attention_mask = prompt.to(DEVICE), attention_mask.to(DEVICE)
    out = model.generate(prompt, attention_mask=attention_mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                         cache_implementation=cache, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0)
    full_mask = torch.cat([attention_mask, torch.ones_like(out.sequences[:, 7:])], dim=1)
    with torch.no_grad():
        full = model(out.sequences, attention_mask=full_mask).logits[:, 6:-1]
    torch.testing.assert_close(torch.stack(out.logits, dim=1), full, rtol=0, atol=FP32_ATOL)


@pytest.mark.parametrize("heads,kv_heads", V1_LAYOUTS)
def test_paired_cuda_kernel_trains_as_close_to_float64_as_the_generic_path(heads, kv_heads):
    """paired_sdpa_cuda (FlashAttention's private ops, keeping only d-wide tensors for backward) really runs, and its
    bf16 loss and gradients are as close to float64 as the generic path's (no padding: the kernel's case)."""
    model, input_ids, attention_mask, error = causal_training_case(heads, kv_heads)
    generic = error(gradients(on_cuda(model, torch.bfloat16, "sdpa", "generic"), input_ids, attention_mask, input_ids))
    function = modeling.CausalPairedAttentionCUDA
    with mock.patch.object(function, "apply", wraps=function.apply) as spy:
        paired = error(gradients(on_cuda(model, torch.bfloat16, "sdpa", "paired_sdpa_cuda"), input_ids,
                                 attention_mask, input_ids))
    assert spy.call_count == 3  # once per layer
    assert paired <= 1.5 * generic, (paired, generic)


def test_dispatch_on_cuda_takes_the_generic_path_except_for_decoding():
    """The automatic choice on CUDA (DIFFERENTIAL_KERNEL_DISPATCH; bench/cuda_benchmark.py measures it)."""
    model = on_cuda(float64_model(1, 6, 3), torch.bfloat16, "sdpa")
    attention = model.model.layers[0].self_attn
    query = torch.randn(1, 6, 5, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    key = torch.randn(1, 6, 5, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    kernels = ALL_DIFFERENTIAL_KERNELS
    with torch.no_grad():
        assert select_differential_kernel(attention, query, key, None).function is kernels["generic"].function
        assert select_differential_kernel(attention, query[:, :, :1], key, None).function is kernels["decode"].function
    assert select_differential_kernel(attention, query.requires_grad_(), key, None).function is (
        kernels["generic"].function)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", V2_LAYOUTS + [(16, 4)])
def test_diff_v2_sdpa_folds_one_token_under_a_mask_as_the_reference_and_transformers_sdpa_say(heads, kv_heads, dtype):
    """DIFF V2's SDPA with one query token under a left-padded batch's mask (the query heads of each key/value head
    folded into its rows, nothing repeated) against the float64 equations and transformers' own SDPA (which repeats
    the keys and values under a mask): equal to the dtype's rounding. (16, 4) is a Llama-3.2-1B conversion's group."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from diff_llama.modeling_diff_llama import DiffLlamaV2Attention

    query, key, value, mask = grouped_attention_inputs(heads, kv_heads, 1, dtype, key_len=37, head_dim=HEAD_DIM,
                                                       device=DEVICE)
    module = DiffLlamaV2Attention(float64_model(2, heads, kv_heads, layers=1).config, layer_idx=0)
    output, weights = folded_gqa_sdpa_attention_forward(module, query, key, value, mask, scaling=module.scaling)
    stock, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=module.scaling)
    assert weights is None and output.is_contiguous() and output.shape == (3, 1, heads, HEAD_DIM)
    expected = grouped_query_attention(query.cpu(), key.cpu(), value.cpu(), mask.cpu())
    atol = FP32_ATOL if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(output.cpu().double(), expected, rtol=0, atol=atol)
    torch.testing.assert_close(output, stock)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("heads,kv_heads", V2_LAYOUTS)
def test_diff_v2_decoding_under_a_mask_matches_the_reference_with_either_cache(heads, kv_heads, cache):
    """fp32 DIFF V2 decoding a left-padded batch token by token on SDPA (every step under a mask, so through the
    folded path), with a dynamic or a static cache, against the float64 reference."""
    from transformers import DynamicCache, StaticCache

    model = float64_model(2, heads, kv_heads)
    input_ids, attention_mask = random_batch()
    expected = reference_forward(model.config, checkpoint_state_dict(model), input_ids, attention_mask)
    model = on_cuda(model, torch.float32, "sdpa")
    cache = (DynamicCache(config=model.config) if cache == "dynamic"
             else StaticCache(config=model.config, max_cache_len=input_ids.shape[1]))
    logits = prefill_then_decode(model, input_ids.to(DEVICE), attention_mask.to(DEVICE), cache=cache).cpu().double()
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=FP32_ATOL)


@pytest.mark.parametrize("heads,kv_heads", V1_LAYOUTS)
def test_rebuilding_for_backward_trains_as_close_to_float64_as_keeping_every_tensor(heads, kv_heads):
    """Version 1's generic path on CUDA keeps d-wide q, k, v and rebuilds the padded layout, the pair difference and
    o_proj's input in backward (`RebuiltForBackward`): its bf16 gradients are as close to float64 as those of the
    same path keeping every tensor. (Not bit for bit: FlashAttention's backward accumulates in a varying order.)"""
    model, input_ids, attention_mask, error = causal_training_case(heads, kv_heads)
    cuda_model = on_cuda(model, torch.bfloat16, "sdpa", "generic")
    packed, own_pack = [], modeling.RebuiltForBackward._pack

    def recording_pack(self, tensor):
        packed.append(own_pack(self, tensor))
        return packed[-1]

    with mock.patch.object(modeling.RebuiltForBackward, "_pack", recording_pack):
        rebuilt = error(gradients(cuda_model, input_ids, attention_mask, input_ids))
    assert any(not isinstance(entry, torch.Tensor) for entry in packed), "nothing was rebuilt"
    with mock.patch.object(modeling, "_pair_difference", modeling._pair_difference_value), \
            mock.patch.object(modeling.RebuiltForBackward, "_pack", lambda self, tensor: tensor):
        kept = error(gradients(cuda_model, input_ids, attention_mask, input_ids))
    assert rebuilt <= 1.1 * kept + 1e-6, (rebuilt, kept)


def test_train_peak_memory_is_the_cpu_prediction():
    """bench/cuda_memory_prediction.py predicts a training step's peak memory on the CPU (meta device, SDPA as on
    CUDA): here, on this GPU, within 1% for Llama and version 1 at Llama-3.2-1B's width (2 layers, 2,048 tokens)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import cuda_benchmark
    from cuda_memory_prediction import predict_train_peak

    shape = {**cuda_benchmark.SHAPES["llama-3.2-1b"], "num_hidden_layers": 2}
    batch = torch.randint(0, 1000, (1, 2048), device=DEVICE)
    for name in ("llama", "diff-llama"):
        model = cuda_benchmark.build(name, shape, cuda_benchmark.Plan(device=DEVICE))
        measured = cuda_benchmark.measure_train(model, batch, torch.device(DEVICE))["train peak memory (GiB)"]
        predicted = predict_train_peak(name, shape, 2048)
        del model
        torch.cuda.empty_cache()
        assert abs(predicted / measured - 1) < 0.01, (name, predicted, measured)


@pytest.mark.parametrize("version", [1, 2])
def test_retrieval_cases_in_a_padded_batch_answer_as_alone_on_cuda(tokenizer, version):
    """The GPU retrieval run scores its cases in left-padded batches: on CUDA (SDPA, lookahead decoding), each row's
    answer and attention allocation are the case's alone in float32, and bf16 batches give finite allocations."""
    from conftest import tiny_model
    from diff_llama.retrieval import make_case, run_case, run_cases

    cases = [make_case(tokenizer, length, depth, 2, 1, seed=f"cuda-batch-{length}")
             for length, depth in [(300, 0.5), (160, 0.0), (220, 1.0), (260, 0.25)]]
    model = tiny_model(vocab_size=len(tokenizer), max_position_embeddings=512, initializer_range=0.2,
                       diff_version=version)
    model = on_cuda(model, torch.float32, "sdpa")
    alone = [run_case(model, tokenizer, case, max_new_tokens=6) for case in cases]
    for first, second in zip(alone, run_cases(model, tokenizer, cases, max_new_tokens=6)):
        assert second["output"] == first["output"]
        assert second["allocation"] == pytest.approx(first["allocation"], abs=FP32_ATOL)
    model = model.to(torch.bfloat16)
    for result in run_cases(model, tokenizer, cases, max_new_tokens=6):
        assert all(torch.isfinite(torch.tensor(share)) for share in result["allocation"].values())


@pytest.mark.parametrize("lora", [False, True])
def test_train_and_recover_commands_train_on_cuda_in_mixed_precision(tmp_path, tokenizer, monkeypatch, lora):
    """`diff-llama train` and `recover` as users run them on a GPU: on CUDA, --autocast auto (bf16 there) with
    gradient checkpointing; recover samples its text from the source and runs the source beside the student, on the
    GPU and in the same precision; generate runs there too."""
    from conftest import SAMPLE_TEXT, LayerZeroQueries, make_llama
    from diff_llama.cli import main
    from diff_llama.resolve import load_causal_lm

    queries = LayerZeroQueries().watch(monkeypatch)
    source = make_llama(tmp_path / "llama", tokenizer)
    converted = tmp_path / "diff"
    assert main(["convert", str(source), str(converted), "--diff-version", "1", "--calibration-tokens", "1024",
                 "--eval-tokens", "1024"]) == 0
    (tmp_path / "text.txt").write_text(SAMPLE_TEXT)
    common = ["--block-size", "32", "--batch-size", "2", "--max-steps", "2", "--autocast", "auto",
              "--gradient-checkpointing"] + (["--lora"] if lora else [])
    assert main(["train", str(converted), "--data", str(tmp_path / "text.txt"), "--output", str(tmp_path / "trained"),
                 *common]) == 0
    assert queries.of("student") == [(torch.bfloat16, "cuda")] * 4  # 2 steps, each layer again in backward
    queries.seen.clear()
    assert main(["recover", str(converted), "--output", str(tmp_path / "recovered"), "--generate", "64", *common]) == 0
    assert queries.of("student") == [(torch.bfloat16, "cuda")] * 4
    assert queries.of("source")[-2:] == [(torch.bfloat16, "cuda")] * 2  # beside each step (after sampling the text)
    for folder in ("trained", "recovered"):
        assert load_causal_lm(tmp_path / folder).dtype == torch.float32
        assert main(["generate", str(tmp_path / folder), "The quick", "--raw", "--max-new-tokens", "4"]) == 0  # on CUDA


@pytest.mark.parametrize("diff_version", [1, 2])
def test_attention_map_draws_on_the_gpu_the_maps_of_the_cpu(tmp_path, tokenizer, diff_version):
    """`attention-map` computes on the GPU by default (--device auto); its maps, λ included, are the CPU's."""
    from conftest import tiny_model
    from diff_llama.attention_maps import attention_maps
    from diff_llama.cli import main

    model = tiny_model(vocab_size=len(tokenizer), num_attention_heads=4, num_key_value_heads=2,
                       diff_version=diff_version)
    on_cpu = attention_maps(model, tokenizer, "The quick brown fox", layer=1)
    on_gpu = attention_maps(model.to(DEVICE), tokenizer, "The quick brown fox", layer=1)
    assert on_gpu[4] == on_cpu[4]
    for got, want in zip(on_gpu[:4], on_cpu[:4]):
        assert got.device.type == "cpu"
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    model.cpu().save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    assert main(["attention-map", str(tmp_path / "m"), "--text", "The quick brown fox", "--layer", "1",
                 "--output", str(tmp_path / "maps")]) == 0
    assert len(list((tmp_path / "maps").glob("*.png"))) == 2


def test_autocast_keeps_diff_v2_lambda_and_the_subtraction_in_float32_on_cuda():
    """CUDA's autocast lists are not the CPU's: the same check there (tests/test_diff_v2.py)."""
    from test_diff_v2 import autocast_keeps_lambda_and_the_subtraction_in_float32

    autocast_keeps_lambda_and_the_subtraction_in_float32(DEVICE)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("kernel", [None, "generic", "blocked", "paired_sdpa_cuda"])
def test_every_kernel_trains_under_autocast_with_a_float32_difference_on_cuda(backend, kernel):
    from test_kernels import trains_under_autocast_with_a_float32_difference

    trains_under_autocast_with_a_float32_difference(backend, kernel, DEVICE)
