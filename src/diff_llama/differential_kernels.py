# Copyright 2026 The diff-llama authors. Licensed under the Apache License, Version 2.0.
"""Differential attention kernels (version 1), their registry and the one place that picks them; and DIFF V2's
attention functions (`GroupedQueryAttentionInterface`: transformers' own, with an SDPA that decodes without repeating
keys and values).

A differential kernel maps the attention inputs after RoPE, the cache and the GQA expansion (query (batch, H, q, d);
key/value (batch, G', k, d), G' even, each half of the query heads reading its own half of them) to the differential
heads' outputs before the head norm, (batch, q, H/2, 2d) in λ's dtype, and the softmax maps when it has them. Every
kernel computes the same function; they differ in what they cost where. DIFF V2 runs one ordinary attention call (any
backend) and needs no differential kernel; its SDPA is `folded_gqa_sdpa_attention_forward`.

Imports only torch and transformers: it ships next to the modeling file as remote code.
"""

import math
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers.models.llama.modeling_llama import repeat_kv
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, is_torch_greater_or_equal
from transformers.utils.generic import GeneralInterface


def _float32_or_wider(dtype: torch.dtype) -> torch.dtype:
    """torch.promote_types(dtype, float32) for real dtypes, in Python: the torch call is an aten op of its own."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's eager attention, with the softmax in float32 or wider: a float64 model keeps float64 maps (Llama's
    float32 cast turns a float64 mask's minimum into -inf and fully padded rows into NaN)."""
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)

    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask

    softmax_dtype = torch.promote_types(query.dtype, torch.float32)
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=softmax_dtype).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


def differential_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    lambda_full: torch.Tensor,
) -> torch.Tensor:
    """(A1 − λ·A2)·V_i for ONE query token, for every differential head i: (batch, 1, H/2, 2d) in λ's dtype.

    Decoding reads the whole cache for one token, so the cost is memory traffic and the number of ops. This reads
    the keys once and the values once and copies nothing the size of the cache (two matmuls around a softmax, with
    A1 − λ·A2 formed between them), where the generic path runs two backend calls on two copies of the values.
    `key`/`value` hold an even number G of heads, half of the query heads on each half of them (what
    `DiffLlamaAttention` passes). Masks are those of the SDPA interface: None, boolean (True = attend) or additive.
    """
    batch, num_heads, _, head_dim = query.shape
    kv_heads, key_len = key.shape[1], key.shape[2]
    group, half = num_heads // kv_heads, kv_heads // 2
    # 3-D views and bmm: matmul on 4-D tensors adds a dozen aten ops of expands and reshapes, and a decoding step
    # pays for every op. Query heads of one key/value head are the rows: (batch * G, group, d). baddbmm with beta=0
    # applies the scaling inside the product, one op where scaling the queries first takes two.
    scores = torch.baddbmm(_empty_like_scalar(query), query.reshape(batch * kv_heads, group, head_dim),
                           key.reshape(batch * kv_heads, key_len, head_dim).transpose(1, 2), beta=0, alpha=scaling)
    if attention_mask is not None:
        view = scores.view(batch, kv_heads, group, key_len)
        if attention_mask.dtype == torch.bool:
            view.masked_fill_(~attention_mask, torch.finfo(scores.dtype).min)  # in place: 2 ops, where takes 5
        else:
            scores = (view + attention_mask).view(scores.shape)
    softmax_dtype = _float32_or_wider(query.dtype)
    # softmax's dtype argument costs an op even when it changes nothing
    maps = torch.softmax(scores, -1) if scores.dtype == softmax_dtype else torch.softmax(scores, -1, dtype=softmax_dtype)
    # A1 − λ·A2 first, as the blocked kernel does: the first half of the query heads reads the first half of the key
    # heads, so map 1 of differential head (G/2 position p, group row r) sits at [:, 0, p, r], map 2 at [:, 1, p, r].
    pairs = maps.view(batch, 2, half * group, key_len)
    first, second = pairs[:, 0], pairs[:, 1]  # unbind costs an op more
    differential = torch.addcmul(first, second, lambda_full, value=-1)  # a 0-d λ keeps the maps' dtype
    if differential.dtype != value.dtype:
        differential = differential.to(value.dtype)  # bf16/fp16: the product on the low-precision units
    # Differential head (p, r) reads value heads p and p + G/2: the differential maps twice over, one copy per value
    # half, meet every value head in one bmm: (batch, value half, G/2, group, d). The copy is of the maps, not of the
    # cached values.
    products = torch.bmm(torch.cat((differential, differential), 1).view(batch * kv_heads, group, key_len),
                         value.reshape(batch * kv_heads, key_len, head_dim))
    if products.dtype != lambda_full.dtype:
        products = products.to(lambda_full.dtype)
    # (batch, value half, G/2, group, d) -> (batch, 1, H/2, 2d): differential head i = (G/2 position, group row).
    return products.view(batch, 2, half, group, head_dim).permute(0, 2, 3, 1, 4).reshape(
        batch, 1, num_heads // 2, 2 * head_dim)


def _empty_like_scalar(like: torch.Tensor) -> torch.Tensor:
    """The ignored `input` of baddbmm(beta=0), one element that broadcasts; cached per dtype and device, since
    allocating it is an op of its own. (Not while compiling: a traced graph owns its constants.)"""
    if torch.compiler.is_compiling():
        return like.new_zeros(1, 1, 1)
    key = (like.dtype, like.device)
    scalar = _EMPTY_SCALARS.get(key)
    if scalar is None:
        scalar = _EMPTY_SCALARS[key] = torch.zeros(1, 1, 1, dtype=like.dtype, device=like.device)
    return scalar


_EMPTY_SCALARS: dict = {}


def _pad_to_pairs(query, key, value):
    """The one-call layout of the prefill path: queries and keys with d zero channels; for every key/value head, the
    value pair [v(first half), v(second half)] of the differential heads it serves."""
    return _zero_padded(query), _zero_padded(key), _value_pairs(value)


def _zero_padded(states):
    """(batch, heads, seq, d) -> (batch, heads, seq, 2d), the new channels zero, laid out in memory as (batch, seq,
    heads, 2d) as the projections lay out q and k: a fused kernel's output then follows that layout, and
    transformers' transpose of it to (batch, seq, heads, 2d) copies nothing (the copy would be a 2d-wide tensor that
    training keeps, since λ's gradient reads A2·V)."""
    return nn.functional.pad(states.transpose(1, 2), (0, states.shape[-1])).transpose(1, 2)


def _value_pairs(value):
    """(batch, G, seq, d) -> (batch, G, seq, 2d): key/value head g holds the pair of the differential heads it serves."""
    value_pairs = torch.cat(value.chunk(2, dim=1), dim=-1)
    return torch.cat([value_pairs, value_pairs], dim=1)


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are in force here: torch's private function from 2.8 on (torch.utils.checkpoint asks
    it too); before, whether a saved tensor was packed by them. Unknown counts as yes."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) is not None if top is not None else _a_saved_tensor_is_packed()


