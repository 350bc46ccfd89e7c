"""What only DIFF V2 (`diff_version=2`) has: its layout rules, parameter shapes and checkpoint names, its per-token
λ, a save/load round trip through the Auto classes, and its SDPA, which decodes without repeating keys and values. Every property it shares with version 1 (the float64
reference, FlexAttention, caches and left padding, compiled generation, half precision, gradient checkpointing, LoRA)
is tested once for both versions, parametrised over `diff_version`, in test_reference.py, test_generation.py,
test_training_and_loading.py and test_finetuning.py."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import diff_llama.modeling_diff_llama as modeling
from conftest import (
    bytes_saved_for_backward,
    differential_model,
    grouped_attention_inputs,
    prefill_then_decode,
    random_batch,
    tiny_config,
)
from diff_llama import DiffLlamaConfig, DiffLlamaForCausalLM
from diff_llama.differential_kernels import folded_gqa_sdpa_attention_forward
from reference import checkpoint_state_dict, grouped_query_attention, reference_forward


# Also run on the oldest supported transformers (scripts/run_oldest_transformers_tests.sh).
pytestmark = pytest.mark.oldest_transformers


def test_layout_rules_are_checked_when_a_model_is_built():
    config = tiny_config(diff_version=2, num_attention_heads=6, num_key_value_heads=2)  # G must divide H/2 = 3
    with pytest.raises(ValueError, match="`num_key_value_heads`.*divide"):
        DiffLlamaForCausalLM(config)
    with pytest.raises(ValueError, match="`diff_version`"):
        DiffLlamaForCausalLM(tiny_config(diff_version=3))


def test_parameters_have_the_spec_shapes_and_names(tmp_path):
    model = differential_model(2, torch.float32, heads=18, kv_heads=3)
    attention, d, hidden = model.model.layers[0].self_attn, 8, 48
    assert attention.q_proj.weight.shape == (18 * d, hidden)
    assert attention.k_proj.weight.shape == attention.v_proj.weight.shape == (3 * d, hidden)
    assert attention.o_proj.weight.shape == (hidden, 9 * d)
    model.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.self_attn.lambda_proj.weight").shape == (9, hidden)
    assert not any("differential_lambda" in key or "head_norm" in key for key in keys)


def test_per_token_lambda_needs_the_hidden_states_and_has_no_per_layer_value():
    model = differential_model(2)
    model.set_attn_implementation("eager")
    input_ids, _ = random_batch()
    with pytest.raises(ValueError, match="output_hidden_states"):
        model.differential_lambdas(model(input_ids, output_attentions=True))
    with pytest.raises(ValueError, match="per token"):
        model.get_lambdas()


def test_auto_classes_and_save_load_round_trip(tmp_path):
    model = differential_model(2, torch.float32)
    model.save_pretrained(tmp_path)
    config = DiffLlamaConfig.from_pretrained(tmp_path)
    assert config.diff_version == 2
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, DiffLlamaForCausalLM)
    input_ids = random_batch()[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits, rtol=0, atol=0)


def test_bf16_lambda_projection_keeps_its_bf16_rows_for_backward():
    """In half-precision training λ's float32 product keeps its input rows as they are (q/k/v_proj keep them anyway),
    not a float32 copy, and its gradients are the float64 ones rounded."""
    from diff_llama.lambda_diff_llama import Float32ProductOfHalfRows

    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(12, 32, generator=generator).to(torch.bfloat16).requires_grad_()
    weight = (0.3 * torch.randn(3, 32, generator=generator)).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(12, 3, generator=generator)
    products = Float32ProductOfHalfRows.apply(rows, weight)
    assert products.dtype == torch.float32
    torch.testing.assert_close(products.double(), rows.double() @ weight.double().t(), rtol=1e-6, atol=1e-6)
    assert [saved.dtype for saved in products.grad_fn.saved_tensors] == [torch.bfloat16, torch.bfloat16]
    products.backward(grad)
    torch.testing.assert_close(rows.grad, (grad.double() @ weight.double()).to(torch.bfloat16), rtol=8e-3, atol=1e-3)
    torch.testing.assert_close(weight.grad, (grad.double().t() @ rows.double()).to(torch.bfloat16), rtol=8e-3,
                               atol=1e-3)


def ops_under_autocast(model, input_ids, device="cpu", dtype=torch.bfloat16) -> list[tuple[str, torch.dtype]]:
    """(aten op, output dtype) of every op of a training forward and backward under torch.autocast, as the Trainer's
    mixed precision (`bf16=True`) runs the model."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            output = func(*args, **(kwargs or {}))
            if isinstance(output, torch.Tensor):
                seen.append((func.overloadpacket.__name__, output.dtype))
            return output

    with Record(), torch.autocast(device, dtype=dtype):
        model(input_ids, labels=input_ids).loss.backward()
    return seen


