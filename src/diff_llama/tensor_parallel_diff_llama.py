# Copyright 2026 The diff-llama authors. Licensed under the Apache License, Version 2.0.
"""Tensor parallelism for DiffLlama (`from_pretrained(..., tp_plan="auto")` under torchrun): the head layout of each
rank and the two plan styles that `DiffLlamaConfig.base_model_tp_plan` names.

Each rank computes whole differential heads: version 1 pairs map i with map i + H/2, so a rank takes the same slice of
both halves of the query heads (a packed split); DIFF V2 pairs adjacent maps, so a plain split keeps pairs whole. Keys
and values are split the same way where the key/value heads divide evenly; otherwise every rank computes them all and
keeps those its queries read.

Imports only torch, transformers and the sibling configuration file: it ships next to the modeling file as remote code.
"""

import contextlib
import math
from collections.abc import Sequence

import torch
from torch import nn

from transformers.utils import is_torch_distributed_available

from .configuration_diff_llama import DiffLlamaConfig


def select_heads(
    key_states: torch.Tensor, value_states: torch.Tensor, heads: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key/value heads `heads` (in that order, repeats allowed) of (batch, G, seq, d) keys and values."""
    index = torch.tensor(heads, device=key_states.device)
    return key_states.index_select(1, index), value_states.index_select(1, index)


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


def engine_tensor_parallel_problem(config: DiffLlamaConfig, tp_size: int, engine: str = "vLLM") -> str | None:
    """Why a serving engine (vLLM, SGLang) cannot split this model over `tp_size` ranks, or None where it can. The
    engines read the plan with plain column splits (`ENGINE_DIFF_V2_TP_PLAN`), which keep DIFF V2's adjacent pairs whole
    when each rank gets whole pairs, and its keys and values right when each gets whole key/value heads.
    (transformers' own TP, with the styles below, also splits other layouts: replicating keys and values, or version
    1's packed halves.)"""
    if tp_size == 1:
        return None
    if config.diff_version != 2:
        return f"{engine} serves only DIFF V2 models"
    pairs, kv_heads = config.num_attention_heads // 2, config.num_key_value_heads
    usable = [size for size in range(1, pairs + 1) if pairs % size == 0 and kv_heads % size == 0]
    if pairs % tp_size == 0 and kv_heads % tp_size == 0:
        return None
    return (f"{engine} splits each layer's heads in contiguous blocks, so every rank must hold whole differential heads "
            f"(num_attention_heads / 2 = {pairs}) and whole key/value heads (num_key_value_heads = {kv_heads}), both "
            f"divisible by the tensor-parallel size {tp_size}; sizes that work here: {usable}")


if is_torch_distributed_available():
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    # `ALL_PARALLEL_STYLES` moved to `parallel_utils` in newer transformers; `tensor_parallel` exports it in all.
    from transformers.distributed.tensor_parallel import (
        ALL_PARALLEL_STYLES,
        ReplicatedWithGradAllReduce,
        TensorParallelLayer,
    )

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

        # `**kwargs`: the config and mesh manager that transformers 5.25 and later pass to every style
        def install_forward(self, module, mesh, **kwargs):
            layout = tensor_parallel_layout(module.config, mesh.size(), mesh.get_local_rank())
            module.q_proj.tp_split = layout["query"]
            module.k_proj.tp_split = module.v_proj.tp_split = layout["key_value"]
            if module.config.diff_version == 2:
                module.differential_lambda.lambda_proj.tp_split = "contiguous"  # one λ per pair, as the queries
            else:
                module.kv_expansion = 1
            module.num_key_value_groups = layout["num_key_value_groups"]
            module.tp_key_value_heads = layout["key_value_heads"]
            module.tp_local_modules = [
                sub for name, sub in module.named_modules() if name != "o_proj" and not name.startswith("o_proj.")
            ]
            return super().install_forward(module, mesh, **kwargs)

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

        def shard_param(self, module, param, mesh, **kwargs):
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

        def install_forward(self, module, mesh, **kwargs):
            if module.tp_split is None:
                # Replicated weights, each rank using some of their heads: training sums their gradients over ranks.
                return ReplicatedWithGradAllReduce().install_forward(module, mesh, **kwargs)
            return module

    ALL_PARALLEL_STYLES.register("diff_llama_attention", DiffLlamaAttentionParallel())
    ALL_PARALLEL_STYLES.register("diff_llama_heads", DiffLlamaHeadsParallel())
