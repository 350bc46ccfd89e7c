# Copyright 2026 The diff-llama authors. Licensed under the Apache License, Version 2.0.
"""DiffLlama: LLaMA with differential attention (Ye et al., arXiv 2410.05258).

The maths and tensor layout follow SPEC.md. Version 1 (the paper's): query heads i and i + H/2 form differential
head i, both maps read the value pair V_i = concat(v_kv(i), v_kv(i + H/2)), and checkpoint names match
transformers' built-in `diffllama`, so its checkpoints load unchanged. Version 2 (DIFF V2, `diff_version=2`): maps
2i and 2i + 1 of one ordinary attention call are subtracted with a per-token λ = sigmoid(lambda_proj(x)).

Imports only torch, transformers and the sibling configuration file, so that a saved model also
loads as remote code (`trust_remote_code=True`) where this package is not installed.
"""

import contextlib
import math
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn

from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming
from transformers.dynamic_module_utils import custom_object_save
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_rope_utils import dynamic_rope_update
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, is_torch_distributed_available
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import GeneralInterface, merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_diff_llama import DiffLlamaConfig


class DiffLlamaMLP(LlamaMLP):
    pass


class DiffLlamaRMSNorm(LlamaRMSNorm):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Llama's RMSNorm, computed in float32 or wider (Llama's always drops to float32, even for float64 models).
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(_float32_or_wider(input_dtype))
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class DiffLlamaRotaryEmbedding(LlamaRotaryEmbedding):
    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x, position_ids):
        # Llama's rotary embedding, with angles in float32 or wider, so that a float64 model is float64 throughout.
        dtype = torch.promote_types(x.dtype, torch.float32)
        freqs = position_ids[..., None].to(dtype) * self.inv_freq.to(device=x.device, dtype=dtype)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def _float32_or_wider(dtype: torch.dtype) -> torch.dtype:
    """torch.promote_types(dtype, float32) for real dtypes, in Python: the torch call is an aten op of its own."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def lambda_init_fn(layer_idx: int) -> float:
    """The paper's depth-dependent λ_init(l) = 0.8 - 0.6 * exp(-0.3 * l), l counted from 0."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


LAMBDA_VECTOR_NAMES = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
# In memory the λ vectors live in a small module (`self_attn.differential_lambda`), so that PEFT can train and save
# them with `modules_to_save`; on disk they keep the built-in model's names (`self_attn.lambda_q1`, ...). transformers
# applies this renaming when loading and reverts it when saving.
# DIFF V2's `self_attn.lambda_proj` lives in the same module, for the same reason.
LAMBDA_CHECKPOINT_RENAMES = {
    rf"\.self_attn\.{name}": f".self_attn.differential_lambda.{name}" for name in (*LAMBDA_VECTOR_NAMES, "lambda_proj")
}
register_checkpoint_conversion_mapping(
    "diff_llama", [WeightRenaming(disk, memory) for disk, memory in LAMBDA_CHECKPOINT_RENAMES.items()], overwrite=True
)


class DiffLlamaLambda(nn.Module):
    """λ of one layer: exp(λ_q1·λ_k1) - exp(λ_q2·λ_k2) + λ_init, from four learned vectors of length head_dim."""

    def __init__(self, head_dim: int, layer_idx: int):
        super().__init__()
        self.lambda_init = lambda_init_fn(layer_idx)
        self.lambda_q1 = nn.Parameter(torch.zeros(head_dim))
        self.lambda_k1 = nn.Parameter(torch.zeros(head_dim))
        self.lambda_q2 = nn.Parameter(torch.zeros(head_dim))
        self.lambda_k2 = nn.Parameter(torch.zeros(head_dim))

    def forward(self) -> torch.Tensor:
        """λ as a scalar tensor in float32 (or float64 for a float64 model): never in half precision, where exp() of
        a dot product loses the small λ updates."""
        dtype = _float32_or_wider(self.lambda_q1.dtype)
        dot1 = torch.dot(self.lambda_q1.to(dtype), self.lambda_k1.to(dtype))
        dot2 = torch.dot(self.lambda_q2.to(dtype), self.lambda_k2.to(dtype))
        return torch.exp(dot1) - torch.exp(dot2) + self.lambda_init


