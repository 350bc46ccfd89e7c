"""The evaluation loop: every case through each model in turn, plus held-out perplexity; `diff-llama evaluate`."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import Interrupted, UserError
from ..options import RetrievalArguments, option_defaults
from ..resolve import uses_cpu_threads
from .cases import make_cases
from .report import markdown_report, write_report
from .scoring import map_kind, run_cases
from .statistics import summarize


def display_name(name: str) -> str:
    if name == "smollm2":
        return "SmolLM2-135M-Instruct"
    return Path(name.rstrip("/")).name or name


# Options an interrupted evaluation may change when it resumes: they do not change what is scored or how.
RESUMABLE_CHANGES = {"output", "threads"}


def case_fields(case) -> dict:
    """What identifies a case in its result (and in a line of cases.jsonl)."""
    return {"length": case.length, "prompt_tokens": len(case.input_ids), "num_needles": case.num_needles,
            "num_queries": case.num_queries, "depth": case.depth, "seed": case.seed, "expected": case.query_numbers,
            "answer_positions": [min(case.answer_positions), max(case.answer_positions)]}


def scored_cases(model, tokenizer, cases: list, max_new_tokens: int = 48, allocation: bool = True) -> list[dict]:
    """`run_cases` (one batch), each result with its case's fields, as retrieval.json and cases.jsonl hold it."""
    answers = run_cases(model, tokenizer, cases, max_new_tokens, allocation)
    return [{**case_fields(case), **result} for case, result in zip(cases, answers)]


def _kept_result(line: dict, case, name: str) -> dict:
    """A result of an interrupted run, checked to be the one of `case` for model `name`."""
    fields = json.loads(json.dumps(case_fields(case)))  # as read back from JSON
    if line.get("model") != name or any(line.get(key) != value for key, value in fields.items()):
        raise UserError(f"cases.jsonl holds other results than this run's (at {name}, {case.seed}): the models or "
                        "their tokenizers changed since it was interrupted; pass --overwrite to start over, or "
                        "choose a new folder.")
    return {key: value for key, value in line.items() if key != "model"}


def scored_in_batches(cases: list, batch_size: int, score, name: str, progress_file: str | Path | None = None,
                      **progress) -> list[dict]:
    """`score(batch)` of each batch of `batch_size` cases in turn, under a progress bar (tqdm's `progress` options),
    each result's "seconds" its share of its batch's; with `progress_file`, each batch's results are appended to it
    (a JSON line a case, with the model's `name`) as soon as they are known."""
    results = []
    with tqdm(**progress) as bar:
        for start in range(0, len(cases), batch_size):
            started = time.perf_counter()
            batch = score(cases[start:start + batch_size])
            seconds = round((time.perf_counter() - started) / len(batch), 3)
            for result in batch:
                result["seconds"] = seconds
            results += batch
            if progress_file is not None:
                with open(progress_file, "a") as handle:
                    handle.writelines(json.dumps({"model": name, **result}) + "\n" for result in batch)
            bar.update(len(batch))
    return results


def evaluate_model(model, tokenizer, options: RetrievalArguments, name: str = "model",
                   progress_file: str | Path | None = None, scored: list[dict] = ()) -> dict:
    """Retrieval and allocation of one loaded model on the cases `options` describe, plus held-out perplexity.
    With `progress_file`, every case's result is also appended to it as one JSON line as soon as it is known.
    `scored`: lines of an interrupted run's progress file; the first ones are this model's first results, kept
    instead of scored again."""
    cases = make_cases(tokenizer, options)
    results = [_kept_result(line, case, name) for line, case in zip(scored, cases)]
    started = time.perf_counter()
    results += scored_in_batches(
        cases[len(results):], options.batch_size,
        lambda batch: scored_cases(model, tokenizer, batch, options.max_new_tokens, options.attention), name,
        progress_file, desc=f"evaluate {name}", initial=len(results), total=len(cases))
    seconds = time.perf_counter() - started + sum(r.get("seconds", 0.0) for r in results[:len(scored)])
    report = {"name": name, "model_type": model.config.model_type, "maps": map_kind(model),
              "dtype": str(model.dtype).removeprefix("torch."), "seconds": round(seconds, 1), "cases": results}
    if options.perplexity_tokens > 0:
        from ..corpus import HELD_OUT_MODULES, stdlib_docstrings
        from ..evaluation import perplexity

        ids = tokenizer(stdlib_docstrings(HELD_OUT_MODULES), return_tensors="pt", add_special_tokens=False)
        report["perplexity"] = perplexity(model, ids.input_ids[0][: options.perplexity_tokens])
    report["summary"] = summarize(results)
    return report


