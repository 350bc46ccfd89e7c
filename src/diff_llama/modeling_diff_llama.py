# Copyright 2026 The diff-llama authors. Licensed under the Apache License, Version 2.0.
"""DiffLlama: LLaMA with differential attention (Ye et al., arXiv 2410.05258).

The maths and tensor layout follow docs/maths.md. Version 1 (the paper's): query heads i and i + H/2 form differential
head i, both maps read the value pair V_i = concat(v_kv(i), v_kv(i + H/2)), and checkpoint names match
transformers' built-in `diffllama`, so its checkpoints load unchanged. Version 2 (DIFF V2, `diff_version=2`): maps
2i and 2i + 1 of one ordinary attention call are subtracted with a per-token λ = sigmoid(lambda_proj(x)).

The decoder layer, the model and the causal LM are transformers' Llama classes with DiffLlama's modules; this file adds
the differential attention. The differential kernels and their dispatch live in `differential_kernels.py`, λ's modules
and checkpoint names in `lambda_diff_llama.py`, the tensor-parallel layout and plan styles in
`tensor_parallel_diff_llama.py`, and what differs between the supported transformers versions (the KV cache's name) in
`compat_diff_llama.py`. This file and those siblings import only torch, transformers and each other (relative imports),
so `save_pretrained` copies them next to the weights and a saved model loads as remote code (`trust_remote_code=True`)
where this package is not installed.
"""

# First: on a transformers too old for the imports below, the configuration refuses it in one line.
from .configuration_diff_llama import MINIMUM_TRANSFORMERS  # noqa: F401  # isort: skip

import math
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
)
from transformers.modeling_rope_utils import dynamic_rope_update
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .compat_diff_llama import accepts_either_cache_name, reachable_by_qualname, with_installed_cache_name
from .configuration_diff_llama import REMOTE_CODE_FILES, DiffLlamaConfig
from .differential_kernels import (
    ALL_DIFFERENTIAL_KERNELS,
    GroupedQueryAttentionInterface,
    RebuiltForBackward,
    _float32_or_wider,
    _pair_difference_value,
    eager_attention_forward,
    pair_difference_inputs,
    select_differential_kernel,
)
from .lambda_diff_llama import (
    LAMBDA_VECTOR_NAMES,
    DiffLlamaLambda,
    DiffLlamaV2Lambda,
    lambda_memory_name,
    load_lambda_under_checkpoint_names,
)
from .tensor_parallel_diff_llama import select_heads


# DIFF V2's attention functions: transformers' own, but its SDPA decodes without repeating the keys and values to all
# query heads (`GroupedQueryAttentionInterface`). Named as transformers' global, as a transformers model names its
# local interface: vLLM's Transformers backend finds the attention call by this name in the forward's source.
ALL_ATTENTION_FUNCTIONS = GroupedQueryAttentionInterface()


class DiffLlamaRMSNorm(LlamaRMSNorm):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Llama's RMSNorm, computed in float32 or wider (Llama's always drops to float32, even for float64 models).
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(_float32_or_wider(input_dtype))
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class DiffLlamaRotaryEmbedding(LlamaRotaryEmbedding):
    @reachable_by_qualname  # for vLLM's compile cache, see compat_diff_llama.py
    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x, position_ids):
        # Llama's rotary embedding, with angles in float32 or wider, so that a float64 model is float64 throughout.
        dtype = _float32_or_wider(x.dtype)  # in Python: torch.promote_types is an aten op
        freqs = position_ids[..., None].to(dtype) * self.inv_freq.to(device=x.device, dtype=dtype)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


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


