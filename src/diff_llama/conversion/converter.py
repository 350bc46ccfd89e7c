"""Convert a LLaMA checkpoint into a DiffLlama checkpoint, streaming one tensor (or one layer) at a time."""

import copy
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import configuration_diff_llama, modeling_diff_llama
from ..configuration_diff_llama import DiffLlamaConfig
from ..corpus import CALIBRATION_MODULES, HELD_OUT_MODULES, stdlib_docstrings
from ..modeling_diff_llama import lambda_init_fn
from .calibration import CalibrationSettings, LayerwiseRunner, fold_head_norm_gain, weight_only_head_norm_eps
from .errors import ConversionError
from ..model_card import write_model_card
from .head_layout import (
    HeadLayout,
    convert_attention_weights,
    expand_layout,
    gather_head_rows,
    permute_o_proj,
    split_layout,
    zero_lambda_vectors,
)
from .source import FLOAT_DTYPES, SAFETENSORS_DTYPES, TOKENIZER_FILES, LlamaSource, open_source
from .writer import AtomicOutputFolder, StreamingSafetensorsWriter

LAYER_TENSORS = (
    "input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
)
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
LAMBDA_VECTORS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
OUTPUT_LAYER_TENSORS = LAYER_TENSORS + tuple(f"self_attn.{name}" for name in LAMBDA_VECTORS)  # in write order


@dataclass
class ConversionOptions:
    """How to convert. The defaults give the most faithful model; see `diff-llama convert --help`."""

    head_layout: str = "expand"  # "expand": every LLaMA head gets its own differential head; "split": same width
    pad_odd_heads: bool = True  # "split" with odd H: add a KV group of zero heads (otherwise refuse)
    lambda_start: str = "zero"  # "zero": λ = 0 with non-zero gradient; "paper": N(0, lambda_std_dev) vectors
    calibration: str = "lstsq"  # "lstsq", "scale" or "none"
    calibration_text: str | None = None  # a file; None: the built-in text (standard-library docstrings)
    calibration_tokens: int = 8192
    head_norm_headroom: float = 0.01
    evaluate: bool = True
    eval_text: str | None = None  # a file; None: built-in held-out text
    eval_tokens: int = 2048
    seq_len: int = 512
    max_shard_bytes: int = 2 * 1024**3
    seed: int = 0


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

    def summary(self) -> str:
        lines = [
            f"Converted {self.source} -> {self.output} in {self.seconds:.0f} s",
            f"  heads: {self.source_num_attention_heads} query / {self.source_num_key_value_heads} KV (LLaMA) -> "
            f"{self.num_attention_heads} softmax maps = {self.num_attention_heads // 2} differential heads / "
            f"{self.num_key_value_heads} KV (layout {self.options['head_layout']})",
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


def make_layout(source_heads: int, source_kv_heads: int, options: ConversionOptions) -> HeadLayout:
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


def diff_config_for(source_config, layout: HeadLayout) -> DiffLlamaConfig:
    """The DiffLlama config of the converted model: the LLaMA's fields with the new head counts."""
    values = source_config.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "auto_map", "pretraining_tp", "_name_or_path",
                "quantization_config", "dtype"):
        values.pop(key, None)
    values.update(
        num_attention_heads=layout.num_heads,
        num_key_value_heads=layout.num_kv_heads,
        head_dim=source_config.head_dim,
        attention_dropout=0.0,
    )
    config = DiffLlamaConfig(**values)
    config.architectures = ["DiffLlamaForCausalLM"]
    config.dtype = getattr(source_config, "dtype", None)
    return config


def _expected_shapes(config) -> dict:
    hidden, head_dim = config.hidden_size, config.head_dim
    q_rows, kv_rows = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (config.intermediate_size, hidden),
        "mlp.up_proj.weight": (config.intermediate_size, hidden),
        "mlp.down_proj.weight": (hidden, config.intermediate_size),
        "self_attn.q_proj.weight": (q_rows, hidden),
        "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, q_rows),
    }


