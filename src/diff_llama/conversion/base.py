"""What every conversion version shares: the checkpoint's tensor schema, the output a layer is written to, and the
`VersionConversion` interface with the two loops that convert a layer (streamed, or in memory when the model runs).

A version (version1.py, version2.py) says only what differs: its head counts, the tensors it computes, where each
LLaMA head goes and what it calibrates. The loops here never branch on the version.
"""

import torch

from ..configuration_diff_llama import DiffLlamaConfig
from ..lambda_diff_llama import LAMBDA_VECTOR_NAMES
from .source import SAFETENSORS_DTYPES, LlamaSource
from .writer import StreamingSafetensorsWriter

# The checkpoint's tensor schema, in one place: the tensors of one LLaMA decoder layer in the order the converter
# writes them (shapes: `layer_shapes`), the biases a LLaMA's config may add (`llama_layer_tensors`), and what a
# converted layer adds after them. `checkpoint_schema` extends it to the whole model; a test checks it against the
# models' own state dicts.
LAYER_TENSORS = (
    "input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
)
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
ATTENTION_BIASES = tuple(f"self_attn.{projection}.bias" for projection in ATTENTION_PROJECTIONS)  # attention_bias
MLP_BIASES = ("mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias")  # mlp_bias
LAMBDA_VECTORS = tuple(f"self_attn.{name}" for name in LAMBDA_VECTOR_NAMES)  # version 1's λ, in write order
LAMBDA_PROJ = "self_attn.lambda_proj.weight"  # DIFF V2's λ


def layer_shapes(config) -> dict:
    """Shape of every tensor of one decoder layer (LLaMA's, and the λ vectors or DIFF V2 λ projection of a DiffLlama's)."""
    hidden, head_dim, intermediate = config.hidden_size, config.head_dim, config.intermediate_size
    q_rows, kv_rows = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (intermediate, hidden),
        "mlp.up_proj.weight": (intermediate, hidden),
        "mlp.down_proj.weight": (hidden, intermediate),
        "self_attn.q_proj.weight": (q_rows, hidden),
        "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, q_rows),
        **{name: (head_dim,) for name in LAMBDA_VECTORS},
        "self_attn.q_proj.bias": (q_rows,),
        "self_attn.k_proj.bias": (kv_rows,),
        "self_attn.v_proj.bias": (kv_rows,),
        "self_attn.o_proj.bias": (hidden,),
        "mlp.gate_proj.bias": (intermediate,),
        "mlp.up_proj.bias": (intermediate,),
        "mlp.down_proj.bias": (hidden,),
    }
    if getattr(config, "diff_version", 1) == 2:  # DIFF V2: o_proj reads the H/2 differential heads; a λ projection
        differential_heads = config.num_attention_heads // 2
        shapes.update({"self_attn.o_proj.weight": (hidden, differential_heads * head_dim),
                       LAMBDA_PROJ: (differential_heads, hidden)})
    return shapes


def llama_layer_tensors(config) -> tuple:
    """The names of one LLaMA decoder layer's tensors in write order: `LAYER_TENSORS`, then the biases its config
    has."""
    return (LAYER_TENSORS + (ATTENTION_BIASES if getattr(config, "attention_bias", False) else ())
            + (MLP_BIASES if getattr(config, "mlp_bias", False) else ()))


