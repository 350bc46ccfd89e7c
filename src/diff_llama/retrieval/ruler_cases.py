"""RULER's needle-in-a-haystack cases (Hsieh et al. 2024, arXiv 2404.06654), built by lm-eval's own RULER code: a
second case generator, independent of `cases.py`, for the same scoring and paired tests.

Only the tasks whose haystack lm-eval generates are offered (`options.RULER_OFFLINE_TASKS`): `niah_single_1` hides
one needle in a repeated paragraph, `niah_multikey_2` (numbers) and `niah_multikey_3` (UUIDs) among needle-shaped
distractors with other keys. The other needle tasks need Paul Graham's essays from the Hugging Face Hub.

A case is text (RULER's prompt and the start of the answer), so it is built once with one tokenizer, which sizes it
to its length, saved as `ruler_cases.json`, and scored later, elsewhere, by any model (`diff-llama ruler
--cases-file`).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import random
from pathlib import Path

from ..errors import UserError

# How lm-eval's niah_utils builds each offline task (tests/test_ruler.py checks it against lm-eval's own functions).
TASK_PARAMETERS = {
    "niah_single_1": dict(type_haystack="repeat", type_needle_k="words", type_needle_v="numbers"),
    "niah_multikey_2": dict(type_haystack="needle", type_needle_k="words", type_needle_v="numbers"),
    "niah_multikey_3": dict(type_haystack="needle", type_needle_k="uuids", type_needle_v="uuids"),
}

FORMAT = "diff-llama RULER cases 1"
INSTALL_HINT = "pip install 'diff-llama[ruler]' (lm-eval with its RULER extra: wonderwords, nltk)"


def lm_eval_ruler():
    """lm-eval's RULER modules (`niah_utils`, `prepare_niah`), imported without their attempt to download nltk's
    sentence splitter, which only the essay haystacks use and which an offline machine cannot fetch."""
    try:
        import nltk
        import wonderwords  # noqa: F401
        from lm_eval import __version__  # noqa: F401
    except ImportError as error:
        raise UserError(f"RULER cases are built by lm-eval's RULER code, which is not installed ({error.name}); "
                        f"{INSTALL_HINT}.") from None
    download = nltk.download
    nltk.download = lambda *args, **kwargs: False
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its message that it downloaded what it did not
            from lm_eval.tasks.ruler import niah_utils, prepare_niah
    finally:
        nltk.download = download
    return niah_utils, prepare_niah


def lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def build_cell(tokenizer, task: str, length: int, count: int, seed: int) -> list[dict]:
    """`count` cases of `task` at `length` tokens: the first `count` of what lm-eval's task builds after
    `random.seed(seed)`, so with seed 0 (lm-eval's default) the very cases `lm_eval --tasks TASK --metadata
    '{"max_seq_lengths":[LENGTH]}'` scores. Python's random state is left as it was."""
    niah_utils, prepare_niah = lm_eval_ruler()
    parameters = TASK_PARAMETERS[task]
    state = random.getstate()
    random.seed(seed)  # lm-eval's generator draws from the global random module
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # its progress bar, once per cell
            samples = prepare_niah.generate_samples(
                prepare_niah.get_haystack(type_haystack=parameters["type_haystack"]), max_seq_length=length,
                template=niah_utils.TEMPLATE, num_samples=count, TOKENIZER=tokenizer, **parameters)
    except ValueError as error:  # lm-eval's: the length cannot hold the prompt and the answer
        # Its advice names its own parameter (max_seq_lengths); the option here is --lengths.
        reason = " ".join(str(error).split()).split(" Raise ")[0].rstrip(".")
        raise UserError(f"{task} at {length} tokens: {reason}; give a longer --lengths, or drop {task} from "
                        "--tasks.") from None
    finally:
        random.setstate(state)
    return [{"id": f"{task}/{length}/{sample['index']}", "task": task, "length": length, "index": sample["index"],
             "value_type": parameters["type_needle_v"], "input": sample["input"], "gen_prefix": sample["gen_prefix"],
             "outputs": list(sample["outputs"])} for sample in samples]


def build_ruler_cases(tokenizer, tasks, lengths, count: int, seed: int = 0) -> list[dict]:
    """Every (task, length) cell's cases, task by task."""
    return [case for task in tasks for length in lengths for case in build_cell(tokenizer, task, length, count, seed)]


def case_file_contents(cases: list[dict], tokenizer_source: str, tasks, lengths, count: int, seed: int) -> dict:
    return {"format": FORMAT, "generator": f"lm-eval {lm_eval_version()}, lm_eval.tasks.ruler",
            "tokenizer": tokenizer_source, "tasks": list(tasks), "lengths": list(lengths), "cases_per_cell": count,
            "seed": seed, "cases": cases}


def write_case_file(contents: dict, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(contents, indent=1) + "\n")
    return path


def read_case_file(path: str | Path) -> dict:
    """The contents of a ruler_cases.json (or of its gzip, .json.gz, as the project keeps saved cases), checked to
    be one."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--cases-file {path} does not exist; give the ruler_cases.json of an earlier `diff-llama "
                        "ruler` run (or of --cases-only).")
    try:
        data = path.read_bytes()
        contents = json.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)
    except (ValueError, UnicodeDecodeError, OSError, EOFError):  # not JSON, or a broken gzip
        contents = None
    if not isinstance(contents, dict) or contents.get("format") != FORMAT or not contents.get("cases"):
        raise UserError(f"{path} is not a RULER case file of diff-llama; give the ruler_cases.json of an earlier "
                        "`diff-llama ruler` run (or of --cases-only).")
    return contents


def ruler_prompt(tokenizer, case: dict, chat_template: bool = True) -> list[int]:
    """The token ids of a case as lm-eval prompts it: RULER's input, then the start of the answer (the gen_prefix),
    which the model continues: as the assistant's unfinished turn under the chat template, else after a space."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": case["input"]}, {"role": "assistant", "content": case["gen_prefix"]}],
            tokenize=False, continue_final_message=True)
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    return list(tokenizer(f"{case['input']} {case['gen_prefix']}").input_ids)