def _unchanged(tensor):
    return tensor


def _a_saved_tensor_is_packed() -> bool:
    """A product saves its input; a saved tensor takes hooks of its own only when no default hooks packed it."""
    with torch.enable_grad():
        probe = torch.zeros((), requires_grad=True)
        product = probe * probe
    try:
        product.grad_fn._raw_saved_self.register_hooks(_unchanged, _unchanged)
    except (AttributeError, RuntimeError):
        return True
    return False


class RebuiltForBackward:
    """While active, autograd keeps for backward, in place of a tensor registered with `add` (or of a view of it), the
    inputs that rebuild it. Meant for tensors larger than inputs that are kept anyway (padding, concatenation, a pair
    difference and what is computed from it); backward pays for computing them again. A no-op without autograd, while
    compiling (the partitioner decides there), and under another saved-tensor policy (non-reentrant activation
    checkpointing, offloading to the CPU), which then decides for every tensor (inner hooks would take over from it)."""

    def __init__(self, enabled: bool = True):
        # By storage, so that a view of a registered tensor is found too; the tensors are held while this is active,
        # so their storages' ids stay theirs.
        self._recipes: dict[int, _Rebuild] = {}
        self._enabled = enabled
        self._hooks = None

    def add(self, tensor: torch.Tensor, rebuild: Callable, *inputs: torch.Tensor) -> torch.Tensor:
        """Register `tensor` = rebuild(*inputs), which must recreate its values and layout. Returns `tensor`. Only
        while active: inactive (compiling among the reasons), there is nothing to pack, and a compiler traces no
        storage's id (torch 2.11's dynamo refuses it)."""
        if self._hooks is not None:
            self._recipes[id(tensor.untyped_storage())] = _Rebuild(tensor, rebuild, inputs)
        return tensor

    def __enter__(self):
        if self._enabled and torch.is_grad_enabled() and not torch.compiler.is_compiling() and (
                not _saved_tensor_hooks_active()):
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info):
        if self._hooks is not None:
            self._hooks.__exit__(*exc_info)
        self._hooks = None
        for recipe in self._recipes.values():
            recipe.tensor = None  # from here on only backward reads it, through what was packed
        self._recipes.clear()

    def _pack(self, tensor):
        recipe = self._recipes.get(id(tensor.untyped_storage()))
        if recipe is None:
            return tensor
        recipe.packed += 1
        return recipe, tensor.size(), tensor.stride(), tensor.storage_offset()

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        recipe, size, stride, offset = packed
        return recipe.unpack().as_strided(size, stride, offset)


class _Rebuild:
    """One registered tensor's recipe. Several saved tensors can be views of it (the head norm keeps its input twice):
    the tensor is rebuilt once per backward and held until the last of them has been read."""

    def __init__(self, tensor, rebuild, inputs):
        self.tensor, self.rebuild, self.inputs = tensor, rebuild, inputs
        self.packed = self.unpacked = 0
        self.rebuilt = None

    def unpack(self) -> torch.Tensor:
        rebuilt = self.rebuilt if self.rebuilt is not None else self.rebuild(*self.inputs)
        self.unpacked += 1
        # Held until every pack has been read once (then again for a backward run a second time, retain_graph=True).
        self.rebuilt = rebuilt if self.unpacked % self.packed else None
        return rebuilt


def _has_cpu_flash_attention() -> bool:
    """The private aten ops of `CausalPairedAttentionCPU`. Present since torch 2.2; a private op may go away, so the
    dispatch checks before using them and falls back to the generic path (tested by hiding them)."""
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
    )


def _has_cuda_flash_attention() -> bool:
    """The private aten ops of `CausalPairedAttentionCUDA` (PyTorch's FlashAttention-2 entry points, present since
    torch 2.2); checked before use, as the CPU ones."""
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention") and hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_backward"
    )


# The CPU flash kernel reads grouped keys and values (fewer heads than the queries) from torch 2.9 on
# (pytorch/pytorch#157893). Before, it takes them without complaint and reads past them: garbage in forward, a crash
# in backward. There they go to it repeated to every query head, and their gradients are summed back.
CPU_FLASH_READS_GROUPED_HEADS = is_torch_greater_or_equal("2.9", accept_dev=True)


