"""Where a command writes: never among files already there, and `--overwrite` replaces only what diff-llama wrote.

Every command that writes a folder treats it alike: a new (or empty) folder is written in place, and one that holds
files is refused in one line naming the fix. `--overwrite` replaces a folder only when this project wrote it and it
holds nothing else (`replace_refusal`): it carries a sign of ours (the `MARKER` file the commands write, a
`conversion_report.json`, or a `config.json` of model_type diff_llama) and every entry in it is a name the project
writes (`PROJECT_FILES`). A user's file dropped into such a folder would be lost, so it is refused too, and so is a
file of ours written again since (`changed_since_written`: a model card edited by hand, weights saved there by the
user's own training), and so are the working directory, any folder above it, the home folder and `/`, whatever they
hold. More refusals protect what a run reads and what took long to make: no command replaces its own input or a
folder that holds it (`input_refusal`), nor makes its output inside an input folder (`inside_input_refusal`), and a
command that names itself (evaluate, ruler, demo, adapt, merge, export-builtin) replaces only an earlier output of
its own, never a converted or trained model that another command wrote (`other_commands_output`).

A replacement is written into a hidden temporary folder beside the old one and swapped in only when complete
(`AtomicOutputFolder`), so a run that fails leaves the old contents as they were. A killed run leaves that hidden
folder behind; the next run writing the same output removes it (`remove_stale_temporaries`) and says so.
"""

import contextlib
import fnmatch
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from .configuration_diff_llama import REMOTE_CODE_FILES
from .conversion.source import CHAT_TEMPLATES_FOLDER, TOKENIZER_FILES
from .errors import Interrupted, OutputExistsError, OutputNotWritableError
from .resolve import is_license_file

# Written into every folder that evaluate, ruler, demo, attention-map and adapt create: the folder is ours to replace.
MARKER = ".diff-llama-output"

# Every file name the commands write at the top of an output folder (model, remote code and tokenizer files, reports,
# plots; and the licence texts every model written carries on, `is_license_file`). A folder whose entries all match
# (and whose subfolders are ours: `PROJECT_FOLDERS`) is one `--overwrite` may replace, when it also carries a sign of
# ours. Patterns only where a command writes numbered names.
PROJECT_FILES = (
    MARKER, ".partial", "config.json", "generation_config.json", "model.safetensors",
    "model-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9].safetensors", "model.safetensors.index.json",
    *REMOTE_CODE_FILES, "README.md", "conversion_report.json", *TOKENIZER_FILES, "*.tiktoken",
    "retrieval.json", "retrieval.md", "retrieval.png", "cases.jsonl", "layer[0-9]*-head*.png",
    "ruler_cases.json", "ruler.json", "ruler.md",
    "adapt.json", "adapt.png", "training_report.json",
)
# The subfolders the commands write, what may be in them, and which commands write them (None: any): the converter's
# named chat templates, and the Trainer's checkpoints (`checkpoint-STEP`, its trainer_state.json the sign; the model,
# optimizer and RNG states, the tokenizer, and adapt's history of the run, `adaptation.resume.ADAPT_STATE`). A
# checkpoint in a converted model's folder is a user's own training run: convert --overwrite never removes it.
PROJECT_FOLDERS = {
    CHAT_TEMPLATES_FOLDER: (None, ("*.jinja",), None),
    "checkpoint-[0-9]*": ("trainer_state.json", (
        *PROJECT_FILES, "adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "scheduler.pt",
        "scaler.pt", "rng_state*.pth", "training_args.bin", "trainer_state.json", "pytorch_model*.bin",
        "adapt_state.json"), ("train", "recover", "adapt")),
}

# A hidden folder of a killed run whose owner cannot be asked (made on another machine, or by an older version that
# did not name its process) counts as abandoned once nothing in it has changed for this long.
STALE_AFTER_SECONDS = 3600


