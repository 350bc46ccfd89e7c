"""English text that every Python installation carries: the docstrings of standard-library modules.

Used as a small, offline, reproducible corpus for calibration, evaluation and demos. Two disjoint module lists
keep training/calibration text apart from held-out text.
"""

import importlib
import inspect
from pathlib import Path

from .errors import UserError

CALIBRATION_MODULES = ("argparse", "collections", "functools", "itertools", "pathlib", "subprocess", "threading")
HELD_OUT_MODULES = ("json", "logging", "random", "string", "textwrap", "typing", "unittest")
# A larger training set (about 330k characters) for examples that train from scratch.
TRAINING_MODULES = CALIBRATION_MODULES + (
    "os", "re", "datetime", "decimal", "fractions", "email.message", "http.client", "urllib.request", "shutil",
    "tempfile", "csv", "sqlite3", "asyncio.tasks", "asyncio.streams", "inspect", "ast", "dataclasses", "enum",
    "heapq", "bisect", "zipfile", "tarfile", "socket", "ssl", "pickle", "copy", "pprint", "difflib", "calendar",
    "statistics", "contextlib", "abc", "io", "codecs", "locale", "gettext", "optparse", "configparser", "queue",
    "sched", "selectors", "hashlib", "hmac", "secrets", "uuid", "ipaddress", "mailbox", "smtplib", "ftplib",
    "imaplib", "xml.dom.minidom", "xml.etree.ElementTree", "html.parser", "wave", "doctest", "pdb", "trace",
    "tracemalloc", "timeit", "cmd", "shlex", "glob", "fnmatch", "filecmp", "gzip", "bz2", "lzma", "zlib", "base64",
    "binascii", "struct", "array", "weakref", "types", "numbers", "math", "cmath", "operator", "traceback",
    "warnings", "platform", "sysconfig", "getopt", "getpass", "signal", "mmap", "multiprocessing.pool",
    "concurrent.futures._base",
)


def stdlib_docstrings(modules=CALIBRATION_MODULES, min_chars: int = 80, exclude: str = "") -> str:
    """Docstrings of the given modules and their public classes and functions, joined by blank lines.

    Docstrings that also occur in `exclude` (e.g. the held-out text) are left out.
    """
    seen, parts = set(exclude.split("\n\n")), []
    for name in modules:
        module = importlib.import_module(name)
        # Only what the module defines itself, so that the two module lists never share text.
        members = [
            obj
            for attr, obj in sorted(vars(module).items())
            if not attr.startswith("_")
            and (inspect.isclass(obj) or inspect.isfunction(obj))
            and getattr(obj, "__module__", None) == name
        ]
        for obj in [module, *members]:
            doc = inspect.getdoc(obj)
            if doc and len(doc) >= min_chars and doc not in seen:
                seen.add(doc)
                parts.append(doc)
    return "\n\n".join(parts)


def read_text_file(path) -> str:
    """A text file of the user's (training, calibration or evaluation text); one that cannot be read, or is not
    UTF-8 text, is refused in one line."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"{path} is not UTF-8 text (byte {error.start}: {error.reason}); give a text file, or convert "
                        "it to UTF-8.") from None
    except OSError as error:
        raise UserError(f"cannot read text file {path} ({error.strerror}).") from None
