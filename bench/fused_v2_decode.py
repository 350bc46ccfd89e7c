"""A probe for issue 40's DIFF V2 decoding target: one Triton kernel for a DIFF V2 layer's whole attention at one
query token (λ, the attention of both maps of every pair, and O_{2i} − λ_i·O_{2i+1}), measured by the CUDA benchmark
as `diff-llama v2 fused` (graphs figures only).

Why: with CUDA graphs a decoding step at batch 1 costs about as much per kernel as per byte, and DIFF V2's shipped
forward runs two kernels a layer that Llama's does not (λ's float32 product, then sigmoid and the subtraction after
SDPA): about Llama's step plus 2/15 of it, the 0.86x–0.90x measured on the H200 (2026-11-27). Neither can fold into
cuBLAS's products or SDPA's kernel without changing λ's precision. Here they live inside the attention kernel, so a
layer runs as many kernels as Llama's: what is left is V2's doubled q_proj. If this probe reaches 0.95x, that is the
way to the target; if it does not, it bounds the target only as far as this kernel goes (a split over the keys,
flash-decoding style, would be the next try).

A probe, not a kernel of the package: one token per sequence, every query head's group holds whole pairs (even
H / G: DIFF V2 conversions always have it), a boolean or absent mask shared by the heads, no dropout or softcap.
`install(model)` gives a DiffLlama V2 model this forward for one-token steps; anything else takes the shipped one.
Checked against the float64 reference in tests/test_fused_v2_decode.py, on the CPU under Triton's interpreter.
"""

import torch
import triton
import triton.language as tl

from diff_llama.modeling_diff_llama import DiffLlamaV2Attention

BLOCK_KEYS = 64
BLOCK_HIDDEN = 1024


@triton.jit
def _v2_decode_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, x_ptr, w_ptr, out_ptr,
    stride_qb, stride_qh, stride_kb, stride_kg, stride_ks, stride_vb, stride_vg, stride_vs,
    stride_mb, stride_ms, stride_xb, stride_wh, stride_ob, stride_oh,
    scaling,
    KEYS: tl.constexpr, HIDDEN: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, HAS_MASK: tl.constexpr,
):
    """One program per (sequence, differential head i): query heads 2i and 2i + 1, which read the same key/value head
    (GROUP, the query heads per key/value head, is even). Online softmax over the cache in blocks, in float32, for
    both maps; then λ_i; then O_2i − λ_i·O_2i+1. As many programs as a LLaMA's SDPA call runs (one per query head of
    the LLaMA, H/2); the R/2 programs of a group read its keys and values from L2 after the first. The cache length
    and the width are compile-time constants: a static cache's length is fixed, and the probe runs on one."""
    batch = tl.program_id(0)
    head = tl.program_id(1)
    group = (2 * head) // GROUP
    dims = tl.arange(0, HEAD_DIM_PADDED)
    real = dims < HEAD_DIM
    q_row = q_ptr + batch * stride_qb + 2 * head * stride_qh + dims
    # Every product in float32: a one-token step is bound by reading the cache, not by arithmetic.
    q1 = tl.load(q_row, mask=real, other=0.0).to(tl.float32)
    q2 = tl.load(q_row + stride_qh, mask=real, other=0.0).to(tl.float32)

    floor = -1.0e30  # a finite start, so that a block masked whole gives exp(-inf) = 0, never inf - inf
    m1 = tl.zeros([1], tl.float32) + floor
    m2 = tl.zeros([1], tl.float32) + floor
    l1 = tl.zeros([1], tl.float32)
    l2 = tl.zeros([1], tl.float32)
    acc1 = tl.zeros([HEAD_DIM_PADDED], tl.float32)
    acc2 = tl.zeros([HEAD_DIM_PADDED], tl.float32)
    for start in range(0, KEYS, BLOCK_S):
        positions = start + tl.arange(0, BLOCK_S)
        present = positions < KEYS
        attend = present
        if HAS_MASK:
            allowed = tl.load(mask_ptr + batch * stride_mb + positions * stride_ms, mask=present, other=0)
            attend = attend & (allowed != 0)
        tile = present[:, None] & real[None, :]
        k = tl.load(k_ptr + batch * stride_kb + group * stride_kg + positions[:, None] * stride_ks + dims[None, :],
                    mask=tile, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + batch * stride_vb + group * stride_vg + positions[:, None] * stride_vs + dims[None, :],
                    mask=tile, other=0.0).to(tl.float32)
        s1 = tl.where(attend, tl.sum(k * q1[None, :], 1) * scaling, float("-inf"))
        s2 = tl.where(attend, tl.sum(k * q2[None, :], 1) * scaling, float("-inf"))
        new1 = tl.maximum(m1, tl.max(s1, 0))
        new2 = tl.maximum(m2, tl.max(s2, 0))
        p1 = tl.exp(s1 - new1)
        p2 = tl.exp(s2 - new2)
        scale1 = tl.exp(m1 - new1)
        scale2 = tl.exp(m2 - new2)
        l1 = l1 * scale1 + tl.sum(p1, 0)
        l2 = l2 * scale2 + tl.sum(p2, 0)
        acc1 = acc1 * scale1 + tl.sum(p1[:, None] * v, 0)
        acc2 = acc2 * scale2 + tl.sum(p2[:, None] * v, 0)
        m1 = new1
        m2 = new2

    # λ_i = sigmoid(x · lambda_proj[i]) in float32.
    logits = tl.zeros([1], tl.float32)
    for start in range(0, HIDDEN, BLOCK_H):
        columns = start + tl.arange(0, BLOCK_H)
        inside = columns < HIDDEN
        x = tl.load(x_ptr + batch * stride_xb + columns, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + head * stride_wh + columns, mask=inside, other=0.0).to(tl.float32)
        logits += tl.sum(x * w, 0)
    lambda_ = tl.sigmoid(logits)

    difference = acc1 / l1 - lambda_ * (acc2 / l2)
    tl.store(out_ptr + batch * stride_ob + head * stride_oh + dims, difference.to(out_ptr.dtype.element_ty),
             mask=real)


