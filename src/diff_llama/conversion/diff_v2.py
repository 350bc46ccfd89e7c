"""DIFF V2's exact conversion from a LLaMA (docs/maths.md, "The exact conversion to DIFF V2").

A LLaMA with H query heads and G KV heads becomes a DIFF V2 model with 2H softmax maps over the same G KV heads:
maps 2j and 2j + 1 are both LLaMA head j, λ = sigmoid(0) = 0.5 everywhere (lambda_proj = 0) and o_proj is doubled,
so differential head j outputs O_j − 0.5·O_j = 0.5·O_j and the doubled o_proj gives back the LLaMA's output exactly.
Nothing is fitted, so there is no calibration: every tensor is a copy, a row-block gather or a doubling, and the
converted model computes the LLaMA's function up to floating-point rounding. Training leaves this point at once: the
two maps of a pair receive +1 and −0.5 times the same gradient signal, and lambda_proj a non-zero one.
"""

import torch

LAMBDA_PROJ = "self_attn.lambda_proj.weight"


def paired_query_sources(source_heads: int) -> tuple:
    """Source LLaMA head of each of the 2H query positions: (0, 0, 1, 1, ..., H-1, H-1)."""
    return tuple(head for head in range(source_heads) for _ in range(2))


def double_o_proj(o_proj: torch.Tensor) -> torch.Tensor:
    """2 x o_proj: exact in every floating-point format (only the exponent changes)."""
    return o_proj * 2


def zero_lambda_proj(num_differential_heads: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    """lambda_proj = 0: λ = sigmoid(0) = 0.5 for every token and head, the value that makes the conversion exact."""
    return torch.zeros(num_differential_heads, hidden_size, dtype=dtype)


def convert_attention_weights_v2(q_proj, k_proj, v_proj, o_proj, head_dim: int) -> dict:
    """A LLaMA layer's attention weights in DIFF V2's layout, keyed by projection name (as in head_layout)."""
    source_heads = q_proj.shape[0] // head_dim
    blocks = q_proj.view(source_heads, head_dim, -1)
    return {
        "q_proj": blocks.repeat_interleave(2, dim=0).reshape(2 * source_heads * head_dim, -1),
        "k_proj": k_proj,
        "v_proj": v_proj,
        "o_proj": double_o_proj(o_proj),
        "lambda_proj": zero_lambda_proj(source_heads, o_proj.shape[0], o_proj.dtype),
    }
