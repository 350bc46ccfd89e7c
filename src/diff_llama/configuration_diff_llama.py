# Copyright 2026 The diff-llama authors. Licensed under the Apache License, Version 2.0.
"""DiffLlama configuration.

Imports only torch/transformers so that it also works as remote code (`trust_remote_code=True`).
"""

import re

import transformers

# The oldest transformers this code runs on (setup.cfg's install_requires says the same).
MINIMUM_TRANSFORMERS = "5.16.1"


def require_transformers(version: str = transformers.__version__) -> None:
    """Refuse, in one line, a transformers older than `MINIMUM_TRANSFORMERS`: as remote code on an older install, the
    imports below would otherwise fail with a traceback that names a missing class, never the version."""
    def release(text):  # "5.16.1.dev0" -> (5, 16, 1); None for a version string of another form
        found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
        return tuple(int(part or 0) for part in found.groups()) if found else None

    installed = release(version)
    if installed is not None and installed < release(MINIMUM_TRANSFORMERS):
        raise ImportError(f"diff-llama's remote code needs transformers {MINIMUM_TRANSFORMERS} or newer; you have "
                          f"{version}: pip install -U 'transformers>={MINIMUM_TRANSFORMERS}'")


require_transformers()

from transformers import PreTrainedConfig  # noqa: E402  (after the version check)
from transformers.utils import logging  # noqa: E402

logger = logging.get_logger(__name__)

# The code a saved model ships with, so that it loads with `trust_remote_code=True` where this package is not
# installed: this file, the modeling file and the siblings the modeling file imports. Saving, converting and pushing
# all use this list.
REMOTE_CODE_FILES = (
    "configuration_diff_llama.py",
    "modeling_diff_llama.py",
    "differential_kernels.py",
    "lambda_diff_llama.py",
    "tensor_parallel_diff_llama.py",
    "compat_diff_llama.py",
)
# Written into every saved config (save_pretrained alone records only the class being saved).
AUTO_MAP = {
    "AutoConfig": "configuration_diff_llama.DiffLlamaConfig",
    "AutoModel": "modeling_diff_llama.DiffLlamaModel",
    "AutoModelForCausalLM": "modeling_diff_llama.DiffLlamaForCausalLM",
    "AutoModelForSequenceClassification": "modeling_diff_llama.DiffLlamaForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_diff_llama.DiffLlamaForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_diff_llama.DiffLlamaForQuestionAnswering",
}
# DIFF V2's plan in transformers' plain styles, for the serving engines whose Transformers backends shard a model by
# its plan with styles of their own: vLLM replicates a layer whose style it does not know (and takes the first pattern
# that matches a layer's name, so no pattern here is a prefix of another's layer); SGLang refuses the whole plan, even
# on one GPU. Plain blocks of rows keep DIFF V2's adjacent map pairs, their λ rows and their key/value heads on one
# rank whenever H/2 and G divide by the TP size (`engine_tensor_parallel_problem` says when they do not).
ENGINE_DIFF_V2_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.differential_lambda.lambda_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
# The attention implementations those engines register when they build the model.
SERVING_ENGINE_ATTENTIONS = ("vllm", "sglang")


