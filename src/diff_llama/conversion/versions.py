"""What a conversion does to each layer, one class per differential-attention version.

`convert_llama_to_diff_llama` chooses one `VersionConversion` from `diff_version` and then only calls its methods:
which tensors a layer writes, what they become (streamed from the stored bytes, or in memory when the model runs for
calibration or evaluation), what is calibrated and what the config records. Neither version's route branches on the
other.
"""

import json
import shutil
from pathlib import Path

import torch

from ..configuration_diff_llama import DiffLlamaConfig
from ..lambda_diff_llama import LAMBDA_VECTOR_NAMES, lambda_init_fn
from .calibration import CalibrationSettings, fold_head_norm_gain, weight_only_head_norm_eps
from .diff_v2 import LAMBDA_PROJ, convert_attention_weights_v2, double_o_proj, paired_query_sources, zero_lambda_proj
from .head_layout import HeadLayout, convert_attention_weights, gather_head_rows, permute_o_proj, zero_lambda_vectors
from .source import SAFETENSORS_DTYPES, LlamaSource
from .writer import StreamingSafetensorsWriter

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


class LayerOutput:
    """Writes converted tensors from a source checkpoint, copying stored bytes wherever nothing changes them."""

    def __init__(self, src: LlamaSource, writer: StreamingSafetensorsWriter, dtype: torch.dtype, head_dim: int):
        self.src, self.writer, self.dtype, self.head_dim = src, writer, dtype, head_dim

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.writer.add(name, tensor.to(self.dtype))

    def copy(self, name: str, keep: bool = True) -> torch.Tensor | None:
        """Copy a tensor unchanged; as raw bytes when it need not be decoded (`keep=False`, the fast path)."""
        shape, dtype = self.src.tensor_info(name)
        location = self.src.location(name)
        if not keep and location is not None and dtype == SAFETENSORS_DTYPES[self.dtype]:
            self.writer.add_bytes(name, shape, self.dtype, *location)
            return None
        tensor = self.src.get(name)
        self.writer.add(name, tensor.to(self.dtype))
        return tensor

    def gather_heads(self, name: str, sources) -> None:
        """Write a q/k/v projection made of the source's head row blocks `sources` (None: a zero head), as kernel-side
        copies of the stored bytes where the dtype allows."""
        shape, dtype = self.src.tensor_info(name)
        location = self.src.location(name)
        if location is not None and dtype == SAFETENSORS_DTYPES[self.dtype]:
            file, offset, length = location
            block_bytes = length // (shape[0] // self.head_dim)
            self.writer.add_row_blocks(name, (len(sources) * self.head_dim, shape[1]), self.dtype, file, offset,
                                       block_bytes, sources)
        else:
            self.add(name, gather_head_rows(self.src.get(name), sources, self.head_dim))


class VersionConversion:
    """The common interface. `layer_tensors`: one converted layer's tensor names in write order (after the LLaMA's
    own, see `converter.LAYER_TENSORS`); `calibrating`: whether the conversion fits anything to calibration text."""

    layer_tensors: tuple
    calibrating: bool = False

    def __init__(self, source_config, options):
        self.source_config, self.options = source_config, options
        self.config = self.make_config()

    def heads(self) -> dict:
        """The converted config's head counts (and version)."""
        raise NotImplementedError

    def make_config(self) -> DiffLlamaConfig:
        """The LLaMA's config fields with the converted head counts."""
        values = self.source_config.to_dict()
        for key in ("model_type", "architectures", "transformers_version", "auto_map", "pretraining_tp", "_name_or_path",
                    "quantization_config", "dtype"):
            values.pop(key, None)
        values.update(self.heads(), head_dim=self.source_config.head_dim, attention_dropout=0.0)
        config = DiffLlamaConfig(**values)
        config.architectures = ["DiffLlamaForCausalLM"]
        config.dtype = getattr(self.source_config, "dtype", None)
        return config

    def stream_layer(self, layer: int, prefix: str, out: LayerOutput) -> None:
        """Write one converted layer without running it (no calibration, no evaluation)."""
        raise NotImplementedError

    def convert_attention(self, layer: int, attention: dict) -> dict:
        """A layer's converted attention tensors in memory, keyed by checkpoint name (without the layer prefix), from
        the LLaMA's (`attention`: name -> tensor, with input_layernorm.weight)."""
        raise NotImplementedError

    def fit_layer(self, layer: int, converted: dict, runner, source_layer, converted_layer,
                  dtype: torch.dtype) -> dict | None:
        """After the layer's modules are built: fit what this version calibrates (updating `converted` and
        `converted_layer` to the weights that are written). Returns the layer's diagnostics, if any."""
        return None

    def finish_config(self) -> None:
        """Record in `self.config` what the conversion set per layer."""


