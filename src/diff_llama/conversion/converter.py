"""Convert a LLaMA checkpoint into a DiffLlama checkpoint, streaming one tensor (or one layer) at a time."""

import copy
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers.utils.hub import convert_file_size_to_int

from diff_llama_cli.options import ConversionOptions

from .. import configuration_diff_llama
from ..configuration_diff_llama import DiffLlamaConfig
from ..corpus import CALIBRATION_MODULES, HELD_OUT_MODULES, stdlib_docstrings
from ..lambda_diff_llama import LAMBDA_VECTOR_NAMES
from .calibration import LayerwiseRunner
from .diff_v2 import LAMBDA_PROJ
from .errors import ConversionError
from ..model_card import write_model_card
from ..resolve import clean_tokenizer_config, save_tokenizer
from .head_layout import HeadLayout, expand_layout, split_layout
from .source import FLOAT_DTYPES, TOKENIZER_FILES, LlamaSource, open_source, source_license
from .versions import DiffV1Conversion, DiffV2Conversion, LayerOutput, VersionConversion
from .writer import AtomicOutputFolder, StreamingSafetensorsWriter

# The checkpoint's tensor schema, in one place: the tensors of one LLaMA decoder layer in the order the converter
# writes them (shapes: `layer_shapes`), plus the λ vectors a converted layer adds. `checkpoint_schema` extends it to
# the whole model; a test checks it against the models' own state dicts.
LAYER_TENSORS = (
    "input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
)
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
LAMBDA_VECTORS = LAMBDA_VECTOR_NAMES
OUTPUT_LAYER_TENSORS = LAYER_TENSORS + tuple(f"self_attn.{name}" for name in LAMBDA_VECTORS)  # in write order
OUTPUT_LAYER_TENSORS_V2 = LAYER_TENSORS + (LAMBDA_PROJ,)


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
        **{f"self_attn.{name}": (head_dim,) for name in LAMBDA_VECTORS},
    }
    if getattr(config, "diff_version", 1) == 2:  # DIFF V2: o_proj reads the H/2 differential heads; a λ projection
        differential_heads = config.num_attention_heads // 2
        shapes.update({"self_attn.o_proj.weight": (hidden, differential_heads * head_dim),
                       LAMBDA_PROJ: (differential_heads, hidden)})
    return shapes


