"""The errors diff-llama raises for bad input: a missing model, an output it may not replace, an option out of range.

Each is raised where the input is judged, with a message of one line that names the problem and the fix; the
`diff-llama` command prints that line and exits with code 2. Any other exception is a bug in diff-llama (or in a
library it calls) and keeps its traceback.

`UserError` subclasses `ValueError`, what Python raises for an argument of the right type and a wrong value, and what
these errors were before they had a type of their own: library code that catches `ValueError` keeps working. The
subclasses below also derive from the built-in exception the same problem raised before (`FileNotFoundError`,
`FileExistsError`, `ImportError`), so `except FileExistsError:` around an output folder still
catches its refusal. The errors of one part of the package derive from these where that part declares them
(`resolve.ModelNotFoundError`, `conversion.errors.ConversionError`, `hub.HubUnreachableError`).

Only the standard library may be imported here: the command line loads this module without torch.
"""


class UserError(ValueError):
    """A problem with the input or the options, reported as one line that says how to fix it."""


class InputNotFoundError(UserError, FileNotFoundError):
    """A file, folder or model named by the input does not exist (or holds nothing usable)."""


class OutputExistsError(UserError, FileExistsError):
    """An output path that this run may not write into or replace."""


class OutputNotWritableError(UserError, OSError):
    """An output folder that the file system will not let this run create (a parent that is a file, a read-only or
    special file system, no permission)."""


class MissingPackageError(UserError, ImportError):
    """An optional package that this use needs is not installed; the message gives the pip command."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run that can go on later: the message says what the run kept and the command that continues
    it. Still a KeyboardInterrupt, so whatever stops on Ctrl-C stops on it."""
