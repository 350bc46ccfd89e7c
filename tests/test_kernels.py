"""The differential kernels and their dispatch: every kernel against the float64 reference, forward and gradients.

The kernel-level checks compare with a per-head float64 implementation written from docs/maths.md with the reference's
softmax (`reference.softmax_maps`), differentiable in q, k, v and λ; the model-level checks compare logits with
`reference.reference_forward` and gradients with the eager generic path.
"""

import contextlib
import math
from unittest import mock

import pytest
import torch
from transformers import DynamicCache

import diff_llama.differential_kernels as kernels
import diff_llama.modeling_diff_llama as modeling
from conftest import bytes_saved_for_backward, tiny_model
from diff_llama.lambda_diff_llama import DiffLlamaLambda
from diff_llama.differential_kernels import (
    ALL_DIFFERENTIAL_KERNELS,
    BlockedDifferentialAttention,
    DifferentialAttentionInterface,
    DifferentialKernel,
    select_differential_kernel,
)
from reference import checkpoint_state_dict, reference_forward, softmax_maps
from conftest import LAYOUTS, padded_labels, prefill_then_decode, random_batch, randomise_lambdas


def per_head_differential(query, key, value, lam, allowed):
    """docs/maths.md's version-1 heads before the norm, head by head: (A1 − λ·A2)·[v_kv(i), v_kv(i + H/2)], as
    (batch, q, H/2, 2d). `allowed`: (batch, q, k) bool."""
    batch, heads, _, d = query.shape
    n_rep = heads // key.shape[1]
    out = []
    for b in range(batch):
        rows = []
        for i in range(heads // 2):
            j = i + heads // 2
            a1 = softmax_maps(query[b, i], key[b, i // n_rep], allowed[b], d)
            a2 = softmax_maps(query[b, j], key[b, j // n_rep], allowed[b], d)
            rows.append((a1 - lam * a2) @ torch.cat([value[b, i // n_rep], value[b, j // n_rep]], -1))
        out.append(torch.stack(rows, dim=1))
    return torch.stack(out)


def kernel_inputs(heads, kv_heads, query_len, key_len, seed=0, dtype=torch.float64):
    """q, k, v as `DiffLlamaAttention` hands them to a kernel: key/value heads already expanded so that each half of
    the query heads reads whole groups (G' even)."""
    generator = torch.Generator().manual_seed(seed)
    group = math.gcd(heads // kv_heads, heads // 2)
    expansion = heads // kv_heads // group
    query = torch.randn(2, heads, query_len, 8, generator=generator, dtype=dtype)
    key = torch.randn(2, kv_heads, key_len, 8, generator=generator, dtype=dtype).repeat_interleave(expansion, 1)
    value = torch.randn(2, kv_heads, key_len, 8, generator=generator, dtype=dtype).repeat_interleave(expansion, 1)
    lam = torch.tensor(0.37, dtype=dtype)
    return [t.requires_grad_() for t in (query, key, value, lam)]


@contextlib.contextmanager
def blocks_of(rows: int):
    """The blocked kernel with `rows` query rows per block; yields the list of the (start, stop) query blocks its
    forward passes score, so that a test can check that it really ran several blocks."""
    blocks = []

    def recorded_block_scores(*args):
        blocks.append(args[4:6])
        return block_scores(*args)

    block_scores = kernels._block_scores
    with mock.patch.object(kernels, "BLOCKED_KERNEL_ROWS", rows), \
            mock.patch.object(kernels, "_block_scores", recorded_block_scores):
        yield blocks


def padding_allowed(query_len, key_len, padded=3):
    """Bottom-right causal with left padding of row 1 (a cached prefix when key_len > query_len); padded query rows
    are left out of comparisons."""
    causal = torch.ones(query_len, key_len, dtype=torch.bool).tril(key_len - query_len)
    keep = torch.ones(2, key_len, dtype=torch.bool)
    keep[1, :padded] = False
    return causal[None] & keep[:, None, :]


def real_rows(query_len, key_len, padded=3):
    rows = torch.ones(2, query_len, dtype=torch.bool)
    rows[1, : max(0, padded - (key_len - query_len))] = False
    return rows


@pytest.mark.parametrize("heads,kv_heads", LAYOUTS)
@pytest.mark.parametrize("mask_kind", ["causal", "bool", "additive"])
@pytest.mark.parametrize("query_len,key_len,block", [(13, 13, 4), (7, 12, 3), (21, 21, 64), (1, 9, 64)])
def test_blocked_kernel_matches_reference_forward_and_gradients(heads, kv_heads, mask_kind, query_len, key_len, block):
    """Odd G, G = 1, even G, G = H; several blocks with a partial last one, a cached prefix, one query token; causal
    (no mask), boolean and additive padding masks. Gradients of q, k, v and λ."""
    query, key, value, lam = kernel_inputs(heads, kv_heads, query_len, key_len)
    module = mock.Mock(scaling=8**-0.5)
    if mask_kind == "causal":
        if query_len > 1 and key_len != query_len:
            pytest.skip("a missing mask means SDPA's top-left causal alignment, tested with the static cache")
        allowed = torch.ones(query_len, key_len, dtype=torch.bool).tril(key_len - query_len)[None].expand(2, -1, -1)
        mask, rows = None, torch.ones(2, query_len, dtype=torch.bool)
    else:
        allowed, rows = padding_allowed(query_len, key_len), real_rows(query_len, key_len)
        mask = allowed[:, None]
        if mask_kind == "additive":
            mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, torch.finfo(torch.float64).min)
    with blocks_of(block) as blocks:
        output, weights = ALL_DIFFERENTIAL_KERNELS["blocked"](module, query, key, value, mask, lam)
    assert blocks == [(start, min(start + block, query_len)) for start in range(0, query_len, block)]
    # Fully masked (padded) query rows have no defined output; the reference lets them see every key (no NaN).
    expected = per_head_differential(query, key, value, lam, allowed | ~rows[:, :, None])
    assert weights is None and output.shape == (2, query_len, heads // 2, 16)
    torch.testing.assert_close(output[rows], expected[rows], rtol=0, atol=1e-12)
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    weights = weights * rows[:, :, None, None]
    got = torch.autograd.grad((output * weights).sum(), (query, key, value, lam))
    want = torch.autograd.grad((expected * weights).sum(), (query, key, value, lam))
    for name, a, b in zip("qkvλ", got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=name)


def causal_kernel_matches_reference(kernel, query, key, value, lam):
    """A kernel on causal self-attention without a mask: its forward and the gradients of q, k, v and λ are those of
    the float64 reference, and it returns no maps."""
    allowed = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool).tril()[None].expand(query.shape[0], -1, -1)
    output, weights = kernel(mock.Mock(scaling=query.shape[-1] ** -0.5), query, key, value, None, lam)
    expected = per_head_differential(query, key, value, lam, allowed)
    assert weights is None
    torch.testing.assert_close(output, expected, rtol=0, atol=1e-12)
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = torch.autograd.grad((output * weights).sum(), (query, key, value, lam))
    want = torch.autograd.grad((expected * weights).sum(), (query, key, value, lam))
    for name, a, b in zip("qkvλ", got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=name)


@contextlib.contextmanager
def cuda_flash_ops_on_the_cpu():
    """PyTorch's CUDA FlashAttention entry points (`_scaled_dot_product_flash_attention` and its backward), emulated
    with its CPU flash ops: the same maths and (batch, heads, seq, d) layout, dummies for the extra outputs only the
    CUDA op has. A stand-in for the unreachable GPU, so that `CausalPairedAttentionCUDA`'s own work (padding, the
    pairs, the gradients of the d-wide tensors) is checked here; tests/test_cuda.py runs the real op. Like
    FlashAttention, the stand-in takes grouped key/value heads (each serving a group of query heads); it calls the CPU
    op as `paired_sdpa_cpu` does, which repeats them for a torch whose CPU op cannot read them."""

    key_heads = []  # what each call was handed: the kernel must not copy keys and values out to every query head

    def forward(query, key, value, dropout_p, is_causal, return_debug_mask, *, scale=None):
        assert key.shape[1] == value.shape[1] and query.shape[1] % key.shape[1] == 0 and not return_debug_mask
        assert dropout_p == 0 and is_causal
        key_heads.append(key.shape[1])
        output, (logsumexp,), _ = kernels._CPUFlash.forward(query, key, value, scale)
        empty = query.new_empty(0)
        return output, logsumexp, empty, empty, query.shape[2], key.shape[2], empty, empty, empty

    def backward(grad_output, query, key, value, output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                 is_causal, philox_seed, philox_offset, *, scale=None):
        assert query.shape[1] % key.shape[1] == 0 and (max_q, max_k) == (query.shape[2], key.shape[2])
        assert dropout_p == 0 and is_causal
        key_heads.append(key.shape[1])
        return kernels._CPUFlash.backward(grad_output, query, key, value, output, (logsumexp,), (), scale)

    with mock.patch.object(torch.ops.aten, "_scaled_dot_product_flash_attention", forward), \
            mock.patch.object(torch.ops.aten, "_scaled_dot_product_flash_attention_backward", backward):
        yield key_heads


@pytest.mark.parametrize("heads,kv_heads", LAYOUTS)
def test_paired_cuda_kernel_matches_reference_forward_and_gradients(heads, kv_heads):
    """Issue 40 §4: version 1's CUDA training kernel keeps only d-wide tensors; its forward and the gradients of q, k,
    v and λ are the float64 reference's (the flash op emulated on the CPU: `cuda_flash_ops_on_the_cpu`)."""
    query, key, value, lam = kernel_inputs(heads, kv_heads, 13, 13)
    with cuda_flash_ops_on_the_cpu() as key_heads:
        causal_kernel_matches_reference(ALL_DIFFERENTIAL_KERNELS["paired_sdpa_cuda"], query, key, value, lam)
        pairs = kernels.CausalPairedAttentionCUDA.apply(query, key, value, 8**-0.5)
    # What backward keeps of q, k and v is the d-wide tensors themselves, not the 2d-wide padded copies; and the flash
    # op gets the grouped key/value heads as they are (both forwards above, one backward).
    assert [tensor.shape for tensor in pairs.grad_fn.saved_tensors[:3]] == [query.shape, key.shape, value.shape]
    assert key_heads == [key.shape[1]] * 3


@pytest.mark.oldest_transformers  # and the oldest torch: its CPU flash op and saved-tensor hooks differ
@pytest.mark.parametrize("heads,kv_heads", LAYOUTS)
@pytest.mark.parametrize("reads_grouped_heads", sorted({kernels.CPU_FLASH_READS_GROUPED_HEADS, False}))
def test_paired_cpu_kernel_matches_reference_forward_and_gradients(heads, kv_heads, reads_grouped_heads):
    """Version 1's CPU training kernel (the CPU flash op on the padded layout): forward and the gradients of q, k, v
    and λ are the float64 reference's. Also as on torch before 2.9, whose CPU flash op cannot read grouped keys and
    values (it reads past them): there they go to it repeated to every query head, and their gradients are summed
    back (forced here on any torch)."""
    query, key, value, lam = kernel_inputs(heads, kv_heads, 13, 13)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    key_heads = []

    def recorded_flash(query, key, value, *args, **kwargs):
        key_heads.append((key.shape[1], value.shape[1]))
        return flash(query, key, value, *args, **kwargs)

    with mock.patch.object(kernels, "CPU_FLASH_READS_GROUPED_HEADS", reads_grouped_heads), \
            mock.patch.object(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", recorded_flash):
        causal_kernel_matches_reference(ALL_DIFFERENTIAL_KERNELS["paired_sdpa_cpu"], query, key, value, lam)
    handed = key.shape[1] if reads_grouped_heads else heads
    assert key_heads == [(handed, handed)]


def test_paired_cuda_kernel_is_chosen_only_where_flash_attention_runs():
    model = tiny_model(torch.float64, num_attention_heads=6, num_key_value_heads=3)
    attention = model.model.layers[0].self_attn
    supports = ALL_DIFFERENTIAL_KERNELS["paired_sdpa_cuda"].supports
    query = torch.randn(1, 6, 5, 8, dtype=torch.bfloat16, requires_grad=True)
    key = torch.randn(1, 6, 5, 8, dtype=torch.bfloat16)
    assert not supports(attention, query, key, None)  # on the CPU
    on_cuda = mock.Mock(device=mock.Mock(type="cuda"), dtype=torch.bfloat16, shape=query.shape)
    assert supports(attention, on_cuda, key, None)
    assert not supports(attention, on_cuda, key, torch.ones(1, 1, 5, 5, dtype=torch.bool))  # padding: generic
    assert not supports(attention, mock.Mock(device=on_cuda.device, dtype=torch.float32, shape=query.shape), key,
                        None)
    with mock.patch.object(kernels, "_has_cuda_flash_attention", lambda: False):
        assert not supports(attention, on_cuda, key, None)


def test_blocked_kernel_skips_future_columns_only_when_the_mask_hides_them():
    """A mask that lets a query see a later key must keep those columns (no causal shortcut on custom masks)."""
    query, key, value, lam = kernel_inputs(4, 2, 8, 8)
    allowed = torch.ones(8, 8, dtype=torch.bool).tril()[None].repeat(2, 1, 1)
    allowed[:, 0, 7] = True  # query 0 also sees the last key
    module = mock.Mock(scaling=8**-0.5)
    with blocks_of(2) as blocks, torch.no_grad():
        output, _ = ALL_DIFFERENTIAL_KERNELS["blocked"](module, query, key, value, allowed[:, None], lam)
        assert len(blocks) == 4
        expected = per_head_differential(query, key, value, lam, allowed)
    torch.testing.assert_close(output, expected, rtol=0, atol=1e-12)


def test_blocked_backward_saves_nothing_quadratic():
    """Memory linear in the sequence length: what the blocked kernel keeps for backward is q, k, v, λ and two
    statistics per row and map; no (q, k) map."""
    length, heads = 256, 4
    query, key, value, lam = kernel_inputs(heads, 2, length, length, dtype=torch.float32)
    output = BlockedDifferentialAttention.apply(query, key, value, lam, None, 8**-0.5, 64, 0, True)
    sizes = [t.numel() for t in output.grad_fn.saved_tensors]
    assert len(sizes) == 6 and max(sizes) == query.numel()
    assert sum(sizes) <= 3 * query.numel() + 1 + 2 * heads * length  # nothing of size heads x length x length
    assert 2 * heads * length * length > 10 * sum(sizes)  # batch 2: one map would be 14x all of it


def test_bf16_cpu_training_keeps_no_float32_copy_of_the_pair_outputs():
    """Issue 40 (version 1 training memory): for λ's gradient, A1·V − λ·A2·V keeps A2·V as the attention kernel's
    bf16 output, which that kernel keeps anyway, not a float32 copy. Against Llama's activations of the same shape:
    1.14x (1.20x with the float32 copy)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=32)
    torch.manual_seed(0)
    llama = bytes_saved_for_backward(LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16))
    model = tiny_model(torch.bfloat16, **shape, differential_kernel="paired_sdpa_cpu")
    assert bytes_saved_for_backward(model) <= 1.16 * llama


@pytest.mark.parametrize("kernel", ["generic", "blocked", "decode", "paired_sdpa_cpu"])
@pytest.mark.parametrize("heads,kv_heads", [(6, 3), (8, 1), (8, 4), (2, 1)])
def test_every_kernel_matches_the_reference_in_the_model(kernel, heads, kv_heads):
    """Prefill with left padding, then token-by-token decoding with a cache, each kernel forced where it applies."""
    model = tiny_model(torch.float64, num_attention_heads=heads, num_key_value_heads=kv_heads)
    randomise_lambdas(model)
    model.set_differential_kernel(kernel)
    input_ids, attention_mask = random_batch()
    logits = prefill_then_decode(model, input_ids, attention_mask)
    with torch.no_grad():
        # And an unpadded causal prefill, the case the CPU training kernel takes.
        plain = model(input_ids).logits
    expected = reference_forward(model.config, checkpoint_state_dict(model), input_ids, attention_mask)
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=1e-12)
    torch.testing.assert_close(plain, reference_forward(model.config, checkpoint_state_dict(model), input_ids),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_blocked_generation_equals_generic_generation(cache):
    """Static caches hand SDPA no mask at prefill with more key slots than queries (top-left causal)."""
    model = tiny_model(torch.float64, num_attention_heads=6, num_key_value_heads=3)
    randomise_lambdas(model)
    prompt = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    logits = {}
    for kernel in ("generic", "blocked"):
        model.set_differential_kernel(kernel)
        out = model.generate(prompt, max_new_tokens=6, do_sample=False, cache_implementation=cache,
                             output_logits=True, return_dict_in_generate=True)
        logits[kernel] = torch.stack(out.logits)
    torch.testing.assert_close(logits["blocked"], logits["generic"], rtol=0, atol=1e-12)


@pytest.mark.parametrize("heads,kv_heads", [(6, 3), (8, 1)])
def test_blocked_training_with_padding_gives_eager_gradients(heads, kv_heads):
    """Loss and every gradient (λ vectors included) through the blocked kernel with a padding mask, against eager."""
    input_ids, attention_mask = random_batch(length=14)
    labels = padded_labels(input_ids, attention_mask)
    grads = {}
    for attn, kernel in (("sdpa", "blocked"), ("eager", "generic")):
        model = tiny_model(torch.float64, num_attention_heads=heads, num_key_value_heads=kv_heads).train()
        randomise_lambdas(model)
        model.set_attn_implementation(attn)
        model.set_differential_kernel(kernel)
        with blocks_of(4) as blocks:
            loss = model(input_ids, attention_mask=attention_mask, labels=labels).loss
            loss.backward()
        assert attn == "eager" or len(blocks) == 2 * 4 * model.config.num_hidden_layers  # forward and backward
        grads[attn] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(grads["sdpa"][0], grads["eager"][0], rtol=0, atol=1e-12)
    for name, grad in grads["eager"][1].items():
        assert grad is not None, name
        torch.testing.assert_close(grads["sdpa"][1][name], grad, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 0.15)])
def test_blocked_kernel_in_low_precision_stays_near_the_reference(dtype, atol):
    """fp32 and bf16 models through the blocked kernel: logits near the float64 reference, and no further from it
    than the generic path (bf16 rounds the weights, so both carry that error)."""
    model = tiny_model(torch.float32, num_attention_heads=6, num_key_value_heads=3, num_hidden_layers=2)
    randomise_lambdas(model)
    input_ids, attention_mask = random_batch(length=40)
    model = model.to(dtype)
    expected = reference_forward(model.config, checkpoint_state_dict(model), input_ids, attention_mask)
    real = attention_mask.bool()
    errors = {}
    for kernel in ("blocked", "generic"):
        model.set_differential_kernel(kernel)
        with torch.no_grad(), blocks_of(16) as blocks:
            logits = model(input_ids, attention_mask=attention_mask).logits
        assert kernel == "generic" or len(blocks) == 3 * model.config.num_hidden_layers
        errors[kernel] = (logits[real].double() - expected[real]).abs().max().item()
    assert errors["blocked"] <= atol
    assert errors["blocked"] <= 1.5 * errors["generic"] + 1e-6


def test_bf16_blocked_gradients_near_fp32():
    query, key, value, lam = kernel_inputs(8, 4, 70, 70, dtype=torch.float32)
    module = mock.Mock(scaling=8**-0.5)
    weights = torch.randn(2, 70, 4, 16, generator=torch.Generator().manual_seed(2))
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (query, key, value)] + [lam.detach().requires_grad_()]
        output, _ = ALL_DIFFERENTIAL_KERNELS["blocked"](module, *inputs[:3], None, inputs[3])
        assert output.dtype == torch.float32  # the differential heads leave in λ's dtype
        (output * weights).sum().backward()
        results[dtype] = [output.detach()] + [t.grad.float() for t in inputs]
    for name, low, high in zip(["output", "q", "k", "v", "λ"], results[torch.bfloat16], results[torch.float32]):
        scale = high.abs().max().item()
        assert (low - high).abs().max().item() <= 0.03 * scale, name


def trains_under_autocast_with_a_float32_difference(backend, kernel, device="cpu"):
    """Mixed precision (torch.autocast, as the Trainer's bf16 runs the model) hands a kernel float32 queries and keys
    (RoPE's float32 angles promote them) with half-precision values: each kernel trains there (paired_sdpa_cpu's
    private op refused the mix), λ and the difference A1·V − λ·A2·V stay float32, and the loss and gradients are the
    float32 run's within bf16's rounding."""
    results = {}
    for autocast in (False, True):
        torch.manual_seed(0)
        model = tiny_model(num_attention_heads=6, num_key_value_heads=3, num_hidden_layers=2).to(device)
        model.set_attn_implementation(backend)
        model.set_differential_kernel(kernel)
        differences = []
        for layer in model.model.layers:
            layer.self_attn.head_norm.register_forward_hook(lambda module, args, out: differences.append(args[0].dtype))
        generator = torch.Generator().manual_seed(1)
        input_ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=generator).to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        assert len(differences) >= 2 and set(differences) == {torch.float32}  # (backward may run the norm again)
        results[autocast] = loss.item(), model.model.layers[0].self_attn.q_proj.weight.grad
    assert results[True][0] == pytest.approx(results[False][0], rel=2e-2)
    scale = results[False][1].abs().max().item()
    assert (results[True][1] - results[False][1]).abs().max().item() <= 0.05 * scale


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("kernel", [None, "generic", "blocked", "paired_sdpa_cpu"])
def test_every_cpu_kernel_trains_under_autocast_with_a_float32_difference(backend, kernel):
    trains_under_autocast_with_a_float32_difference(backend, kernel)


def test_dispatch_picks_by_backend_device_and_step():
    model = tiny_model(num_attention_heads=6, num_key_value_heads=3)
    attention = model.model.layers[0].self_attn
    query = torch.randn(1, 6, 5, 8)
    key = torch.randn(1, 6, 5, 8)
    picked = {}
    for backend in ("sdpa", "eager"):
        model.set_attn_implementation(backend)
        with torch.no_grad():
            picked[backend, "prefill"] = select_differential_kernel(attention, query, key, None)
            picked[backend, "decode"] = select_differential_kernel(attention, query[:, :, :1], key, None)
        picked[backend, "train"] = select_differential_kernel(attention, query.requires_grad_(), key, None)
        query = query.detach()
    kernels = ALL_DIFFERENTIAL_KERNELS
    # The measured CPU choices (see DIFFERENTIAL_KERNEL_DISPATCH and bench/results/model-kernels*.md).
    assert picked["sdpa", "prefill"].function is kernels["blocked"].function
    assert picked["sdpa", "train"].function is kernels["blocked"].function
    assert picked["sdpa", "decode"].function is kernels["decode"].function
    for step in ("prefill", "decode", "train"):  # eager keeps the generic path: it returns the maps
        assert picked["eager", step].function is kernels["generic"].function
    # A chosen kernel serves the calls it supports; the others keep the automatic choice.
    model.set_attn_implementation("sdpa")
    # bf16 training on CPU: the paired SDPA kernel (the blocked one is slow there).
    bf16_query = query.to(torch.bfloat16).requires_grad_()
    assert select_differential_kernel(attention, bf16_query, key, None).function is kernels["paired_sdpa_cpu"].function
    with torch.no_grad():  # bf16 prefill on CPU: the padded one-call path
        assert select_differential_kernel(attention, query.to(torch.bfloat16), key, None).function is (
            kernels["generic"].function)
    model.set_differential_kernel("decode")
    with torch.no_grad():
        assert select_differential_kernel(attention, query[:, :, :1], key, None).function is kernels["decode"].function
        assert select_differential_kernel(attention, query, key, None).function is not kernels["decode"].function
    with pytest.raises(ValueError, match="Unknown differential kernel"):
        model.set_differential_kernel("fastest")


def test_private_cpu_flash_op_missing_falls_back_to_generic():
    """paired_sdpa_cpu uses a private aten op: without it (another torch version) the dispatch takes the generic
    path, and training still gives the same loss."""
    model = tiny_model(torch.float64, num_attention_heads=6, num_key_value_heads=3).train()
    model.set_differential_kernel("paired_sdpa_cpu")
    input_ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    attention = model.model.layers[0].self_attn
    query, key = torch.randn(1, 6, 5, 8, requires_grad=True), torch.randn(1, 6, 5, 8)
    assert select_differential_kernel(attention, query, key, None).function is (
        ALL_DIFFERENTIAL_KERNELS["paired_sdpa_cpu"].function)
    with_op = model(input_ids, labels=input_ids).loss
    with mock.patch.object(kernels, "_has_cpu_flash_attention", lambda: False), \
            mock.patch.object(kernels.CausalPairedAttentionCPU, "apply", side_effect=AssertionError("private op")):
        assert select_differential_kernel(attention, query, key, None).function is not (
            ALL_DIFFERENTIAL_KERNELS["paired_sdpa_cpu"].function)
        without_op = model(input_ids, labels=input_ids).loss
    torch.testing.assert_close(without_op, with_op, rtol=0, atol=1e-12)


def test_registered_kernel_is_selectable_and_used():
    calls = []

    def traced_generic(module, *args, **kwargs):
        calls.append(args[0].shape)
        return kernels.generic_differential_attention(module, *args, **kwargs)

    DifferentialAttentionInterface.register("traced", DifferentialKernel(traced_generic))
    try:
        model = tiny_model(num_attention_heads=6, num_key_value_heads=3)
        model.set_differential_kernel("traced")
        assert model.config.differential_kernel == "traced"
        with torch.no_grad():
            model(torch.randint(3, 128, (1, 7)))
        assert len(calls) == model.config.num_hidden_layers
    finally:
        DifferentialAttentionInterface._global_mapping.pop("traced")


def test_decoding_reuses_lambda_only_while_the_vectors_are_unchanged():
    """λ is computed once per generation (per cache) without autograd, and afresh after any in-place update or
    replacement of a λ vector, and always with autograd on."""
    model = tiny_model(torch.float64, num_attention_heads=6, num_key_value_heads=3)
    randomise_lambdas(model)
    layers = model.config.num_hidden_layers
    with mock.patch.object(DiffLlamaLambda, "forward", autospec=True, side_effect=DiffLlamaLambda.forward) as spy:
        model.generate(torch.randint(3, 128, (1, 5)), max_new_tokens=6, do_sample=False)
    assert spy.call_count == layers  # not once per step
    attention = model.model.layers[1].self_attn
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        first = attention._lambda(cache)
        assert attention._lambda(cache) is first
        attention.differential_lambda.lambda_q1.add_(0.5)  # what an optimizer step does
        second = attention._lambda(cache)
        assert second.item() != first.item() and second.item() == attention.differential_lambda().item()
        attention.differential_lambda.lambda_k2.data = torch.randn(8, dtype=torch.float64)  # replaced
        third = attention._lambda(cache)
        assert third.item() != second.item() and third.item() == attention.differential_lambda().item()
    assert attention._lambda(cache).requires_grad  # autograd on: never the cached value


def test_head_norm_is_rms_norm():
    norm = modeling.DiffLlamaHeadNorm(16, eps=0.3, elementwise_affine=False).double()
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(norm(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 0.3), rtol=0, atol=1e-14)
    norm.eps = 1e-6  # the converter sets it after construction
    torch.testing.assert_close(norm(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), rtol=0, atol=1e-14)
    # A zero output (a converted LLaMA's zero GQA group) must keep rms_norm's gradient, not 0/0 from the norm.
    zero = torch.zeros(2, 16, dtype=torch.float64, requires_grad=True)
    reference = zero.detach().clone().requires_grad_()
    weights = torch.arange(16, dtype=torch.float64)
    (norm(zero) * weights).sum().backward()
    (torch.nn.functional.rms_norm(reference, (16,), eps=1e-6) * weights).sum().backward()
    torch.testing.assert_close(zero.grad, reference.grad, rtol=1e-12, atol=0)


def training_gradients(model, input_ids, weights):
    model.train().zero_grad(set_to_none=True)
    (model(input_ids).logits * weights).sum().backward()
    return {name: param.grad.clone() for name, param in model.named_parameters()}


@pytest.mark.parametrize("kernel", ["generic", "paired_sdpa_cpu"])
@pytest.mark.parametrize("heads,kv_heads", [(6, 3), (8, 1), (2, 1), (8, 4)])
def test_training_recomputes_the_pair_difference_and_gives_the_reference_gradients(kernel, heads, kv_heads):
    """Issue 40 §4 (version 1 training memory): the float32 difference and o_proj's input are rebuilt in backward from
    A1·V and A2·V (kept by the attention kernel anyway) instead of kept; every gradient, λ included, is the float64
    reference's."""
    model = tiny_model(torch.float64, num_attention_heads=heads, num_key_value_heads=kv_heads)
    randomise_lambdas(model)
    model.set_differential_kernel(kernel)
    input_ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(2))
    weights = torch.randn(2, 11, model.config.vocab_size, generator=torch.Generator().manual_seed(4),
                          dtype=torch.float64)
    with mock.patch.object(kernels.PairDifference, "apply", wraps=kernels.PairDifference.apply) as spy:
        got = training_gradients(model, input_ids, weights)
    assert spy.call_count == model.config.num_hidden_layers
    state = {name: tensor.detach().clone().requires_grad_() for name, tensor in checkpoint_state_dict(model).items()}
    (reference_forward(model.config, state, input_ids) * weights).sum().backward()
    names = {param.data_ptr(): name for name, param in model.named_parameters()}
    compared = 0
    for checkpoint_name, tensor in checkpoint_state_dict(model).items():
        name = names.get(tensor.data_ptr())
        if name is not None and tensor.shape == got[name].shape:
            torch.testing.assert_close(got[name], state[checkpoint_name].grad, rtol=1e-9, atol=1e-11, msg=name)
            compared += 1
    assert compared == len(got)  # every parameter, the λ vectors too


@pytest.mark.parametrize("kernel", ["generic", "paired_sdpa_cpu"])
def test_rebuilding_for_backward_changes_no_bf16_gradient(kernel):
    """The rebuilding runs the forward's own ops again: bf16 gradients equal, bit for bit, those of autograd keeping
    every tensor. (What it saves: tests/test_bench_probes.py.)"""
    model = tiny_model(torch.bfloat16, num_attention_heads=8, num_key_value_heads=2)
    randomise_lambdas(model)
    model.set_differential_kernel(kernel)
    input_ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    weights = torch.randn(2, 16, model.config.vocab_size, generator=torch.Generator().manual_seed(4))
    recomputed = training_gradients(model, input_ids, weights)
    with mock.patch.object(kernels, "_pair_difference", kernels._pair_difference_value), \
            mock.patch.object(kernels.RebuiltForBackward, "_pack", lambda self, tensor: tensor):
        kept = training_gradients(model, input_ids, weights)
    for name, grad in kept.items():
        assert torch.equal(recomputed[name], grad), name


@pytest.mark.oldest_transformers  # and the oldest torch: its CPU flash op and saved-tensor hooks differ
def test_rebuilding_leaves_every_tensor_to_an_outer_saved_tensor_policy():
    """Under non-reentrant activation checkpointing (transformers' default) or CPU offloading, their hooks decide for
    every saved tensor: inner hooks would take over from them. So rebuilding packs nothing there (the outer hooks see
    every tensor), and checkpointed gradients equal the plain ones, in either checkpointing mode."""
    model = tiny_model(torch.float64, num_attention_heads=8, num_key_value_heads=2)
    randomise_lambdas(model)
    model.set_attn_implementation("sdpa")
    model.set_differential_kernel("generic")
    input_ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    seen, packed = [], []
    pack = kernels.RebuiltForBackward._pack
    recording = lambda self, tensor: packed.append(tensor.shape) or pack(self, tensor)  # noqa: E731
    with mock.patch.object(kernels.RebuiltForBackward, "_pack", recording):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(tuple(t.shape)) or t, lambda t: t):
            model.train().model(input_ids)
        assert seen and not packed
        model.train().model(input_ids)
        assert packed  # without another policy, rebuilding packs what it keeps

    model(input_ids, labels=input_ids).loss.backward()
    plain = {name: param.grad.clone() for name, param in model.named_parameters()}
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    for reentrant in (False, True):
        model.zero_grad(set_to_none=True)
        enable({"use_reentrant": reentrant})
        model(input_ids, labels=input_ids).loss.backward()
        for name, grad in plain.items():
            torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.oldest_transformers  # and the oldest torch: its CPU flash op and saved-tensor hooks differ
@pytest.mark.parametrize("asks_torch", [True, False], ids=["torch 2.8+", "before torch 2.8"])
def test_another_saved_tensor_policy_is_seen_on_every_torch(monkeypatch, asks_torch):
    """Rebuilding steps aside for another saved-tensor policy. torch 2.8 has a private function that names the hooks
    in force; before, a saved tensor is probed (forced here on any torch)."""
    from torch.utils.checkpoint import checkpoint

    if not asks_torch:
        monkeypatch.delattr(torch._C._autograd, "_top_saved_tensors_default_hooks", raising=False)
    seen = []

    def function(tensor):
        seen.append(kernels._saved_tensor_hooks_active())
        return tensor * 2

    assert not kernels._saved_tensor_hooks_active()
    with torch.autograd.graph.saved_tensors_hooks(kernels._unchanged, kernels._unchanged):
        assert kernels._saved_tensor_hooks_active()
    with torch.autograd.graph.save_on_cpu():
        assert kernels._saved_tensor_hooks_active()
    checkpoint(function, torch.ones(2, requires_grad=True), use_reentrant=False)
    assert seen[0] is True
    assert not kernels._saved_tensor_hooks_active()
    with kernels.RebuiltForBackward() as rebuilt:
        assert rebuilt._hooks is not None  # no other policy: rebuilding is on


def test_a_rebuilt_tensor_is_rebuilt_once_per_backward_however_often_it_is_saved():
    source = torch.randn(5, dtype=torch.float64, requires_grad=True)
    calls = []

    def double(tensor):
        calls.append(1)
        return tensor * 2

    with kernels.RebuiltForBackward() as rebuilt:
        doubled = rebuilt.add(double(source), double, source)
        output = (doubled * doubled).sum() + doubled[1:].pow(3).sum()  # saved three times: twice whole, once a view
    calls.clear()
    output.backward(retain_graph=True)
    assert len(calls) == 1
    expected = 8 * source.detach() + torch.cat([torch.zeros(1, dtype=torch.float64), 24 * source.detach()[1:] ** 2])
    torch.testing.assert_close(source.grad, expected)
    output.backward()
    assert len(calls) == 2