def checkpoint_schema(config, added_tensors: tuple = ()) -> dict:
    """name -> shape of every tensor of a checkpoint, in write order: the LLaMA's, or a converted model's with its
    version's `added_tensors` after each layer's LLaMA tensors. Tied embeddings store no lm_head."""
    shapes = layer_shapes(config)
    layer_tensors = llama_layer_tensors(config) + added_tensors
    schema = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size)}
    for layer in range(config.num_hidden_layers):
        schema.update({f"model.layers.{layer}.{name}": shapes[name] for name in layer_tensors})
    schema["model.norm.weight"] = (config.hidden_size,)
    if not config.tie_word_embeddings:
        schema["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return schema


def attention_projections(attention: dict) -> list:
    """A layer's q/k/v/o weights, in that order, from its tensors keyed by checkpoint name."""
    return [attention[f"self_attn.{projection}.weight"] for projection in ATTENTION_PROJECTIONS]


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
        """Write a q/k/v projection's weight or bias made of the source's head row blocks `sources` (None: a zero
        head), as kernel-side copies of the stored bytes where the dtype allows."""
        shape, dtype = self.src.tensor_info(name)
        location = self.src.location(name)
        if location is not None and dtype == SAFETENSORS_DTYPES[self.dtype]:
            file, offset, length = location
            block_bytes = length // (shape[0] // self.head_dim)
            self.writer.add_row_blocks(name, (len(sources) * self.head_dim, *shape[1:]), self.dtype, file, offset,
                                       block_bytes, sources)
        else:
            self.add(name, gather_head_rows(self.src.get(name), sources, self.head_dim))


def gather_head_rows(weight: torch.Tensor, sources, head_dim: int) -> torch.Tensor:
    """Rows of a q/k/v projection's weight or bias, head by head (source head index, or zero rows for None)."""
    blocks = weight.view(-1, head_dim, *weight.shape[1:])
    zero = torch.zeros_like(blocks[0])
    return torch.cat([zero if s is None else blocks[s] for s in sources], dim=0)


class VersionConversion:
    """What a version says about a conversion; the converter chooses one and then only calls its methods.

    `added_tensors`: what a converted layer adds after the LLaMA's tensors (`layer_tensors`: all of one converted
    layer's in write order); `query_sources` / `kv_sources`: the LLaMA head at each query / KV head position (None: a
    zero head); `calibrating`: whether it fits anything to text.
    """

    added_tensors: tuple
    query_sources: tuple
    kv_sources: tuple
    calibrating: bool = False

    def __init__(self, source_config, options):
        self.source_config, self.options = source_config, options
        self.source_tensors = llama_layer_tensors(source_config)
        self.layer_tensors = self.source_tensors + self.added_tensors
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

    def write_plan(self, dtype: torch.dtype) -> list:
        """Every output tensor (name, shape, dtype) in the order the converter writes them."""
        return [(name, shape, dtype) for name, shape in checkpoint_schema(self.config, self.added_tensors).items()]

    def streamed_tensors(self, layer: int, prefix: str, src: LlamaSource, dtype: torch.dtype) -> dict:
        """The tensors of a streamed layer that are computed rather than copied or gathered, keyed by checkpoint name
        (without the layer prefix)."""
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

    def stream_layer(self, layer: int, out: LayerOutput) -> None:
        """Write one converted layer without running it (no calibration, no evaluation): computed tensors from
        memory, q/k/v as gathered head blocks and everything else as copies of the stored bytes."""
        prefix = f"model.layers.{layer}."
        computed = self.streamed_tensors(layer, prefix, out.src, out.dtype)
        for name in self.layer_tensors:
            if name in computed:
                out.add(prefix + name, computed[name])
            elif name.startswith("self_attn.q_proj."):
                out.gather_heads(prefix + name, self.query_sources)
            elif name.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
                out.gather_heads(prefix + name, self.kv_sources)
            else:
                out.copy(prefix + name, keep=False)

    def run_layer(self, layer: int, out: LayerOutput, runner) -> dict | None:
        """Convert one layer in memory, fit it, push the runner's streams through it and write it; returns the
        layer's diagnostics, if any."""
        prefix = f"model.layers.{layer}."
        source_tensors = {name: out.src.get(prefix + name) for name in self.source_tensors}
        converted = {**source_tensors, **self.convert_attention(layer, source_tensors)}
        source_layer, converted_layer = runner.build_layers(layer, source_tensors, converted)
        diagnostics = self.fit_layer(layer, converted, runner, source_layer, converted_layer, out.dtype)
        runner.advance(source_layer, converted_layer)
        for name in self.layer_tensors:
            out.add(prefix + name, converted[name])
        return diagnostics