def supports(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """One query token per sequence, whole pairs in every key/value head's group (an even number of query heads per
    key/value head), and a boolean mask shared by the heads (or none)."""
    batch, heads, tokens, head_dim = query.shape
    groups = key.shape[1]
    if tokens != 1 or heads % groups or (heads // groups) % 2:
        return False
    if attention_mask is None:
        return True
    return attention_mask.dtype == torch.bool and attention_mask.dim() == 4 and attention_mask.shape[1] == 1 \
        and attention_mask.shape[2] == 1


def fused_v2_decode(query, key, value, attention_mask, hidden_states, lambda_weight, scaling) -> torch.Tensor:
    """query (batch, H, 1, d), key and value (batch, G, keys, d), a boolean mask (batch, 1, 1, keys) or None, the
    layer's attention input (batch, 1, hidden) and lambda_proj's weight (H/2, hidden) -> the differential heads
    (batch, 1, H/2, d) in the query's dtype."""
    batch, heads, _, head_dim = query.shape
    groups, keys = key.shape[1], key.shape[2]
    output = query.new_empty(batch, 1, heads // 2, head_dim)
    has_mask = attention_mask is not None
    mask = attention_mask[:, 0, 0] if has_mask else query.new_empty(1, 1, dtype=torch.bool)
    x = hidden_states[:, -1]
    for name, tensor in (("query", query), ("key", key), ("value", value), ("hidden_states", x),
                         ("lambda_weight", lambda_weight)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"fused_v2_decode: {name} must be contiguous in its last dimension")
    _v2_decode_kernel[(batch, heads // 2)](
        query, key, value, mask, x, lambda_weight, output,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), mask.stride(0), mask.stride(1), x.stride(0),
        lambda_weight.stride(0), output.stride(0), output.stride(2),
        scaling, KEYS=keys, HIDDEN=x.shape[-1], GROUP=heads // groups, HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim), BLOCK_S=BLOCK_KEYS,
        BLOCK_H=min(BLOCK_HIDDEN, triton.next_power_of_2(x.shape[-1])), HAS_MASK=has_mask,
    )
    return output


class FusedDecodeForward:
    """A DIFF V2 attention's forward with the fused kernel for one-token steps, the shipped forward otherwise."""

    def __init__(self, attention: DiffLlamaV2Attention):
        self.attention, self.shipped = attention, attention.forward

    def __call__(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        attention = self.attention
        if hidden_states.shape[1] != 1:
            return self.shipped(hidden_states, position_embeddings, attention_mask, **kwargs)
        cache = None
        for name in ("cache", "past_key_values"):  # the names transformers 5 has used for the KV cache
            found = kwargs.pop(name, None)
            cache = found if found is not None else cache
        query, key, value = attention.project(hidden_states, position_embeddings, cache, kwargs)
        if not supports(query, key, attention_mask):
            raise ValueError("diff-llama v2 fused: this step's shapes or mask are outside the probe's kernel")
        heads = fused_v2_decode(query, key, value, attention_mask, hidden_states,
                                attention.differential_lambda.lambda_proj.weight, attention.scaling)
        return attention.o_proj(heads.reshape(*hidden_states.shape[:-1], -1)), None


def install(model) -> int:
    """Give every DIFF V2 attention of `model` the fused one-token forward; the number of layers changed."""
    changed = 0
    for module in model.modules():
        if isinstance(module, DiffLlamaV2Attention):
            module.forward = FusedDecodeForward(module)
            changed += 1
    if not changed:
        raise ValueError("install: the model has no DIFF V2 attention (diff_version=2)")
    return changed
