"""DIFF V2's exact conversion from a LLaMA (docs/maths.md, "The exact conversion to DIFF V2").

A LLaMA with H query heads and G KV heads becomes a DIFF V2 model with 2H softmax maps over the same G KV heads:
maps 2j and 2j + 1 are both LLaMA head j, λ = sigmoid(0) = 0.5 everywhere (lambda_proj = 0) and o_proj is doubled,
so differential head j outputs O_j − 0.5·O_j = 0.5·O_j and the doubled o_proj gives back the LLaMA's output exactly.
Nothing is fitted, so there is no calibration: every tensor is a copy, a row-block gather or a doubling, and the
converted model computes the LLaMA's function up to floating-point rounding. Training leaves this point at once: the
two maps of a pair receive +1 and −0.5 times the same gradient signal, and lambda_proj a non-zero one.

A LLaMA's biases (`attention_bias`, `mlp_bias`) come along: q_proj's is paired as its rows are, the others are copied
(o_proj's is not doubled: it is added after the doubled product).
"""

import torch

from .base import LAMBDA_PROJ, VersionConversion, attention_projections, gather_head_rows


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
    """A LLaMA layer's attention weights in DIFF V2's layout, keyed by projection name (as in version 1's
    `convert_attention_weights`)."""
    source_heads = q_proj.shape[0] // head_dim
    blocks = q_proj.view(source_heads, head_dim, -1)
    return {
        "q_proj": blocks.repeat_interleave(2, dim=0).reshape(2 * source_heads * head_dim, -1),
        "k_proj": k_proj,
        "v_proj": v_proj,
        "o_proj": double_o_proj(o_proj),
        "lambda_proj": zero_lambda_proj(source_heads, o_proj.shape[0], o_proj.dtype),
    }


class DiffV2Conversion(VersionConversion):
    """DIFF V2, exact: maps 2j and 2j+1 are LLaMA head j, λ = 0.5, o_proj doubled; nothing to fit."""

    added_tensors = (LAMBDA_PROJ,)

    def __init__(self, source_config, options):
        super().__init__(source_config, options)
        self.query_sources = paired_query_sources(source_config.num_attention_heads)
        self.kv_sources = tuple(range(source_config.num_key_value_heads))

    def heads(self) -> dict:
        return dict(num_attention_heads=2 * self.source_config.num_attention_heads,
                    num_key_value_heads=self.source_config.num_key_value_heads, diff_version=2)

    def streamed_tensors(self, layer, prefix, src, dtype):
        return {
            "self_attn.o_proj.weight": double_o_proj(src.get(prefix + "self_attn.o_proj.weight")),
            LAMBDA_PROJ: zero_lambda_proj(self.config.num_attention_heads // 2, self.config.hidden_size, dtype),
        }

    def convert_attention(self, layer, attention):
        head_dim = self.source_config.head_dim
        converted = convert_attention_weights_v2(*attention_projections(attention), head_dim)
        converted = {f"self_attn.{name}.weight": tensor for name, tensor in converted.items()}
        if "self_attn.q_proj.bias" in attention:  # paired like q_proj's rows; k/v/o biases stay the LLaMA's
            converted["self_attn.q_proj.bias"] = gather_head_rows(attention["self_attn.q_proj.bias"],
                                                                  self.query_sources, head_dim)
        return converted