def _cpu_flash_heads(query, states):
    if CPU_FLASH_READS_GROUPED_HEADS or states.shape[1] == query.shape[1]:
        return states
    return states.repeat_interleave(query.shape[1] // states.shape[1], dim=1)  # repeat_kv's order


def _summed_to_heads(gradient, heads):
    if gradient.shape[1] == heads:
        return gradient
    batch, _, seq, width = gradient.shape
    return gradient.view(batch, heads, -1, seq, width).sum(2)


class _CPUFlash:
    """The CPU flash kernel's private entry points: (output, tensors backward needs, other values backward needs)."""

    @staticmethod
    def forward(query, key, value, scaling):
        output, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, _cpu_flash_heads(query, key), _cpu_flash_heads(query, value), 0.0, True, scale=scaling
        )
        return output, (logsumexp,), ()

    @staticmethod
    def backward(grad_output, query, key, value, output, saved, constants, scaling):
        grad_query, grad_key, grad_value = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_output, query, _cpu_flash_heads(query, key), _cpu_flash_heads(query, value), output, *saved, 0.0,
            True, scale=scaling,
        )
        return grad_query, _summed_to_heads(grad_key, key.shape[1]), _summed_to_heads(grad_value, value.shape[1])


class _CUDAFlash:
    """PyTorch's FlashAttention-2 entry points on CUDA. They take grouped keys and values as they are (FlashAttention
    reads each key/value head for its group of query heads, and sums their gradients itself), as PyTorch's own SDPA
    hands them over."""

    @staticmethod
    def forward(query, key, value, scaling):
        output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, _ = (
            torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, True, False, scale=scaling)
        )
        return output, (logsumexp, cum_seq_q, cum_seq_k, philox_seed, philox_offset), (max_q, max_k)

    @staticmethod
    def backward(grad_output, query, key, value, output, saved, constants, scaling):
        logsumexp, cum_seq_q, cum_seq_k, philox_seed, philox_offset = saved
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_output, query, key, value, output, logsumexp, cum_seq_q, cum_seq_k, *constants, 0.0, True,
            philox_seed, philox_offset, scale=scaling,
        )


def _paired_forward(ctx, flash, query, key, value, scaling):
    """A causal flash call on `_pad_to_pairs`' layout, keeping for backward the d-wide query, key and value, not their
    padded copies: (batch, H, seq, 2d)."""
    output, saved, constants = flash.forward(*_pad_to_pairs(query, key, value), scaling)
    ctx.save_for_backward(query, key, value, output, *saved)
    ctx.constants, ctx.scaling = constants, scaling
    return output


def _paired_backward(ctx, flash, grad_output):
    """The padded layout built again (three concatenations), the flash backward on it, and the gradients of the
    d-wide query, key and value it was built from."""
    query, key, value, output, *saved = ctx.saved_tensors
    grad_query, grad_key, grad_value = flash.backward(
        grad_output.contiguous(), *_pad_to_pairs(query, key, value), output, saved, ctx.constants, ctx.scaling
    )
    head_dim = query.shape[-1]
    grad_pairs = sum(grad_value.chunk(2, dim=1))  # both halves of the heads read the same value pairs
    grad_value = torch.cat(grad_pairs.split(head_dim, dim=-1), dim=1)
    return grad_query[..., :head_dim], grad_key[..., :head_dim], grad_value, None


class CausalPairedAttentionCPU(torch.autograd.Function):
    """Training on CPU, causal, no padding mask: the fused SDPA kernel on the padded layout of `_pad_to_pairs`, but
    saving for backward only the d-wide query, key and value (and the output), not their padded copies. Output:
    (batch, H, seq, 2d)."""

    @staticmethod
    def forward(ctx, query, key, value, scaling):
        return _paired_forward(ctx, _CPUFlash, query, key, value, scaling)

    @staticmethod
    def backward(ctx, grad_output):
        return _paired_backward(ctx, _CPUFlash, grad_output)


class CausalPairedAttentionCUDA(torch.autograd.Function):
    """`CausalPairedAttentionCPU` on CUDA, with FlashAttention's entry points; grouped keys and values go to it as
    they are (no copy to every query head)."""

    @staticmethod
    def forward(ctx, query, key, value, scaling):
        return _paired_forward(ctx, _CUDAFlash, query, key, value, scaling)

    @staticmethod
    def backward(ctx, grad_output):
        return _paired_backward(ctx, _CUDAFlash, grad_output)


def _future_is_masked(attention_mask: torch.Tensor, query_len: int, key_len: int) -> bool:
    """Whether no query may see a key after its own position, the queries being the last `query_len` positions (any
    causal mask, padded or not), so that the key columns right of a row block can be skipped. One pass over the mask
    per call; a custom mask that lets queries see the future keeps every column."""
    future = torch.ones(query_len, key_len, dtype=torch.bool, device=attention_mask.device)
    future = future.triu_(key_len - query_len + 1)
    mask = attention_mask[..., -query_len:, :key_len]
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    return not bool((allowed & future).any())


def _block_masking(attention_mask, block_size, device):
    """What `_mask_block` applies, prepared once per call rather than once per block (on a busy CPU every op of a
    multi-threaded kernel waits for its threads): causal, the future pattern of a diagonal block; boolean, the
    positions to hide; additive, the mask itself."""
    if attention_mask is None:
        return torch.ones(block_size, block_size, dtype=torch.bool, device=device).triu_(1)
    return ~attention_mask if attention_mask.dtype == torch.bool else attention_mask


