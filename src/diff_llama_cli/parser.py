"""Option dataclasses to argparse: each dataclass field is one option, parsed the way transformers' HfArgumentParser
parses it (`--max-steps` and `--max_steps`; a `bool` field is a flag, `--lora` or `--lora false`, and one that
defaults to True also gets `--no-NAME`). A mistyped option is refused in one line that names the nearest one."""

import argparse
import dataclasses
import difflib
import os
import types
import typing

from .command_table import COMMANDS, PROG
from .library import errors


class UsageError(errors.UserError):
    """A bad command line: printed as one line, exit code 2."""


def _bool(text: str) -> bool:
    if text.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if text.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _float(text: str) -> float:
    # float() also takes "nan", which passes every range check (nan < 0 is False) and then samples garbage.
    value = float(text)
    if value != value:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    return value


_float.__name__ = "float"  # argparse names the type in "invalid float value: 'abc'"


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
        # The dashed name first: usage and help show it, as the docs write it; the underscored one still parses.
        names = ([f"--{field.name.replace('_', '-')}"] if "_" in field.name else []) + [f"--{field.name}"]
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
            kwargs.update(type=_float if typing.get_args(kind)[0] is float else typing.get_args(kind)[0], nargs="+")
        else:
            kwargs["type"] = _float if kind is float else kind
            if "choices" in kwargs:
                kwargs["type"] = _choice(kwargs["choices"])
        parser.add_argument(*names, dest=field.name, **kwargs)
        if kind is bool and field.default is True:
            parser.add_argument(f"--no-{field.name.replace('_', '-')}", f"--no_{field.name}", action="store_false",
                                dest=field.name, help=f"turn --{field.name.replace('_', '-')} off")


class _HelpFormatter(argparse.HelpFormatter):
    """Adds "(default: ...)" to an option's help unless the help already says what the default is, and shows a bool
    field as the flag it is (`--lora`, not `--lora [LORA]`; `--lora false` still parses)."""

    def _format_args(self, action, default_metavar):
        if action.type is _bool:
            return ""
        return super()._format_args(action, default_metavar)

    def _format_action_invocation(self, action):
        if action.type is _bool:
            return ", ".join(action.option_strings)
        return super()._format_action_invocation(action)

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
    command = COMMANDS[name]
    argv, after = list(argv), []
    if command.after_dashes and "--" in argv:  # the words after it are another program's: argparse never reads them
        dashes = argv.index("--")
        argv, after = argv[:dashes], argv[dashes + 1:]
    argv = _expand_options(parser, name, argv)
    if not command.after_dashes:
        values = vars(parser.parse_args(argv))
    else:  # argparse fills an optional positional at its first chance, so a word after an option is left over
        namespace, left_over = parser.parse_known_args(argv)
        if any(word.startswith("-") for word in left_over):
            parser.parse_args(argv)  # argparse's own one-line error for the unknown option
        values = vars(namespace)
        stray = values[command.after_dashes] + left_over
        if stray:  # a stray word, or the other program's option value without the `--` before it
            raise UsageError(f"unexpected argument {stray[0]!r}: {PROG} {name} takes one "
                             f"{command.positionals[0][0].upper()}, and then -- before any "
                             f"{command.after_dashes.upper()} ({PROG} {name} --help shows the usage)")
        values[command.after_dashes] = after
    if isinstance(values.get("output"), str):  # "~/out" quoted past the shell, as model paths already are
        values["output"] = os.path.expanduser(values["output"])
    result = [values.pop(positional) for positional, *_ in command.positionals]
    for options_class in command.options:
        init = [f.name for f in dataclasses.fields(options_class) if f.init]
        result.append(options_class(**{field: values.pop(field) for field in init}))
    if command.after_dashes:  # the other program's words, checked with the options: before the command imports torch
        getattr(result[len(command.positionals)], f"check_{command.after_dashes}")(after)
    return result
