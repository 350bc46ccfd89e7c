"""Writing a checkpoint tensor by tensor (into the temporary folder of `output_folder.AtomicOutputFolder`)."""

import json
import math
import os
import struct
from pathlib import Path

import torch

from .errors import ConversionError
from .source import SAFETENSORS_DTYPES


class StreamingSafetensorsWriter:
    """Writes safetensors shards tensor by tensor, holding none of them in memory.

    The safetensors header lists every tensor's shape and offset before the data, so the writer takes the full plan
    (name, shape, dtype, in write order) up front, splits it into shards of at most `max_shard_bytes`, writes each
    header when its shard opens, and then appends each tensor's bytes as it arrives. A tensor that does not match the
    plan is an error. Files follow transformers' naming (model.safetensors, or model-0000i-of-0000N.safetensors with
    an index).
    """

    def __init__(self, folder: Path, plan: list[tuple[str, tuple, torch.dtype]], max_shard_bytes: int = 2 * 1024**3):
        self.folder = folder
        shards, current, current_bytes = [], [], 0
        for name, shape, dtype in plan:
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if current and current_bytes + size > max_shard_bytes:
                shards.append(current)
                current, current_bytes = [], 0
            current.append((name, tuple(shape), dtype, size))
            current_bytes += size
        shards.append(current)
        count = len(shards)
        self._file_names = (
            ["model.safetensors"] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        )
        self._queue = [(index, entry) for index, shard in enumerate(shards) for entry in shard]
        self._shards = shards
        self._position = 0
        self._open_index = None
        self._file = None
        self.total_bytes = sum(entry[3] for _, entry in self._queue)

    def _close_file(self) -> None:
        self._file.truncate()  # sets the size where the data ends, also when it ends in a hole
        self._file.close()

    def _open_shard(self, index: int) -> None:
        if self._file is not None:
            self._close_file()
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, dtype, size in self._shards[index]:
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        # unbuffered, so that kernel-side copies and our writes share one file position
        self._file = open(self.folder / self._file_names[index], "wb", buffering=0)
        self._file.write(struct.pack("<Q", len(encoded)))
        self._file.write(encoded)
        self._open_index = index

    def _next(self, name: str, shape: tuple, dtype: torch.dtype) -> None:
        if self._position >= len(self._queue):
            raise RuntimeError(f"internal error: tensor {name} is not in the conversion plan")
        index, (planned, planned_shape, planned_dtype, _) = self._queue[self._position]
        if (name, tuple(shape), dtype) != (planned, planned_shape, planned_dtype):
            raise RuntimeError(
                f"internal error: expected {planned} {planned_shape} {planned_dtype}, got {name} {tuple(shape)} {dtype}"
            )
        if index != self._open_index:
            self._open_shard(index)
        self._position += 1

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._next(name, tensor.shape, tensor.dtype)
        data = tensor.detach().contiguous().cpu().flatten().view(torch.uint8).numpy()
        self._file.write(memoryview(data))

    def add_bytes(self, name: str, shape: tuple, dtype: torch.dtype, source: Path, offset: int, length: int) -> None:
        """Append a tensor's bytes straight from another file (kernel-side copy where the OS allows)."""
        self._next(name, shape, dtype)
        self._copy_range(name, source, offset, length)

    def add_row_blocks(self, name: str, shape: tuple, dtype: torch.dtype, source: Path, offset: int,
                       block_bytes: int, blocks) -> None:
        """Append a tensor made of equal row blocks of a stored tensor (block i of the source, or zeros for None),
        copying runs of consecutive blocks in one kernel-side copy: a head gather without decoding anything."""
        self._next(name, shape, dtype)
        runs = []  # (first source block or None, count)
        for block in blocks:
            if runs and runs[-1][0] is not None and block is not None and block == runs[-1][0] + runs[-1][1]:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            elif runs and runs[-1][0] is None and block is None:
                runs[-1] = (None, runs[-1][1] + 1)
            else:
                runs.append((block, 1))
        for first, count in runs:
            if first is None:  # zeros as a hole in a sparse file: free to write, reads back as zeros
                self._file.seek(block_bytes * count, os.SEEK_CUR)
            else:
                self._copy_range(name, source, offset + first * block_bytes, count * block_bytes)

    def _copy_range(self, name: str, source: Path, offset: int, length: int) -> None:
        with open(source, "rb", buffering=0) as handle:
            copied = 0
            try:
                while copied < length:
                    step = os.copy_file_range(handle.fileno(), self._file.fileno(), length - copied, offset + copied)
                    if step == 0:
                        raise ConversionError(f"{source.name} ended while copying {name}: the shard is truncated.")
                    copied += step
            except (AttributeError, OSError):  # no copy_file_range here: copy through user space
                handle.seek(offset + copied)
                while copied < length:
                    chunk = handle.read(min(64 << 20, length - copied))
                    if not chunk:
                        raise ConversionError(f"{source.name} ended while copying {name}: the shard is truncated.")
                    self._file.write(chunk)
                    copied += len(chunk)

    def close(self) -> list[str]:
        if self._position != len(self._queue):
            missing = self._queue[self._position][1][0]
            raise RuntimeError(f"internal error: conversion stopped before writing {missing}")
        self._close_file()
        if len(self._file_names) > 1:
            weight_map = {
                entry[0]: self._file_names[index] for index, shard in enumerate(self._shards) for entry in shard
            }
            index_data = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index_data, indent=2) + "\n")
        return list(self._file_names)