def _mask_block(scores, attention_mask, masking, start, stop, columns, offset, group):
    """Mask the scores of query rows start..stop (rows ordered (token, query head of the group)) in place."""
    batch, kv_heads, _, _ = scores.shape
    rows = stop - start
    view = scores.view(batch, kv_heads, rows, group, columns)
    if attention_mask is None:
        # Causal, no padding: only the block's last `rows` columns hold future keys (the columns stop at the block's
        # last row).
        if rows > 1:
            view[..., start + offset :].masked_fill_(masking[:rows, None, :rows], float("-inf"))
        return scores
    mask = masking[:, :, start:stop, :columns, None].transpose(-1, -2)  # (batch, 1, rows, 1, columns)
    if attention_mask.dtype == torch.bool:
        # The most negative finite value, as eager's additive masks: a fully masked (padded) row stays finite.
        view.masked_fill_(mask, torch.finfo(scores.dtype).min)
    else:
        view.add_(mask.to(scores.dtype))
    return scores


def _query_rows(query: torch.Tensor, scaling: float, kv_heads: int) -> torch.Tensor:
    """Scaled queries (batch, H, q, d) as rows of their key/value head, (batch, G, q·H/G, d), ordered (token, query
    head of the group): a block of tokens is then a contiguous slice of rows."""
    batch, num_heads, query_len, head_dim = query.shape
    group = num_heads // kv_heads
    rows = (query * scaling).view(batch, kv_heads, group, query_len, head_dim).transpose(2, 3)
    return rows.reshape(batch, kv_heads, query_len * group, head_dim)


def _block_buffer(buffer: torch.Tensor, *shape: int) -> torch.Tensor:
    """A contiguous (shape) view of the start of a flat buffer allocated once per call: on CPU, allocating a fresh
    block-sized tensor for every block costs more than the block's softmax."""
    return buffer[: math.prod(shape)].view(shape)


def _score_buffer(query, key, block_size, group, dtype) -> torch.Tensor:
    """The flat buffer that every block of one call writes its scores into: a block's rows against every key column."""
    return query.new_empty(key.shape[0] * key.shape[1] * min(block_size, query.shape[2]) * group * key.shape[2],
                           dtype=dtype)


def _block_scores(query_rows, key, attention_mask, masking, start, stop, offset, skip_future, group, buffer):
    """Masked scores of query tokens start..stop against the key columns they may see, written into `buffer` (flat,
    float32 or wider): (scores, rows, columns)."""
    rows = slice(start * group, stop * group)
    columns = stop + offset if skip_future else key.shape[2]
    batch, kv_heads = key.shape[:2]
    scores = _block_buffer(buffer, batch, kv_heads, (stop - start) * group, columns)
    if buffer.dtype == query_rows.dtype:
        torch.matmul(query_rows[:, :, rows], key[:, :, :columns].transpose(2, 3), out=scores)
    else:  # bf16/fp16 matmul on the CPU's low-precision units, scores kept in float32
        scores.copy_(torch.matmul(query_rows[:, :, rows], key[:, :, :columns].transpose(2, 3)))
    return _mask_block(scores, attention_mask, masking, start, stop, columns, offset, group), rows, columns


