"""Moving checkpoints between diff-llama and transformers' built-in `diffllama` model (even G only).

Both checkpoints use the same parameter names and shapes, so no tensor is changed: only the config differs. One
exception: the built-in model's head norm always uses `rms_norm_eps`, so a model with its own `head_norm_eps` (a
converted LLaMA) is exported with its value projections scaled by sqrt(rms_norm_eps / head_norm_eps), which computes
the same function (RMSNorm(s x; s² eps) = RMSNorm(x; eps)).
"""

import os

import torch
import transformers
from transformers.core_model_loading import revert_weight_conversion

from .configuration_diff_llama import DiffLlamaConfig
from .errors import InputNotFoundError, UserError
from .modeling_diff_llama import DiffLlamaForCausalLM

# Fields that exist only in diff-llama's config; the built-in config would keep them as stray attributes.
_OWN_FIELDS = ("auto_map", "diff_version", "head_norm_eps", "mlp_bias", "architectures", "model_type", "transformers_version")


def load_builtin_checkpoint(path: str | os.PathLike, **from_pretrained_kwargs) -> DiffLlamaForCausalLM:
    """Load a checkpoint saved by `transformers.DiffLlamaForCausalLM` into diff-llama's class (identical logits)."""
    builtin_config = transformers.DiffLlamaConfig.from_pretrained(path)
    if builtin_config.model_type != "diffllama":
        raise UserError(f"{path} holds a `{builtin_config.model_type}` checkpoint, not a built-in `diffllama` one.")
    config = DiffLlamaConfig(**builtin_config.to_dict())
    return DiffLlamaForCausalLM.from_pretrained(path, config=config, **from_pretrained_kwargs)


def to_builtin_config(config: DiffLlamaConfig) -> "transformers.DiffLlamaConfig":
    """The built-in config for the same model; refuses what the built-in model cannot compute."""
    if config.diff_version != 1:
        raise UserError(
            "transformers' built-in DiffLlama implements version 1 only; this is a DIFF V2 model (diff_version=2). "
            "Keep it in diff-llama (which loads anywhere via trust_remote_code=True)."
        )
    if config.num_key_value_heads % 2:
        raise UserError(
            f"transformers' built-in DiffLlama needs an even `num_key_value_heads`, this model has "
            f"{config.num_key_value_heads}. Keep it in diff-llama (which loads anywhere via trust_remote_code=True)."
        )
    if config.mlp_bias:
        raise UserError("transformers' built-in DiffLlama has no MLP biases; this model has `mlp_bias=True`.")
    values = {k: v for k, v in config.to_dict().items() if k not in _OWN_FIELDS}
    return transformers.DiffLlamaConfig(**values)


def export_to_builtin(model: DiffLlamaForCausalLM, output_dir: str | os.PathLike) -> None:
    """Save `model` so that `transformers.DiffLlamaForCausalLM.from_pretrained(output_dir)` loads it unchanged."""
    builtin_config = to_builtin_config(model.config)
    with torch.device("meta"):
        builtin = transformers.DiffLlamaForCausalLM(builtin_config)
    # The checkpoint names (λ vectors as `self_attn.lambda_q1`, ...) are the built-in model's module names.
    state_dict = revert_weight_conversion(model, model.state_dict())
    config = model.config
    if config.head_norm_eps is not None:  # fold the epsilon into the values (see the module docstring)
        for layer in range(config.num_hidden_layers):
            scale = (config.rms_norm_eps / config.head_norm_epsilon(layer)) ** 0.5
            for kind in ("weight", "bias"):
                key = f"model.layers.{layer}.self_attn.v_proj.{kind}"
                if key in state_dict:
                    state_dict[key] = state_dict[key] * scale
    builtin.load_state_dict(state_dict, strict=True, assign=True)
    builtin.generation_config = model.generation_config
    builtin.save_pretrained(output_dir)


def refuse_other_model_types(source) -> None:
    """One line for a folder that holds no DiffLlama (a LLaMA, say): its weights lack λ, and loading them as one would
    fail with a traceback naming missing keys."""
    import json
    from pathlib import Path

    try:
        model_type = json.loads(Path(source, "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # transformers' own error on reading it says more
    if model_type == "llama":
        raise UserError(f"{source} holds a LLaMA, not a DiffLlama; convert it first (diff-llama convert {source} OUT "
                        "--diff-version 1), then export OUT.")
    if model_type not in ("diff_llama", "diffllama"):
        raise UserError(f"{source} holds a `{model_type}` model, not a DiffLlama; export-builtin takes a version 1 "
                        "DiffLlama (diff-llama convert --diff-version 1 makes one from a LLaMA).")


def export_folder_to_builtin(source: str | os.PathLike, output_dir: str | os.PathLike, overwrite: bool = False) -> None:
    """`diff-llama export-builtin`: the checkpoint in `source` saved for the built-in class, with its tokenizer. With
    `overwrite`, an earlier export's output there is replaced once the new one is complete."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from .output_folder import AtomicOutputFolder
    from .resolve import adapter_refusal, is_adapter_folder, save_tokenizer

    # New, empty or (with `overwrite`) an earlier export's, and neither the source nor inside it; renamed into place
    # once complete.
    target = AtomicOutputFolder(output_dir, overwrite=overwrite, inputs=[source], command="export-builtin")
    if not Path(source, "config.json").is_file():
        if is_adapter_folder(source):
            raise InputNotFoundError(adapter_refusal(source, "and export that folder"))
        raise InputNotFoundError(f"{source}: no such diff-llama checkpoint folder (no config.json).")
    refuse_other_model_types(source)
    config = DiffLlamaConfig.from_pretrained(source)
    to_builtin_config(config)  # refuses what the built-in cannot compute before the weights are read
    with target as folder:
        export_to_builtin(DiffLlamaForCausalLM.from_pretrained(source, config=config), folder)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError):  # a checkpoint saved without its tokenizer: the weights are still useful
            return
        save_tokenizer(tokenizer, folder)