class DiffLlamaConfig(PreTrainedConfig):
    r"""
    Configuration of a Differential Transformer (arXiv 2410.05258) with LLaMA's layout: pre-RMSNorm, SwiGLU, RoPE,
    and differential attention in place of softmax attention.

    Every LLaMA field keeps its meaning. `num_attention_heads` (H) counts softmax maps and must be even. Version 1
    (the paper's): differential head `i` subtracts map `i + H/2` from map `i`, and `num_key_value_heads` (G) may be
    any divisor of H, odd and 1 included. Version 2 (DIFF V2): differential head `i` subtracts map `2i + 1` from map
    `2i` with a per-token λ, and G must divide H/2 so that both maps of a pair read the same key and value.

    The config stores any values (recent `LlamaConfig`s refuse some when built); a layout the differential attention
    cannot run with is refused with a message naming the field when a model is built from it
    (`validate_differential_layout`).

    Args:
        lambda_std_dev (`float`, defaults to 0.1):
            Standard deviation of the normal initialisation of the four per-layer λ vectors.
        head_norm_eps (`float` or `list[float]`, *optional*):
            Version 1: epsilon of the per-head RMSNorm of differential attention, one value or one per layer. `None`
            (the default) uses `rms_norm_eps`, as the paper and transformers' built-in `diffllama` do. Converted
            LLaMAs set it per layer, well above the heads' mean square, so that the norm starts nearly linear with the
            LLaMA's weights at their own scale (see the converter).
        diff_version (`int`, defaults to 1):
            Differential attention variant: 1, the paper's (two maps per head over a 2d-wide value, λ per layer,
            per-head RMSNorm); 2, DIFF V2 (adjacent maps, λ per token and head from `lambda_proj`, no head norm,
            one ordinary attention call and the LLaMA's KV cache).
        differential_kernel (`str`, *optional*):
            Version 1: the differential attention kernel to use where it applies ("generic", "blocked", "decode",
            "paired_sdpa_cpu", "paired_sdpa_cuda", or one registered with `DifferentialAttentionInterface`); `None`
            (the default) picks one per attention backend, device and step (`DIFFERENTIAL_KERNEL_DISPATCH` in
            `differential_kernels.py`).
            `model.set_differential_kernel(name)` sets it. Every kernel computes the same function.
        attention_dropout (`float`, defaults to 0.0):
            Must be 0: the paper defines no dropout for the differential map (see the error message).

    ```python
    >>> from diff_llama import DiffLlamaConfig, DiffLlamaForCausalLM
    >>> config = DiffLlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    ...                          num_attention_heads=8, num_key_value_heads=1)
    >>> model = DiffLlamaForCausalLM(config)
    ```
    """

    model_type = "diff_llama"
    # Llama's pipeline-parallel plan (the layer's inputs and outputs are Llama's), which vLLM's Transformers backend
    # needs for --pipeline-parallel-size.
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 2048,
        intermediate_size: int = 8192,
        num_hidden_layers: int = 16,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 2048,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-5,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | list[int] | None = 2,
        tie_word_embeddings: bool = False,
        rope_parameters: dict | None = None,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        mlp_bias: bool = False,
        lambda_std_dev: float = 0.1,
        diff_version: int = 1,
        head_norm_eps: float | list[float] | None = None,
        differential_kernel: str | None = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_parameters = rope_parameters
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.mlp_bias = mlp_bias
        self.lambda_std_dev = lambda_std_dev
        self.diff_version = diff_version
        self.head_norm_eps = head_norm_eps
        self.differential_kernel = differential_kernel
        if self.head_dim is None and isinstance(num_attention_heads, int) and num_attention_heads > 0:
            self.head_dim = hidden_size // num_attention_heads  # as LlamaConfig; validated when a model is built
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.tie_word_embeddings = tie_word_embeddings
        kwargs["auto_map"] = {**AUTO_MAP, **(kwargs.get("auto_map") or {})}
        # A built-in `diffllama` config.json names its own model_type; this class's is the one that applies.
        kwargs.pop("model_type", None)
        super().__init__(**kwargs)

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if config_dict.get("model_type") == "llama":
            # `DiffLlamaForCausalLM.from_pretrained(a_llama)` builds a model, but not the LLaMA's function;
            # transformers' own warning for another model_type does not say what to do instead.
            logger.warning(
                f"{pretrained_model_name_or_path} is a LLaMA checkpoint: loaded into DiffLlama as it is, its "
                "attention heads are paired into differential heads beside untrained λ, which does not compute the "
                "LLaMA's function. To keep what the LLaMA knew, convert it first (`diff-llama convert "
                f"{pretrained_model_name_or_path} OUT`, or diff_llama.conversion.converter.convert_llama_to_diff_llama) "
                "and load OUT."
            )
        return config_dict, kwargs

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """Tensor-parallel plan (`tp_plan="auto"`). The attention styles are defined in `tensor_parallel_diff_llama.py`:
        version 1 splits q/k/v as packed halves (maps i and i + H/2 on one rank), DIFF V2 as blocks of adjacent pairs;
        λ of version 1 is replicated. A layout the TP size cannot split is refused when the model is sharded.

        Built by vLLM or SGLang (their Transformers backends set the attention implementation to their own name), DIFF
        V2's plan is `ENGINE_DIFF_V2_TP_PLAN`, in the plain styles those engines know."""
        if self.diff_version == 2 and getattr(self, "_attn_implementation", None) in SERVING_ENGINE_ATTENTIONS:
            plan = dict(ENGINE_DIFF_V2_TP_PLAN)
        else:
            plan = {
                "layers.*.self_attn": "diff_llama_attention",
                "layers.*.self_attn.q_proj": "diff_llama_heads",
                "layers.*.self_attn.k_proj": "diff_llama_heads",
                "layers.*.self_attn.v_proj": "diff_llama_heads",
                "layers.*.self_attn.o_proj": "rowwise",
                "layers.*.mlp.gate_proj": "colwise",
                "layers.*.mlp.up_proj": "colwise",
                "layers.*.mlp.down_proj": "rowwise",
            }
            if self.diff_version == 2:
                plan["layers.*.self_attn.differential_lambda.lambda_proj"] = "diff_llama_heads"
            else:
                plan["layers.*.self_attn.differential_lambda"] = "replicated_with_grad_allreduce"
        # Entries transformers adds itself (older versions add the tied embedding's style in `__post_init__`).
        return {**plan, **self.__dict__.get("base_model_tp_plan", {})}

    @base_model_tp_plan.setter
    def base_model_tp_plan(self, plan: dict[str, str] | None):
        # Keeps what differs from the plan above, so that the version-dependent entries follow `diff_version`. Stored
        # under the attribute's own name, which `to_dict` leaves out of config.json.
        self.__dict__.pop("base_model_tp_plan", None)
        own = self.base_model_tp_plan
        self.__dict__["base_model_tp_plan"] = {key: value for key, value in (plan or {}).items() if own.get(key) != value}

    def head_norm_epsilon(self, layer_idx: int) -> float:
        """Epsilon of layer `layer_idx`'s per-head RMSNorm (version 1)."""
        eps = self.head_norm_eps
        if eps is None:
            return self.rms_norm_eps
        return float(eps[layer_idx] if isinstance(eps, (list, tuple)) else eps)

    def validate_differential_layout(self):
        """Refuse every value the differential attention cannot run with, naming the field and the fix. Called when a
        model is built, so that configs (like `LlamaConfig`) construct with any values, as transformers' tests expect."""
        if self.diff_version not in (1, 2):
            raise ValueError(
                f"DiffLlamaConfig: `diff_version` must be 1 (the paper's differential attention) or 2 (DIFF V2), got "
                f"{self.diff_version!r}."
            )
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        if not isinstance(heads, int) or heads < 2 or heads % 2:
            raise ValueError(
                f"DiffLlamaConfig: `num_attention_heads` must be a positive even number (the softmax maps are "
                f"subtracted in pairs), got {heads}. To convert a LLaMA with an odd head "
                f"count, pad it with an extra GQA group of zero heads (see the converter)."
            )
        if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
            raise ValueError(
                f"DiffLlamaConfig: `num_key_value_heads` ({kv_heads}) must be a positive divisor of "
                f"`num_attention_heads` ({heads}); use one of {[g for g in range(1, heads + 1) if heads % g == 0]}."
            )
        if self.diff_version == 2 and (heads // 2) % kv_heads:
            raise ValueError(
                f"DiffLlamaConfig: with diff_version=2, `num_key_value_heads` ({kv_heads}) must divide "
                f"num_attention_heads / 2 ({heads // 2}), so that maps 2i and 2i + 1 of a pair read the same key and "
                f"value; use one of {[g for g in range(1, heads // 2 + 1) if (heads // 2) % g == 0]}."
            )
        head_dim = self.head_dim
        if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
            raise ValueError(
                f"DiffLlamaConfig: `head_dim` must be a positive even number (RoPE rotates pairs of channels), got "
                f"{head_dim}; pass an even `head_dim` or a `hidden_size` that gives one."
            )
        if not self.lambda_std_dev >= 0:
            raise ValueError(
                f"DiffLlamaConfig: `lambda_std_dev` must be >= 0 (it is a standard deviation), got {self.lambda_std_dev}."
            )
        eps = self.head_norm_eps
        values = eps if isinstance(eps, (list, tuple)) else [eps]
        if eps is not None and (
            (isinstance(eps, (list, tuple)) and len(eps) != self.num_hidden_layers)
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf") for v in values)
        ):
            raise ValueError(
                f"DiffLlamaConfig: `head_norm_eps` must be None (use `rms_norm_eps`), a positive number, or a list of "
                f"{self.num_hidden_layers} positive numbers (one per layer), got {eps!r}."
            )
        if self.attention_dropout:
            raise ValueError(
                f"DiffLlamaConfig: `attention_dropout` must be 0, got {self.attention_dropout}. The paper defines no "
                f"dropout for the differential map A1 - λ·A2, and dropping A1 and A2 independently would change what "
                f"is subtracted. Regularise with weight decay or dropout outside attention instead."
            )


__all__ = ["DiffLlamaConfig", "REMOTE_CODE_FILES"]
