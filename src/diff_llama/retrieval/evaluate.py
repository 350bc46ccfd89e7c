"""The evaluation loop: every case through each model in turn, plus held-out perplexity; `diff-llama evaluate`."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from diff_llama_cli.options import RetrievalArguments

from .cases import make_cases
from .report import markdown_report, write_report
from .scoring import map_kind, run_case
from .statistics import summarize


def display_name(name: str) -> str:
    if name == "smollm2":
        return "SmolLM2-135M-Instruct"
    return Path(name.rstrip("/")).name or name


def evaluate_model(model, tokenizer, options: RetrievalArguments, name: str = "model",
                   progress_file: str | Path | None = None) -> dict:
    """Retrieval and allocation of one loaded model on the cases `options` describe, plus held-out perplexity.
    With `progress_file`, every case's result is also appended to it as one JSON line as soon as it is known."""
    cases = make_cases(tokenizer, options)
    results = []
    started = time.perf_counter()
    for case in tqdm(cases, desc=f"evaluate {name}"):
        result = run_case(model, tokenizer, case, options.max_new_tokens, options.attention)
        results.append({
            "length": case.length, "prompt_tokens": len(case.input_ids), "num_needles": case.num_needles,
            "num_queries": case.num_queries, "depth": case.depth, "seed": case.seed,
            "expected": case.query_numbers, "answer_positions": [min(case.answer_positions),
                                                                 max(case.answer_positions)],
            **result,
        })
        if progress_file is not None:
            with open(progress_file, "a") as handle:
                handle.write(json.dumps({"model": name, **results[-1]}) + "\n")
    report = {"name": name, "model_type": model.config.model_type, "maps": map_kind(model),
              "dtype": str(model.dtype).removeprefix("torch."), "seconds": round(time.perf_counter() - started, 1),
              "cases": results}
    if options.perplexity_tokens > 0:
        from ..corpus import HELD_OUT_MODULES, stdlib_docstrings
        from ..evaluation import perplexity

        ids = tokenizer(stdlib_docstrings(HELD_OUT_MODULES), return_tensors="pt", add_special_tokens=False)
        report["perplexity"] = perplexity(model, ids.input_ids[0][: options.perplexity_tokens])
    report["summary"] = summarize(results)
    return report


def evaluate_models(models: list[str], options: RetrievalArguments, overwrite: bool = False) -> dict:
    """Evaluate every model (folder, .gguf, Hub id or 'smollm2') in turn; write and return the report.

    `options.output` must be new or empty (an earlier evaluation there would be lost), unless `overwrite`: then the
    new report is written beside it and replaces it when complete."""
    if options.threads > 0:
        torch.set_num_threads(options.threads)
    names = options.names or [display_name(m) for m in models]
    if len(names) != len(models):
        raise ValueError(f"{len(names)} names for {len(models)} models")
    from ..resolve import find_model, load_model

    for source in models:  # a missing model (or tokenizer) stops the run before its output folder is made
        find_model(source, tokenizer=True)
    from ..output_folder import new_output_folder

    report = {"options": asdict(options), "models": []}
    with new_output_folder(options.output, overwrite=overwrite) as folder:
        progress_file = folder / "cases.jsonl"  # results so far, for long runs
        for source, name in zip(models, names):
            model, tokenizer = load_model(source, options.dtype, options.device)
            entry = evaluate_model(model, tokenizer, options, name, progress_file=progress_file)
            entry["source"] = source
            report["models"].append(entry)
            del model
        write_report(report, folder)
    return report


def run_evaluate(models: list[str], options: RetrievalArguments, overwrite: bool = False) -> int:
    """`diff-llama evaluate MODEL [MODEL ...] [options]` (declared in `diff_llama_cli`)."""
    options.parsed_settings()  # a bad NxR fails before any model loads
    report = evaluate_models(models, options, overwrite=overwrite)
    print(markdown_report(report))
    print(f"Wrote {Path(options.output) / 'retrieval.json'}, retrieval.md, retrieval.png and cases.jsonl")
    return 0