class DiffV2Conversion(VersionConversion):
    """DIFF V2, exact (see diff_v2.py): maps 2j and 2j+1 are LLaMA head j, λ = 0.5, o_proj doubled; nothing to fit."""

    def __init__(self, source_config, options):
        super().__init__(source_config, options)
        from .converter import LAYER_TENSORS

        self.layer_tensors = LAYER_TENSORS + (LAMBDA_PROJ,)
        self.query_sources = paired_query_sources(source_config.num_attention_heads)
        self.kv_sources = tuple(range(source_config.num_key_value_heads))

    def heads(self) -> dict:
        return dict(num_attention_heads=2 * self.source_config.num_attention_heads,
                    num_key_value_heads=self.source_config.num_key_value_heads, diff_version=2)

    def stream_layer(self, layer, prefix, out):
        for name in self.layer_tensors:
            full = prefix + name
            if name == LAMBDA_PROJ:
                out.add(full, zero_lambda_proj(self.config.num_attention_heads // 2, self.config.hidden_size,
                                               out.dtype))
            elif name == "self_attn.o_proj.weight":
                out.add(full, double_o_proj(out.src.get(full)))
            elif name == "self_attn.q_proj.weight":
                out.gather_heads(full, self.query_sources)
            elif name.startswith("self_attn."):
                out.gather_heads(full, self.kv_sources)
            else:
                out.copy(full, keep=False)

    def convert_attention(self, layer, attention):
        projections = [attention[f"self_attn.{p}.weight"] for p in ATTENTION_PROJECTIONS]
        converted = convert_attention_weights_v2(*projections, self.source_config.head_dim)
        return {f"self_attn.{name}.weight": tensor for name, tensor in converted.items()}