class DiffLlamaAttentionBase(nn.Module):
    """What both versions share, as in Llama's attention: the q/k/v/o projections, RoPE, the KV cache and, under tensor
    parallelism, the key/value heads this rank reads. A version supplies `differential_heads`: the attention between
    the cache and `o_proj`. (Not a LlamaAttention: DIFF V2's `o_proj` reads H/2 heads, and Llama's forward has no
    seam between the cache and `o_proj`.)"""

    def __init__(self, config: DiffLlamaConfig, layer_idx: int, num_key_value_groups: int, output_heads: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        # GQA seen by the attention backend: query heads per key/value head it is handed.
        self.num_key_value_groups = num_key_value_groups
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        # Set by tensor parallelism when each rank keeps only some of the (replicated) key/value heads.
        self.tp_key_value_heads: tuple[int, ...] | None = None

        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(output_heads * self.head_dim, config.hidden_size, bias=bias)
        self.register_load_state_dict_pre_hook(load_lambda_under_checkpoint_names)

    @accepts_either_cache_name
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        query_states, key_states, value_states = self.project(hidden_states, position_embeddings, cache, kwargs)
        attn_output, attn_weights = self.differential_heads(
            hidden_states, query_states, key_states, value_states, attention_mask, cache, **kwargs
        )
        return self.project_out(attn_output, hidden_states), attn_weights

    def project_out(self, attn_output: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """(batch, q, h, width) differential heads -> o_proj's output, in the model's dtype."""
        return self.o_proj(self.o_proj_input(attn_output, hidden_states.shape, hidden_states.dtype))

    @staticmethod
    def o_proj_input(attn_output: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if attn_output.dtype != dtype:  # a no-op .to() is still an aten op
            attn_output = attn_output.to(dtype)
        return attn_output.reshape(*shape[:-1], -1)

    def project(self, hidden_states, position_embeddings, cache, kwargs):
        """Llama's queries (batch, H, q, d), and the keys and values (batch, G, k, d) after RoPE and the cache."""
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
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
        return query_states, key_states, value_states

    def differential_heads(self, hidden_states, query, key, value, attention_mask, cache, **kwargs):
        """(batch, q, h, width) differential heads' outputs, before `o_proj`, and the softmax maps when there are."""
        raise NotImplementedError

    @classmethod
    def combine_maps(cls, maps: torch.Tensor, lambdas: torch.Tensor) -> torch.Tensor:
        """Softmax maps (batch, H, q, k) and this layer's λ -> differential maps A1 − λ·A2, (batch, h, q, k), in
        float32 or wider: λ a scalar (version 1) or (batch, q, h) per token (DIFF V2)."""
        dtype = torch.promote_types(maps.dtype, torch.float32)
        first, second = cls.pair_maps(maps.to(dtype))
        lambdas = torch.as_tensor(lambdas, dtype=dtype, device=maps.device)
        if lambdas.dim():
            lambdas = lambdas.transpose(1, 2)[..., None]  # per token: (batch, h, q, 1)
        return first - lambdas * second


class DiffLlamaAttention(DiffLlamaAttentionBase):
    """Differential attention: out_i = (1 - λ_init) * RMSNorm((A1 - λ A2) V_i) for differential head i.

    Both softmax maps of every pair come from one differential kernel (`differential_kernels.py`), so eager, SDPA,
    flex and flash kernels all compute the exact maps. Key/value heads are expanded only as far as needed for each
    half of the query heads to see whole GQA groups: not at all for even G, and to 2 heads for G = 1. That is what
    lets odd G and multi-query models run.
    """

    def __init__(self, config: DiffLlamaConfig, layer_idx: int):
        # No key/value head may be shared across the two halves of the query heads: the backend's GQA group must
        # divide H/2, and the key/value heads are repeated up to it.
        heads = config.num_attention_heads
        query_heads_per_kv = heads // config.num_key_value_heads
        super().__init__(config, layer_idx, math.gcd(query_heads_per_kv, heads // 2), output_heads=heads)
        self.num_heads = heads
        self.kv_expansion = query_heads_per_kv // self.num_key_value_groups
        self.differential_lambda = DiffLlamaLambda(self.head_dim, layer_idx)
        # The paper's per-head normalisation over the 2d-wide output; it has no affine weight. Its epsilon is
        # rms_norm_eps unless the config sets head_norm_eps (converted LLaMAs do: see the converter).
        eps = config.head_norm_epsilon(layer_idx)
        self.head_norm = DiffLlamaHeadNorm(2 * self.head_dim, eps=eps, elementwise_affine=False)

    def differential_heads(self, hidden_states, query, key, value, attention_mask, cache, **kwargs):
        """A1·V − λ·A2·V of every differential head, before the head norm (which `project_out` applies)."""
        key, value = repeat_kv(key, self.kv_expansion), repeat_kv(value, self.kv_expansion)
        # λ in float32 (or wider): the subtraction cancels most of the signal, whatever the model dtype.
        lambda_full = self._lambda(cache)
        kernel = select_differential_kernel(self, query, key, attention_mask)
        return kernel(self, query, key, value, attention_mask, lambda_full, **kwargs)

    def project_out(self, attn_output: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """The head norm, the (1 − λ_init) factor and o_proj. Training on a difference formed from a pair of attention
        outputs (`pair_difference_inputs`): the float32 difference and o_proj's input, 2d wide per differential head,
        are rebuilt from that pair in backward rather than kept (the pair is kept anyway, by the attention kernel)."""
        shape, dtype = hidden_states.shape, hidden_states.dtype
        pair = pair_difference_inputs(attn_output)
        with RebuiltForBackward(enabled=pair is not None) as rebuilt:
            if pair is not None:
                rebuilt.add(attn_output, _pair_difference_value, *pair)
            output = self.o_proj_input(self.normalized_heads(attn_output), shape, dtype)
            if pair is not None:
                rebuilt.add(output, lambda *inputs: self.o_proj_input(
                    self.normalized_heads(_pair_difference_value(*inputs)), shape, dtype), *pair)
            return self.o_proj(output)

    def normalized_heads(self, difference: torch.Tensor) -> torch.Tensor:
        normalized = self.head_norm(difference)
        # x·(1 − λ_init) as x + (−λ_init)·x: one aten op, where multiplying by a Python number takes five.
        return torch.add(normalized, normalized, alpha=-self.differential_lambda.lambda_init)

    def _lambda(self, cache: Cache | None) -> torch.Tensor:
        """This layer's λ. Decoding without autograd reuses the λ computed earlier with the same cache (one
        generation), as long as no λ vector was modified in place (their version counters) or replaced (their data
        pointers); anything else computes it afresh (16 aten ops), as do vectors made under `torch.inference_mode()`,
        which have no version counter."""
        if cache is None or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return self.differential_lambda()
        vectors = [getattr(self.differential_lambda, name) for name in LAMBDA_VECTOR_NAMES]
        if any(vector.is_inference() for vector in vectors):
            return self.differential_lambda()
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


class DiffLlamaV2Attention(DiffLlamaAttentionBase):
    """DIFF V2: out_{t,i} = O_{t,2i} − λ_{t,i}·O_{t,2i+1}, O = one ordinary attention call over all H query heads.

    Keys, values and the KV cache are exactly a LLaMA's (G heads of width d); every backend (eager, SDPA, flex,
    flash) runs unchanged, since nothing differential happens before the attention output. λ_{t,i} =
    sigmoid(x_t · lambda_proj[i]) for the block's input x; there is no per-head norm.
    """

    def __init__(self, config: DiffLlamaConfig, layer_idx: int):
        heads = config.num_attention_heads
        super().__init__(config, layer_idx, heads // config.num_key_value_heads, output_heads=heads // 2)
        self.num_differential_heads = heads // 2
        self.differential_lambda = DiffLlamaV2Lambda(config.hidden_size, self.num_differential_heads)

    # Its own forward, not the base's `differential_heads` seam: vLLM's Transformers backend serves a module whose
    # forward source makes the one attention-interface call itself (it reads the call and its `scaling=`, and finds it
    # by the name ALL_ATTENTION_FUNCTIONS: this file's interface, which hands vLLM's name to transformers' own).
    @accepts_either_cache_name
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        query_states, key_states, value_states = self.project(hidden_states, position_embeddings, cache, kwargs)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
        )
        # (..., H, d): maps 2i and 2i + 1 are differential head i's pair, taken as strided views (no copy). Shaped
        # from the input's shape, not indexed as (batch, seq, H, d): vLLM's attention returns (tokens, H·d).
        heads = attn_output.reshape(*hidden_states.shape[:-1], -1, self.head_dim)
        first, second = heads[..., 0::2, :], heads[..., 1::2, :]
        lambdas = self.differential_lambda(hidden_states)
        # first − λ·second in one op; addcmul promotes a bf16/fp16 pair to λ's float32.
        differential = torch.addcmul(first, lambdas.view(*lambdas.shape, 1), second, value=-1)
        # An unconditional cast: vLLM traces this forward with torch.fx, where a branch on a dtype cannot be traced.
        differential = differential.to(hidden_states.dtype).reshape(*hidden_states.shape[:-1], -1)
        return self.o_proj(differential), attn_weights

    @staticmethod
    def pair_maps(maps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax maps (batch, H, q, k) -> (A1, A2) of every differential head i: maps 2i and 2i + 1."""
        return maps[:, 0::2], maps[:, 1::2]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The serving engines' weight-loading protocol (SGLang's and vLLM's `AutoWeightsLoader` hand a module that has
        this method its checkpoint tensors, named relative to it). λ's projection is `lambda_proj` on disk but
        `differential_lambda.lambda_proj` here: SGLang hands it by the name on disk, vLLM (which applies transformers'
        renaming first) by the name here, and both are taken. Each tensor goes through its parameter's `weight_loader`
        where the engine gave it one (which takes this rank's shard under tensor parallel), else is copied whole.
        Returns the parameters' names, which the engines check for completeness."""
        loaded = set()
        for checkpoint_name, tensor in weights:
            name = lambda_memory_name(checkpoint_name)
            try:
                parameter = self.get_parameter(name)
            except AttributeError:
                raise ValueError(f"layer {self.layer_idx}'s attention has no parameter {name!r} for the checkpoint "
                                 f"tensor {checkpoint_name!r}: is the checkpoint another model's?") from None
            weight_loader = getattr(parameter, "weight_loader", None)
            if weight_loader is not None:
                weight_loader(parameter, tensor)
            elif parameter.shape != tensor.shape:
                raise ValueError(f"layer {self.layer_idx}'s {name} is {tuple(parameter.shape)} but the checkpoint "
                                 f"tensor is {tuple(tensor.shape)}")
            else:
                with torch.no_grad():
                    parameter.copy_(tensor)
            loaded.add(name)
        return loaded


# The attention variant is chosen once, from `config.diff_version`.
DIFF_ATTENTION_CLASSES = {1: DiffLlamaAttention, 2: DiffLlamaV2Attention}


class DiffLlamaDecoderLayer(LlamaDecoderLayer):
    """Llama's layer and forward, with the differential attention of `config.diff_version` and norms that keep a
    float64 model in float64."""

    def __init__(self, config: DiffLlamaConfig, layer_idx: int):
        super(LlamaDecoderLayer, self).__init__()  # Llama's own would build a LlamaAttention first
        self.hidden_size = config.hidden_size
        self.self_attn = DIFF_ATTENTION_CLASSES[config.diff_version](config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = DiffLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DiffLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DiffLlamaPreTrainedModel(LlamaPreTrainedModel):
    """Llama's: the same backends and compile support; its own config, layer and recorded outputs, saving that ships
    the remote code, λ's initialisation and the differential helpers."""

    config: DiffLlamaConfig
    config_class = DiffLlamaConfig
    _no_split_modules = ["DiffLlamaDecoderLayer"]
    # DIFF V2's λ projection: left out of every quantizer (λ weights a subtraction that cancels most of the signal,
    # and its float32 product cannot read a quantized weight), and kept float32 in a float16 load. Quantizers match
    # module names by suffix, torchao's parameter names: hence both names.
    _keep_in_fp32_modules = ["lambda_proj", "lambda_proj.weight"]
    _can_record_outputs = {
        "hidden_states": DiffLlamaDecoderLayer,
        "attentions": DiffLlamaAttentionBase,
    }

    @classmethod
    def is_remote_code(cls) -> bool:
        # FSDP2 (`fully_shard`) swaps a model's class for a subclass defined in torch's own files; transformers would
        # copy those files into the saved folder and name that subclass in config.json's auto_map. For such a class,
        # `save_pretrained` below copies the remote code itself (config.json's auto_map is always the full AUTO_MAP).
        return super().is_remote_code() and cls.__module__ == DiffLlamaPreTrainedModel.__module__

    def save_pretrained(self, save_directory, *args, **kwargs):
        result = super().save_pretrained(save_directory, *args, **kwargs)
        cls = type(self)
        if cls._auto_class is not None and not cls.is_remote_code():
            if self.should_save_on_this_rank(kwargs.get("is_main_process", True)):
                here = Path(__file__).parent
                for name in REMOTE_CODE_FILES:
                    shutil.copyfile(here / name, Path(save_directory) / name)
        return result

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DiffLlamaLambda):
            for name in LAMBDA_VECTOR_NAMES:
                init.normal_(getattr(module, name), 0.0, self.config.lambda_std_dev)

    def set_differential_kernel(self, kernel: str | None):
        """Choose the differential attention kernel (version 1) by name, from `ALL_DIFFERENTIAL_KERNELS`: "generic",
        "blocked", "decode", "paired_sdpa_cpu", "paired_sdpa_cuda" or one registered with
        `DifferentialAttentionInterface.register`. It serves every call it supports; the others keep the automatic
        choice (`DIFFERENTIAL_KERNEL_DISPATCH`), which `None` restores. Sets `config.differential_kernel`, so a saved
        model keeps the choice."""
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
        attentions = _softmax_maps(getattr(outputs, "attentions", None))
        lambdas = self.differential_lambdas(outputs)
        return tuple(
            layer.self_attn.combine_maps(maps, lam)
            for layer, maps, lam in zip(self.base_model.layers, attentions, lambdas)
        )


class DiffLlamaModel(DiffLlamaPreTrainedModel, LlamaModel):
    """Llama's model and forward, with DiffLlama's layers, final norm and rotary embedding."""

    def __init__(self, config: DiffLlamaConfig):
        config.validate_differential_layout()  # the config constructs with any values, as LlamaConfig does
        super(LlamaModel, self).__init__(config)  # Llama's own would build Llama's layers first
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

    # A `def` of this class, not a wrapper of Llama's bound here: vLLM's compile cache pickles the compiled forward
    # by module and qualname, which must lead back to the same function.
    def forward(self, *args, **kwargs):
        return LlamaModel.forward(self, *args, **with_installed_cache_name(kwargs))

    # Llama's signature for what reads it through `__wrapped__` (vLLM's compile decorator, generate()); torch's
    # compiler binds the arguments of this frame itself, so no `__signature__` may stand in for them.
    forward.__wrapped__ = LlamaModel.forward
    forward.__doc__ = LlamaModel.forward.__doc__


class DiffLlamaForCausalLM(DiffLlamaPreTrainedModel, LlamaForCausalLM):
    """Llama's causal LM head, forward and plans, over a `DiffLlamaModel`."""

    def __init__(self, config: DiffLlamaConfig):
        super(LlamaForCausalLM, self).__init__(config)  # Llama's own would build a LlamaModel first
        self.model = DiffLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

        self.post_init()

    def forward(self, *args, **kwargs):  # a def of this class, as DiffLlamaModel's
        return LlamaForCausalLM.forward(self, *args, **with_installed_cache_name(kwargs))

    forward.__wrapped__ = LlamaForCausalLM.forward
    forward.__doc__ = LlamaForCausalLM.forward.__doc__


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
        # The generic head's rules: classifier_dropout, else hidden_dropout, else 0.1; a bias unless the config says not.
        dropout = next((p for p in (getattr(config, "classifier_dropout", None), getattr(config, "hidden_dropout", None))
                        if p is not None), 0.1)
        self.dropout = nn.Dropout(dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels,
                               bias=getattr(config, "token_classification_bias", True))
        self.post_init()


class DiffLlamaForQuestionAnswering(GenericForQuestionAnswering, DiffLlamaPreTrainedModel):
    def __init__(self, config: DiffLlamaConfig):
        DiffLlamaPreTrainedModel.__init__(self, config)
        self.model = DiffLlamaModel(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()


def _softmax_maps(attentions):
    """`output_attentions`'s maps (one layer's tensor or every layer's), refused where a backend returned none."""
    if attentions is None or (not isinstance(attentions, torch.Tensor) and any(maps is None for maps in attentions)):
        raise ValueError(
            "No softmax maps to combine: only eager attention returns them. Load the model with "
            "`attn_implementation=\"eager\"` (or call `model.set_attn_implementation(\"eager\")`) and pass "
            "`output_attentions=True`."
        )
    return attentions


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
    attentions = _softmax_maps(attentions)
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
]
