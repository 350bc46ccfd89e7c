"""A LLaMA GGUF file read whole: what transformers' GGUF reader leaves out, put back, and the rest refused by name.

transformers builds a LLaMA's config from a GGUF file's metadata and then reads only the tensors that config's model
has: every other tensor in the file is skipped without a word (`load_gguf_checkpoint`). So a file written by
llama.cpp's converter loses three things on the way, and the model loaded (and any conversion of it) would not compute
the LLaMA's function:
- its biases (`blk.N.attn_q.bias`, ... and `blk.N.ffn_up.bias`, ...): the config built has none;
- Llama 3's RoPE scaling, which the file stores as `rope_freqs.weight` (one divisor per frequency), not as the
  config's parameters;
- linear RoPE scaling, stored as `llama.rope.scaling.type` and `.factor`, which transformers reads only for other
  architectures.
`load_gguf_causal_lm` puts all three back into the config before the model is loaded (`gguf_llama_config`); any other
tensor a LLaMA does not have, and any other RoPE scaling, is refused (the fix: use the Transformers checkpoint). The
converter reads its GGUF sources so, and so do the commands that load a GGUF LLaMA to run it (evaluate, ruler,
attention-map, adapt: `resolve.load_causal_lm`; serve: `serving_loader`).
"""

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.utils import logging as transformers_logging

from .errors import UserError
from .gguf_metadata import each_gguf_parsed_once

ATTENTION_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output")
MLP_TENSORS = ("ffn_gate", "ffn_up", "ffn_down")
BLOCK_WEIGHTS = ("attn_norm", "ffn_norm", *ATTENTION_TENSORS, *MLP_TENSORS)
ROPE_DIVISORS = "rope_freqs.weight"
# The fix for a file this module cannot read whole.
USE_TRANSFORMERS_CHECKPOINT = "use the model's Transformers checkpoint (its folder or Hub id) instead"


@dataclass(frozen=True)
class GGUFContents:
    """What of a GGUF file decides its LLaMA's config beyond transformers' reading: its tensor names, its RoPE
    divisors (`rope_freqs.weight`), and its `llama.rope.scaling.*` metadata."""

    tensor_names: frozenset
    rope_divisors: tuple | None
    rope_scaling: dict


def load_gguf_causal_lm(path: Path, **kwargs):
    """`AutoModelForCausalLM.from_pretrained` of the GGUF file at `path` (`kwargs` go with it); a LLaMA's biases and
    RoPE scaling read as well. Biases a LLaMA's file leaves out (llama.cpp writes the ones the model has: a query, key
    and value bias without an output one, say) are zero, not transformers' random initialisation; any other tensor
    missing means the file is incomplete."""
    with each_gguf_parsed_once():  # the config, the tensor names and the weights from one parse of the file
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        if config.model_type != "llama":
            return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kwargs)
        config = gguf_llama_config(config, read_gguf_contents(path), str(path))
        verbosity = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()  # its load report calls the biases zeroed below "newly initialized"
        try:
            model, loading = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                                  output_loading_info=True, **kwargs)
        finally:
            transformers_logging.set_verbosity(verbosity)
    absent = sorted(name for name in loading["missing_keys"] if not name.endswith(".bias"))
    if absent:
        raise UserError(f"{path} lacks tensors every LLaMA has ({', '.join(absent[:4])}); if it is truncated or "
                        "corrupt, download it again.")
    with torch.no_grad():
        for name in loading["missing_keys"]:
            model.get_parameter(name).zero_()
    return model


def read_gguf_contents(path: Path) -> GGUFContents:
    from gguf import GGUFReader  # optional (transformers' GGUF extra), needed only for a GGUF source

    reader = GGUFReader(path)
    prefix = "llama.rope.scaling."
    scaling = {key[len(prefix):]: reader.fields[key].contents() for key in reader.fields if key.startswith(prefix)}
    divisors = next((tuple(float(value) for value in tensor.data) for tensor in reader.tensors
                     if tensor.name == ROPE_DIVISORS), None)
    return GGUFContents(frozenset(tensor.name for tensor in reader.tensors), divisors, scaling)


def gguf_llama_config(config: LlamaConfig, contents: GGUFContents, where: str) -> LlamaConfig:
    """`config` (transformers' reading of the file) with the file's biases and RoPE scaling put back; raises
    UserError for a tensor or a scaling that a LLaMA config cannot hold."""
    names = contents.tensor_names
    blocks = range(config.num_hidden_layers)
    config.attention_bias = any(f"blk.{i}.{name}.bias" in names for i in blocks for name in ATTENTION_TENSORS)
    config.mlp_bias = any(f"blk.{i}.{name}.bias" in names for i in blocks for name in MLP_TENSORS)
    known = {"token_embd.weight", "output_norm.weight", "output.weight", ROPE_DIVISORS}
    known |= {f"blk.{i}.{name}.{kind}" for i in blocks for name in BLOCK_WEIGHTS for kind in ("weight", "bias")}
    unknown = sorted(names - known)
    if unknown:
        listed = ", ".join(unknown[:4]) + (f" and {len(unknown) - 4} more" if len(unknown) > 4 else "")
        raise UserError(f"{where} holds tensors a LLaMA does not have ({listed}), which transformers' GGUF reader "
                        f"would skip, so the model would lose them; {USE_TRANSFORMERS_CHECKPOINT}.")
    config.rope_parameters = {**config.rope_parameters, **_rope_scaling(config, contents, where)}
    return config


