"""The torch-free modules of `diff_llama` that the command line needs before it runs a command.

Importing `diff_llama.options` the usual way runs `diff_llama/__init__.py` first, which registers the model with
transformers' Auto classes and so imports torch (seconds): `diff-llama COMMAND --help` would wait for it. These
modules import only the standard library and each other, so they are run here on their own, under their own names in
`sys.modules`. When a command then imports the package, its `__init__` and every module find these same modules: the
option classes and error types stay the same objects.
"""

import importlib
import importlib.machinery
import importlib.util
import sys


def import_torch_free(name: str):
    """The module `diff_llama.<name>`, imported without running the package's `__init__` unless it already ran. The
    modules it imports itself must have been imported this way first."""
    full_name = f"diff_llama.{name}"
    if full_name in sys.modules or "diff_llama" in sys.modules:
        return importlib.import_module(full_name)
    package = importlib.util.find_spec("diff_llama")  # finds the package without running it
    if package is None:
        raise ModuleNotFoundError("No module named 'diff_llama'", name="diff_llama")
    spec = importlib.machinery.PathFinder.find_spec(full_name, package.submodule_search_locations)
    module = importlib.util.module_from_spec(spec)
    sys.modules[full_name] = module  # before it runs: dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[full_name]
        raise
    return module


errors = import_torch_free("errors")
options = import_torch_free("options")  # imports .errors
