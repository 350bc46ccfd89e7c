"""`diff-llama ruler`: models compared on RULER's needle tasks (cases from `ruler_cases`), scored like `evaluate`'s
cases (greedy, with a cache, the first values the model states) and compared with the same paired McNemar test.

A case is right when every expected value is among the values the model states before it stops: generation ends at
the end of the answer, after `max_new_tokens`, or once the model has stated as many complete values (7-digit numbers,
UUIDs) as the case expects, so listing many values earns nothing. lm-eval's own RULER metric instead counts an expected
value anywhere in 128 generated tokens.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time
from pathlib import Path

import torch

from ..errors import UserError
from ..options import RulerOptions
from ..resolve import uses_cpu_threads
from .evaluate import (
    display_name,
    interrupted_run,
    run_description,
    scored_in_batches,
    scoring_interrupted,
    warn_past_context,
)
from .ruler_cases import build_ruler_cases, case_file_contents, read_case_file, ruler_prompt, write_case_file
from .scoring import greedy_answers
from .statistics import mean_or_none, paired_comparison

_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
VALUE_PATTERNS = {"numbers": re.compile(r"\d+"), "uuids": re.compile(_UUID, re.IGNORECASE)}
# A value is complete once a character that cannot continue it follows.
COMPLETE_VALUE_PATTERNS = {"numbers": re.compile(r"\d{7,}(?=\D)"),
                           "uuids": re.compile(_UUID + r"(?=[^0-9a-f])", re.IGNORECASE)}
_QUERY = re.compile(r" for (.+) mentioned in the provided text")


def queried_key(case: dict) -> str:
    """The key the case asks about (a word, or a UUID in niah_multikey_3), from the start of its answer."""
    found = _QUERY.search(case["gen_prefix"])
    return found[1].lower() if found else ""


def stated_values(text: str, case: dict, pattern=None) -> list[str]:
    """The values (numbers, UUIDs) in `text`, lower-cased, but for the queried key, which a model may repeat."""
    pattern = pattern or VALUE_PATTERNS[case["value_type"]]
    key = queried_key(case)
    return [value.lower() for value in pattern.findall(text) if value.lower() != key]


def score_ruler_output(text: str, case: dict) -> list[bool]:
    """For each expected value, whether the output states it (as a whole number or UUID)."""
    stated = set(stated_values(text, case))
    return [expected.lower() in stated for expected in case["outputs"]]


def run_ruler_case(model, tokenizer, case: dict, max_new_tokens: int = 128, chat_template: bool = True) -> dict:
    """One case's greedy answer and score."""
    return run_ruler_cases(model, tokenizer, [case], max_new_tokens, chat_template)[0]


def run_ruler_cases(model, tokenizer, cases: list[dict], max_new_tokens: int = 128, chat_template: bool = True,
                    lookahead: bool | None = None) -> list[dict]:
    """`run_ruler_case` for several cases in one batch (`greedy_answers`); "seconds" is the batch's share a case."""
    prompts = [ruler_prompt(tokenizer, case, chat_template) for case in cases]
    started = time.perf_counter()
    answers = greedy_answers(model, tokenizer, prompts, max_new_tokens, [_stated(case) for case in cases],
                             lookahead=lookahead)
    seconds = round((time.perf_counter() - started) / len(cases), 3)
    results = []
    for case, input_ids, (text, _) in zip(cases, prompts, answers):
        found = score_ruler_output(text, case)
        results.append({"id": case["id"], "task": case["task"], "length": case["length"],
                        "prompt_tokens": len(input_ids), "expected": case["outputs"], "output": text, "found": found,
                        "correct": all(found), "seconds": seconds})
    return results


def _stated(case: dict):
    complete, wanted = COMPLETE_VALUE_PATTERNS[case["value_type"]], len(case["outputs"])
    return lambda text: len(stated_values(text, case, complete)) >= wanted


