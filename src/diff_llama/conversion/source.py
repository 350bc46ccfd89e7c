"""Reading a LLaMA checkpoint tensor by tensor: a local Transformers folder (single or sharded safetensors),
a `.gguf` file (through transformers' GGUF loader), or a Hub repository id (through huggingface_hub)."""

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import LlamaConfig

from .errors import ConversionError

LLAMA_ARCHITECTURES = {"LlamaForCausalLM"}
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "chat_template.jinja",
    "added_tokens.json",
)


class LlamaSource:
    """A LLaMA checkpoint: its config and a `get(name)` that loads one tensor at a time."""

    def __init__(self, config: LlamaConfig, description: str, folder: Path | None):
        self.config = config
        self.description = description
        self.folder = folder  # where tokenizer and generation config files live, if any

    def tensor_names(self) -> list[str]:
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def has(self, name: str) -> bool:
        return name in self._names_set

    @property
    def _names_set(self):
        if not hasattr(self, "_names_cache"):
            self._names_cache = set(self.tensor_names())
        return self._names_cache


class SafetensorsSource(LlamaSource):
    """A Transformers folder; tensors are memory-mapped from their shards, never loaded all at once."""

    def __init__(self, folder: Path):
        config = _read_llama_config(folder)
        super().__init__(config, str(folder), folder)
        index_file = folder / "model.safetensors.index.json"
        single_file = folder / "model.safetensors"
        if index_file.exists():
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as error:
                raise ConversionError(f"{index_file} is not a valid safetensors index ({error}).") from None
            missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
            if missing:
                raise ConversionError(
                    f"{index_file.name} names shard(s) that are not in {folder}: {', '.join(missing)}. "
                    "Download the missing files (or fix the index) and run again."
                )
            self._weight_map = weight_map
        elif single_file.exists():
            self._weight_map = None
            self._single = single_file
        elif list(folder.glob("*.bin")) or list(folder.glob("*.pth")):
            raise ConversionError(
                f"{folder} has only PyTorch pickle weights; re-save it with safetensors first "
                "(`model.save_pretrained(folder)` with transformers 5 writes safetensors)."
            )
        else:
            raise ConversionError(f"{folder} has no model.safetensors or model.safetensors.index.json.")
        self._handles = {}
        names = []
        for file in self._files():
            handle = self._open(file)
            file_names = list(handle.keys())
            if self._weight_map is not None:
                expected = {n for n, f in self._weight_map.items() if f == file.name}
                absent = expected - set(file_names)
                if absent:
                    raise ConversionError(
                        f"{file.name} lacks {len(absent)} tensor(s) that the index puts there (e.g. {min(absent)}): "
                        "the shard is incomplete or the index is stale."
                    )
            names.extend(file_names)
        self._names = names
        self._location = (
            {n: folder / f for n, f in self._weight_map.items()}
            if self._weight_map is not None
            else dict.fromkeys(names, single_file)
        )

    def _files(self) -> list[Path]:
        if self._weight_map is None:
            return [self._single]
        return [self.folder / f for f in sorted(set(self._weight_map.values()))]

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(file, framework="pt")
            except Exception as error:  # safetensors raises its own error types for truncated/corrupt files
                raise ConversionError(
                    f"{file.name} cannot be read as safetensors ({error}); the file is truncated or corrupt. "
                    "Download it again."
                ) from None
        return self._handles[file]

    def tensor_names(self) -> list[str]:
        return list(self._names)

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._open(self._location[name]).get_tensor(name)
        except KeyError:
            raise ConversionError(f"the checkpoint has no tensor {name}.") from None
        except Exception as error:
            raise ConversionError(
                f"reading {name} from {self._location[name].name} failed ({error}); the shard is truncated or "
                "corrupt. Download it again."
            ) from None

    def tensor_bytes(self, name: str) -> int:
        handle = self._open(self._location[name])
        sl = handle.get_slice(name)
        shape, dtype = sl.get_shape(), sl.get_dtype()
        itemsize = {"F64": 8, "F32": 4, "I64": 8, "I32": 4}.get(dtype, 2)
        numel = 1
        for s in shape:
            numel *= s
        return numel * itemsize


class InMemorySource(LlamaSource):
    """A LLaMA loaded through transformers (the GGUF path): the dequantized weights are in memory."""

    def __init__(self, model, description: str, folder: Path | None):
        super().__init__(model.config, description, folder)
        self._state = {k: v.detach() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            self._state.pop("lm_head.weight", None)

    def tensor_names(self) -> list[str]:
        return list(self._state)

    def get(self, name: str) -> torch.Tensor:
        return self._state[name]

    def tensor_bytes(self, name: str) -> int:
        t = self._state[name]
        return t.numel() * t.element_size()


def _read_llama_config(folder: Path) -> LlamaConfig:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConversionError(f"{folder} has no config.json; point at a Transformers LLaMA folder or a .gguf file.")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ConversionError(f"{config_file} is not valid JSON ({error}).") from None
    _check_llama(raw.get("model_type"), raw.get("architectures"), str(folder))
    return LlamaConfig.from_pretrained(folder)


def _check_llama(model_type, architectures, where: str):
    architectures = architectures or []
    if model_type != "llama" or (architectures and not set(architectures) & LLAMA_ARCHITECTURES):
        found = ", ".join(architectures) or f"model_type {model_type!r}"
        raise ConversionError(
            f"{where} is not a LLaMA checkpoint (found {found}); the converter takes LlamaForCausalLM models only."
        )


def open_source(source: str | os.PathLike, revision: str | None = None) -> LlamaSource:
    """Open a local folder, a local `.gguf` file, or (anything else) a Hub repository id."""
    path = Path(source)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ConversionError(f"{path} does not exist.")
        return _open_gguf(path)
    if path.is_dir():
        return SafetensorsSource(path)
    if path.exists():
        raise ConversionError(f"{path} is neither a folder nor a .gguf file.")
    if str(source).startswith((".", "/", "~")) or str(source).count("/") != 1:
        raise ConversionError(f"{source} does not exist (and is not a Hub repository id of the form owner/name).")
    return _open_hub(str(source), revision)


def _open_gguf(path: Path) -> LlamaSource:
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as error:
        raise ConversionError(f"{path} cannot be read as GGUF ({error}).") from None
    _check_llama(config.model_type, getattr(config, "architectures", None), str(path))
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.config.quantization_config = None
    del model.config.quantization_config
    return InMemorySource(model, str(path), path.parent)


def _open_hub(repo_id: str, revision: str | None) -> LlamaSource:
    """Download the safetensors, config and tokenizer files of a Hub repository (cached), then read them locally."""
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=["*.json", "*.safetensors", "tokenizer.model", "*.jinja"],
        )
    except Exception as error:
        raise ConversionError(f"could not fetch {repo_id} from the Hub ({type(error).__name__}: {error}).") from None
    return SafetensorsSource(Path(folder))