def learns_positions(model, context: int) -> bool:
    """Whether `model` adds learned position embeddings (GPT-2's `wpe`): a table of `context` rows, which no position
    past them can read."""
    vocab = getattr(model.config, "vocab_size", None)
    return any(isinstance(module, torch.nn.Embedding) and module.num_embeddings in (context, context + 2)
               and module.num_embeddings != vocab for module in model.modules())


def refuse_past_learned_positions(model, lengths: list[int], name: str, option: str) -> None:
    """One line for lengths (of `option`) past the positions a model learned, which its forward cannot compute."""
    context = getattr(model.config, "max_position_embeddings", None)
    beyond = [length for length in lengths if context and length > context]
    if beyond and learns_positions(model, context):
        raise UserError(f"{name} learns its positions, up to {context} tokens (max_position_embeddings), and cannot "
                        f"read past them; {option} {' '.join(map(str, beyond))} run past that: give lengths of at most "
                        f"{context}.")


def warn_past_context(model, lengths: list[int], name: str, option: str = "--lengths") -> None:
    """Say so when a length runs past the context the model was configured for: its retrieval there measures
    extrapolation, which may be the point of the run, so this warns rather than refuses. A model that learns its
    positions cannot run there at all (an index error deep in its forward): refused in one line."""
    refuse_past_learned_positions(model, lengths, name, option)
    context = getattr(model.config, "max_position_embeddings", None)
    beyond = [length for length in lengths if context and length > context]
    if beyond:
        print(f"Warning: {name} has a context of {context} tokens (max_position_embeddings); --lengths "
              f"{' '.join(map(str, beyond))} run past it, so its results there measure extrapolation.",
              file=sys.stderr)


def run_description(models: list[str], names: list[str], options: RetrievalArguments) -> dict:
    """What an interrupted run must share with the rerun that resumes it (kept in the output folder's marker)."""
    return {"models": [str(Path(m).resolve()) if Path(m).exists() else m for m in models], "names": list(names),
            "options": {k: v for k, v in asdict(options).items() if k not in RESUMABLE_CHANGES}}


def _read_progress(progress_file: Path) -> list[dict]:
    """The complete lines of an interrupted run's cases.jsonl; a line cut short by the interruption (and anything
    after it) is cut off the file, to be scored again."""
    data = progress_file.read_bytes() if progress_file.exists() else b""
    lines, end = [], 0
    for raw in data.splitlines(keepends=True):
        try:
            if not raw.endswith(b"\n"):
                raise ValueError("cut short")
            lines.append(json.loads(raw))
        except ValueError:
            break
        end += len(raw)
    if end < len(data):
        os.truncate(progress_file, end)
    return lines


