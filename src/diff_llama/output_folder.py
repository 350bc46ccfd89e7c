"""Where a command writes: never among files already there.

Every command that writes a folder treats it as `convert` does: a new (or empty) folder is written in place, and one
that holds files is refused in one line naming the fix, unless the command was asked to replace it (`--overwrite`).
A replacement is written into a temporary folder beside the old one and swapped in only when complete
(`conversion.writer.AtomicOutputFolder`), so a run that fails or is killed leaves the old contents as they were.
"""

import contextlib
import os
from pathlib import Path


def holds_files(path: str | os.PathLike) -> bool:
    """True when `path` is a folder with anything in it (or is a file: nothing can be written there either)."""
    path = Path(path)
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def check_new_output(path: str | os.PathLike, fix: str = "choose a new folder, or pass --overwrite to replace it",
                     overwrite: bool = False) -> None:
    """Raise FileExistsError (one line: what is there and `fix`) unless `path` is new, an empty folder, or a folder
    that `overwrite` allows to replace."""
    path = Path(path)
    if path.is_file():
        raise FileExistsError(f"{path} is a file; give a folder name that does not exist yet.")
    if holds_files(path) and not overwrite:
        raise FileExistsError(f"{path} is not empty; {fix}.")


@contextlib.contextmanager
def new_output_folder(path: str | os.PathLike, overwrite: bool = False,
                      fix: str = "choose a new folder, or pass --overwrite to replace it"):
    """The folder to write `path`'s new contents into: `path` itself when it is new or empty; with `overwrite`, a
    temporary sibling that replaces `path` when the block ends without an error (and is removed when it fails)."""
    check_new_output(path, fix, overwrite)
    if holds_files(path):
        from .conversion.writer import AtomicOutputFolder

        with AtomicOutputFolder(path, overwrite=True) as temporary:
            yield temporary
        return
    Path(path).mkdir(parents=True, exist_ok=True)
    yield Path(path)