def holds_files(path: str | os.PathLike) -> bool:
    """True when `path` is a folder with anything in it (or is a file: nothing can be written there either)."""
    path = Path(path)
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def read_marker(folder: str | os.PathLike) -> dict | None:
    """What the marker of an earlier run in `folder` records (its command, and what evaluate needs to resume)."""
    try:
        return json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def write_marker(folder: str | os.PathLike, command: str, **details) -> None:
    (Path(folder) / MARKER).write_text(json.dumps({"written_by": f"diff-llama {command}", "command": command,
                                                   **details}, indent=1) + "\n")


# The precisions a copy that keeps file times may keep them at (ns), coarser than the file system's own: rsync's and
# some file systems' microseconds, tar's whole seconds, zip's and FAT's two.
KEPT_TIME_UNITS_NS = (1, 1000, 10**9, 2 * 10**9)


def _same_time(recorded: int, current: int) -> bool:
    """Whether the modification time `current` is `recorded`, or that time kept at a coarser precision. A file
    written again has a new time at the file system's own precision, which passes for the recorded one only when it
    falls within a unit of it and on a whole unit."""
    return any(current % unit == 0 and abs(current - recorded) < unit for unit in KEPT_TIME_UNITS_NS)


def _written_files(folder: Path) -> dict[str, list[int]]:
    """Every file under `folder` but the marker, by its path relative to `folder`: [size, modification time in ns]."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink() and path != folder / MARKER:
            stat = path.stat()
            found[path.relative_to(folder).as_posix()] = [stat.st_size, stat.st_mtime_ns]
    return found


def record_written_files(folder: str | os.PathLike, command: str) -> None:
    """Note in the marker of `folder`, which `command` has just finished writing, each file's size and time, so that a
    later `--overwrite` can tell a file written again since (`changed_since_written`) from one of ours."""
    folder = Path(folder)
    details = {key: value for key, value in (read_marker(folder) or {}).items()
               if key not in ("written_by", "command", "files")}
    write_marker(folder, command, **details, files=_written_files(folder))


def changed_since_written(folder: str | os.PathLike) -> list[str]:
    """The files of `folder` written (or added) since the command that made it recorded them, largest first: each
    one's size or time differs from the marker's record, or it has none. Empty for a folder without a record (an
    older version's)."""
    folder = Path(folder)
    recorded = (read_marker(folder) or {}).get("files")
    if not isinstance(recorded, dict):
        return []
    changed = []
    for name, (size, modified) in _written_files(folder).items():
        then = recorded.get(name)
        kept = (isinstance(then, list) and len(then) == 2 and all(isinstance(each, int) for each in then)
                and then[0] == size and _same_time(then[1], modified))
        if not kept:
            changed.append((-size, name))
    return [name for _, name in sorted(changed)]


def _carries_our_sign(folder: Path) -> bool:
    if (folder / MARKER).is_file() or (folder / "conversion_report.json").is_file():
        return True
    try:
        return json.loads((folder / "config.json").read_text()).get("model_type") == "diff_llama"
    except (OSError, ValueError, AttributeError):
        return False


def is_project_file_name(name: str) -> bool:
    """Whether a command writes a file of this name at the top of an output folder (`PROJECT_FILES`, licences)."""
    return is_license_file(name) or any(fnmatch.fnmatchcase(name, pattern) for pattern in PROJECT_FILES)


def _is_project_entry(entry: Path, command: str | None) -> bool:
    """Whether a command writes `entry` of an output folder: a file of `PROJECT_FILES`, or a subfolder of
    `PROJECT_FOLDERS` that `command` (None: a command not known) writes, that carries its sign and holds only what
    that subfolder holds (no further folders)."""
    if entry.is_symlink():
        return False
    if entry.is_file():
        return is_project_file_name(entry.name)
    for name, (sign, contents, writers) in PROJECT_FOLDERS.items():
        if writers is not None and command not in writers:
            continue
        if entry.is_dir() and fnmatch.fnmatchcase(entry.name, name) and (sign is None or (entry / sign).is_file()):
            return all(each.is_file() and not each.is_symlink()
                       and any(fnmatch.fnmatchcase(each.name, pattern) for pattern in contents)
                       for each in entry.iterdir())
    return False


def foreign_entries(folder: str | os.PathLike, command: str | None = None) -> list[str]:
    """The entries of `folder` that diff-llama (`command`, when it is known) did not write: all of them when it
    carries no sign of ours, else those whose names no command writes. Folders are shown with a trailing /."""
    folder = Path(folder)
    entries = sorted(folder.iterdir())
    ours = _carries_our_sign(folder)
    return [entry.name + ("/" if entry.is_dir() else "") for entry in entries
            if not (ours and _is_project_entry(entry, command))]


def _protected_place(path: Path) -> str | None:
    """What `path` is, when it is a folder no output may replace: the working directory, a folder above it, home."""
    resolved, cwd = path.resolve(), Path.cwd().resolve()
    if resolved == cwd:
        return "the working directory"
    if resolved in cwd.parents:
        return "the root folder" if resolved == Path(resolved.anchor) else "a folder above the working directory"
    try:
        home = Path.home().resolve()
    except RuntimeError:  # no home folder known
        home = None
    return "your home folder" if resolved == home else None


def input_refusal(output: str | os.PathLike, inputs=()) -> str | None:
    """Why `output` may not be written over, because of what the command reads: it is one of `inputs` (a model
    folder, a GGUF file) or a folder that holds one. Inputs that are not local paths (Hub ids) are skipped."""
    resolved_output = Path(output).resolve()
    for each in inputs:
        if each is None or not Path(each).exists():
            continue
        resolved = Path(each).resolve()
        if resolved == resolved_output or resolved_output in resolved.parents:
            what = "is this command's input" if resolved == resolved_output else f"holds this command's input ({each})"
            return f"{output} {what}, which --overwrite never replaces; give a new folder for the output"
    return None


def inside_input_refusal(output: str | os.PathLike, inputs=()) -> str | None:
    """Why a new `output` may not be made where it is asked for: inside a folder the command reads (a model folder,
    training data). A folder added there changes that input: `push` would upload it with the model, a later
    `--overwrite` of the model is refused for it, and a data folder would feed this run's model card to the next run
    as training text."""
    resolved_output = Path(output).resolve()
    for each in inputs:
        if each is not None and Path(each).is_dir() and Path(each).resolve() in resolved_output.parents:
            return (f"{output} is inside {each}, which this command reads; writing there would change it, so give a "
                    "folder outside it")
    return None


# What a folder with a model's files and no marker holds: a model from elsewhere, or an output of an older diff-llama,
# which wrote none.
UNRECORDED_MODEL = "a model with no record of the command that wrote it"


def other_commands_output(folder: Path, command: str) -> str | None:
    """What `folder` holds when a command other than `command` wrote it ("the output of diff-llama demo" from its
    marker, or "a model" from a model's files), or None when `command` wrote it or nothing says who did."""
    written_by = (read_marker(folder) or {}).get("command")
    if written_by == command:
        return None
    if written_by not in (None, "convert"):  # convert's marker only records its files: its folder is a model
        return f"the output of diff-llama {written_by}"
    if command == "convert" and (folder / "conversion_report.json").is_file():
        return None  # a conversion's own report, and no marker of a command that trained it since
    if (folder / "config.json").is_file() or (folder / "conversion_report.json").is_file():
        return "a model" if written_by else UNRECORDED_MODEL
    return None


def first_names(names: list[str], shown: int = 3) -> str:
    """The first `shown` names and how many more: short enough for a one-line error."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def replace_refusal(path: str | os.PathLike, inputs=(), command: str | None = None) -> str | None:
    """Why the folder `path` may not be replaced (one clause naming the fix), or None when it may. `inputs`: what the
    command reads; `command`: the command replacing it, when it may replace only its own earlier output."""
    path = Path(path)
    place = _protected_place(path)
    if place is not None:
        return f"{path} is {place}, which diff-llama never replaces; give a new folder for the output"
    refusal = input_refusal(path, inputs)
    if refusal is not None:
        return refusal
    if not path.is_dir():
        return None
    foreign = foreign_entries(path, command)
    unrecorded = "" if read_marker(path) else (f", or delete it yourself if it is an earlier {command or 'diff-llama'} "
                                               "output that an older diff-llama wrote without a record")
    if foreign and (path / "config.json").is_file() and unrecorded:
        return (f"{path} holds {UNRECORDED_MODEL} ({first_names(foreign)}), which "
                f"--overwrite never replaces; choose a new folder{unrecorded}")
    if foreign:
        return (f"{path} holds files diff-llama did not write ({first_names(foreign)}), which --overwrite never "
                "replaces; choose a new folder, or move them out")
    changed = changed_since_written(path)
    if changed:
        return (f"{path} holds files written again since diff-llama made the folder ({first_names(changed)}: their "
                "size or time is not the one it recorded, as after an edit, or a copy that did not keep file times), "
                "which --overwrite never replaces; choose a new folder, or move them out")
    other = other_commands_output(path, command) if command is not None else None
    if other is not None:
        return (f"{path} holds {other}, which {command} --overwrite never replaces (it replaces only an earlier "
                f"{command} output); choose a new folder{unrecorded}")
    return None


def check_not_a_link(path: Path) -> None:
    """Refuse an output that is a symbolic link: a replacement would put a folder in the link's place, and a link to
    nothing would fail only once the work is done."""
    if path.is_symlink():
        missing = "" if path.exists() else ", which does not exist"
        raise OutputExistsError(f"{path} is a symbolic link to {os.readlink(path)}{missing}; give a real folder for the "
                                "output (the folder the link points to, or a new name).")


def check_output_place(path: Path, inputs=(), *, if_a_file: str) -> None:
    """Where an output folder may go, before what it holds is looked at: not a symbolic link, not a file (`if_a_file`
    is the advice then), not inside a model folder the command reads (`inputs`), and creatable where it is new."""
    check_not_a_link(path)
    if path.is_file():
        raise OutputExistsError(f"{path} is a file; {if_a_file}.")
    inside = inside_input_refusal(path, inputs)
    if inside is not None:
        raise OutputExistsError(f"{inside}.")
    if not path.exists():
        check_creatable(path)


def check_new_output(path: str | os.PathLike, fix: str = "choose a new folder", overwrite: bool = False, *,
                     offers_overwrite: bool = True, inputs=(), command: str | None = None) -> None:
    """Raise OutputExistsError (a FileExistsError; one line: what is there and how to go on) unless `path` is new,
    an empty folder, or, with `overwrite`, a folder diff-llama may replace (`replace_refusal`, given the command's
    `inputs` and, for a command that replaces only its own outputs, its name). Without it, `fix` is the advice,
    followed by --overwrite for a command that `offers_overwrite` where --overwrite would be allowed."""
    path = Path(path)
    check_output_place(path, inputs, if_a_file="give a folder name that does not exist yet")
    if overwrite:
        refusal = replace_refusal(path, inputs, command) if path.exists() else None
        if refusal is not None:
            raise OutputExistsError(f"--overwrite refused: {refusal}.")
    elif holds_files(path):
        allowed = offers_overwrite and replace_refusal(path, inputs, command) is None
        raise OutputExistsError(f"{path} is not empty; {fix}{', or pass --overwrite to replace it' if allowed else ''}.")


def clear_output(path: str | os.PathLike, inputs=(), command: str | None = None) -> None:
    """Remove what an earlier run wrote into `path` (`--overwrite` of a command that must write in place), after
    checking again that it holds nothing else."""
    check_new_output(path, overwrite=True, inputs=inputs, command=command)
    for entry in Path(path).iterdir():
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def _blocked_by(path: Path) -> str | None:
    """Why no folder can be made at `path`, whatever is tried: a file above it, or a folder above it that this user
    may not write in (None: neither)."""
    existing = next(each for each in path.absolute().parents if each.exists() or each == each.parent)
    if existing.is_file():
        return f"{existing} is a file"
    if existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
        return f"no permission to write in {existing}"
    return None


def _cannot_create(output: Path, cause: str) -> OutputNotWritableError:
    return OutputNotWritableError(f"cannot create the folder {output}: {cause}; choose a place you can write to")


def check_creatable(path: str | os.PathLike) -> None:
    """Before any work: one line when the folder `path` could not be made where it is asked for. What only the
    attempt shows is reported by `creating`."""
    path = Path(path).absolute()
    cause = _blocked_by(path)
    if cause is not None:
        raise _cannot_create(path, cause)


@contextlib.contextmanager
def creating(output: str | os.PathLike):
    """Around the creation of the folder `output` (or of a temporary folder beside it): what the file system refuses
    becomes one line naming the folder asked for, not the temporary one."""
    try:
        yield
    except OSError as error:
        output = Path(output)
        raise _cannot_create(output, _blocked_by(output) or error.strerror or str(error)) from None


def make_folder(path: str | os.PathLike) -> Path:
    """`path` as a folder, with the folders above it, or one line saying why it cannot be made."""
    with creating(path):
        Path(path).mkdir(parents=True, exist_ok=True)
    return Path(path)


def _missing_folders(folder: Path) -> list[Path]:
    """`folder` and the folders above it that do not exist yet, deepest first."""
    return [each for each in (folder, *folder.parents) if not each.exists()]


def _remove_empty(folders: list[Path]) -> None:
    """Remove each folder in order, leaving any that is not empty (another process wrote there)."""
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


@contextlib.contextmanager
def new_output_folder(path: str | os.PathLike, overwrite: bool = False, fix: str = "choose a new folder",
                      command: str | None = None, inputs=(), in_place: bool = True, **marker_details):
    """The folder to write `path`'s new contents into: `path` itself when it is new or empty (and `in_place`: a run
    that resumes from what it wrote, or that the user watches fill up); otherwise a temporary sibling that replaces
    `path` when the block ends without an error (and is removed when it fails). With `command`, the folder gets the
    marker that lets a later `--overwrite` of the same command replace it. `inputs`: what the command reads, which
    it never replaces."""
    remove_stale_temporaries(path)
    check_new_output(path, fix, overwrite, inputs=inputs, command=command)
    if holds_files(path) or not in_place:
        with AtomicOutputFolder(path, overwrite=overwrite, inputs=inputs, command=command) as temporary:
            if command is not None:
                write_marker(temporary, command, **marker_details)
            yield temporary
        return
    with removed_unless_written(path):
        make_folder(path)
        if command is not None:
            write_marker(path, command, **marker_details)
        yield Path(path)
    if command is not None:
        record_written_files(path, command)


@contextlib.contextmanager
def files_added_together(output: str | os.PathLike, command: str):
    """A hidden folder beside `output` to write new files for it into: they move into `output` together when the block
    ends without an error (`output` made, with `command`'s marker, when it holds nothing yet), and go when it fails. So
    a run that adds files to a folder of earlier ones (attention-map's maps) adds or replaces none of them unless it
    finishes, and never leaves a file half written under its final name."""
    output = Path(output).absolute()
    remove_stale_temporaries(output)
    created = _missing_folders(output.parent)
    with creating(output):
        output.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=_temporary_prefix(output, "partial"), dir=output.parent))
    try:
        yield staging
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_empty(created)
        if isinstance(error, KeyboardInterrupt) and not isinstance(error, Interrupted):
            kept = f"{output} is left as it was" if output.exists() else "nothing was written"
            raise Interrupted(f"{kept}; run the command again to start over") from None
        raise
    if not holds_files(output):
        make_folder(output)
        write_marker(output, command)
    for file in sorted(staging.iterdir()):
        os.replace(file, output / file.name)
    staging.rmdir()


@contextlib.contextmanager
def removed_unless_written(path: str | os.PathLike):
    """Around a run that makes the folder `path` and writes into it: when it fails before writing anything but the
    marker, the folder goes again (with the folders above it that it made), so that a rerun is not refused."""
    created = _missing_folders(Path(path).absolute())
    try:
        yield
    except BaseException:
        if Path(path).is_dir() and [entry.name for entry in Path(path).iterdir()] in ([MARKER], []):
            with contextlib.suppress(FileNotFoundError):
                (Path(path) / MARKER).unlink()
            _remove_empty(created)  # the output, then the folders above it that this run made
        raise


# ---- the hidden temporary folders of a replacement ----------------------------------------------------------------


def _temporary_prefix(output: Path, kind: str) -> str:
    """`.NAME.partial-HOST-PID-` (or `.old-`): the name says whose it is, so a later run can tell a killed run's."""
    return f".{output.name}.{kind}-{socket.gethostname()}-{os.getpid()}-"


class AtomicOutputFolder:
    """A temporary folder beside `output` that is renamed to `output` on success and removed on failure.

    A killed process leaves at most a hidden `.NAME.partial-*` folder, never a half-written `output`; the next one
    writing `output` removes it. `output` must be new or empty, or, with `overwrite`, a folder diff-llama may replace.
    With `command`, the folder gets its marker, recording what it holds (`record_written_files`).
    """

    def __init__(self, output: str | os.PathLike, overwrite: bool = False, *, inputs=(), command: str | None = None):
        remove_stale_temporaries(output)  # first: it may put back an output that an interrupted swap moved aside
        self.overwrite, self.inputs, self.command = overwrite, inputs, command
        self._check(output)
        self.output = Path(output).absolute()
        self.path = None
        # The folders above `output` that this run creates: a failed run removes them again (when still empty).
        self.created_parents = _missing_folders(self.output.parent)

    def _check(self, output) -> None:
        """Refuse `output` unless it is new, empty, or (with `overwrite`) a folder this command may replace."""
        check_new_output(output, overwrite=self.overwrite, inputs=self.inputs, command=self.command)
        if Path(output).exists():  # even an empty folder is replaced: never the working directory or a folder above
            refusal = replace_refusal(output, self.inputs, self.command)
            if refusal is not None:
                raise OutputExistsError(f"{refusal}.")

    def _recheck_before_swap(self) -> None:
        """The checks of the start again, at the end: a folder made or filled at `output` while this ran (by the user,
        or by another run writing the same output) is never replaced unasked. The finished output is then kept in a
        sibling folder that the error names."""
        try:
            self._check(self.output)
        except OutputExistsError as error:
            kept = Path(tempfile.mkdtemp(prefix=f"{self.output.name}.finished-", dir=self.output.parent))
            os.replace(self.path, kept)
            raise OutputExistsError(f"{self.output} was made or changed while this command ran, so it is left as it "
                                    f"is ({str(error).rstrip('.')}); the finished output is in {kept}: move it where "
                                    "you want it") from None

    def __enter__(self) -> Path:
        try:
            with creating(self.output):
                self.output.parent.mkdir(parents=True, exist_ok=True)
                self.path = Path(tempfile.mkdtemp(prefix=_temporary_prefix(self.output, "partial"),
                                                  dir=self.output.parent))
        except OutputNotWritableError:
            _remove_empty(self.created_parents)
            raise
        return self.path

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            _remove_empty(self.created_parents)
            if issubclass(exc_type, KeyboardInterrupt) and not issubclass(exc_type, Interrupted):
                kept = f"{self.output} is left as it was" if self.output.exists() else "nothing was written"
                raise Interrupted(f"{kept}; run the command again to start over") from None
            return False
        if self.command is not None:
            record_written_files(self.path, self.command)
        _make_shareable(self.path)
        self._recheck_before_swap()
        if self.output.exists():
            # --overwrite: move the old output aside first, so that a failure here still loses nothing.
            trash = Path(tempfile.mkdtemp(prefix=_temporary_prefix(self.output, "old"), dir=self.output.parent))
            os.replace(self.output, trash / "old")
            os.replace(self.path, self.output)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(self.path, self.output)
        return False


def _umask() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _make_shareable(folder: Path) -> None:
    """mkdtemp makes a private (0700) folder; the finished output gets the usual permissions under the umask."""
    umask = _umask()
    os.chmod(folder, 0o777 & ~umask)
    for file in folder.iterdir():
        os.chmod(file, 0o666 & ~umask)


def give_weights_the_usual_permissions(folder: str | os.PathLike) -> None:
    """Give the `.safetensors` files under `folder` the permissions of any other new file (0644 under umask 022).
    safetensors 0.8 writes them 0600 whatever the umask (a temporary file renamed into place; safetensors issue
    #782), so a model trained here would be unreadable to another user: a server in a container, a shared folder."""
    mode = 0o666 & ~_umask()
    for file in Path(folder).rglob("*.safetensors"):
        if file.is_file() and not file.is_symlink() and file.stat().st_mode & 0o777 == 0o600:
            os.chmod(file, mode)


def _is_abandoned(kind: str, name: str, folder: Path) -> bool:
    """Whether `folder` is a temporary folder of ours (`kind` partial or old; `name` after the kind: HOST-PID-RANDOM,
    or RANDOM from older versions) whose run is no longer running."""
    entries = [entry.name for entry in folder.iterdir()]
    if kind == "old" and entries != ["old"]:
        return False
    if kind == "partial" and not all(_is_project_entry(folder / entry, None) for entry in entries):
        return False  # holds something our runs do not write: not ours to remove
    named = re.fullmatch(r"(?P<host>.+)-(?P<pid>\d+)-[a-z0-9_]{8}", name)
    if named and named["host"] == socket.gethostname():
        pid = int(named["pid"])
        if pid == os.getpid():
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # another user's live process
            return False
        return False
    if not named and not re.fullmatch(r"[a-z0-9_]{8}", name):
        return False  # not a name our writer makes
    newest = max([folder.lstat().st_mtime, *(p.lstat().st_mtime for p in folder.rglob("*"))])
    return time.time() - newest > STALE_AFTER_SECONDS


def remove_stale_temporaries(output: str | os.PathLike) -> None:
    """Remove the hidden folders beside `output` that a killed run writing it left (`.NAME.partial-*`, and
    `.NAME.old-*` holding the output an interrupted swap had moved aside, which goes back into place when `output` is
    missing), and say so in one line on stderr."""
    output = Path(output).absolute()
    if not output.parent.is_dir():
        return
    pattern = re.compile(rf"\.{re.escape(output.name)}\.(?P<kind>partial|old)-(?P<owner>.+)")
    removed, restored = [], None
    for folder in sorted(output.parent.iterdir()):
        found = pattern.fullmatch(folder.name)
        if not (found and folder.is_dir() and not folder.is_symlink()
                and _is_abandoned(found["kind"], found["owner"], folder)):
            continue
        if found["kind"] == "old" and (folder / "old").is_dir() and not output.exists():
            os.replace(folder / "old", output)
            restored = folder.name
        shutil.rmtree(folder)
        removed.append(folder.name)
    if restored:
        print(f"Restored {output} from {restored}, where an interrupted --overwrite had moved it.", file=sys.stderr)
    if removed:
        print(f"Removed {', '.join(removed)} from {output.parent}: left by a run writing {output.name} that did not "
              "finish.", file=sys.stderr)
