"""Does a freshly converted model fine-tune like its source? Measured on the real SmolLM2-135M-Instruct.

Converts the LLaMA (each conversion the converter offers: V1 with `--calibration lstsq` (the default), `scale` and
`none`; V2 `--diff-version 2` when this checkout has it), then runs the same short training on the source and on
every conversion, and reports held-out perplexity before and after:

- `diff-llama train` with its defaults (full fine-tuning, AdamW lr 5e-5, cosine schedule, λ at 1e-2),
- `diff-llama train --lora` with its defaults (LoRA r 16 on q/k/v/o, lr 2e-4, λ trained and saved in the adapter),
- a plain `transformers.Trainer` (its own AdamW, lr 5e-5, linear schedule: no diff-llama code),
- a plain PEFT LoRA (r 16, alpha 32 on q/k/v/o, Trainer's AdamW, lr 2e-4).

Same seed, same batches (4 x 256 tokens of Python standard-library docstrings that neither the calibration nor the
held-out text uses), same steps. Held-out perplexity: 2,048 tokens of the converter's held-out text, windows of
512 (the converter's own quality report). The requirement (issue 9): after the same steps, a conversion's perplexity
is within 1.05x of the source's.

Usage: python -m bench finetune_after_conversion [--steps 3] [--conversions lstsq,scale,none] [--work DIR]
(about 15 minutes on 2 CPU cores). Writes bench/results/finetune_after_conversion.md and .json.
"""

import argparse
import dataclasses
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import torch

import suite

BLOCK = 256
BATCH = 4
# Docstrings of modules that neither CALIBRATION_MODULES nor HELD_OUT_MODULES use.
TRAINING_TEXT_MODULES = ("os", "re", "datetime", "decimal", "fractions", "email.message", "http.client",
                         "urllib.request", "shutil", "tempfile", "csv", "sqlite3")
RECIPES = ("train", "train --lora", "Trainer", "PEFT LoRA")


def prepare_source(work: Path) -> Path:
    """SmolLM2-135M-Instruct dequantized into a float32 Transformers folder (the GGUF ships Q4_1)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from diff_llama.smollm2 import smollm2_gguf_path

    folder = work / "source"
    if (folder / "model.safetensors").is_file():
        return folder
    gguf = smollm2_gguf_path()
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    del quantized.config.quantization_config
    model = LlamaForCausalLM(quantized.config)  # a plain model: transformers refuses to save GGUF-loaded ones
    model.load_state_dict(quantized.state_dict())
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    return folder


def conversions(names: list[str]) -> list[tuple[str, dict]]:
    from diff_llama.conversion.converter import ConversionOptions

    fields = {f.name for f in dataclasses.fields(ConversionOptions)}
    variants = []
    for name in filter(None, names):
        if name == "v2":
            if "diff_version" in fields:
                variants.append(("V2 (--diff-version 2)", dict(diff_version=2)))
            else:
                print("this checkout has no --diff-version 2: V2 rows left out", flush=True)
        else:
            label = "V1 (defaults)" if name == "lstsq" else f"V1 --calibration {name}"
            variants.append((label, dict(diff_version=1, calibration=name)))
    return variants


def weight_scales(folder: Path) -> dict:
    """RMS of v_proj and o_proj over all layers: the conversion must keep them at the source's scale."""
    from safetensors import safe_open

    sums = {"v_proj": [0.0, 0], "o_proj": [0.0, 0]}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                for name in sums:
                    if key.endswith(f"self_attn.{name}.weight"):
                        t = f.get_tensor(key).double()
                        nonzero = t[t.abs().sum(1) > 0] if name == "v_proj" else t[:, t.abs().sum(0) > 0]
                        sums[name][0] += nonzero.pow(2).sum().item()
                        sums[name][1] += nonzero.numel()
    return {f"{name}_rms": math.sqrt(s / max(n, 1)) for name, (s, n) in sums.items()}


def held_out_perplexity(model, ids) -> float:
    from diff_llama.evaluation import perplexity

    return perplexity(model, ids, window=512)


