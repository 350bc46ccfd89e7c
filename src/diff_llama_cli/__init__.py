"""The `diff-llama` command line, a thin layer over the library: the command table (`command_table`), the option
dataclasses of `diff_llama.options` turned into argparse parsers (`parser`), and running a command (`main`).

This package lives outside `diff_llama` on purpose: importing `diff_llama` registers the model with transformers'
Auto classes, which imports torch (seconds). The command line loads the torch-free modules it needs (`library`)
without that, so `diff-llama`, `diff-llama COMMAND --help`, a mistyped option and `--version` answer at once; a
command imports `diff_llama.commands`, which runs it, only once its arguments have been parsed.
"""

from .command_table import COMMANDS, Command
from .main import main, overview, version
from .parser import UsageError, build_parser, parse

__all__ = ["COMMANDS", "Command", "UsageError", "build_parser", "main", "overview", "parse", "version"]
