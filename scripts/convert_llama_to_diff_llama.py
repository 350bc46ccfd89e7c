#!/usr/bin/env python
"""Convert a LLaMA checkpoint into a DiffLlama: the same as `diff-llama convert SRC OUT [options]`."""

import sys

from diff_llama.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