class BlockedDifferentialAttention(torch.autograd.Function):
    """Exact differential attention by blocks of query rows: (batch, q_len, H/2, 2d), before the head norm.

    For each block of query rows it forms the full score rows of both maps (Q·Kᵀ costs Llama's), an exact softmax,
    then A1 − λ·A2, one map per differential head, which meets the 2d-wide value pair once (A·V costs Llama's too:
    H/2 maps x 2d = H maps x d). Key columns right of the block are skipped when the mask is causal. Backward
    recomputes each block from q, k, v, λ and the saved row statistics (maximum, sum), so memory stays linear in the sequence
    length. Matmuls run in the input dtype (bf16 keeps the CPU's bf16 units); softmax, A1 − λ·A2 and the row
    statistics in float32 or wider.

    Inputs as `differential_decode_attention`'s: query (batch, H, q_len, d), key/value (batch, G, kv_len, d) with G
    even and query head h reading key/value head h // (H / G); λ a 0-d tensor.
    """

    @staticmethod
    def forward(ctx, query, key, value, lambda_full, attention_mask, scaling, block_size, offset, skip_future):
        batch, num_heads, query_len, head_dim = query.shape
        kv_heads = key.shape[1]
        group, half = num_heads // kv_heads, kv_heads // 2
        softmax_dtype = torch.promote_types(query.dtype, torch.float32)
        rows_query = _query_rows(query, scaling, kv_heads)
        key = key.contiguous()  # sliced per block: a strided key would be copied by every matmul
        value_pairs = torch.cat((value[:, :half], value[:, half:]), dim=-1)  # (batch, G/2, kv_len, 2d)
        lam = lambda_full.to(softmax_dtype)
        output = query.new_empty(batch, query_len, half, group, 2 * head_dim, dtype=softmax_dtype)
        save_statistics = any(ctx.needs_input_grad[:4])
        if save_statistics:  # row maximum and sum of exp(score - maximum), per map and query row
            row_max = query.new_empty(batch, kv_heads, query_len * group, 1, dtype=softmax_dtype)
            row_sum = torch.empty_like(row_max)
        masking = _block_masking(attention_mask, block_size, query.device)
        score_buffer = _score_buffer(query, key, block_size, group, softmax_dtype)
        block_buffer = value.new_empty(batch * half * min(block_size, query_len) * group * 2 * head_dim)
        for start in range(0, query_len, block_size):
            stop = min(start + block_size, query_len)
            scores, rows, columns = _block_scores(rows_query, key, attention_mask, masking, start, stop, offset,
                                                  skip_future, group, score_buffer)
            if save_statistics:
                # Not a single log-sum-exp: for a fully masked (padded) row, min + log(n) rounds to min, and the
                # recomputed map would not be eager's uniform one.
                torch.amax(scores, dim=-1, keepdim=True, out=row_max[:, :, rows])
                maps = scores.sub_(row_max[:, :, rows]).exp_()
                torch.sum(maps, dim=-1, keepdim=True, out=row_sum[:, :, rows])
                maps = maps.div_(row_sum[:, :, rows])
            else:
                maps = torch.softmax(scores, dim=-1, out=scores)
            differential = maps[:, :half].addcmul_(maps[:, half:], lam, value=-1).to(value.dtype)
            block = _block_buffer(block_buffer, batch, half, (stop - start) * group, 2 * head_dim)
            torch.matmul(differential, value_pairs[:, :, :columns], out=block)
            output[:, start:stop] = block.view(batch, half, stop - start, group, 2 * head_dim).transpose(1, 2)
        if save_statistics:
            ctx.save_for_backward(query, key, value, lambda_full, row_max, row_sum)
            ctx.attention_mask = attention_mask
            ctx.settings = (scaling, block_size, offset, skip_future)
        return output.view(batch, query_len, half * group, 2 * head_dim)

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, lambda_full, row_max, row_sum = ctx.saved_tensors
        scaling, block_size, offset, skip_future = ctx.settings
        attention_mask = ctx.attention_mask
        batch, num_heads, query_len, head_dim = query.shape
        kv_heads = key.shape[1]
        group, half = num_heads // kv_heads, kv_heads // 2
        softmax_dtype = row_max.dtype
        rows_query = _query_rows(query, scaling, kv_heads)
        value_pairs = torch.cat((value[:, :half], value[:, half:]), dim=-1)
        lam = lambda_full.to(softmax_dtype)
        # (batch, q_len, H/2, 2d) -> (batch, G/2, rows, 2d), rows ordered as in forward.
        grad_output = grad_output.to(value.dtype).view(batch, query_len, half, group, 2 * head_dim).transpose(1, 2)
        grad_output = grad_output.reshape(batch, half, query_len * group, 2 * head_dim)
        grad_rows_query = torch.empty_like(rows_query, dtype=softmax_dtype)
        grad_key = torch.zeros_like(key, dtype=softmax_dtype)
        grad_pairs = torch.zeros_like(value_pairs, dtype=softmax_dtype)
        grad_lambda = torch.zeros((), dtype=softmax_dtype, device=query.device)
        masking = _block_masking(attention_mask, block_size, query.device)
        score_buffer = _score_buffer(query, key, block_size, group, softmax_dtype)
        for start in range(0, query_len, block_size):
            stop = min(start + block_size, query_len)
            scores, rows, columns = _block_scores(rows_query, key, attention_mask, masking, start, stop, offset,
                                                  skip_future, group, score_buffer)
            maps = scores.sub_(row_max[:, :, rows]).exp_().div_(row_sum[:, :, rows])  # A1 (first G/2 heads), A2
            differential = torch.addcmul(maps[:, :half], maps[:, half:], lam, value=-1).to(value.dtype)
            grad_block = grad_output[:, :, rows]
            grad_pairs[:, :, :columns] += torch.matmul(differential.transpose(2, 3), grad_block)
            grad_differential = torch.matmul(grad_block, value_pairs[:, :, :columns].transpose(2, 3))
            # Softmax backward of both maps, dS = A * (dA - rowsum(dA * A)), with dA1 = dP and dA2 = -λ dP.
            paired_maps = maps.view(batch, 2, half, -1, columns)
            grad_differential = grad_differential.to(softmax_dtype)[:, None]
            row_sums = (paired_maps * grad_differential).sum(-1, keepdim=True)  # (batch, 2, G/2, rows, 1)
            grad_lambda -= row_sums[:, 1].sum()
            grad_scores = (grad_differential - row_sums).mul_(paired_maps)
            grad_scores[:, 1].mul_(-lam)
            grad_scores = grad_scores.view(batch, kv_heads, -1, columns).to(query.dtype)
            grad_rows_query[:, :, rows] = torch.matmul(grad_scores, key[:, :, :columns])
            grad_key[:, :, :columns] += torch.matmul(grad_scores.transpose(2, 3), rows_query[:, :, rows])
        # dK = dSᵀ·(q·scaling) above already holds the scaling; dQ gets it here.
        grad_query = (grad_rows_query * scaling).view(batch, kv_heads, query_len, group, head_dim).transpose(2, 3)
        grad_query = grad_query.reshape(batch, num_heads, query_len, head_dim).to(query.dtype)
        grad_value = torch.cat(grad_pairs.split(head_dim, dim=-1), dim=1).to(value.dtype)
        return (grad_query, grad_key.to(key.dtype), grad_value, grad_lambda.to(lambda_full.dtype)) + (None,) * 5


class DifferentialKernel:
    """A named differential kernel and the calls it can take (`supports`); the dispatch skips it for other calls."""

    def __init__(self, function: Callable, supports: Callable | None = None, description: str = ""):
        self.function = function
        self.supports = supports or (lambda module, query, key, attention_mask: True)
        self.description = description

    def __call__(self, *args, **kwargs):
        return self.function(*args, **kwargs)