def interrupted_run(output: Path, run: dict, options_type: type = RetrievalArguments, command: str = "evaluate",
                    report_file: str = "retrieval.json") -> list[dict] | None:
    """The results so far of an interrupted run of `command` (evaluate, ruler) in `output` with the same models and
    options (`run`, its options of `options_type`), to resume; None when `output` holds no interrupted run of it (a
    finished one has its `report_file`). Refuses one with other models or options; an option the interrupted run did
    not record counts as its default."""
    from ..output_folder import read_marker

    marker = read_marker(output) if output.is_dir() else None
    if not marker or marker.get("command") != command or (output / report_file).exists():
        return None
    earlier = marker.get("run", {})
    earlier_options = {**option_defaults(options_type), **earlier.get("options", {})}
    pairs = [(earlier, run, ("models", "names")), (earlier_options, run["options"], run["options"])]
    differ = [f"{key} {then.get(key)!r}, not {now[key]!r}" for then, now, keys in pairs for key in keys
              if then.get(key) != now[key]]
    if differ:
        label = "evaluation" if command == "evaluate" else f"{command} run"
        raise UserError(f"{output} holds an interrupted {label} with other models or options "
                        f"({'; '.join(differ)}); pass the same ones to resume it, --overwrite to start over, or "
                        "choose a new folder.")
    return _read_progress(output / "cases.jsonl")


def scoring_interrupted(progress_file: Path, resumable: bool, output: Path) -> Interrupted:
    """Ctrl-C while evaluate or ruler scores cases: what was kept. A run writing its output in place resumes from
    its cases.jsonl; an --overwrite run writes beside the old output, which stays as it was."""
    if resumable:
        return Interrupted(f"the cases scored so far are kept in {progress_file}: run the same command again to resume")
    return Interrupted(f"{output} is left as it was")


@uses_cpu_threads
def evaluate_models(models: list[str], options: RetrievalArguments, overwrite: bool = False) -> dict:
    """Evaluate every model (folder, .gguf, Hub id or 'smollm2') in turn; write and return the report.

    `options.output` must be new or empty (an earlier evaluation there would be lost), or hold an interrupted
    evaluation of the same models with the same options, which this one resumes: the cases already in its
    cases.jsonl are kept, not scored again. With `overwrite`, an earlier run's folder is replaced instead: the new
    report is written beside it and replaces it when complete."""
    names = options.names or [display_name(m) for m in models]
    if len(names) != len(models):
        raise UserError(f"{len(names)} names for {len(models)} models; give one --names label per model.")
    from ..resolve import find_model, load_model, resolve_device

    device = resolve_device(options.device)  # a device this machine lacks, before its output folder is made
    for source in models:  # a missing model (or tokenizer) stops the run before its output folder is made
        find_model(source, tokenizer=True, adapters=True)
    from ..output_folder import new_output_folder

    output, run = Path(options.output), run_description(models, names, options)
    scored = None if overwrite else interrupted_run(output, run)
    if scored is not None:
        print(f"Resuming the interrupted evaluation in {output}: the {len(scored)} case(s) already scored in "
              "cases.jsonl are kept, not scored again.", file=sys.stderr)
    report = {"options": asdict(options), "device": device, "models": []}
    target = contextlib.nullcontext(output) if scored is not None else new_output_folder(
        output, overwrite=overwrite, command="evaluate", inputs=models, run=run)
    with target as folder:
        progress_file = folder / "cases.jsonl"  # results so far: an interrupted run resumes from them
        scored = scored or []
        try:
            for source, name in zip(models, names):
                model, tokenizer = load_model(source, options.dtype, device)
                warn_past_context(model, options.lengths, name)
                entry = evaluate_model(model, tokenizer, options, name, progress_file=progress_file, scored=scored)
                scored = scored[len(entry["cases"]):]
                entry["source"] = source
                report["models"].append(entry)
                del model
        except KeyboardInterrupt:
            raise scoring_interrupted(progress_file, resumable=folder == output, output=output) from None
        write_report(report, folder)
    return report


def run_evaluate(models: list[str], options: RetrievalArguments, overwrite: bool = False) -> int:
    """`diff-llama evaluate MODEL [MODEL ...] [options]` (declared in `diff_llama_cli`)."""
    options.parsed_settings()  # a bad NxR fails before any model loads
    report = evaluate_models(models, options, overwrite=overwrite)
    print(markdown_report(report))
    print(f"Wrote {Path(options.output) / 'retrieval.json'}, retrieval.md, retrieval.png and cases.jsonl")
    return 0