class DiffLlamaFloat32Linear(nn.Linear):
    """nn.Linear computed in float32 or wider, whatever the dtype of its weight and input."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype == self.weight.dtype and hidden_states.dtype in (torch.float32, torch.float64):
            return super().forward(hidden_states)  # no casts: a decoding step pays for every op, no-op casts included
        dtype = torch.promote_types(hidden_states.dtype, torch.float32)
        bias = None if self.bias is None else self.bias.to(dtype)
        return nn.functional.linear(hidden_states.to(dtype), self.weight.to(dtype), bias)


class DiffLlamaHeadNorm(nn.RMSNorm):
    """The paper's per-head RMSNorm over the 2d-wide output, without affine weight: nn.RMSNorm's function in four
    aten ops (F.rms_norm runs 23 on CPU), since a decoding step pays for every op."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return super().forward(hidden_states)
        # x / sqrt(mean(x²) + eps) = x · rsqrt(eps + ‖x‖² / n); eps as a tensor, since a Python number is wrapped and
        # copied by every op that takes it.
        eps = self._eps_tensor(hidden_states)
        norm = torch.linalg.vector_norm(hidden_states, dim=-1, keepdim=True)
        return hidden_states * torch.rsqrt(torch.addcmul(eps, norm, norm, value=1 / hidden_states.shape[-1]))

    def _eps_tensor(self, like: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(like.dtype).eps  # nn.RMSNorm's default
        key = (like.device, like.dtype, eps)
        cached = getattr(self, "_eps_cache", None)
        if cached is None or cached[0] != key:
            cached = self._eps_cache = (key, torch.tensor(eps, dtype=like.dtype, device=like.device))
        return cached[1]


class DiffLlamaV2Lambda(nn.Module):
    """DIFF V2's λ: sigmoid(lambda_proj(x)) per token and differential head, from the attention block's input."""

    def __init__(self, hidden_size: int, num_differential_heads: int):
        super().__init__()
        self.lambda_proj = DiffLlamaFloat32Linear(hidden_size, num_differential_heads, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(batch, seq, h) in float32 or wider: the subtraction it weights cancels much of the signal. `lambda_proj`
        is called, not read: offloading hooks (`device_map` with disk or CPU offload) bring its weight in on call."""
        return torch.sigmoid(self.lambda_proj(hidden_states))


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
    the keys once and the values once and copies nothing the size of the cache (two matmuls around a softmax), where
    the generic path runs two backend calls on two copies of the values. `key`/`value` hold an even number G of heads, half
    of the query heads on each half of them (what `DiffLlamaAttention` passes). Masks are those of the SDPA
    interface: None, boolean (True = attend) or additive.
    """
    batch, num_heads, _, head_dim = query.shape
    kv_heads, key_len = key.shape[1], key.shape[2]
    group = num_heads // kv_heads
    # 3-D views and bmm: matmul on 4-D tensors adds a dozen aten ops of expands and reshapes, and a decoding step
    # pays for every op. Query heads of one key/value head are the rows: (batch * G, group, d).
    rows = query.reshape(batch * kv_heads, group, head_dim)
    rows = torch.add(rows, rows, alpha=scaling - 1)  # rows·scaling in one op (a Python multiplier costs five)
    scores = torch.bmm(rows, key.reshape(batch * kv_heads, key_len, head_dim).transpose(1, 2))
    if attention_mask is not None:
        view = scores.view(batch, kv_heads, group, key_len)
        if attention_mask.dtype == torch.bool:
            scores = torch.where(attention_mask, view, torch.finfo(scores.dtype).min).view_as(scores)
        else:
            scores = (view + attention_mask).view_as(scores)
    softmax_dtype = _float32_or_wider(query.dtype)
    # softmax's dtype argument costs an op even when it changes nothing
    maps = torch.softmax(scores, -1) if scores.dtype == softmax_dtype else torch.softmax(scores, -1, dtype=softmax_dtype)
    # Every value head must be read by the maps of both halves: next to each value head, stack the maps of the same
    # position in both halves (map 1, then map 2), so that one bmm gives every (map, value half) product. One copy
    # (in the value dtype) builds it for both value halves: (batch, value half, G/2, 2 maps, group, T).
    by_position = maps.view(batch, 2, kv_heads // 2, group, key_len).transpose(1, 2)  # (batch, G/2, map, group, T)
    both = maps.new_empty(batch, 2, kv_heads // 2, 2, group, key_len, dtype=value.dtype)
    both.copy_(by_position.unsqueeze(1))
    products = torch.bmm(both.view(batch * kv_heads, 2 * group, key_len),
                         value.reshape(batch * kv_heads, key_len, head_dim))
    products = products.view(batch, 2, kv_heads // 2, 2, group, head_dim)
    if products.dtype != lambda_full.dtype:
        products = products.to(lambda_full.dtype)
    # products[:, a, :, m] = A(map m)·V(half a): the differential map applied to value half a is m=0 − λ·(m=1).
    differential = torch.addcmul(products[:, :, :, 0], products[:, :, :, 1], lambda_full, value=-1)
    # (batch, value half, G/2, group, d) -> (batch, 1, H/2, 2d): differential head i = (G/2 position, group row). (An
    # `out=` straight into that layout would save the copy, but torch.compile refuses a non-contiguous `out=`.)
    return differential.permute(0, 2, 3, 1, 4).reshape(batch, 1, num_heads // 2, 2 * head_dim)


def _pad_to_pairs(query, key, value):
    """The one-call layout of the prefill path: queries and keys with d zero channels; for every key/value head, the
    value pair [v(first half), v(second half)] of the differential heads it serves."""
    head_dim = query.shape[-1]
    value_pairs = torch.cat(value.chunk(2, dim=1), dim=-1)
    return (
        nn.functional.pad(query, (0, head_dim)),
        nn.functional.pad(key, (0, head_dim)),
        torch.cat([value_pairs, value_pairs], dim=1),
    )


def _has_cpu_flash_attention() -> bool:
    """The private aten ops of `CausalPairedAttentionCPU`. Present since torch 2.2; a private op may go away, so the
    dispatch checks before using them and falls back to the generic path (tested by hiding them)."""
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
    )


class CausalPairedAttentionCPU(torch.autograd.Function):
    """Training on CPU, causal, no padding mask: the fused SDPA kernel on the padded layout of `_pad_to_pairs`, but
    saving for backward only the d-wide query, key and value (and the output), not their padded copies. The padded
    layout is rebuilt in backward, which costs three concatenations. Output: (batch, H, seq, 2d)."""

    @staticmethod
    def forward(ctx, query, key, value, scaling):
        output, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *_pad_to_pairs(query, key, value), 0.0, True, scale=scaling
        )
        ctx.save_for_backward(query, key, value, output, logsumexp)
        ctx.scaling = scaling
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, output, logsumexp = ctx.saved_tensors
        head_dim = query.shape[-1]
        grad_query, grad_key, grad_value = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_output.contiguous(), *_pad_to_pairs(query, key, value), output, logsumexp, 0.0, True,
            scale=ctx.scaling,
        )
        grad_pairs = sum(grad_value.chunk(2, dim=1))  # both halves of the heads read the same value pairs
        grad_value = torch.cat(grad_pairs.split(head_dim, dim=-1), dim=1)
        return grad_query[..., :head_dim], grad_key[..., :head_dim], grad_value, None


def select_heads(
    key_states: torch.Tensor, value_states: torch.Tensor, heads: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key/value heads `heads` (in that order, repeats allowed) of (batch, G, seq, d) keys and values."""
    index = torch.tensor(heads, device=key_states.device)
    return key_states.index_select(1, index), value_states.index_select(1, index)


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
    """A contiguous (shape) view of the start of a flat buffer allocated once per call: a fresh block-sized tensor
    for every block costs more than its softmax on CPU (bench/results/attention_core.md)."""
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


# ---------------------------------------------------------------------------------------------------------------
# Differential kernels and the one place that picks them.
#
# A differential kernel maps the attention inputs after RoPE, the cache and the GQA expansion (query (batch, H, q, d);
# key/value (batch, G', k, d), G' even, each half of the query heads reading its own half of them) to the
# differential heads' outputs before the head norm, (batch, q, H/2, 2d) in λ's dtype, and the softmax maps when it
# has them. DIFF V2 runs one ordinary attention call (any backend) and needs no differential kernel.
# ---------------------------------------------------------------------------------------------------------------


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
        padded_query, padded_key, value_pairs = _pad_to_pairs(query, key, value)
        attn_output, attn_weights = call(query=padded_query, key=padded_key, value=value_pairs, **kwargs)
    else:
        # Decoding one token: padding the whole cached keys every step costs more than forming the scores twice.
        first_values, second_values = value.chunk(2, dim=1)
        first_output, attn_weights = call(query=query, key=key, value=torch.cat([first_values] * 2, dim=1), **kwargs)
        second_output, _ = call(query=query, key=key, value=torch.cat([second_values] * 2, dim=1), **kwargs)
        attn_output = torch.cat([first_output, second_output], dim=-1)
    map1_output, map2_output = attn_output.chunk(2, dim=2)  # (batch, q, H, 2d): maps i and i + H/2
    differential = torch.addcmul(map1_output.to(lambda_full.dtype), map2_output.to(lambda_full.dtype), lambda_full,
                                 value=-1)
    return differential, attn_weights


def decode_differential_attention(module, query, key, value, attention_mask, lambda_full, **kwargs):
    return differential_decode_attention(query, key, value, attention_mask, module.scaling, lambda_full), None


def paired_sdpa_cpu_differential_attention(module, query, key, value, attention_mask, lambda_full, **kwargs):
    attn_output = CausalPairedAttentionCPU.apply(query, key, value, module.scaling).transpose(1, 2)
    map1_output, map2_output = attn_output.chunk(2, dim=2)
    differential = torch.addcmul(map1_output.to(lambda_full.dtype), map2_output.to(lambda_full.dtype), lambda_full,
                                 value=-1)
    return differential, None


# Query rows per block of the blocked kernel. On the benchmark CPU (fp32, 8 heads of 64, 2 threads, quiet), with the
# block buffers allocated once per call, 128 rows match 96 and beat 64 at 512, 2048 and 8192 tokens (64 won while
# every block allocated its own scores); under heavy load larger blocks lose less (bench/results/attention_core*.md).
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
# dtype. Each entry says why it wins. A kernel that does not support a call (see `supports`) passes it to the next
# matching entry; "generic" ends the list. The figures are from an Intel CPU with AMX; on an AMD EPYC (AVX2) the fp32
# choices beat the padded call in two runs of three and in training memory always, by margins inside that shared VM's
# run-to-run spread for decoding (bench/results/model-kernels-epyc*.md, README "Speed against Llama and the built-in").
_FULL_PRECISION = (torch.float32, torch.float64)
DIFFERENTIAL_KERNEL_DISPATCH = [
    ("sdpa", "*", "decode", "*", "decode",
     "CPU, fp32, one token after 128, quiet: 0.93x / 0.94x / 0.93x Llama's tokens/s (batch 1, batch 8, static cache) "
     "against 0.90x / 0.87x / 0.91x for the generic path's two calls in the same run (bench/results/model-kernels.md; "
     "other runs: 0.92x-0.98x); under load the generic path's two calls gave 0.74-0.91x against this kernel's "
     "0.91-0.96x (bench/results/model-kernels-loaded.md); aten ops per step 986 against Llama's 893 "
     "(bench/results/decode_ops.md). Plain bmm and softmax, so it runs on CUDA too. H200, bf16, against the generic "
     "path's two SDPA calls, decoding alone, 6-8 rounds: 0.89x-1.05x its time per token at SmolLM2-135M's and "
     "Llama-3.2-1B's shapes, 512- and 4096-token prompts, b1 and b16, inside each model's 1.2-1.5x spread: alike, so "
     "one rule serves every device (bench/results/cuda-h200-decode-*.md)."),
    ("sdpa", "cpu", "prefill", _FULL_PRECISION, "blocked",
     "CPU, fp32, quiet machine, one run (bench/results/model-kernels.md): whole-model prefill 1.04x / 1.09x / 1.15x "
     "Llama at 512 / 2048 / 8192 tokens against 1.18x / 1.26x / 1.43x for the padded call; attention layer at 2048 "
     "1.20x against 1.44x. Under heavy load (load 6-9 on 2 cores) the older 64-row kernel lost at 512 and 2048: "
     "each of its ops waits for descheduled threads (bench/results/model-kernels-loaded.md, "
     "kernel_profile-loaded-2048.md)."),
    ("sdpa", "cpu", "train", _FULL_PRECISION, "blocked",
     "CPU, fp32, train step b4x256, quiet: 1.04x Llama's time and 1.03x its peak memory, against 1.06x / 1.11x for "
     "the padded call (bench/results/model-kernels.md); under load: memory 1.02x against 1.07x (paired_sdpa_cpu) and "
     "1.14x (generic) (bench/results/model-kernels-loaded.md)."),
    ("sdpa", "cpu", "train", "*", "paired_sdpa_cpu",
     "CPU, bf16: the blocked core is 3.4-3.7x Llama's SDPA (which runs on the bf16 units), the padded call 1.26-1.29x "
     "at 2048-8192 tokens (bench/results/attention_core-bfloat16.md); this one saves only d-wide tensors (train step "
     "1.12x, memory 1.08x, bench/results/model-kernels-bfloat16.md)."),
    ("*", "*", "*", "*", "generic",
     "The default: exact on every backend and device. CPU bf16 prefill stays here: Llama's SDPA runs on the bf16 "
     "units and the padded call stays within 1.26-1.29x of it at 2048-8192 tokens, where the blocked core is 3.4-3.7x "
     "(bench/results/attention_core-bfloat16.md). CUDA prefill and training (H200, bf16, SDPA): this path 1.19-1.71x "
     "Llama's time, the blocked kernel 5.7-8.7x (bench/results/cuda-h200-*.md); flash-attention 2 is unmeasured."),
]


def _step(query) -> str:
    if query.shape[2] == 1:
        return "decode"
    return "train" if torch.is_grad_enabled() and query.requires_grad else "prefill"


def select_differential_kernel(module, query, key, attention_mask) -> DifferentialKernel:
    """The kernel for this call: `config.differential_kernel` when set and it supports the call, else the first
    matching entry of `DIFFERENTIAL_KERNEL_DISPATCH` that supports it."""
    chosen = getattr(module.config, "differential_kernel", None)
    if chosen is not None:
        kernel = ALL_DIFFERENTIAL_KERNELS.get_kernel(chosen)
        if kernel.supports(module, query, key, attention_mask):
            return kernel
    backend, device, step = module.config._attn_implementation, query.device.type, _step(query)
    for rule_backend, rule_device, rule_step, rule_dtypes, name, _why in DIFFERENTIAL_KERNEL_DISPATCH:
        if (
            rule_backend in ("*", backend)
            and rule_device in ("*", device)
            and rule_step in ("*", step)
            and (rule_dtypes == "*" or query.dtype in rule_dtypes)
        ):
            kernel = ALL_DIFFERENTIAL_KERNELS.get_kernel(name)
            if kernel.supports(module, query, key, attention_mask):
                return kernel
    return ALL_DIFFERENTIAL_KERNELS.get_kernel("generic")


class DiffLlamaAttention(nn.Module):
    """Differential attention: out_i = (1 - λ_init) * RMSNorm((A1 - λ A2) V_i) for differential head i.

    Both softmax maps of every pair come from one call of the configured attention backend per value half,
    so eager, SDPA, flex and flash kernels all compute the exact maps. Key/value heads are expanded only as
    far as needed for each half of the query heads to see whole GQA groups: not at all for even G, and to
    2 heads for G = 1. That is what lets odd G and multi-query models run.
    """

    def __init__(self, config: DiffLlamaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        # GQA seen by the attention backend: query heads per (expanded) key/value head. It must divide H/2 so
        # that no key/value head is shared across the two halves of the query heads.
        query_heads_per_kv = config.num_attention_heads // config.num_key_value_heads
        self.num_key_value_groups = math.gcd(query_heads_per_kv, config.num_attention_heads // 2)
        self.kv_expansion = query_heads_per_kv // self.num_key_value_groups
        # Set by tensor parallelism when each rank keeps only some of the (replicated) key/value heads.
        self.tp_key_value_heads: tuple[int, ...] | None = None

        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)

        self.differential_lambda = DiffLlamaLambda(self.head_dim, layer_idx)
        # The paper's per-head normalisation over the 2d-wide output; it has no affine weight. Its epsilon is
        # rms_norm_eps unless the config sets head_norm_eps (converted LLaMAs do: see the converter).
        eps = config.head_norm_epsilon(layer_idx)
        self.head_norm = DiffLlamaHeadNorm(2 * self.head_dim, eps=eps, elementwise_affine=False)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if self.tp_key_value_heads is not None:
            # Tensor parallel with replicated k/v projections: keep the key/value heads this rank's queries read.
            key_states, value_states = select_heads(key_states, value_states, self.tp_key_value_heads)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)

        key_states = repeat_kv(key_states, self.kv_expansion)
        value_states = repeat_kv(value_states, self.kv_expansion)

        # λ in float32 (or wider): the subtraction cancels most of the signal, whatever the model dtype.
        lambda_full = self._lambda(cache)
        kernel = select_differential_kernel(self, query_states, key_states, attention_mask)
        attn_output, attn_weights = kernel(
            self, query_states, key_states, value_states, attention_mask, lambda_full, **kwargs
        )

        attn_output = self.head_norm(attn_output)
        # x·(1 − λ_init) as x + (−λ_init)·x: one aten op, where multiplying by a Python number takes five.
        attn_output = torch.add(attn_output, attn_output, alpha=-self.differential_lambda.lambda_init)
        attn_output = attn_output.to(hidden_states.dtype).reshape(*input_shape, -1)
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights

    def _lambda(self, cache: Cache | None) -> torch.Tensor:
        """This layer's λ. Decoding without autograd reuses the λ computed earlier with the same cache (one
        generation), as long as no λ vector was modified in place (their version counters) or replaced (their data
        pointers); anything else computes it afresh (16 aten ops)."""
        if cache is None or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return self.differential_lambda()
        vectors = [getattr(self.differential_lambda, name) for name in LAMBDA_VECTOR_NAMES]
        key = tuple((vector._version, vector.data_ptr(), vector.dtype, vector.device) for vector in vectors)
        cached = getattr(cache, "_differential_lambdas", None)
        if cached is None:
            cached = cache._differential_lambdas = {}
        entry = cached.get(self.layer_idx)
        if entry is None or entry[0] != key:
            entry = cached[self.layer_idx] = (key, self.differential_lambda())
        return entry[1]

    @staticmethod
    def pair_maps(maps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax maps (batch, H, q, k) -> (A1, A2) of every differential head i: maps i and i + H/2."""
        return maps.chunk(2, dim=1)

    @classmethod
    def combine_maps(cls, maps: torch.Tensor, lambdas: torch.Tensor) -> torch.Tensor:
        """Softmax maps (batch, H, q, k) and this layer's λ (a scalar) -> differential maps A_i − λ·A_{i+H/2},
        (batch, H/2, q, k), in float32 or wider."""
        dtype = torch.promote_types(maps.dtype, torch.float32)
        first, second = cls.pair_maps(maps.to(dtype))
        return first - torch.as_tensor(lambdas, dtype=dtype, device=maps.device) * second


class DiffLlamaV2Attention(nn.Module):
    """DIFF V2: out_{t,i} = O_{t,2i} − λ_{t,i}·O_{t,2i+1}, O = one ordinary attention call over all H query heads.

    Keys, values and the KV cache are exactly a LLaMA's (G heads of width d); every backend (eager, SDPA, flex,
    flash) runs unchanged, since nothing differential happens before the attention output. λ_{t,i} =
    sigmoid(x_t · lambda_proj[i]) for the block's input x; there is no per-head norm.
    """

    def __init__(self, config: DiffLlamaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_differential_heads = config.num_attention_heads // 2
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        # Set by tensor parallelism when each rank keeps only some of the (replicated) key/value heads.
        self.tp_key_value_heads: tuple[int, ...] | None = None

        self.q_proj = nn.Linear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias
        )
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(
            self.num_differential_heads * self.head_dim, config.hidden_size, bias=config.attention_bias
        )
        self.differential_lambda = DiffLlamaV2Lambda(config.hidden_size, self.num_differential_heads)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if self.tp_key_value_heads is not None:
            # Tensor parallel with replicated k/v projections: keep the key/value heads this rank's queries read.
            key_states, value_states = select_heads(key_states, value_states, self.tp_key_value_heads)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0,
            scaling=self.scaling,
            **kwargs,
        )
        # (batch, seq, H, d) -> (batch, seq, h, 2 maps, d): maps 2i and 2i + 1 are differential head i's pair.
        first, second = attn_output.reshape(*input_shape, -1, 2, self.head_dim).unbind(-2)  # -1: this rank's heads
        lambdas = self.differential_lambda(hidden_states)[..., None]
        # first − λ·second in one op; addcmul promotes a bf16/fp16 pair to λ's float32.
        differential = torch.addcmul(first, lambdas, second, value=-1).reshape(*input_shape, -1)
        attn_output = self.o_proj(differential.to(hidden_states.dtype))
        return attn_output, attn_weights

    @staticmethod
    def pair_maps(maps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax maps (batch, H, q, k) -> (A1, A2) of every differential head i: maps 2i and 2i + 1."""
        return maps[:, 0::2], maps[:, 1::2]

    @classmethod
    def combine_maps(cls, maps: torch.Tensor, lambdas: torch.Tensor) -> torch.Tensor:
        """Softmax maps (batch, H, q, k) and this layer's λ (batch, q, h) -> per-token differential maps
        A_{2i}[t] − λ_{t,i}·A_{2i+1}[t], (batch, h, q, k), in float32 or wider."""
        dtype = torch.promote_types(maps.dtype, torch.float32)
        first, second = cls.pair_maps(maps.to(dtype))
        return first - lambdas.to(dtype).transpose(1, 2)[..., None] * second  # λ as (batch, h, q, 1)


# Tensor parallelism (`from_pretrained(..., tp_plan="auto")` under torchrun). Each rank computes whole differential
# heads: version 1 pairs map i with map i + H/2, so a rank takes the same slice of both halves of the query heads
# (a packed split); DIFF V2 pairs adjacent maps, so a plain split keeps pairs whole. Keys and values are split the same
# way where the key/value heads divide evenly; otherwise every rank computes them all and keeps those its queries read.


def tensor_parallel_layout(config: DiffLlamaConfig, tp_size: int, rank: int) -> dict:
    """How rank `rank` of `tp_size` splits one attention layer: `query` and `key_value` name the split of the
    projection rows ("packed": the same slice of each half; "contiguous": one block; None: not split), and
    `key_value_heads` the key/value heads (before RoPE) a rank keeps when `key_value` is None. Raises ValueError for a
    layout that cannot be split over `tp_size` ranks."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    pairs, group = heads // 2, heads // kv_heads
    usable = [size for size in range(1, pairs + 1) if pairs % size == 0]
    if pairs % tp_size:
        pairing = (
            "maps i and i + H/2 (version 1) are split as packed halves"
            if config.diff_version == 1
            else "maps 2i and 2i + 1 (DIFF V2) stay on one rank"
        )
        raise ValueError(
            f"Tensor parallel over {tp_size} ranks cannot split this DiffLlama: each rank must hold whole differential "
            f"heads ({pairing}), so num_attention_heads / 2 = {pairs} must be divisible by the TP size. Use a TP size in "
            f"{usable} (e.g. `torchrun --nproc_per_node {max(s for s in usable if s <= tp_size)}`)."
        )
    local_pairs = pairs // tp_size
    if config.diff_version == 1:
        even = kv_heads % 2 == 0 and (kv_heads // 2) % tp_size == 0
        # This rank's query heads: its slice of the first half, then the same slice of the second half.
        local = [half * pairs + rank * local_pairs + j for half in (0, 1) for j in range(local_pairs)]
        local_group = group if even else math.gcd(group, local_pairs)
        layout = {"query": "packed", "key_value": "packed" if even else None}
    else:
        even = kv_heads % tp_size == 0
        local = list(range(rank * 2 * local_pairs, (rank + 1) * 2 * local_pairs))
        local_group = group if even else math.gcd(group, 2 * local_pairs)
        layout = {"query": "contiguous", "key_value": "contiguous" if even else None}
    # Each kept key/value head serves `local_group` consecutive local query heads, all in one GQA group.
    layout["key_value_heads"] = None if even else tuple(head // group for head in local[::local_group])
    layout["num_key_value_groups"] = local_group
    return layout


if is_torch_distributed_available():
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    from transformers.distributed.tensor_parallel import ReplicatedWithGradAllReduce, TensorParallelLayer

    class _SumGradientAcrossRanks(torch.autograd.Function):
        """Identity forward; backward sums the gradient over the TP group (each rank's heads give a part of it)."""

        @staticmethod
        def forward(ctx, hidden_states, group):
            ctx.group = group
            return hidden_states.view_as(hidden_states)

        @staticmethod
        def backward(ctx, grad_output):
            grad_output = grad_output.contiguous()
            dist.all_reduce(grad_output, group=ctx.group)
            return grad_output, None

    class DiffLlamaAttentionParallel(TensorParallelLayer):
        """Plan style of the attention module (`layers.*.self_attn`): checks that the layout splits over the TP
        size, tells the projections how to split (`diff_llama_heads`), records which key/value heads this rank keeps,
        and runs the attention on this rank's local weights. `o_proj` keeps its own `rowwise` style."""

        def install_forward(self, module, mesh):
            layout = tensor_parallel_layout(module.config, mesh.size(), mesh.get_local_rank())
            module.q_proj.tp_split = layout["query"]
            module.k_proj.tp_split = module.v_proj.tp_split = layout["key_value"]
            if isinstance(module, DiffLlamaV2Attention):
                module.differential_lambda.lambda_proj.tp_split = "contiguous"  # one λ per pair, as the queries
            else:
                module.kv_expansion = 1
            module.num_key_value_groups = layout["num_key_value_groups"]
            module.tp_key_value_heads = layout["key_value_heads"]
            module.tp_local_modules = [
                sub for name, sub in module.named_modules() if name != "o_proj" and not name.startswith("o_proj.")
            ]
            return super().install_forward(module, mesh)

        def transform_inputs_pre_forward(self, module, args, kwargs, mesh):
            if torch.is_grad_enabled():
                group = mesh.get_group()
                if args:
                    args = (_SumGradientAcrossRanks.apply(args[0], group), *args[1:])
                elif "hidden_states" in kwargs:
                    kwargs = {**kwargs, "hidden_states": _SumGradientAcrossRanks.apply(kwargs["hidden_states"], group)}
            return args, kwargs

        @contextlib.contextmanager
        def context_around_forward(self, module, mesh):
            swapped = []
            for sub in module.tp_local_modules:
                for name, param in list(sub._parameters.items()):
                    if isinstance(param, DTensor):
                        sub._parameters[name] = param.to_local()
                        swapped.append((sub, name, param))
            try:
                yield
            finally:
                for sub, name, param in swapped:
                    sub._parameters[name] = param

    class DiffLlamaHeadsParallel(TensorParallelLayer):
        """Plan style of q/k/v (and DIFF V2's lambda_proj): splits the output rows as the attention style decided
        (packed halves, one block, or not at all). The layer runs inside the attention's forward on local weights;
        replicated ones get their gradients summed over the ranks."""

        def shard_param(self, module, param, mesh):
            meta = module._parameters.get(param)
            if meta is None:
                return
            if not hasattr(module, "tp_split"):
                raise ValueError(
                    "The `diff_llama_heads` tensor-parallel style needs its attention module planned as "
                    "`diff_llama_attention` (`layers.*.self_attn`), which decides how the heads split."
                )
            if module.tp_split is None:
                return  # every rank loads the whole weight and keeps the heads it needs
            placement = _StridedShard(0, split_factor=2) if module.tp_split == "packed" else Shard(0)
            module._parameters[param] = nn.Parameter(
                distribute_tensor(meta, mesh, [placement], src_data_rank=None), requires_grad=meta.requires_grad
            )

        def install_forward(self, module, mesh):
            if module.tp_split is None:
                # Replicated weights, each rank using some of their heads: training sums their gradients over ranks.
                return ReplicatedWithGradAllReduce().install_forward(module, mesh)
            return module

    ALL_PARALLEL_STYLES.register("diff_llama_attention", DiffLlamaAttentionParallel())
    ALL_PARALLEL_STYLES.register("diff_llama_heads", DiffLlamaHeadsParallel())


# The attention variant is chosen once, from `config.diff_version`.
DIFF_ATTENTION_CLASSES = {1: DiffLlamaAttention, 2: DiffLlamaV2Attention}


class DiffLlamaDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: DiffLlamaConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = DIFF_ATTENTION_CLASSES[config.diff_version](config=config, layer_idx=layer_idx)
        self.mlp = DiffLlamaMLP(config)
        self.input_layernorm = DiffLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DiffLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class DiffLlamaPreTrainedModel(PreTrainedModel):
    config: DiffLlamaConfig
    config_class = DiffLlamaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DiffLlamaDecoderLayer"]
    _skip_keys_device_placement = ["cache"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    _can_record_outputs = {
        "hidden_states": DiffLlamaDecoderLayer,
        "attentions": [DiffLlamaAttention, DiffLlamaV2Attention],
    }

    @classmethod
    def is_remote_code(cls) -> bool:
        # FSDP2 (`fully_shard`) swaps a model's class for a subclass defined in torch's own files; transformers would
        # copy those files into the saved folder and name that subclass in config.json's auto_map. For such a class,
        # `save_pretrained` below copies this file instead (config.json's auto_map is always the full AUTO_MAP).
        return super().is_remote_code() and cls.__module__ == DiffLlamaPreTrainedModel.__module__

    def save_pretrained(self, save_directory, *args, **kwargs):
        result = super().save_pretrained(save_directory, *args, **kwargs)
        cls = type(self)
        if cls._auto_class is not None and not cls.is_remote_code():
            if self.should_save_on_this_rank(kwargs.get("is_main_process", True)):
                defined_here = next(c for c in cls.__mro__ if c.__module__ == DiffLlamaPreTrainedModel.__module__)
                custom_object_save(defined_here.__new__(defined_here), save_directory)
        return result

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DiffLlamaLambda):
            for name in LAMBDA_VECTOR_NAMES:
                init.normal_(getattr(module, name), 0.0, self.config.lambda_std_dev)

    def set_differential_kernel(self, kernel: str | None):
        """Choose the differential attention kernel (version 1) by name, from `ALL_DIFFERENTIAL_KERNELS`: "generic",
        "blocked", "decode", "paired_sdpa_cpu" or one registered with `DifferentialAttentionInterface.register`.
        It serves every call it supports; the others keep the automatic choice (`DIFFERENTIAL_KERNEL_DISPATCH`),
        which `None` restores. Sets `config.differential_kernel`, so a saved model keeps the choice."""
        if kernel is not None and kernel not in ALL_DIFFERENTIAL_KERNELS:
            raise ValueError(
                f"Unknown differential kernel {kernel!r}; choose one of {ALL_DIFFERENTIAL_KERNELS.valid_keys()} or None "
                f"(automatic)."
            )
        self.config.differential_kernel = kernel

    def get_lambdas(self) -> torch.Tensor:
        """The current λ of every layer, float32, shape (num_hidden_layers,). Version 1 only: DIFF V2's λ depends on
        the token (see `differential_lambdas`)."""
        if self.config.diff_version != 1:
            raise ValueError(
                "get_lambdas(): DIFF V2's λ is per token and head, not per layer; use "
                "`model.differential_lambdas(outputs)` with outputs of a forward pass run with output_hidden_states=True."
            )
        return torch.stack([layer.self_attn.differential_lambda() for layer in self.base_model.layers])

    def differential_lambdas(self, outputs=None) -> tuple[torch.Tensor, ...]:
        """λ of every layer, float32: version 1, a scalar per layer (no outputs needed); DIFF V2, (batch, seq, h) per
        layer, recomputed from `outputs.hidden_states` (run the model with `output_hidden_states=True`): layer l's
        λ is a function of its input, which is hidden state l after that layer's input norm."""
        layers = self.base_model.layers
        if self.config.diff_version == 1:
            return tuple(layer.self_attn.differential_lambda() for layer in layers)
        hidden_states = getattr(outputs, "hidden_states", None)
        if hidden_states is None:
            raise ValueError("DIFF V2's λ depends on the tokens: pass the outputs of a forward pass run with "
                             "`output_hidden_states=True`.")
        return tuple(
            layer.self_attn.differential_lambda(layer.input_layernorm(hidden))
            for layer, hidden in zip(layers, hidden_states)
        )

    def differential_maps(self, outputs) -> tuple[torch.Tensor, ...]:
        """The differential attention maps of every layer, (batch, H/2, q, k) each, from the outputs of a forward pass
        run with eager attention, `output_attentions=True` and (for DIFF V2, whose λ is per token)
        `output_hidden_states=True`. Version 1: A_i − λ·A_{i+H/2}; DIFF V2: A_{2i}[t] − λ_{t,i}·A_{2i+1}[t]."""
        attentions = getattr(outputs, "attentions", None)
        if attentions is None or any(maps is None for maps in attentions):
            raise ValueError(
                "No softmax maps to combine: only eager attention returns them. Load the model with "
                "`attn_implementation=\"eager\"` (or call `model.set_attn_implementation(\"eager\")`) and pass "
                "`output_attentions=True`."
            )
        lambdas = self.differential_lambdas(outputs)
        return tuple(
            layer.self_attn.combine_maps(maps, lam)
            for layer, maps, lam in zip(self.base_model.layers, attentions, lambdas)
        )


class DiffLlamaModel(DiffLlamaPreTrainedModel):
    def __init__(self, config: DiffLlamaConfig):
        config.validate_differential_layout()  # the config constructs with any values, as LlamaConfig does
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size

        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [DiffLlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = DiffLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DiffLlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False

        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)

        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)

        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)

        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **kwargs,
            )

        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


class DiffLlamaForCausalLM(DiffLlamaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: DiffLlamaConfig):
        super().__init__(config)
        self.model = DiffLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )

        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


# The generic task heads build their backbone with `AutoModel.from_config`, which fails as the first call of a
# fresh remote-code process; each head below builds its backbone explicitly and reuses the generic forward.
class DiffLlamaForSequenceClassification(GenericForSequenceClassification, DiffLlamaPreTrainedModel):
    def __init__(self, config: DiffLlamaConfig):
        DiffLlamaPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = DiffLlamaModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()


class DiffLlamaForTokenClassification(GenericForTokenClassification, DiffLlamaPreTrainedModel):
    def __init__(self, config: DiffLlamaConfig):
        DiffLlamaPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = DiffLlamaModel(config)
        classifier_dropout = getattr(config, "classifier_dropout", None)
        self.dropout = nn.Dropout(0.1 if classifier_dropout is None else classifier_dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


class DiffLlamaForQuestionAnswering(GenericForQuestionAnswering, DiffLlamaPreTrainedModel):
    def __init__(self, config: DiffLlamaConfig):
        DiffLlamaPreTrainedModel.__init__(self, config)
        self.model = DiffLlamaModel(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()


def differential_attention_maps(
    attentions: torch.Tensor | Sequence[torch.Tensor], lambdas: float | torch.Tensor | Sequence
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Turn version-1 softmax maps into differential maps A1 - λ·A2 (for either version, and DIFF V2's per-token
    λ, use `model.differential_maps(outputs)`).

    Args:
        attentions: what `output_attentions=True` returns (eager attention): one tensor of shape
            (batch, H, q, k), where head i holds A1 and head i + H/2 holds A2 of differential head i, or the
            per-layer tuple `outputs.attentions`.
        lambdas: λ for one layer (a float or 0-d tensor), or one per layer, e.g. `model.get_lambdas()`.

    Returns:
        (batch, H/2, q, k) in float32 (float64 for float64 maps), or a tuple of those, one per layer.

    ```python
    >>> out = model(input_ids, output_attentions=True)  # model loaded with attn_implementation="eager"
    >>> maps = differential_attention_maps(out.attentions, model.get_lambdas())
    ```
    """
    if attentions is None or (not isinstance(attentions, torch.Tensor) and any(a is None for a in attentions)):
        raise ValueError(
            "No softmax maps to combine: only eager attention returns them. Load the model with "
            "`attn_implementation=\"eager\"` (or call `model.set_attn_implementation(\"eager\")`) and pass "
            "`output_attentions=True`."
        )
    if isinstance(attentions, torch.Tensor):
        return DiffLlamaAttention.combine_maps(attentions, lambdas)
    if len(attentions) != len(lambdas):
        raise ValueError(f"Got attention maps for {len(attentions)} layers but {len(lambdas)} λ values.")
    return tuple(differential_attention_maps(maps, lam) for maps, lam in zip(attentions, lambdas))


__all__ = [
    "DiffLlamaPreTrainedModel",
    "DiffLlamaModel",
    "DiffLlamaForCausalLM",
    "DiffLlamaForSequenceClassification",
    "DiffLlamaForTokenClassification",
    "DiffLlamaForQuestionAnswering",
    "differential_attention_maps",
    "tensor_parallel_layout",
    "DifferentialAttentionInterface",
    "DifferentialKernel",
    "ALL_DIFFERENTIAL_KERNELS",
    "DIFFERENTIAL_KERNEL_DISPATCH",
]
