"""The model card written next to a converted model, from the template in `model_cards/`."""

import json
from importlib import resources
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData


def write_conversion_card(folder: Path, report, config) -> ModelCard:
    options = report.options
    quality = report.quality
    card_data = ModelCardData(
        library_name="transformers",
        base_model=report.source if "/" in report.source and not Path(report.source).exists() else None,
        tags=["diff-llama", "differential-transformer", "llama", "text-generation"],
        pipeline_tag="text-generation",
    )
    fmt = lambda value: f"{value:.2f}" if isinstance(value, float) else "not measured"  # noqa: E731
    template = resources.files("diff_llama").joinpath("model_cards/converted_model.md").read_text()
    card = ModelCard.from_template(
        card_data,
        template_str=template,
        model_name=Path(report.output).name,
        base_model=report.source,
        eval_tokens=quality.get("eval_tokens", 0),
        eval_text=options["eval_text"] or "Python standard-library docstrings",
        source_perplexity=fmt(quality.get("source_perplexity")),
        converted_perplexity=fmt(quality.get("converted_perplexity")),
        ratio=fmt(quality["converted_perplexity"] / quality["source_perplexity"]) if quality else "n/a",
        kl=f"{quality['kl_source_to_converted']:.4f}" if quality else "not measured",
        source_heads=report.source_num_attention_heads,
        source_kv_heads=report.source_num_key_value_heads,
        heads=report.num_attention_heads,
        diff_heads=report.num_attention_heads // 2,
        kv_heads=report.num_key_value_heads,
        head_layout=options["head_layout"],
        lambda_start="0 (off the saddle point)" if options["lambda_start"] == "zero" else "the paper's initialisation",
        calibration=options["calibration"],
        calibration_text=options["calibration_text"] or "Python standard-library docstrings",
        repo_or_path=report.output,
        options_json=json.dumps(options, indent=2),
    )
    card.save(folder / "README.md")
    return card