def generic_differential_attention(module, query, key, value, attention_mask, lambda_full, **kwargs):
    """Every softmax map applied to the 2d-wide value pair of its differential head through the configured attention
    backend (`config._attn_implementation`: eager, SDPA, flex, flash, or one registered with `AttentionInterface`),
    then A1·V − λ·A2·V. Runs anywhere, and returns the maps when the backend does (eager)."""
    attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
        module.config._attn_implementation, eager_attention_forward
    )
    call = partial(attention_interface, module, attention_mask=attention_mask, dropout=0.0, scaling=module.scaling)
    if query.shape[2] > 1:
        # Prefill: one backend call forms every softmax map once and applies it to the 2d-wide value pair. Fused
        # kernels want equal query/key/value widths, so queries and keys get d zero channels: the scores, hence the
        # maps, are unchanged (the scaling stays 1/sqrt(d)).
        # The backend keeps what it was handed for backward; in training it keeps the d-wide tensors instead and
        # rebuilds the padded layout from them.
        # (Eager and SDPA only: FlexAttention compiles its call, and has never been run under these hooks.)
        with RebuiltForBackward(module.config._attn_implementation in ("eager", "sdpa")) as rebuilt:
            padded_query = rebuilt.add(_zero_padded(query), _zero_padded, query)
            padded_key = rebuilt.add(_zero_padded(key), _zero_padded, key)
            value_pairs = rebuilt.add(_value_pairs(value), _value_pairs, value)
            attn_output, attn_weights = call(query=padded_query, key=padded_key, value=value_pairs, **kwargs)
    else:
        # Decoding one token: padding the whole cached keys every step costs more than forming the scores twice.
        first_values, second_values = value.chunk(2, dim=1)
        first_output, attn_weights = call(query=query, key=key, value=torch.cat([first_values] * 2, dim=1), **kwargs)
        second_output, _ = call(query=query, key=key, value=torch.cat([second_values] * 2, dim=1), **kwargs)
        attn_output = torch.cat([first_output, second_output], dim=-1)
    map1_output, map2_output = attn_output.chunk(2, dim=2)  # (batch, q, H, 2d): maps i and i + H/2
    return _pair_difference(map1_output, map2_output, lambda_full), attn_weights


def _pair_difference(map1_output, map2_output, lambda_full):
    """A1·V − λ·A2·V in λ's dtype (float32 or wider). λ as a one-element tensor, so that the product promotes to its
    dtype: autograd then keeps A2·V for λ's gradient as it is, a view of the attention output in the model's dtype,
    which the attention kernel keeps anyway, instead of a float32 copy. In training, one `PairDifference` node, so
    that what is computed from the difference need not be kept either."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # compiled: the partitioner recomputes itself
        return PairDifference.apply(map1_output, map2_output, lambda_full)
    return _pair_difference_value(map1_output, map2_output, lambda_full)


def _pair_difference_value(map1_output, map2_output, lambda_full):
    # One op (it promotes the bf16/fp16 pair to λ's dtype): training computes it again in backward.
    return torch.addcmul(map1_output, map2_output, lambda_full.view(1), value=-1)


def _recomputed_gradients(function, inputs, needs_grad, grad_output):
    """Gradients of `function(*inputs)` for the inputs that need them (None for the others), recomputing its
    forward: the same ops as the forward that ran, so the same gradients as autograd keeping its tensors would give."""
    inputs = [tensor.detach().requires_grad_(needs) for tensor, needs in zip(inputs, needs_grad)]
    with torch.enable_grad():
        output = function(*inputs)
    wanted = [tensor for tensor in inputs if tensor.requires_grad]
    grads = iter(torch.autograd.grad(output, wanted, grad_output) if wanted else ())
    return tuple(next(grads) if tensor.requires_grad else None for tensor in inputs)


class PairDifference(torch.autograd.Function):
    """`_pair_difference` as one autograd node, keeping only its inputs A1·V, A2·V and λ: views of the attention
    kernel's output, which that kernel keeps anyway. What is computed from the float32 difference (the head norm,
    o_proj's input) can then be rebuilt from them in backward rather than kept (`pair_difference_inputs`,
    `RebuiltForBackward`)."""

    @staticmethod
    def forward(ctx, map1_output, map2_output, lambda_full):
        ctx.save_for_backward(map1_output, map2_output, lambda_full)
        ctx.is_pair_difference = True  # read by `pair_difference_inputs`, on this node
        return _pair_difference_value(map1_output, map2_output, lambda_full)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        return _recomputed_gradients(_pair_difference_value, ctx.saved_tensors, ctx.needs_input_grad, grad_output)


def pair_difference_inputs(difference: torch.Tensor) -> tuple | None:
    """(A1·V, A2·V, λ) when `difference` is a `PairDifference` output that autograd records, else None. None while
    compiling or exporting: `_pair_difference` makes no such node there (the partitioner decides what is kept), and
    the compiler cannot read a tensor's `grad_fn`."""
    if torch.compiler.is_compiling():
        return None
    node = difference.grad_fn
    if node is None or not getattr(node, "is_pair_difference", False):
        return None
    return node.saved_tensors


def decode_differential_attention(module, query, key, value, attention_mask, lambda_full, **kwargs):
    return differential_decode_attention(query, key, value, attention_mask, module.scaling, lambda_full), None


def paired_sdpa_cpu_differential_attention(module, query, key, value, attention_mask, lambda_full, **kwargs):
    # Under autocast the values come from v_proj in half precision while the queries and keys, after RoPE, are
    # float32; the fused kernel takes one dtype (SDPA itself would be cast by autocast, its private op is not).
    value = value.to(query.dtype)
    attn_output = CausalPairedAttentionCPU.apply(query, key, value, module.scaling).transpose(1, 2)
    return _pair_difference(*attn_output.chunk(2, dim=2), lambda_full), None


# Query rows per block of the blocked kernel. Larger blocks mean fewer per-block ops, each of which waits for every
# thread of a multi-threaded kernel; the score buffer grows with the block (rows x key length). docs/kernels.md has
# the measurements behind the value.
BLOCKED_KERNEL_ROWS = 128