def run_recipe(recipe: str, model_dir: Path, data_file: Path, out: Path, steps: int, held_out) -> float:
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, set_seed

    from diff_llama.training import FineTuneOptions, TokenBlocks, read_text, train

    if out.exists():
        shutil.rmtree(out)
    if recipe in ("train", "train --lora"):
        lora = recipe.endswith("--lora")
        train(str(model_dir), FineTuneOptions(data=str(data_file), output=str(out), lora=lora, max_steps=steps,
                                              save_steps=10**6))
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, out) if lora else AutoModelForCausalLM.from_pretrained(out)
    else:
        set_seed(0)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        learning_rate = 5e-5
        if recipe == "PEFT LoRA":
            model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
            learning_rate = 2e-4
        args = TrainingArguments(str(out), max_steps=steps, per_device_train_batch_size=BATCH,
                                 learning_rate=learning_rate, save_strategy="no", report_to="none", seed=0,
                                 logging_steps=1)
        Trainer(model=model, args=args, train_dataset=TokenBlocks(tokenizer, read_text(data_file), BLOCK)).train()
    result = held_out_perplexity(model, held_out)
    shutil.rmtree(out, ignore_errors=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--conversions", default="lstsq,scale,none,v2",
                        help="comma-separated: lstsq, scale, none (V1 calibrations), v2 (default: %(default)s)")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--work", help="folder for the models (default: a temporary one)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default %(default)s: on a shared 2-core machine one thread is faster)")
    parser.add_argument("--append", action="store_true",
                        help="add rows to the existing results (models already there are skipped), e.g. the V2 rows "
                        "from a checkout that has --diff-version 2")
    parser.add_argument("--output", default="finetune_after_conversion",
                        help="results name under bench/results, or a path (no suffix)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from diff_llama.conversion.converter import ConversionOptions, convert_llama_to_diff_llama
    from diff_llama.corpus import HELD_OUT_MODULES, stdlib_docstrings

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="diff-llama-finetune-"))
    work.mkdir(parents=True, exist_ok=True)
    source = prepare_source(work)
    tokenizer = AutoTokenizer.from_pretrained(source)
    data_file = work / "train.txt"
    data_file.write_text(stdlib_docstrings(TRAINING_TEXT_MODULES, exclude=stdlib_docstrings(HELD_OUT_MODULES)))
    held_out = tokenizer(stdlib_docstrings(HELD_OUT_MODULES), return_tensors="pt",
                         add_special_tokens=False).input_ids[0][: 2048 + 1]
    recipes = args.recipes.split(",")

    previous = json.loads(suite.result_path(args.output, ".json").read_text()) if args.append else None
    done = {row["model"] for row in previous["rows"]} if previous else set()
    seconds = {}
    models = [] if "source LLaMA" in done else [("source LLaMA", source, {}, {})]
    for label, overrides in conversions(args.conversions.split(",")):
        if label in done:
            continue
        folder = work / ("converted-" + "-".join(f"{k}-{v}" for k, v in overrides.items()))
        started = time.perf_counter()
        report = convert_llama_to_diff_llama(str(source), str(folder), ConversionOptions(**overrides), overwrite=True,
                                             progress=False)
        seconds[label] = time.perf_counter() - started
        print(report.summary(), flush=True)
        models.append((label, folder, overrides, report.quality))

    from transformers import AutoModelForCausalLM

    rows = previous["rows"] if previous else []
    for label, folder, overrides, quality in models:
        row = {"model": label, "options": overrides, **weight_scales(folder)}
        row["conversion_report_perplexity"] = quality.get("converted_perplexity")
        row["conversion_seconds"] = seconds.get(label)
        row["before"] = held_out_perplexity(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), held_out)
        for recipe in recipes:
            started = time.perf_counter()
            row[recipe] = run_recipe(recipe, folder, data_file, work / "run", args.steps, held_out)
            print(f"{label} | {recipe}: {row['before']:.2f} -> {row[recipe]:.2f} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
        rows.append(row)
        (work / "rows.json").write_text(json.dumps(rows, indent=2) + "\n")  # partial results, in case of a stop
    source_row = rows[0]
    for row in rows:
        row["before_x_source"] = row["before"] / source_row["before"]
        for recipe in recipes:
            row[f"{recipe} x source"] = row[recipe] / source_row[recipe]

    result = {"steps": args.steps, "batch": f"{BATCH} x {BLOCK} tokens", "threads": args.threads,
              "held_out_tokens": len(held_out) - 1, "recipes": recipes, "rows": rows}
    suite.write_result("finetune_after_conversion", args.output, result, render)


def render(result: dict) -> str:
    rows, steps = result["rows"], result["steps"]
    recipes = result.get("recipes") or [key for key in rows[0] if f"{key} x source" in rows[0]]
    lines = [
        f"SmolLM2-135M-Instruct: held-out perplexity (2,048 tokens) before and after {steps} training steps "
        f"({result['batch']} each, same seed and batches); in brackets: x the source LLaMA after the same "
        "recipe (required: at most 1.05).", "",
        "| model | v_proj rms | o_proj rms | before | " + " | ".join(recipes) + " |",
        "|---|---|---|---|" + "---|" * len(recipes),
    ]
    for row in rows:
        cells = [f"{row[r]:.2f} ({row[f'{r} x source']:.3f}x)" for r in recipes]
        lines.append(f"| {row['model']} | {row['v_proj_rms']:.4f} | {row['o_proj_rms']:.4f} | {row['before']:.2f} "
                     f"({row['before_x_source']:.3f}x) | " + " | ".join(cells) + " |")
    lines += ["", "Recipes: `train` = `diff-llama train MODEL DATA OUT --max-steps N` (defaults: AdamW lr 5e-5, cosine, "
              "λ lr 1e-2); `train --lora` = the same with `--lora` (lr 2e-4); `Trainer` = a plain "
              "`transformers.Trainer` with its own AdamW at lr 5e-5; `PEFT LoRA` = plain PEFT LoRA r 16 on q/k/v/o, "
              "Trainer's AdamW at lr 2e-4."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
