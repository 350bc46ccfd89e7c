"""Convert a LLaMA checkpoint into a DiffLlama checkpoint, streaming one tensor (or one layer) at a time.

`convert_llama_to_diff_llama` is the whole route, read top to bottom: check the options, open and check the source
(source.py), choose the version once (version1.py or version2.py, both built on base.py), stream or calibrate the
layers into the output folder (writer.py, calibration.py), then write config, remote code, tokenizer, report and
model card. Each step finishes in its own module and returns here; none calls back into a module already left.
"""

import copy
import functools
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer, GenerationConfig
from transformers.utils.hub import convert_file_size_to_int

from .. import configuration_diff_llama
from ..configuration_diff_llama import DiffLlamaConfig
from ..corpus import CALIBRATION_MODULES, HELD_OUT_MODULES, read_text_file, stdlib_docstrings
from ..gguf_metadata import each_gguf_parsed_once, gguf_has_tokenizer
from ..model_card import write_model_card
from ..options import ConversionOptions
from ..output_folder import AtomicOutputFolder
from ..resolve import clean_tokenizer_config, has_tokenizer_files, save_tokenizer
from .base import LayerOutput, VersionConversion, checkpoint_schema
from .calibration import LayerwiseRunner
from .errors import ConversionError
from .source import (FLOAT_DTYPES, TORCH_DTYPES, LlamaSource, open_source, side_files, source_gguf_type,
                     source_license)
