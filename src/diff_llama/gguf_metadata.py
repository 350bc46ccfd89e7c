"""What a GGUF file says about itself, read once: the few metadata fields the commands look at, and one parse of a
file shared by everything that reads it within a block (`each_gguf_parsed_once`). Torch-free; `gguf` (an optional
dependency, transformers' GGUF extra) is imported only when a file is read."""

import contextlib
import functools
import os
from pathlib import Path


@contextlib.contextmanager
def each_gguf_parsed_once():
    """Within the block, every `gguf.GGUFReader` of one file is the same reader. transformers parses a GGUF file's
    whole header (its vocabulary: seconds for a small model) once for the config, again for the model and again for
    the tokenizer; the reader only reads its memory-mapped file, so one parse serves them all. Without `gguf`
    installed, nothing changes."""
    try:
        import gguf
    except ImportError:
        yield
        return
    parse = gguf.GGUFReader
    readers = {}

    def shared_reader(path, *args, **kwargs):
        if args or kwargs:  # another mode than read-only: its own reader
            return parse(path, *args, **kwargs)
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
        if key not in readers:
            readers[key] = parse(path)
        return readers[key]

    gguf.GGUFReader = shared_reader
    try:
        yield
    finally:
        gguf.GGUFReader = parse


@functools.lru_cache(maxsize=4)
def _gguf_metadata(path: Path, size: int, mtime: float) -> dict:
    from gguf import GGUFReader  # optional (transformers' GGUF extra), needed only for a GGUF source

    # Reading the metadata parses the whole vocabulary (seconds): once per file, for licence, type and tokenizer.
    fields = GGUFReader(path).fields
    # general.architecture, which every GGUF file states: a file read is never empty, so a file without a vocabulary
    # is told from one whose metadata could not be read (`gguf_has_tokenizer`)
    keys = ("general.architecture", "general.license", "general.file_type", "tokenizer.ggml.model")
    return {key: fields[key].contents() for key in keys if key in fields}


def gguf_has_tokenizer(path: Path) -> bool:
    """Whether a GGUF file holds a vocabulary (`tokenizer.ggml.model`); a file that does not say is tried."""
    fields = gguf_fields(path)
    return not fields or "tokenizer.ggml.model" in fields


def gguf_fields(path: Path) -> dict:
    """The `general.architecture`, `general.license`, `general.file_type` and `tokenizer.ggml.model` of a GGUF file;
    empty where it cannot be read."""
    try:
        stat = path.stat()
        return _gguf_metadata(path, stat.st_size, stat.st_mtime)
    except Exception:  # an unreadable or older-format file: what it would have said stays unknown
        return {}