def summarize_ruler(results: list[dict]) -> dict:
    """Accuracy in all, per (task, length), per task and per length."""
    def by(key):
        groups = {}
        for r in results:
            groups.setdefault(key(r), []).append(r["correct"])
        return {k: mean_or_none(v) for k, v in groups.items()}

    return {"accuracy": mean_or_none(r["correct"] for r in results),
            "accuracy_by_cell": by(lambda r: f"{r['task']}/{r['length']}"),
            "accuracy_by_task": by(lambda r: r["task"]), "accuracy_by_length": by(lambda r: str(r["length"]))}


def _kept(line: dict, case: dict, name: str) -> dict:
    """A result of an interrupted run, checked to be the one of `case` for model `name`."""
    if line.get("model") != name or line.get("id") != case["id"]:
        raise UserError(f"cases.jsonl holds other results than this run's (at {name}, {case['id']}); pass "
                        "--overwrite to start over, or choose a new folder.")
    return {key: value for key, value in line.items() if key != "model"}


def score_model(model, tokenizer, cases: list[dict], options: RulerOptions, name: str,
                progress_file: Path | None = None, scored: list[dict] = ()) -> dict:
    """Every case through one loaded model; each result is appended to `progress_file` as it is known. `scored`: an
    interrupted run's first results for this model, kept instead of scored again."""
    results = [_kept(line, case, name) for line, case in zip(scored, cases)]
    results += scored_in_batches(
        cases[len(results):], options.batch_size,
        lambda batch: run_ruler_cases(model, tokenizer, batch, options.max_new_tokens, options.chat_template), name,
        progress_file, desc=f"ruler {name}", initial=len(results), total=len(cases))
    return {"name": name, "model_type": model.config.model_type, "dtype": str(model.dtype).removeprefix("torch."),
            "seconds": round(sum(r["seconds"] for r in results), 1), "summary": summarize_ruler(results),
            "cases": results}


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def markdown_ruler_report(report: dict) -> str:
    """The accuracy table and, with two or more models, each model paired with the first on the same cases."""
    about, models = report["cases"], report["models"]
    lengths = [str(n) for n in about["lengths"]]
    lines = [f"RULER needle tasks ({about['generator']}; haystacks generated offline): {about['cases_per_cell']} "
             f"case(s) per task and length, seed {about['seed']}, sized with the tokenizer of {about['tokenizer']}; "
             "greedy; a case is right when the model states every expected value among its first answers; chat "
             f"template: {'yes' if report['options']['chat_template'] else 'no'}.", "",
             "| model | task | " + " | ".join(lengths) + " | all |", "|---|---|" + "---|" * (len(lengths) + 1)]
    for m in models:
        s = m["summary"]
        for task in about["tasks"]:
            cells = [s["accuracy_by_cell"].get(f"{task}/{n}") for n in lengths]
            lines.append(f"| {m['name']} | {task} | " + " | ".join(map(_pct, cells))
                         + f" | {_pct(s['accuracy_by_task'].get(task))} |")
        lines.append(f"| {m['name']} | all | " + " | ".join(_pct(s["accuracy_by_length"].get(n)) for n in lengths)
                     + f" | {_pct(s['accuracy'])} |")
    if len(models) > 1:
        lines += ["", "Paired on the same cases: cases only one of the two models got right, and the exact McNemar "
                  "p-value (two-sided; small means the difference is unlikely to be chance):", "",
                  "| first | second | task | length | both right | only first | only second | neither | p |",
                  "|---|---|---|---|---|---|---|---|---|"]
        subsets = [(task, n) for task in about["tasks"] for n in lengths] + [("all", n) for n in lengths]
        subsets.append(("all", "all"))
        first = models[0]
        for second in models[1:]:
            for task, n in subsets:
                def keep(c, task=task, n=n):
                    return task in ("all", c["task"]) and n in ("all", str(c["length"]))

                c = paired_comparison([x for x in first["cases"] if keep(x)], [x for x in second["cases"] if keep(x)],
                                      key="id")
                lines.append(f"| {first['name']} | {second['name']} | {task} | {n} | {c['both']} | "
                             f"{c['only_first']} | {c['only_second']} | {c['neither']} | {c['p_value']:.3f} |")
    return "\n".join(lines) + "\n"