def autocast_keeps_lambda_and_the_subtraction_in_float32(device):
    """Under mixed precision (torch.autocast, which the Trainer's bf16/fp16 wrap the forward in), DIFF V2's λ and the
    subtraction O_2i − λ·O_2i+1 stay float32, as in a half-precision model: autocast runs `mm` in half precision, so
    λ's product came out bf16 and took the subtraction down with it."""
    model = differential_model(2, torch.float32, heads=6, kv_heads=3, layers=2).to(device)
    attention = model.model.layers[0].self_attn
    hidden = torch.randn(2, 5, model.config.hidden_size, device=device)
    with torch.no_grad():
        expected = torch.sigmoid(hidden.double() @ attention.differential_lambda.lambda_proj.weight.double().t())
        with torch.autocast(device, dtype=torch.bfloat16):
            got = attention.differential_lambda(hidden)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-6)  # bf16 is off by about 1e-3
    ops = ops_under_autocast(model, random_batch()[0].to(device), device)
    assert ("mm", torch.bfloat16) in ops  # autocast is on: q/k/v/o and the MLP run in bf16
    assert {dtype for name, dtype in ops if name in ("sigmoid", "addcmul")} == {torch.float32}


def test_autocast_keeps_lambda_and_the_subtraction_in_float32():
    autocast_keeps_lambda_and_the_subtraction_in_float32("cpu")


def test_bf16_training_keeps_about_what_a_llama_with_its_query_heads_keeps():
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=16,
                 num_key_value_heads=2, head_dim=32)
    torch.manual_seed(0)
    llama = bytes_saved_for_backward(LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16))
    model = DiffLlamaForCausalLM(tiny_config(**shape, diff_version=2)).to(torch.bfloat16)
    assert bytes_saved_for_backward(model) <= 1.05 * llama  # 1.03x; 1.10x with a float32 copy of λ's input


# DIFF V2's SDPA (`folded_gqa_sdpa_attention_forward`): under a mask that every query row shares (decoding one token),
# the query heads of each key/value head are folded into its rows instead of repeating the cache to all H heads.
FOLD_LAYOUTS = [(6, 3), (8, 1), (18, 3), (12, 2)]  # odd G, G = 1, SmolLM2's converted layout, even G


class HeadCount:
    """Sees every op's output; `repeated` is set when one holds keys or values for all H query heads."""

    def __init__(self, heads, key_len):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.repeated, owner = False, self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                output = func(*args, **(kwargs or {}))
                for tensor in torch.utils._pytree.tree_leaves(output):
                    if isinstance(tensor, torch.Tensor) and tensor.dim() == 4 and tensor.shape[1:3] == (heads, key_len):
                        owner.repeated = True
                return output

        self.mode = Mode()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_len,causal", [(1, True), (3, False), (3, True)])
