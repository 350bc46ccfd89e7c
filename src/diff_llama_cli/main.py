"""Running `diff-llama`: the overview, `--version`, and each command, with its errors reported.

A problem with the input (`diff_llama.errors.UserError`, raised where the input is judged) reaches the terminal as one
line that says how to fix it, with exit code 2. The file system's refusals (no space left, a read-only file system,
no permission) are one line too, with exit code 1: the machine's state, not a bug. Anything else is a bug: it keeps
its traceback, followed by one line asking to report it, and exits with code 1. DIFF_LLAMA_TRACEBACK=1 raises every
error, user errors included.
"""

import difflib
import errno
import importlib
import os
import re
import sys
import traceback

from .command_table import COMMANDS, DESCRIPTION, PROG
from .library import errors
from .parser import UsageError, parse


# errno values of a file operation refused by the file system, with what to do about each.
FILE_SYSTEM_REFUSALS = {
    errno.ENOSPC: "free some space, or choose a place with more, and run it again",
    errno.EDQUOT: "free some space, or choose a place with more, and run it again",
    errno.EROFS: "choose a place you can write to",
    errno.EACCES: "choose a place you may write to (or a file you may read)",
    errno.EPERM: "choose a place you may write to (or a file you may read)",
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
    commands = importlib.import_module("diff_llama.commands")  # torch: only once the arguments are known to be good
    run = getattr(commands, COMMANDS[argv[0]].run)
    if argv[0] == "serve":  # a server lives on: it should not keep every GGUF file it ever parsed
        return run(*values)
    from diff_llama.gguf_metadata import each_gguf_parsed_once

    with each_gguf_parsed_once():  # a GGUF model's config, weights and tokenizer read from one parse of it
        return run(*values)


def _close_progress_bars() -> None:
    """Close the progress bars a Ctrl-C or an error left open, so that the line saying so starts a line of its own."""
    tqdm = getattr(sys.modules.get("tqdm.std"), "tqdm", None)  # loaded only if a bar was ever made
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def _file_system_refusal(error: Exception) -> str | None:
    """One line for a file operation that the file system refused (`FILE_SYSTEM_REFUSALS`): an OSError, or the error
    safetensors raises in its own type, which names the OS error only in its text ("... (os error 28)")."""
    if isinstance(error, OSError) and error.errno in FILE_SYSTEM_REFUSALS:
        # A copy's error names its source first and its destination second: the destination is what was refused.
        where = f" ({error.filename2 or error.filename})" if error.filename2 or error.filename else ""
        return f"{error.strerror}{where}; {FILE_SYSTEM_REFUSALS[error.errno]}"
    found = re.search(r"\(os error (\d+)\)", str(error)) if type(error).__name__ == "SafetensorError" else None
    number = int(found[1]) if found else None
    if number in FILE_SYSTEM_REFUSALS:
        return f"{os.strerror(number)} (a .safetensors file); {FILE_SYSTEM_REFUSALS[number]}"
    return None


def _stdout_is_closed() -> bool:
    """Whether standard output is a pipe nobody reads any more (a broken pipe elsewhere is a bug like any other): the
    write end of a pipe without readers polls as an error. Where poll cannot say (no select.poll), it is taken to be."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return True


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    prefix = f"{PROG}{' ' + argv[0] if argv and argv[0] in COMMANDS else ''}"
    try:
        return _run(argv)
    except SystemExit as exit:  # argparse: --help (0) or a usage error (2), already printed
        return exit.code
    except KeyboardInterrupt as interrupt:  # an `errors.Interrupted` says what was kept and how to go on
        _close_progress_bars()
        print(f"{prefix}: interrupted{'; ' + str(interrupt) if str(interrupt) else ''}", file=sys.stderr)
        return 130
    except Exception as error:
        if isinstance(error, BrokenPipeError) and _stdout_is_closed():
            # The reader of the output went away (`diff-llama --help | head`): not an error, and nothing to say.
            # Python flushes stdout once more at exit, into the closed pipe: point it at /dev/null first.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141  # 128 + SIGPIPE: what the shell reports for a command whose output pipe closed
        if os.environ.get("DIFF_LLAMA_TRACEBACK", "") not in ("", "0"):
            raise
        _close_progress_bars()
        if isinstance(error, errors.UserError):
            print(f"{prefix}: error: {' '.join(str(error).split())}", file=sys.stderr)
            return 2
        refused = _file_system_refusal(error)  # not a UserError: returned above
        if refused is not None:
            print(f"{prefix}: error: {refused}", file=sys.stderr)
            return 1
        traceback.print_exc()
        print(f"{prefix}: this is a bug in diff-llama; please report it with the traceback above", file=sys.stderr)
        return 1