from .version1 import VERSION_1_OPTIONS, DiffV1Conversion, HeadLayout, make_layout
from .version2 import DiffV2Conversion
from .writer import StreamingSafetensorsWriter


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
    source_gguf_type: str | None = None  # a GGUF source's file type (Q4_1, F16, ...), for the model card

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
    check_options(options)
    # Refuses an output it may not replace (the source itself, or a folder holding it, among them) before any work.
    target = AtomicOutputFolder(output, overwrite=overwrite, inputs=[source], command="convert")

    with target as folder:  # entered first: whenever the run stops, the old output (if any) is as it was
        with each_gguf_parsed_once():  # a GGUF source: its config, weights, tokenizer and licence from one parse
            src = open_source(source)
            check_source(src)
            version = conversion_for(src.config, options)
            tokenizer = tokenizer_for(src, version, options)
            source_facts = {"source_license": source_license(src), "source_gguf_type": source_gguf_type(src)}
        runner = layerwise_runner(src, version, options, tokenizer)
        layer_diagnostics, quality = write_weights(src, version, options, runner, folder, progress)
        write_model_files(src, version, folder, tokenizer)
        report = ConversionReport(
            # A local source by its absolute path: `recover` reads it back from wherever it is run.
            source=str(Path(src.description).absolute()) if Path(src.description).exists() else src.description,
            output=str(Path(output).absolute()),
            options=asdict(options),
            num_attention_heads=version.config.num_attention_heads,
            num_key_value_heads=version.config.num_key_value_heads,
            source_num_attention_heads=src.config.num_attention_heads,
            source_num_key_value_heads=src.config.num_key_value_heads,
            seconds=time.perf_counter() - started,
            quality=quality,
            layers=layer_diagnostics,
            **source_facts,
        )
        (folder / "conversion_report.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
        write_model_card(folder, location=report.output)
    return report


def check_options(options: ConversionOptions) -> None:
    """Refuse unknown option values, and version 1 options on a DIFF V2 conversion (`--calibration none` is allowed:
    V2 never calibrates)."""
    if options.calibration not in ("lstsq", "scale", "none"):
        raise ConversionError(f"unknown calibration {options.calibration!r}; use lstsq, scale or none.")
    if options.lambda_start not in ("zero", "paper"):
        raise ConversionError(f"unknown lambda start {options.lambda_start!r}; use zero or paper.")
    if options.diff_version not in (1, 2):
        raise ConversionError(f"unknown diff version {options.diff_version!r}; use 1 (the paper's) or 2 (DIFF V2).")
    if options.seq_len < 1:
        raise ConversionError(f"--seq-len must be 1 or more tokens, not {options.seq_len}.")
    if options.head_norm_headroom < 0:
        raise ConversionError(f"--head-norm-headroom must be 0 (keep rms_norm_eps) or more, not "
                              f"{options.head_norm_headroom:g}.")
    try:
        shard_bytes = convert_file_size_to_int(options.max_shard_size)
    except ValueError:
        shard_bytes = None
    if not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise ConversionError(f"--max-shard-size {options.max_shard_size!r} is not a size: give a number with a unit, "
                              "such as 500MB or 5GB.")
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


def check_source(source: LlamaSource) -> None:
    """Every tensor the conversion needs exists with the shape the config implies, as floating-point numbers, and
    the checkpoint holds nothing else that carries weights."""
    config = source.config
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
    # A tensor the config does not account for would not reach the converted model: refused, not dropped. Old
    # checkpoints' rotary buffers hold nothing (recomputed from the config), and a tied model's stored lm_head is what
    # transformers ties away too.
    unused = sorted(name for name in names - set(expected)
                    if not name.endswith(".rotary_emb.inv_freq") and name != "lm_head.weight")
    if unused:
        raise ConversionError(
            f"the checkpoint holds {len(unused)} tensor(s) that a LLaMA of its config.json does not have, e.g. "
            f"{unused[0]}, and the converted model would lose them: config.json does not describe these weights "
            "(more layers than num_hidden_layers, or another architecture labelled llama); the converter takes "
            "LlamaForCausalLM checkpoints only."
        )


def conversion_for(source_config, options: ConversionOptions) -> VersionConversion:
    """The one place the diff version is looked at: the conversion of that version, for this LLaMA."""
    if options.diff_version == 2:
        return DiffV2Conversion(source_config, options)
    if getattr(source_config, "attention_bias", False) or getattr(source_config, "mlp_bias", False):
        raise ConversionError("this LLaMA has attention or MLP biases, which version 1's conversion does not take; "
                              "DIFF V2 (the default: drop --diff-version 1) converts it exactly.")
    layout = make_layout(source_config.num_attention_heads, source_config.num_key_value_heads, options)
    return DiffV1Conversion(source_config, options, layout)


def diff_config_for(source_config, layout: HeadLayout | None) -> DiffLlamaConfig:
    """The DiffLlama config of the converted model: the LLaMA's fields with the new head counts. `layout` None: DIFF
    V2, twice the LLaMA's query heads over its own KV heads."""
    if layout is None:
        return DiffV2Conversion(source_config, ConversionOptions()).config
    return DiffV1Conversion(source_config, ConversionOptions(diff_version=1), layout).config


def tokenizer_for(src: LlamaSource, version: VersionConversion, options: ConversionOptions):
    """The source's tokenizer where the conversion needs it loaded, else None.

    A folder's tokenizer files are copied as they are; loading the tokenizer costs time only worth paying when text is
    encoded or the tokenizer lives inside a GGUF file.
    """
    needs = {}  # what runs text -> the flag that turns it off
    if version.calibrating:
        needs["calibration"] = "--calibration none"
    if options.evaluate:
        needs["evaluation"] = "--no-evaluate"
    if not (needs or src.description.endswith(".gguf")):
        return None
    tokenizer = load_tokenizer(src)
    if needs and tokenizer is None:
        raise ConversionError(f"{src.description} has no tokenizer, which {' and '.join(needs)} "
                              f"{'need' if len(needs) > 1 else 'needs'}; add the tokenizer files or pass "
                              f"{' '.join(needs.values())}.")
    return tokenizer


def load_tokenizer(source: LlamaSource):
    """The source's tokenizer, or None where it has none: a folder without tokenizer files, a GGUF file without a
    vocabulary. A tokenizer that is there but fails to load is not a missing one: its error goes through."""
    if source.folder is None:
        return None
    if source.description.endswith(".gguf"):
        gguf_file = Path(source.description)
        if not gguf_has_tokenizer(gguf_file):
            return None
        return AutoTokenizer.from_pretrained(source.folder, gguf_file=gguf_file.name)
    if not has_tokenizer_files(source.folder):
        return None
    return AutoTokenizer.from_pretrained(source.folder)


def layerwise_runner(src: LlamaSource, version: VersionConversion, options: ConversionOptions,
                     tokenizer) -> LayerwiseRunner | None:
    """What runs the model layer by layer for calibration and evaluation; None when neither is asked for, and the
    conversion is pure streaming."""
    calibrating = version.calibrating
    if not (calibrating or options.evaluate):
        return None
    source_config = copy.deepcopy(src.config)
    source_config._attn_implementation = "sdpa"
    run_config = copy.deepcopy(version.config)
    run_config._attn_implementation = "sdpa"
    encode = lambda text: tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]  # noqa: E731
    return LayerwiseRunner(
        source_config,
        run_config,
        src.get("model.embed_tokens.weight"),
        encode(read_text(options.calibration_text, CALIBRATION_MODULES)) if calibrating else None,
        encode(read_text(options.eval_text, HELD_OUT_MODULES)) if options.evaluate else None,
        seq_len=options.seq_len,
        calibration_tokens=options.calibration_tokens,
        eval_tokens=options.eval_tokens,
    )