def checkpoint_schema(config, layer_tensors=LAYER_TENSORS) -> dict:
    """name -> shape of every tensor of a checkpoint, in write order: the LLaMA's with `LAYER_TENSORS`, the converted
    model's with `OUTPUT_LAYER_TENSORS`. Tied embeddings store no lm_head."""
    shapes = layer_shapes(config)
    schema = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size)}
    for layer in range(config.num_hidden_layers):
        schema.update({f"model.layers.{layer}.{name}": shapes[name] for name in layer_tensors})
    schema["model.norm.weight"] = (config.hidden_size,)
    if not config.tie_word_embeddings:
        schema["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return schema


# Options that shape only a version 1 conversion: given to a DIFF V2 conversion they would be silently ignored.
VERSION_1_OPTIONS = ("head_layout", "pad_odd_heads", "lambda_start", "calibration", "calibration_text",
                     "calibration_tokens", "head_norm_headroom")


def check_version_options(options: ConversionOptions) -> None:
    """Refuse version 1 options on a DIFF V2 conversion (`--calibration none` is allowed: V2 never calibrates)."""
    if options.diff_version != 2:
        return
    defaults = ConversionOptions()
    given = [name for name in VERSION_1_OPTIONS if getattr(options, name) != getattr(defaults, name)
             and not (name == "calibration" and options.calibration == "none")]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        verb, pronoun = ("applies", "it") if len(given) == 1 else ("apply", "them")
        raise ConversionError(f"{flags} only {verb} to a version 1 conversion, and DIFF V2 (--diff-version 2) is the "
                              f"default; add --diff-version 1, or drop {pronoun}.")


@dataclass
class ConversionReport:
    source: str
    output: str
    options: dict
    num_attention_heads: int
    num_key_value_heads: int
    source_num_attention_heads: int
    source_num_key_value_heads: int
    seconds: float
    quality: dict = field(default_factory=dict)
    layers: list = field(default_factory=list)
    source_license: dict = field(default_factory=dict)  # model-card licence metadata of the source, when it states one

    def summary(self) -> str:
        how = (
            "DIFF V2, exact: maps 2j and 2j+1 are LLaMA head j, λ = 0.5, o_proj doubled"
            if self.options.get("diff_version", 1) == 2
            else f"version 1, layout {self.options['head_layout']}"
        )
        lines = [
            f"Converted {self.source} -> {self.output} in {self.seconds:.0f} s",
            f"  heads: {self.source_num_attention_heads} query / {self.source_num_key_value_heads} KV (LLaMA) -> "
            f"{self.num_attention_heads} softmax maps = {self.num_attention_heads // 2} differential heads / "
            f"{self.num_key_value_heads} KV ({how})",
        ]
        q = self.quality
        if q:
            ratio = q["converted_perplexity"] / q["source_perplexity"]
            lines += [
                f"  held-out perplexity ({q['eval_tokens']} tokens): source {q['source_perplexity']:.2f}, "
                f"converted {q['converted_perplexity']:.2f} ({ratio:.3f}x)",
                f"  KL(source || converted): {q['kl_source_to_converted']:.4f} nats/token",
            ]
        return "\n".join(lines)


def make_layout(source_heads: int, source_kv_heads: int, options: ConversionOptions) -> HeadLayout | None:
    """Version 1's head layout; None for DIFF V2, whose layout is fixed (see diff_v2.py)."""
    if options.diff_version == 2:
        return None
    if options.head_layout == "expand":
        layout = expand_layout(source_heads, source_kv_heads)
    elif options.head_layout == "split":
        if source_heads % 2 and not options.pad_odd_heads:
            raise ConversionError(
                f"the LLaMA has an odd number of query heads ({source_heads}), which cannot be split into pairs; "
                "allow padding with a zero KV group (drop --no-pad-odd-heads) or use --head-layout expand."
            )
        layout = split_layout(source_heads, source_kv_heads)
    else:
        raise ConversionError(f"unknown head layout {options.head_layout!r}; use 'expand' or 'split'.")
    layout.validate(source_heads, source_kv_heads)
    return layout


def conversion_for(source_config, options: ConversionOptions) -> VersionConversion:
    """The one place the diff version is looked at: the conversion of that version, for this LLaMA."""
    if options.diff_version == 2:
        return DiffV2Conversion(source_config, options)
    layout = make_layout(source_config.num_attention_heads, source_config.num_key_value_heads, options)
    return DiffV1Conversion(source_config, options, layout)


def diff_config_for(source_config, layout: HeadLayout | None) -> DiffLlamaConfig:
    """The DiffLlama config of the converted model: the LLaMA's fields with the new head counts. `layout` None: DIFF
    V2, twice the LLaMA's query heads over its own KV heads."""
    if layout is None:
        return DiffV2Conversion(source_config, ConversionOptions()).config
    return DiffV1Conversion(source_config, ConversionOptions(diff_version=1), layout).config

def check_source(source: LlamaSource) -> list[str]:
    """Every tensor the conversion needs exists with the shape the config implies; returns the plan (names)."""
    config = source.config
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ConversionError("LLaMA checkpoints with attention or MLP biases are not supported yet.")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ConversionError("the LLaMA's num_attention_heads is not a multiple of num_key_value_heads.")
    expected = checkpoint_schema(config)
    names = set(source.tensor_names())
    missing = sorted(set(expected) - names)
    if missing:
        raise ConversionError(
            f"the checkpoint lacks {len(missing)} tensor(s) its config requires, e.g. {missing[0]}; "
            "the download is incomplete or config.json does not belong to these weights."
        )
    for name, shape in expected.items():
        actual, dtype = source.tensor_info(name)
        if actual != shape:
            raise ConversionError(
                f"{name} has shape {actual} but config.json implies {shape}; the weights and config do not match."
            )
        if dtype not in FLOAT_DTYPES:
            raise ConversionError(
                f"{name} is stored as {dtype}; the converter needs floating-point weights (F32, F16, BF16). "
                "Dequantize the checkpoint first."
            )
    return sorted(expected)


def _load_tokenizer(source: LlamaSource):
    from transformers import AutoTokenizer

    if source.folder is None:
        return None
    kwargs = {"gguf_file": Path(source.description).name} if source.description.endswith(".gguf") else {}
    try:
        return AutoTokenizer.from_pretrained(source.folder, **kwargs)
    except Exception:
        return None


def _read_text(path: str | None, default_modules) -> str:
    if path is None:
        return stdlib_docstrings(default_modules)
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ConversionError(f"cannot read text file {path} ({error.strerror}).") from None


def convert_llama_to_diff_llama(
    source: str,
    output: str,
    options: ConversionOptions | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> ConversionReport:
    """Convert the LLaMA at `source` (folder, .gguf file or Hub id) into a DiffLlama folder at `output`.

    The input is never modified; `output` appears only once complete (it is written beside it under a hidden
    temporary name and renamed).
    """
    options = options or ConversionOptions()
    started = time.perf_counter()
    if options.calibration not in ("lstsq", "scale", "none"):
        raise ConversionError(f"unknown calibration {options.calibration!r}; use lstsq, scale or none.")
    if options.lambda_start not in ("zero", "paper"):
        raise ConversionError(f"unknown lambda start {options.lambda_start!r}; use zero or paper.")
    if options.diff_version not in (1, 2):
        raise ConversionError(f"unknown diff version {options.diff_version!r}; use 1 (the paper's) or 2 (DIFF V2).")
    check_version_options(options)
    target = AtomicOutputFolder(output, overwrite=overwrite)  # refuses an existing output before any work

    src = open_source(source)
    config = src.config
    names = check_source(src)
    version = conversion_for(config, options)
    diff_config = version.config
    out_dtype = src.get("model.norm.weight").dtype  # the converted model keeps the checkpoint's dtype

    calibrating = version.calibrating
    # A folder's tokenizer files are copied as they are; loading the tokenizer costs time only worth paying when
    # text is encoded or the tokenizer lives inside a GGUF file.
    needs_tokenizer = calibrating or options.evaluate or src.description.endswith(".gguf")
    tokenizer = _load_tokenizer(src) if needs_tokenizer else None
    if (calibrating or options.evaluate) and tokenizer is None:
        raise ConversionError(
            f"{src.description} has no tokenizer, which calibration and evaluation need; add the tokenizer files or "
            "pass --calibration none --no-evaluate."
        )
    runner = None  # without calibration and evaluation nothing runs the model: pure streaming
    if calibrating or options.evaluate:
        source_config = copy.deepcopy(config)
        source_config._attn_implementation = "sdpa"
        run_config = copy.deepcopy(diff_config)
        run_config._attn_implementation = "sdpa"
        encode = lambda text: tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]  # noqa: E731
        runner = LayerwiseRunner(
            source_config,
            run_config,
            src.get("model.embed_tokens.weight"),
            encode(_read_text(options.calibration_text, CALIBRATION_MODULES)) if calibrating else None,
            encode(_read_text(options.eval_text, HELD_OUT_MODULES)) if options.evaluate else None,
            seq_len=options.seq_len,
            calibration_tokens=options.calibration_tokens,
            eval_tokens=options.eval_tokens,
        )

    layer_diagnostics = []
    with target as folder:
        max_shard_bytes = convert_file_size_to_int(options.max_shard_size)
        writer = StreamingSafetensorsWriter(folder, write_plan(diff_config, out_dtype), max_shard_bytes)
        out = LayerOutput(src, writer, out_dtype, config.head_dim)
        # Layers are the unit of work (calibration takes seconds per layer, streaming milliseconds): count them, ETA.
        bar = tqdm(total=config.num_hidden_layers, unit="layer", disable=not progress,
                   desc="converting and calibrating" if calibrating else "converting")

        out.copy("model.embed_tokens.weight", keep=False)
        for layer in range(config.num_hidden_layers):
            prefix = f"model.layers.{layer}."
            if runner is None:  # nothing runs the model: stream, copying stored bytes wherever possible
                version.stream_layer(layer, prefix, out)
            else:
                source_tensors = {name: src.get(prefix + name) for name in LAYER_TENSORS}
                converted = {**source_tensors, **version.convert_attention(layer, source_tensors)}
                source_layer, converted_layer = runner.build_layers(layer, source_tensors, converted)
                diagnostics = version.fit_layer(layer, converted, runner, source_layer, converted_layer, out_dtype)
                if diagnostics is not None:
                    layer_diagnostics.append(diagnostics)
                runner.advance(source_layer, converted_layer)
                for name in version.layer_tensors:
                    out.add(prefix + name, converted[name])
            bar.update(1)

        evaluate = options.evaluate
        norm = out.copy("model.norm.weight", keep=evaluate)
        if config.tie_word_embeddings:
            lm_head = src.get("model.embed_tokens.weight") if evaluate else None
        else:
            lm_head = out.copy("lm_head.weight", keep=evaluate)
        writer.close()
        bar.close()
        quality = runner.quality(norm, lm_head, config.rms_norm_eps) if options.evaluate else {}

        version.finish_config()
        diff_config.save_pretrained(folder)
        for name in configuration_diff_llama.REMOTE_CODE_FILES:  # remote code next to the weights
            shutil.copyfile(Path(configuration_diff_llama.__file__).with_name(name), folder / name)
        _copy_side_files(src, folder, tokenizer)

        report = ConversionReport(
            source=src.description,
            output=str(Path(output).absolute()),
            options=asdict(options),
            num_attention_heads=diff_config.num_attention_heads,
            num_key_value_heads=diff_config.num_key_value_heads,
            source_num_attention_heads=config.num_attention_heads,
            source_num_key_value_heads=config.num_key_value_heads,
            seconds=time.perf_counter() - started,
            quality=quality,
            layers=layer_diagnostics,
            source_license=source_license(src),
        )
        (folder / "conversion_report.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
        write_model_card(folder, location=report.output)
    return report


def write_plan(config: DiffLlamaConfig, dtype: torch.dtype) -> list:
    """Every output tensor (name, shape, dtype) in the order the converter writes them."""
    layer_tensors = OUTPUT_LAYER_TENSORS_V2 if config.diff_version == 2 else OUTPUT_LAYER_TENSORS
    return [(name, shape, dtype) for name, shape in checkpoint_schema(config, layer_tensors).items()]


def _copy_side_files(src: LlamaSource, folder: Path, tokenizer) -> None:
    """Tokenizer and generation config travel with the model."""
    if src.folder is not None and not src.description.endswith(".gguf"):
        for name in (*TOKENIZER_FILES, "generation_config.json"):
            if (src.folder / name).is_file():
                shutil.copyfile(src.folder / name, folder / name)
        clean_tokenizer_config(folder)
        _name_tokenizer_class(src, folder, tokenizer)
    elif tokenizer is not None:
        save_tokenizer(tokenizer, folder)
    if not (folder / "generation_config.json").exists():
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(src.config).save_pretrained(folder)


def _name_tokenizer_class(src: LlamaSource, folder: Path, tokenizer) -> None:
    """Write the source's tokenizer class into a copied tokenizer_config.json that names none.

    Without `tokenizer_class`, AutoTokenizer picks the class from config.json's model_type: the source's `llama`
    chose its tokenizer, the converted folder's `diff_llama` is unknown to transformers and would choose another (or
    none). Naming the class the source actually loads as keeps the converted tokenizer the source's.
    """
    config_file = folder / "tokenizer_config.json"
    if not config_file.is_file():
        return
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if config.get("tokenizer_class"):
        return
    tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(src)
    if tokenizer is not None:
        config["tokenizer_class"] = type(tokenizer).__name__
        config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