def blocked_differential_attention(module, query, key, value, attention_mask, lambda_full, **kwargs):
    query_len, key_len = query.shape[2], key.shape[2]
    if attention_mask is None:
        # SDPA's convention (is_causal): query t sees keys 0..t (a static cache's unused slots come after), and one
        # query token sees every key.
        offset, skip_future = (0 if query_len > 1 else key_len - 1), True
    else:
        offset = key_len - query_len
        skip_future = _future_is_masked(attention_mask, query_len, key_len)
    output = BlockedDifferentialAttention.apply(
        query, key, value, lambda_full, attention_mask, module.scaling, BLOCKED_KERNEL_ROWS, offset, skip_future
    )
    return output.to(lambda_full.dtype), None


def paired_sdpa_cuda_differential_attention(module, query, key, value, attention_mask, lambda_full, **kwargs):
    attn_output = CausalPairedAttentionCUDA.apply(query, key, value, module.scaling).transpose(1, 2)
    return _pair_difference(*attn_output.chunk(2, dim=2), lambda_full), None


def _is_causal_cuda_half_training(module, query, key, attention_mask) -> bool:
    """CUDA, bf16/fp16 (FlashAttention's dtypes), padded width 2d at most 256 (its largest head), plain causal
    self-attention, the private ops present, not compiling."""
    return (
        attention_mask is None
        and key.shape[2] == query.shape[2]
        and query.device.type == "cuda"
        and query.dtype in (torch.bfloat16, torch.float16)
        and 2 * query.shape[-1] <= 256
        and _has_cuda_flash_attention()
        and not torch.compiler.is_compiling()
    )


def _is_causal_cpu_training(module, query, key, attention_mask) -> bool:
    """CPU, plain causal self-attention (no padding mask, no cached prefix), the private ops present, not compiling."""
    return (
        attention_mask is None
        and key.shape[2] == query.shape[2]
        and query.device.type == "cpu"
        and _has_cpu_flash_attention()
        and not torch.compiler.is_compiling()
    )


def _blocked_supports(module, query, key, attention_mask) -> bool:
    # Transformers' masks have one head; torch.compile keeps the generic path (it traces the backend call instead).
    return (attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1)) and (
        not torch.compiler.is_compiling()
    )


class DifferentialAttentionInterface(GeneralInterface):
    """Name -> differential kernel, in the manner of transformers' `AttentionInterface`: `register(name, kernel)` adds
    one library-wide (a `DifferentialKernel`, or a plain function taking the arguments of
    `generic_differential_attention`), and every name can be chosen with `model.set_differential_kernel(name)` or
    `config.differential_kernel`."""

    _global_mapping = {
        "generic": DifferentialKernel(
            generic_differential_attention,
            description="the configured attention backend on the padded one-call layout (prefill) or two calls "
            "(decode); any backend and device; returns the maps with eager",
        ),
        "blocked": DifferentialKernel(
            blocked_differential_attention,
            _blocked_supports,
            "exact, by blocks of query rows: A1 − λ·A2 formed before it meets the 2d-wide value; causal blocks "
            "skipped; backward recomputes from row statistics",
        ),
        "decode": DifferentialKernel(
            decode_differential_attention,
            lambda module, query, key, attention_mask: query.shape[2] == 1,
            "one query token: two matmuls around one softmax, keys and values read once",
        ),
        "paired_sdpa_cpu": DifferentialKernel(
            paired_sdpa_cpu_differential_attention,
            _is_causal_cpu_training,
            "CPU SDPA flash kernel on the padded layout, saving only d-wide tensors for backward (private aten op, "
            "guarded)",
        ),
        "paired_sdpa_cuda": DifferentialKernel(
            paired_sdpa_cuda_differential_attention,
            _is_causal_cuda_half_training,
            "CUDA FlashAttention on the padded layout, saving only d-wide tensors for backward (private aten op, "
            "guarded; bf16/fp16)",
        ),
    }

    def get_kernel(self, name: str) -> DifferentialKernel:
        if name not in self:
            raise ValueError(
                f"Unknown differential kernel {name!r}; choose one of {self.valid_keys()} or None (automatic), or "
                f"register it with `DifferentialAttentionInterface.register`."
            )
        kernel = self[name]
        return kernel if isinstance(kernel, DifferentialKernel) else DifferentialKernel(kernel)


ALL_DIFFERENTIAL_KERNELS = DifferentialAttentionInterface()


# The automatic choice: (attention backend, device type, step, dtypes) -> kernel, first match wins, "*" matches
# anything; steps: "prefill" (no autograd), "train" (autograd on), "decode" (one query token); dtypes: the query's
# dtype. Each entry says why it wins (docs/kernels.md has the measurements). A kernel that does not support a call
# (see `supports`) passes it to the next matching entry; "generic" ends the list.
_FULL_PRECISION = (torch.float32, torch.float64)
DIFFERENTIAL_KERNEL_DISPATCH = [
    ("sdpa", "*", "decode", "*", "decode",
     "Decoding is bound by reading the cache and by the op count: this kernel reads keys and values once in two "
     "matmuls, where the generic path makes two backend calls on two copies of the values. Plain bmm and softmax, "
     "so it runs on every device."),
    ("sdpa", "cpu", "prefill", _FULL_PRECISION, "blocked",
     "CPU, full precision: forming A1 - λ·A2 before it meets the value halves the A·V work of the padded call and "
     "skips the causal blocks."),
    ("sdpa", "cpu", "train", _FULL_PRECISION, "blocked",
     "CPU, full precision, training: as for prefill, and backward recomputes from row statistics, so memory stays "
     "linear in the sequence length."),
    ("sdpa", "cpu", "train", "*", "paired_sdpa_cpu",
     "CPU, half precision, training: the fused SDPA kernel runs far faster here than the blocked kernel's per-block "
     "ops, and saving only d-wide tensors for backward keeps the memory close to Llama's."),
    ("*", "*", "*", "*", "generic",
     "The default: exact on every backend and device. Fused backends (CPU half precision, CUDA) run the padded call "
     "faster than the blocked kernel's per-block ops."),
]