def _case_contents(models: list[str], options: RulerOptions) -> dict:
    """The cases to score: those of --cases-file, or new ones sized with the first model's tokenizer."""
    if options.cases_file:
        return read_case_file(options.cases_file)
    from ..resolve import load_tokenizer

    tokenizer = load_tokenizer(models[0])
    cases = build_ruler_cases(tokenizer, options.tasks, options.lengths, options.cases, options.seed)
    return case_file_contents(cases, display_name(models[0]), options.tasks, options.lengths, options.cases,
                              options.seed)


@uses_cpu_threads
def ruler_models(models: list[str], options: RulerOptions, overwrite: bool = False) -> dict:
    """Build (or read) the cases, score every model on them in turn, and write ruler_cases.json, cases.jsonl,
    ruler.json and ruler.md into `options.output`; with `cases_only`, write ruler_cases.json alone. An interrupted
    run in `options.output` with the same models and options resumes, like `evaluate`'s."""
    names = options.names or [display_name(m) for m in models]
    if len(names) != len(models):
        raise UserError(f"{len(names)} names for {len(models)} models; give one --names label per model.")
    if options.cases_only and len(models) != 1:
        raise UserError(f"--cases-only sizes the cases with one model's tokenizer, and {len(models)} models were "
                        "given; give one.")
    from ..output_folder import new_output_folder
    from ..resolve import find_model, load_model, resolve_device

    device = resolve_device(options.device)  # a device this machine lacks, before its output folder is made
    for source in models:  # a missing model (or tokenizer) stops the run before its output folder is made
        find_model(source, tokenizer=True, adapters=True)
    if options.cases_file:
        read_case_file(options.cases_file)  # a bad file too
    output, run = Path(options.output), run_description(models, names, options)
    scored = None
    if not (overwrite or options.cases_only):
        scored = interrupted_run(output, run, RulerOptions, "ruler", "ruler.json")
    if scored is not None:
        print(f"Resuming the interrupted run in {output}: the {len(scored)} case(s) already scored in cases.jsonl are "
              "kept, not scored again.", file=sys.stderr)
    command = "ruler-cases" if options.cases_only else "ruler"
    target = contextlib.nullcontext(output) if scored is not None else new_output_folder(
        output, overwrite=overwrite, command=command, inputs=[*models, options.cases_file], run=run)
    with target as folder:
        case_path = folder / "ruler_cases.json"
        contents = read_case_file(case_path) if case_path.exists() else _case_contents(models, options)
        if not case_path.exists():
            write_case_file(contents, case_path)
        report = {"options": run["options"], "device": device,
                  "cases": {k: v for k, v in contents.items() if k != "cases"}, "models": []}
        if options.cases_only:
            return report
        progress_file, scored = folder / "cases.jsonl", scored or []
        try:
            for source, name in zip(models, names):
                model, tokenizer = load_model(source, options.dtype, device)
                warn_past_context(model, contents["lengths"], name)
                entry = score_model(model, tokenizer, contents["cases"], options, name, progress_file, scored)
                scored = scored[len(entry["cases"]):]
                report["models"].append({"source": source, **entry})
                del model
        except KeyboardInterrupt:
            raise scoring_interrupted(progress_file, resumable=folder == output, output=output) from None
        (folder / "ruler.md").write_text(markdown_ruler_report(report))
        (folder / "ruler.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def run_ruler(models: list[str], options: RulerOptions, overwrite: bool = False) -> int:
    """`diff-llama ruler MODEL [MODEL ...] [options]` (declared in `diff_llama_cli`)."""
    report = ruler_models(models, options, overwrite=overwrite)
    output = Path(options.output)
    if options.cases_only:
        about = report["cases"]
        print(f"Wrote {output / 'ruler_cases.json'}: {about['cases_per_cell']} case(s) for each of "
              f"{', '.join(about['tasks'])} at {', '.join(map(str, about['lengths']))} tokens; score them with "
              f"diff-llama ruler MODEL [MODEL ...] --cases-file {output / 'ruler_cases.json'}")
        return 0
    print(markdown_ruler_report(report))
    print(f"Wrote {output / 'ruler.json'}, ruler.md, ruler_cases.json and cases.jsonl")
    return 0
