# Copyright 2026 The diff-llama authors. Licensed under the Apache License, Version 2.0.
"""λ of both differential attention versions: its modules, its initial value and its names in checkpoints.

Version 1 (the paper's): one λ per layer, exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init, from four learned vectors. DIFF V2:
λ per token and differential head, sigmoid(lambda_proj(x)). Both are computed in float32 or wider, since the subtraction
they weight cancels much of the signal.

Imports only torch, transformers and its siblings: it ships next to the modeling file as remote code.
"""

import math

import torch
from torch import nn

from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming

from .differential_kernels import _float32_or_wider



def lambda_init_fn(layer_idx: int) -> float:
    """The paper's depth-dependent λ_init(l) = 0.8 - 0.6 * exp(-0.3 * l), l counted from 0."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


LAMBDA_VECTOR_NAMES = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
# In memory λ's parameters live in a small module (`self_attn.differential_lambda`), so that PEFT can train and save
# them with `modules_to_save`; on disk they keep the names each version's checkpoints have: the built-in model's
# `self_attn.lambda_q1`, ... for version 1, the reference code's `self_attn.lambda_proj` for DIFF V2. transformers
# applies this renaming when loading and reverts it when saving.
LAMBDA_CHECKPOINT_NAMES = {1: LAMBDA_VECTOR_NAMES, 2: ("lambda_proj",)}
# transformers looks renamings up by model type (or class name), which both versions share. One renaming with the
# names as alternatives therefore serves both: every model registers only renamings its own checkpoints' keys match
# (transformers' `test_reverse_loading_mapping` fails a renaming that matches no key of a saved model).
LAMBDA_CHECKPOINT_RENAMES = {
    rf"\.self_attn\.({'|'.join(name for names in LAMBDA_CHECKPOINT_NAMES.values() for name in names)})": (
        r".self_attn.differential_lambda.\1"
    )
}
register_checkpoint_conversion_mapping(
    "diff_llama", [WeightRenaming(disk, memory) for disk, memory in LAMBDA_CHECKPOINT_RENAMES.items()], overwrite=True
)


def lambda_memory_name(name: str) -> str:
    """An attention module's tensor name as a checkpoint has it (`lambda_proj.weight`) -> its name in memory
    (`differential_lambda.lambda_proj.weight`); every other name, in-memory λ names included, is returned as it is."""
    checkpoint_names = {known for names in LAMBDA_CHECKPOINT_NAMES.values() for known in names}
    return f"differential_lambda.{name}" if name.split(".", 1)[0] in checkpoint_names else name


def load_lambda_under_checkpoint_names(module, state_dict, prefix, *args) -> None:
    """A `load_state_dict` pre-hook of the attention modules: λ tensors under their checkpoint names (what
    `save_pretrained` writes) load into `differential_lambda`. `from_pretrained` renames them itself, but the Trainer
    resumes a checkpoint, and a user may load one, with a plain non-strict `load_state_dict`, which would otherwise
    leave λ silently at its old values. A tensor under its checkpoint name replaces one under its in-memory name:
    torch's `set_model_state_dict` (accelerate's `load_checkpoint_in_model` without a device map) adds every
    parameter the file lacks under its in-memory name, with the model's current value."""
    for key in [key for key in state_dict if key.startswith(prefix)]:
        name = key[len(prefix):]
        memory_name = lambda_memory_name(name)
        if memory_name != name:
            state_dict[prefix + memory_name] = state_dict.pop(key)


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


class Float32ProductOfHalfRows(torch.autograd.Function):
    """rows · weightᵀ in float32 or wider for half-precision rows, keeping for backward the rows as they are: the
    attention's other projections keep them anyway, where the product's float32 copy would be twice their bytes."""

    @staticmethod
    def forward(ctx, rows, weight):
        dtype = _float32_or_wider(rows.dtype)
        ctx.save_for_backward(rows, weight)
        return torch.mm(rows.to(dtype), weight.to(dtype).t())

    @staticmethod
    def backward(ctx, grad_products):
        rows, weight = ctx.saved_tensors
        grad_rows = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_rows = torch.mm(grad_products, weight.to(grad_products.dtype)).to(rows.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = torch.mm(grad_products.t(), rows.to(grad_products.dtype)).to(weight.dtype)
        return grad_rows, grad_weight


class DiffLlamaFloat32Linear(nn.Linear):
    """nn.Linear computed in float32 or wider, whatever the dtype of its weight and input."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Autocast has no meta device (the memory prediction runs there); torch.amp.is_autocast_available would ask,
        # but torch 2.11's compiler cannot trace it.
        device_type = hidden_states.device.type
        if device_type != "meta" and torch.is_autocast_enabled(device_type):
            # Mixed precision (the Trainer's bf16/fp16) would run the product in half precision: mm is on autocast's
            # lists. λ stays float32 there too.
            with torch.autocast(device_type, enabled=False):
                return self.forward(hidden_states)
        dtype = _float32_or_wider(hidden_states.dtype)
        if self.bias is not None:
            return nn.functional.linear(hidden_states.to(dtype), self.weight.to(dtype), self.bias.to(dtype))
        # Rows as one matrix product: nn.Linear on a 3-D input adds reshapes and views around the same product.
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        if hidden_states.dtype != dtype and torch.is_grad_enabled():
            products = Float32ProductOfHalfRows.apply(rows, self.weight)
        else:  # no autograd.Function where nothing is kept for backward: a decoding step pays for every op
            weight = self.weight if self.weight.dtype == dtype else self.weight.to(dtype)
            products = torch.mm(rows if rows.dtype == dtype else rows.to(dtype), weight.t())
        return products.view(*hidden_states.shape[:-1], -1)


class DiffLlamaV2Lambda(nn.Module):
    """DIFF V2's λ: sigmoid(lambda_proj(x)) per token and differential head, from the attention block's input."""

    def __init__(self, hidden_size: int, num_differential_heads: int):
        super().__init__()
        self.lambda_proj = DiffLlamaFloat32Linear(hidden_size, num_differential_heads, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(batch, seq, h) in float32 or wider: the subtraction it weights cancels much of the signal. `lambda_proj`
        is called, not read: offloading hooks (`device_map` with disk or CPU offload) bring its weight in on call."""
        return torch.sigmoid(self.lambda_proj(hidden_states))