def _step(query) -> str:
    if query.shape[2] == 1:
        return "decode"
    return "train" if torch.is_grad_enabled() and query.requires_grad else "prefill"


# (backend, device type, step, dtype) -> the names of the matching entries, in order; matched once per key rather
# than once per layer and step, and matched afresh whenever the table is changed (compared with the copy it was
# built from). Kernels are still looked up by name and asked whether they support each call.
_MATCHING_KERNELS: dict = {}
_MATCHED_TABLE: list = []


def _matching_kernels(backend, device, step, dtype) -> tuple:
    if torch.compiler.is_compiling():
        # Matched once at trace time anyway; filling the memo while tracing would guard the graph on the key's
        # absence, and the next step (the key now present) would recompile.
        return _match_kernels(backend, device, step, dtype)
    if _MATCHED_TABLE != DIFFERENTIAL_KERNEL_DISPATCH:
        _MATCHING_KERNELS.clear()
        _MATCHED_TABLE[:] = DIFFERENTIAL_KERNEL_DISPATCH
    key = (backend, device, step, dtype)
    names = _MATCHING_KERNELS.get(key)
    if names is None:
        names = _MATCHING_KERNELS[key] = _match_kernels(backend, device, step, dtype)
    return names


def _match_kernels(backend, device, step, dtype) -> tuple:
    return tuple(
        name
        for rule_backend, rule_device, rule_step, rule_dtypes, name, _why in DIFFERENTIAL_KERNEL_DISPATCH
        if rule_backend in ("*", backend)
        and rule_device in ("*", device)
        and rule_step in ("*", step)
        and (rule_dtypes == "*" or dtype in rule_dtypes)
    )


def select_differential_kernel(module, query, key, attention_mask) -> DifferentialKernel:
    """The kernel for this call: `config.differential_kernel` when set and it supports the call, else the first
    matching entry of `DIFFERENTIAL_KERNEL_DISPATCH` that supports it."""
    chosen = getattr(module.config, "differential_kernel", None)
    if chosen is not None:
        kernel = ALL_DIFFERENTIAL_KERNELS.get_kernel(chosen)
        if kernel.supports(module, query, key, attention_mask):
            return kernel
    names = _matching_kernels(module.config._attn_implementation, query.device.type, _step(query), query.dtype)
    for name in names:
        kernel = ALL_DIFFERENTIAL_KERNELS.get_kernel(name)
        if kernel.supports(module, query, key, attention_mask):
            return kernel
    return ALL_DIFFERENTIAL_KERNELS.get_kernel("generic")


def folded_gqa_sdpa_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa_attention_forward`, without repeating keys and values under a mask that every query row
    shares (one decoding token): the query heads of each key/value head are folded into the rows,
    (batch, H, q, d) -> (batch, G, H/G·q, d), so SDPA reads the G cached heads as they are. Other calls go to
    transformers' function unchanged.

    Why: with a mask, transformers repeats the keys and values to all H query heads (SDPA's `enable_gqa` would fall
    back to its math kernel on CUDA), every decoding step, and a static cache always passes a mask. DIFF V2 has twice
    a LLaMA's query heads over the same key/value heads, so it would copy twice a LLaMA's cache per step. Returns
    what transformers' function returns: (batch, q, H, d), contiguous, and no weights.
    """
    if not _mask_is_shared_by_every_row(attention_mask) or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, query_len, _ = query.shape
    kv_heads = key.shape[1]
    # Query head h reads key/value head h // (H/G) (repeat_kv's order), so the heads of one key/value head are
    # consecutive and fold into its rows; the shared mask row broadcasts over them without a copy.
    rows = query.reshape(batch, kv_heads, heads // kv_heads * query_len, query.shape[-1])
    # No is_causal: a mask is given (transformers' function passes False then too).
    attn_output = nn.functional.scaled_dot_product_attention(
        rows, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    attn_output = attn_output.view(batch, heads, query_len, value.shape[-1]).transpose(1, 2)
    return attn_output.contiguous(), None


def _mask_is_shared_by_every_row(attention_mask: torch.Tensor | None) -> bool:
    """A mask of transformers' layout (batch, 1, q, k) with one row for every query: decoding one token (or
    several queries that see the same keys). (Without a mask, transformers' function uses SDPA's own GQA and copies
    nothing.)"""
    return attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1:3] == (1, 1)


class GroupedQueryAttentionInterface(AttentionInterface):
    """DIFF V2's attention functions, in the manner of a transformers model's local `AttentionInterface`: "sdpa" is
    `folded_gqa_sdpa_attention_forward`; every other name (eager, flex, flash, vLLM's, one registered by a user) is
    looked up in transformers' `ALL_ATTENTION_FUNCTIONS` at call time, so names registered later are found."""

    def __init__(self):
        super().__init__()
        self["sdpa"] = folded_gqa_sdpa_attention_forward

    def __getitem__(self, key):
        if key in self._local_mapping:
            return self._local_mapping[key]
        return ALL_ATTENTION_FUNCTIONS[key]

    def __iter__(self):
        return iter({**dict.fromkeys(ALL_ATTENTION_FUNCTIONS), **self._local_mapping})

    def __len__(self):
        return len(ALL_ATTENTION_FUNCTIONS.keys() | self._local_mapping.keys())