def _rope_scaling(config: LlamaConfig, contents: GGUFContents, where: str) -> dict:
    """The RoPE parameters the file states beyond `rope_theta`: llama3's from its divisors, or linear's."""
    kind = contents.rope_scaling.get("type", "none")
    if contents.rope_divisors is not None and any(divisor != 1.0 for divisor in contents.rope_divisors):
        if kind not in ("none", "llama3"):
            raise UserError(f"{where} scales RoPE twice (rope_freqs.weight and llama.rope.scaling.type {kind!r}); "
                            f"{USE_TRANSFORMERS_CHECKPOINT}.")
        return _llama3_parameters(config, contents.rope_divisors, where)
    if kind == "none":
        return {}
    if kind == "linear" and isinstance(factor := contents.rope_scaling.get("factor"), (int, float)):
        return {"rope_type": "linear", "factor": float(factor)}
    unreadable = f"{kind!r} without a factor" if kind == "linear" else repr(kind)
    raise UserError(f"{where} uses RoPE scaling {unreadable} (llama.rope.scaling.type), which diff-llama cannot read "
                    f"from a GGUF file; {USE_TRANSFORMERS_CHECKPOINT}.")


def _llama3_parameters(config: LlamaConfig, divisors: tuple, where: str) -> dict:
    """Llama 3's RoPE parameters that give `divisors`, checked against transformers' own llama3 frequencies."""
    theta = config.rope_parameters["rope_theta"]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    expected = torch.tensor([theta ** (-2 * i / head_dim) / divisor for i, divisor in enumerate(divisors)],
                            dtype=torch.float64)
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # a candidate that fails may fail transformers' checks too: unsaid
    try:
        for candidate in _llama3_candidates(divisors, [2 * math.pi * theta ** (2 * i / head_dim)
                                                       for i in range(len(divisors))]):
            parameters = {"rope_type": "llama3", **candidate}
            trial = copy.deepcopy(config)
            trial.rope_parameters = {**config.rope_parameters, **parameters}
            frequencies = LlamaRotaryEmbedding(config=trial).inv_freq.to(torch.float64)
            if torch.allclose(frequencies, expected, rtol=1e-5, atol=0):
                return parameters
    finally:
        transformers_logging.set_verbosity(verbosity)
    raise UserError(f"{where} scales RoPE by rope_freqs.weight in a way Llama 3's RoPE scaling does not reproduce; "
                    f"{USE_TRANSFORMERS_CHECKPOINT}.")


def _llama3_candidates(divisors: tuple, wavelengths: list):
    """Parameters that may give `divisors`: Meta's published ones, then ones fitted to the divisors.

    The divisors are 1 for wavelengths under `original / high`, `factor` over `original / low`, and between them
    `1 / ((1 - s) / factor + s)` with `s = (original / wavelength - low) / (high - low)`. Only the two edges matter,
    so `low = 1` loses nothing, and `s` is then linear in `original` and `high - 1`: two divisors between the edges
    fix both; with one or none, any edges around them do.
    """
    factor = max(divisors)
    yield {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    smooth = {wavelength: (1 / divisor - 1 / factor) / (1 - 1 / factor)
              for wavelength, divisor in zip(wavelengths, divisors) if 1 + 1e-6 < divisor < factor * (1 - 1e-6)}
    unscaled = [wavelength for wavelength, divisor in zip(wavelengths, divisors) if divisor <= 1 + 1e-6]
    scaled = [wavelength for wavelength, divisor in zip(wavelengths, divisors) if divisor >= factor * (1 - 1e-6)]
    if factor <= 1 or not scaled:
        return
    if len(smooth) >= 2:
        rows = torch.tensor([[1 / wavelength, -s] for wavelength, s in smooth.items()], dtype=torch.float64)
        original = round(torch.linalg.lstsq(rows, torch.ones(len(smooth), 1, dtype=torch.float64)).solution[0].item())
    elif smooth:
        original = round(math.sqrt(next(iter(smooth)) * min(scaled)))
    else:
        original = round(math.sqrt(max(unscaled, default=min(scaled) / 4) * min(scaled)))
    if smooth:  # high - 1 by least squares over (original / wavelength - 1) = s * (high - 1)
        high = 1 + sum(s * (original / wavelength - 1) for wavelength, s in smooth.items()) / sum(
            s * s for s in smooth.values())
    else:
        high = math.sqrt(original / max(unscaled, default=min(scaled) / 4))
    if original > 0 and high > 1:
        for value in (float(f"{high:.6g}"), high):
            yield {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": value,
                   "original_max_position_embeddings": original}