def check_source(source: LlamaSource) -> list[str]:
    """Every tensor the conversion needs exists with the shape the config implies; returns the plan (names)."""
    config = source.config
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ConversionError("LLaMA checkpoints with attention or MLP biases are not supported yet.")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ConversionError("the LLaMA's num_attention_heads is not a multiple of num_key_value_heads.")
    expected = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
                "model.norm.weight": (config.hidden_size,)}
    if not config.tie_word_embeddings:
        expected["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    for layer in range(config.num_hidden_layers):
        for name, shape in _expected_shapes(config).items():
            expected[f"model.layers.{layer}.{name}"] = shape
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
    target = AtomicOutputFolder(output, overwrite=overwrite)  # refuses an existing output before any work

    src = open_source(source)
    config = src.config
    names = check_source(src)
    layout = make_layout(config.num_attention_heads, config.num_key_value_heads, options)
    diff_config = diff_config_for(config, layout)
    out_dtype = src.get("model.norm.weight").dtype  # the converted model keeps the checkpoint's dtype

    calibrating = options.calibration != "none"
    # A folder's tokenizer files are copied as they are; loading the tokenizer costs time only worth paying when
    # text is encoded or the tokenizer lives inside a GGUF file.
    needs_tokenizer = calibrating or options.evaluate or src.description.endswith(".gguf")
    tokenizer = _load_tokenizer(src) if needs_tokenizer else None
    if (calibrating or options.evaluate) and tokenizer is None:
        raise ConversionError(
            f"{src.description} has no tokenizer, which calibration and evaluation need; add the tokenizer files or "
            "pass --calibration none --no-eval."
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
    settings = CalibrationSettings(method=options.calibration, head_norm_headroom=options.head_norm_headroom)

    total_bytes = sum(src.tensor_bytes(n) for n in names)
    layer_diagnostics = []
    head_norm_eps = []  # per layer, set by calibration
    with target as folder:
        writer = StreamingSafetensorsWriter(folder, write_plan(diff_config, out_dtype), options.max_shard_bytes)
        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="converting", disable=not progress)

        def progress(name):
            bar.update(src.tensor_bytes(name))

        def copy_tensor(name, keep=True):
            """Copy a tensor unchanged; as raw bytes when it need not be decoded (the fast path)."""
            shape, dtype = src.tensor_info(name)
            location = src.location(name)
            if not keep and location is not None and dtype == SAFETENSORS_DTYPES[out_dtype]:
                writer.add_bytes(name, shape, out_dtype, *location)
                tensor = None
            else:
                tensor = src.get(name)
                writer.add(name, tensor.to(out_dtype))
            progress(name)
            return tensor

        copy_tensor("model.embed_tokens.weight", keep=False)
        for layer in range(config.num_hidden_layers):
            prefix = f"model.layers.{layer}."
            if runner is None:  # nothing runs the model: stream, copying stored bytes wherever possible
                head_norm_eps.append(_stream_layer(src, writer, prefix, layer, layout, diff_config, options, out_dtype,
                                                   copy_tensor, progress) or config.rms_norm_eps)
                continue
            attention = {name: src.get(prefix + name) for name in LAYER_TENSORS if name.startswith("self_attn.")}
            new_attention = convert_attention_weights(
                *(attention[f"self_attn.{p}.weight"] for p in ATTENTION_PROJECTIONS), layout, config.head_dim
            )
            converted = {f"self_attn.{p}.weight": t for p, t in new_attention.items()}
            converted.update({f"self_attn.{n}": v for n, v in _lambda_vectors(layer, diff_config, options).items()})
            source_tensors = {**attention, **{n: src.get(prefix + n) for n in LAYER_TENSORS if n not in attention}}
            converted = {**source_tensors, **converted}
            eps = None if calibrating else _weight_only_calibration(converted, layer, options)
            source_layer, converted_layer = runner.build_layers(layer, source_tensors, converted)
            if not calibrating:
                converted_layer.self_attn.head_norm.eps = eps if eps is not None else config.rms_norm_eps
            else:
                diagnostics = runner.calibrate(source_layer, converted_layer, settings)  # sets the layer's eps
                layer_diagnostics.append({"layer": layer, **diagnostics})
                fitted = converted_layer.self_attn.o_proj.weight.detach()
                converted["self_attn.o_proj.weight"] = fitted.to(out_dtype)
                # continue the streams with exactly the weights that are written
                converted_layer.self_attn.o_proj.weight.data = converted["self_attn.o_proj.weight"].float()
            head_norm_eps.append(converted_layer.self_attn.head_norm.eps)
            runner.advance(source_layer, converted_layer)

            for name in OUTPUT_LAYER_TENSORS:
                writer.add(prefix + name, converted[name].to(out_dtype))
            bar.update(sum(t.numel() * t.element_size() for t in source_tensors.values()))

        evaluate = options.evaluate
        norm = copy_tensor("model.norm.weight", keep=evaluate)
        if config.tie_word_embeddings:
            lm_head = src.get("model.embed_tokens.weight") if evaluate else None
        else:
            lm_head = copy_tensor("lm_head.weight", keep=evaluate)
        writer.close()
        bar.close()
        quality = runner.quality(norm, lm_head, config.rms_norm_eps) if options.evaluate else {}

        if head_norm_eps and head_norm_eps != [config.rms_norm_eps] * len(head_norm_eps):
            diff_config.head_norm_eps = head_norm_eps
        diff_config.save_pretrained(folder)
        for module in (configuration_diff_llama, modeling_diff_llama):  # remote code next to the weights
            shutil.copyfile(module.__file__, folder / Path(module.__file__).name)
        _copy_side_files(src, folder, tokenizer)

        report = ConversionReport(
            source=src.description,
            output=str(Path(output).absolute()),
            options=asdict(options),
            num_attention_heads=layout.num_heads,
            num_key_value_heads=layout.num_kv_heads,
            source_num_attention_heads=config.num_attention_heads,
            source_num_key_value_heads=config.num_key_value_heads,
            seconds=time.perf_counter() - started,
            quality=quality,
            layers=layer_diagnostics,
        )
        (folder / "conversion_report.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
        write_model_card(folder, location=report.output)
    return report


def _weight_only_calibration(converted: dict, layer: int, options: ConversionOptions) -> float | None:
    """Without calibration text: the head-norm epsilon estimated from the weights, its gain folded into o_proj (in
    `converted`, in place). Returns the epsilon, None when `--head-norm-headroom 0` keeps rms_norm_eps."""
    eps = weight_only_head_norm_eps(converted["self_attn.v_proj.weight"], converted["input_layernorm.weight"],
                                    options.head_norm_headroom)
    if eps is not None:
        o_proj = converted["self_attn.o_proj.weight"]
        converted["self_attn.o_proj.weight"] = fold_head_norm_gain(o_proj.float(), eps, lambda_init_fn(layer)).to(o_proj.dtype)
    return eps


def _stream_layer(src, writer, prefix, layer, layout, diff_config, options, out_dtype, copy_tensor, progress):
    """Write one converted layer without running it: q/k/v are row-block gathers of the stored tensors (kernel
    copies), o_proj is permuted (and scaled, see `_weight_only_calibration`) in memory, everything else is copied
    unchanged. Returns the layer's head-norm epsilon (None: rms_norm_eps)."""
    head_dim, hidden = diff_config.head_dim, diff_config.hidden_size
    attention = {
        "self_attn.o_proj.weight": permute_o_proj(src.get(prefix + "self_attn.o_proj.weight"), layout, head_dim),
        "self_attn.v_proj.weight": gather_head_rows(src.get(prefix + "self_attn.v_proj.weight"), layout.kv_sources,
                                                    head_dim),
        "input_layernorm.weight": src.get(prefix + "input_layernorm.weight"),
    }
    eps = _weight_only_calibration(attention, layer, options)
    lambdas = _lambda_vectors(layer, diff_config, options)
    for name in OUTPUT_LAYER_TENSORS:
        full = prefix + name
        if name.startswith("self_attn.lambda"):
            writer.add(full, lambdas[name.removeprefix("self_attn.")].to(out_dtype))
        elif name == "self_attn.o_proj.weight":
            writer.add(full, attention["self_attn.o_proj.weight"].to(out_dtype))
            progress(full)
        elif name.startswith("self_attn."):
            sources = layout.query_sources if name.startswith("self_attn.q_proj") else layout.kv_sources
            shape, dtype = src.tensor_info(full)
            location = src.location(full)
            if location is not None and dtype == SAFETENSORS_DTYPES[out_dtype]:
                file, offset, length = location
                block_bytes = length // (shape[0] // head_dim)
                writer.add_row_blocks(full, (len(sources) * head_dim, hidden), out_dtype, file, offset, block_bytes,
                                      sources)
            else:
                writer.add(full, gather_head_rows(src.get(full), sources, head_dim).to(out_dtype))
            progress(full)
        else:
            copy_tensor(full, keep=False)
    return eps


def write_plan(config: DiffLlamaConfig, dtype: torch.dtype) -> list:
    """Every output tensor (name, shape, dtype) in the order the converter writes them."""
    hidden, head_dim = config.hidden_size, config.head_dim
    plan = [("model.embed_tokens.weight", (config.vocab_size, hidden), dtype)]
    layer_shapes = {**_expected_shapes(config), **{f"self_attn.{name}": (head_dim,) for name in LAMBDA_VECTORS}}
    for layer in range(config.num_hidden_layers):
        plan += [(f"model.layers.{layer}.{name}", layer_shapes[name], dtype) for name in OUTPUT_LAYER_TENSORS]
    plan.append(("model.norm.weight", (hidden,), dtype))
    if not config.tie_word_embeddings:
        plan.append(("lm_head.weight", (config.vocab_size, hidden), dtype))
    return plan


def _lambda_vectors(layer: int, config: DiffLlamaConfig, options: ConversionOptions) -> dict:
    if options.lambda_start == "zero":
        return zero_lambda_vectors(lambda_init_fn(layer), config.head_dim, seed=options.seed + layer)
    generator = torch.Generator().manual_seed(options.seed + layer)
    return {
        name: torch.randn(config.head_dim, generator=generator) * config.lambda_std_dev
        for name in LAMBDA_VECTORS
    }


def _copy_side_files(src: LlamaSource, folder: Path, tokenizer) -> None:
    """Tokenizer and generation config travel with the model."""
    if src.folder is not None and not src.description.endswith(".gguf"):
        for name in (*TOKENIZER_FILES, "generation_config.json"):
            if (src.folder / name).is_file():
                shutil.copyfile(src.folder / name, folder / name)
    elif tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if not (folder / "generation_config.json").exists():
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(src.config).save_pretrained(folder)