def read_text(path: str | None, default_modules) -> str:
    """A text file's contents, or the standard-library docstrings of `default_modules` when no file is given."""
    return stdlib_docstrings(default_modules) if path is None else read_text_file(path)


def output_dtype(src: LlamaSource) -> torch.dtype:
    """The converted model's dtype: the checkpoint's, or, for one stored in several (bf16 matrices beside float32
    norms), the narrowest that holds every tensor exactly; rounding any of them would make DIFF V2 inexact."""
    stored = {TORCH_DTYPES[src.tensor_info(name)[1]] for name in checkpoint_schema(src.config)}
    return functools.reduce(torch.promote_types, sorted(stored, key=str))


def write_weights(src: LlamaSource, version: VersionConversion, options: ConversionOptions,
                  runner: LayerwiseRunner | None, folder: Path, progress: bool) -> tuple[list, dict]:
    """Write every tensor of the converted model into `folder`, layer by layer; returns the layers' calibration
    diagnostics and the held-out quality report (empty without evaluation)."""
    config = src.config
    out_dtype = output_dtype(src)
    max_shard_bytes = convert_file_size_to_int(options.max_shard_size)
    writer = StreamingSafetensorsWriter(folder, version.write_plan(out_dtype), max_shard_bytes)
    out = LayerOutput(src, writer, out_dtype, config.head_dim)
    # Layers are the unit of work (calibration takes seconds per layer, streaming milliseconds): count them, ETA.
    # A context: a failure closes the bar before its error is printed, not across it.
    with tqdm(total=config.num_hidden_layers, unit="layer", disable=not progress,
              desc="converting and calibrating" if version.calibrating else "converting") as bar:
        layer_diagnostics = []
        out.copy("model.embed_tokens.weight", keep=False)
        for layer in range(config.num_hidden_layers):
            if runner is None:  # nothing runs the model: stream, copying stored bytes wherever possible
                version.stream_layer(layer, out)
            else:
                diagnostics = version.run_layer(layer, out, runner)
                if diagnostics is not None:
                    layer_diagnostics.append(diagnostics)
            bar.update(1)

    evaluate = options.evaluate
    norm = out.copy("model.norm.weight", keep=evaluate)
    if config.tie_word_embeddings:
        lm_head = src.get("model.embed_tokens.weight") if evaluate else None
    else:
        lm_head = out.copy("lm_head.weight", keep=evaluate)
    writer.close()
    quality = runner.quality(norm, lm_head, config.rms_norm_eps) if evaluate else {}
    return layer_diagnostics, quality


def write_model_files(src: LlamaSource, version: VersionConversion, folder: Path, tokenizer) -> None:
    """The config, the remote code next to the weights, and the source's tokenizer and generation config."""
    version.finish_config()
    version.config.save_pretrained(folder)
    for name in configuration_diff_llama.REMOTE_CODE_FILES:
        shutil.copyfile(Path(configuration_diff_llama.__file__).with_name(name), folder / name)
    _copy_side_files(src, folder, tokenizer)


def _copy_side_files(src: LlamaSource, folder: Path, tokenizer) -> None:
    """Tokenizer, licence texts and generation config travel with the model."""
    if src.folder is not None and not src.description.endswith(".gguf"):
        names = side_files(src.folder)
        if (src.folder / "generation_config.json").is_file():
            names.append(Path("generation_config.json"))
        for name in names:
            (folder / name).parent.mkdir(exist_ok=True)
            shutil.copyfile(src.folder / name, folder / name)
        clean_tokenizer_config(folder)
        _name_tokenizer_class(src, folder, tokenizer)
    elif tokenizer is not None:
        save_tokenizer(tokenizer, folder)
    if not (folder / "generation_config.json").exists():
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
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(src)
    if tokenizer is not None:
        config["tokenizer_class"] = type(tokenizer).__name__
        config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
