"""Writing a checkpoint tensor by tensor into a temporary folder that becomes the output only when complete."""

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from .errors import ConversionError


class AtomicOutputFolder:
    """A temporary folder beside `output` that is renamed to `output` on success and removed on failure.

    A killed process leaves at most a hidden `.NAME.partial-*` folder, never a half-written `output`.
    """

    def __init__(self, output: str | os.PathLike, overwrite: bool = False):
        self.output = Path(output).absolute()
        if self.output.exists() and not overwrite:
            raise ConversionError(f"{self.output} already exists; choose another output or pass --overwrite.")
        self.output.parent.mkdir(parents=True, exist_ok=True)
        self.path = None

    def __enter__(self) -> Path:
        self.path = Path(tempfile.mkdtemp(prefix=f".{self.output.name}.partial-", dir=self.output.parent))
        return self.path

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            return False
        _make_shareable(self.path)
        if self.output.exists():
            # --overwrite: move the old output aside first, so that a failure here still loses nothing.
            trash = Path(tempfile.mkdtemp(prefix=f".{self.output.name}.old-", dir=self.output.parent))
            os.replace(self.output, trash / "old")
            os.replace(self.path, self.output)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(self.path, self.output)
        return False


def _make_shareable(folder: Path) -> None:
    """mkdtemp makes a private (0700) folder; the finished output gets the usual permissions under the umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for file in folder.iterdir():
        os.chmod(file, 0o666 & ~umask)


class ShardedSafetensorsWriter:
    """Accumulates tensors up to `max_shard_bytes`, writes each full shard, and writes the index at the end.

    Memory holds at most one shard. Files follow transformers' naming (model-0000i-of-0000N.safetensors).
    """

    def __init__(self, folder: Path, max_shard_bytes: int = 2 * 1024**3):
        self.folder = folder
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in shard for shard in self._shards):
            raise ConversionError(f"tensor {name} written twice")
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        index = len(self._shards)
        save_file(self._pending, self.folder / f"shard-{index:05d}.tmp", metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        if self._pending:
            self._flush()
        count = len(self._shards)
        if count == 1:
            os.replace(self.folder / "shard-00000.tmp", self.folder / "model.safetensors")
            return ["model.safetensors"]
        weight_map, names = {}, []
        for index, tensor_names in enumerate(self._shards):
            name = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.folder / f"shard-{index:05d}.tmp", self.folder / name)
            weight_map.update(dict.fromkeys(tensor_names, name))
            names.append(name)
        index_data = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index_data, indent=2) + "\n")
        return names