class DiffV1Conversion(VersionConversion):
    """The paper's differential attention: LLaMA heads placed by a head layout, λ vectors started at 0 (or the paper's
    initialisation), and the head norm absorbed by calibration on text (lstsq or scale) or estimated from the weights."""

    def __init__(self, source_config, options, layout: HeadLayout):
        self.layout = layout
        super().__init__(source_config, options)
        from .converter import OUTPUT_LAYER_TENSORS

        self.layer_tensors = OUTPUT_LAYER_TENSORS
        self.calibrating = options.calibration != "none"
        self.settings = CalibrationSettings(method=options.calibration, head_norm_headroom=options.head_norm_headroom)
        self.head_norm_eps = []  # per layer
        self._weight_only_eps = None  # of the layer in progress, without calibration text

    def heads(self) -> dict:
        return dict(num_attention_heads=self.layout.num_heads, num_key_value_heads=self.layout.num_kv_heads)

    def lambda_vectors(self, layer: int) -> dict:
        """The layer's four λ vectors, keyed by checkpoint name."""
        head_dim, seed = self.config.head_dim, self.options.seed + layer
        if self.options.lambda_start == "zero":
            vectors = zero_lambda_vectors(lambda_init_fn(layer), head_dim, seed=seed)
        else:
            generator = torch.Generator().manual_seed(seed)
            vectors = {name: torch.randn(head_dim, generator=generator) * self.config.lambda_std_dev
                       for name in LAMBDA_VECTOR_NAMES}
        return {f"self_attn.{name}": vector for name, vector in vectors.items()}

    def weight_only_calibration(self, converted: dict, layer: int) -> float | None:
        """Without calibration text: the head-norm epsilon estimated from the weights, its gain folded into o_proj (in
        `converted`, in place). Returns the epsilon, None when `--head-norm-headroom 0` keeps rms_norm_eps."""
        eps = weight_only_head_norm_eps(converted["self_attn.v_proj.weight"], converted["input_layernorm.weight"],
                                        self.options.head_norm_headroom)
        if eps is not None:
            o_proj = converted["self_attn.o_proj.weight"]
            converted["self_attn.o_proj.weight"] = fold_head_norm_gain(o_proj.float(), eps,
                                                                       lambda_init_fn(layer)).to(o_proj.dtype)
        return eps

    def stream_layer(self, layer, prefix, out):
        head_dim, layout = self.config.head_dim, self.layout
        attention = {
            "self_attn.o_proj.weight": permute_o_proj(out.src.get(prefix + "self_attn.o_proj.weight"), layout, head_dim),
            "self_attn.v_proj.weight": gather_head_rows(out.src.get(prefix + "self_attn.v_proj.weight"),
                                                        layout.kv_sources, head_dim),
            "input_layernorm.weight": out.src.get(prefix + "input_layernorm.weight"),
        }
        eps = self.weight_only_calibration(attention, layer)
        self.head_norm_eps.append(eps or self.source_config.rms_norm_eps)
        lambdas = self.lambda_vectors(layer)
        for name in self.layer_tensors:
            full = prefix + name
            if name in lambdas:
                out.add(full, lambdas[name])
            elif name == "self_attn.o_proj.weight":
                out.add(full, attention[name])
            elif name == "self_attn.q_proj.weight":
                out.gather_heads(full, layout.query_sources)
            elif name.startswith("self_attn."):
                out.gather_heads(full, layout.kv_sources)
            else:
                out.copy(full, keep=False)

    def convert_attention(self, layer, attention):
        projections = [attention[f"self_attn.{p}.weight"] for p in ATTENTION_PROJECTIONS]
        converted = {f"self_attn.{name}.weight": tensor for name, tensor in
                     convert_attention_weights(*projections, self.layout, self.source_config.head_dim).items()}
        converted.update(self.lambda_vectors(layer))
        self._weight_only_eps = None
        if not self.calibrating:  # folded into o_proj before the layer is built, so that it runs what is written
            work = {**converted, "input_layernorm.weight": attention["input_layernorm.weight"]}
            self._weight_only_eps = self.weight_only_calibration(work, layer)
            converted["self_attn.o_proj.weight"] = work["self_attn.o_proj.weight"]
        return converted

    def fit_layer(self, layer, converted, runner, source_layer, converted_layer, dtype):
        diagnostics = None
        if self.calibrating:
            diagnostics = {"layer": layer, **runner.calibrate(source_layer, converted_layer, self.settings)}
            fitted = converted_layer.self_attn.o_proj.weight.detach()
            converted["self_attn.o_proj.weight"] = fitted.to(dtype)
            # continue the streams with exactly the weights that are written
            converted_layer.self_attn.o_proj.weight.data = converted["self_attn.o_proj.weight"].float()
        else:
            eps = self._weight_only_eps
            converted_layer.self_attn.head_norm.eps = eps if eps is not None else self.source_config.rms_norm_eps
        self.head_norm_eps.append(converted_layer.self_attn.head_norm.eps)
        return diagnostics

    def finish_config(self) -> None:
        rms_norm_eps = self.source_config.rms_norm_eps
        if self.head_norm_eps and self.head_norm_eps != [rms_norm_eps] * len(self.head_norm_eps):
            self.config.head_norm_eps = self.head_norm_eps