@pytest.mark.parametrize("heads,kv_heads", FOLD_LAYOUTS)
def test_folded_sdpa_matches_the_float64_reference_and_transformers_sdpa(heads, kv_heads, query_len, causal, dtype):
    """One decoding token folds, and so do three queries under one shared mask row; three causal rows (a mask row
    each) go to transformers' function. Either way: transformers' layout (batch, q, H, d), contiguous, no weights, the
    reference's values, and transformers' own SDPA's to the dtype's rounding."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    query, key, value, mask = grouped_attention_inputs(heads, kv_heads, query_len, dtype, causal=causal)
    module = modeling.DiffLlamaV2Attention(tiny_config(diff_version=2, num_attention_heads=heads,
                                                       num_key_value_heads=kv_heads), layer_idx=0)
    output, weights = folded_gqa_sdpa_attention_forward(module, query, key, value, mask, scaling=module.scaling)
    stock, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=module.scaling)
    assert weights is None and output.is_contiguous() and output.shape == stock.shape == (3, query_len, heads, 8)
    atol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(output.double(), grouped_query_attention(query, key, value, mask), rtol=0, atol=atol)
    torch.testing.assert_close(output, stock)  # the dtype's default tolerance: bf16 rounding for bf16


@pytest.mark.parametrize("heads,kv_heads", FOLD_LAYOUTS)
def test_folded_sdpa_decodes_without_repeating_keys_or_values(heads, kv_heads):
    query, key, value, mask = grouped_attention_inputs(heads, kv_heads, 1, torch.float32)
    counter = HeadCount(heads, key.shape[2])
    with counter.mode:
        folded_gqa_sdpa_attention_forward(None, query, key, value, mask, scaling=0.5)
    assert not counter.repeated
    with counter.mode:  # guards the counter: repeated keys are seen
        torch.repeat_interleave(key, heads // kv_heads, dim=1)
    assert counter.repeated


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("heads,kv_heads", [(6, 3), (8, 1)])
def test_decoding_with_either_cache_matches_the_reference_and_the_unfolded_path(heads, kv_heads, cache_kind,
                                                                                monkeypatch):
    """Left-padded prefill, then one token at a time (every step under a mask): float64 gives the reference's logits,
    float32 too within its rounding, and bf16 the logits of the same model on transformers' own SDPA (which repeats
    the keys and values where the installed transformers does)."""
    from transformers import DynamicCache, StaticCache
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = differential_model(2, heads=heads, kv_heads=kv_heads)
    model.set_attn_implementation("sdpa")
    input_ids, attention_mask = random_batch()
    expected = reference_forward(model.config, checkpoint_state_dict(model), input_ids, attention_mask)
    real = attention_mask.bool()

    def decode(model):
        cache = (DynamicCache(config=model.config) if cache_kind == "dynamic"
                 else StaticCache(config=model.config, max_cache_len=input_ids.shape[1]))
        return prefill_then_decode(model, input_ids, attention_mask, cache=cache)[real]

    torch.testing.assert_close(decode(model), expected[real], rtol=0, atol=1e-12)
    torch.testing.assert_close(decode(model.float()).double(), expected[real], rtol=0, atol=1e-5)
    folded = decode(model.bfloat16())
    monkeypatch.setattr(modeling, "ALL_ATTENTION_FUNCTIONS", ALL_ATTENTION_FUNCTIONS)
    torch.testing.assert_close(folded, decode(model))


def test_the_attention_functions_defer_every_other_name_to_transformers_at_call_time(monkeypatch):
    """DIFF V2 looks its attention function up in its own interface: "sdpa" folds, and every other name is
    transformers' entry at call time, one registered after import (globally or on transformers' instance) too."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls = []

    def user_attention(*args, **kwargs):
        calls.append(args[0].layer_idx)
        return ALL_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "registered_later", user_attention)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "on_the_instance", user_attention)
    functions = modeling.ALL_ATTENTION_FUNCTIONS
    assert functions.get_interface("sdpa", None) is folded_gqa_sdpa_attention_forward
    for name in ("registered_later", "on_the_instance"):
        assert functions.get_interface(name, None) is user_attention and name in functions
    assert functions.get_interface("flex_attention", None) is ALL_ATTENTION_FUNCTIONS["flex_attention"]
    assert functions.get_interface("eager", "default") == "default"  # as transformers': eager is the forward's default
    assert set(functions) == set(ALL_ATTENTION_FUNCTIONS) and len(functions) == len(ALL_ATTENTION_FUNCTIONS)
    with pytest.raises(KeyError, match="not_registered"):
        functions.get_interface("not_registered", None)

    # The model reaches it (unpadded: transformers builds masks only for the backends it knows).
    model = differential_model(2, heads=6, kv_heads=3)
    input_ids, _ = random_batch()
    with torch.no_grad():
        expected = model(input_ids).logits
        model.set_attn_implementation("registered_later")
        logits = model(input_ids).logits
    assert calls == [0, 1, 2]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-12)
