"""Reading a LLaMA checkpoint tensor by tensor: a local Transformers folder (single or sharded safetensors),
a `.gguf` file (through transformers' GGUF loader), or a Hub repository id (through huggingface_hub)."""

import json
import os
import re
import struct
from pathlib import Path

import huggingface_hub
import torch
from huggingface_hub.repocard import metadata_load
from transformers import AutoConfig, LlamaConfig

from ..errors import UserError
from ..gguf_llama import load_gguf_causal_lm
from ..gguf_metadata import gguf_fields
from ..resolve import (LICENSE_FILE_STEMS, TOKENIZER_FILE_NAMES, ModelNotFoundError, adapter_refusal, check_hub_model,
                       is_adapter_folder, license_files, resolve_model)
from .errors import ConversionError

LLAMA_ARCHITECTURES = {"LlamaForCausalLM"}
# The one dtype table: torch dtype <-> safetensors name, for reading and for writing.
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}
FLOAT_DTYPES = set(SAFETENSORS_DTYPES.values())
TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
# The files a tokenizer loads from (any of them may be the vocabulary: a GPT-2-style folder has vocab.json and
# merges.txt, no tokenizer.json), and its named chat templates' folder; all travel with the converted model.
TOKENIZER_FILES = (
    *TOKENIZER_FILE_NAMES, "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
TOKENIZER_FILE_PATTERNS = ("*.tiktoken",)
CHAT_TEMPLATES_FOLDER = "additional_chat_templates"


def side_files(folder: Path) -> list[Path]:
    """The source folder's files that the converted folder copies as they are: tokenizer and licence (paths relative
    to `folder`)."""
    found = [Path(name) for name in TOKENIZER_FILES if (folder / name).is_file()]
    found += [path.relative_to(folder) for pattern in TOKENIZER_FILE_PATTERNS for path in sorted(folder.glob(pattern))]
    found += [path.relative_to(folder) for path in sorted((folder / CHAT_TEMPLATES_FOLDER).glob("*.jinja"))]
    found += [Path(path.name) for path in license_files(folder)]
    return found


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

    def tensor_info(self, name: str) -> tuple[tuple, str]:
        """Shape and safetensors dtype name ("BF16", "F32", ...) without loading the tensor."""
        raise NotImplementedError

    def location(self, name: str) -> tuple[Path, int, int] | None:
        """Where a tensor's bytes lie on disk, if they do (then they can be copied without decoding)."""
        return None


class SafetensorsSource(LlamaSource):
    """A Transformers folder; tensors are read from their shards one at a time, never all at once."""

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
        names, self._entries = [], {}
        for file in self._files():
            entries = _read_safetensors_header(file)
            if self._weight_map is not None:
                expected = {n for n, f in self._weight_map.items() if f == file.name}
                absent = expected - set(entries)
                if absent:
                    raise ConversionError(
                        f"{file.name} lacks {len(absent)} tensor(s) that the index puts there (e.g. {min(absent)}): "
                        "the shard is incomplete or the index is stale."
                    )
            for name, entry in entries.items():
                self._entries[name] = (file, *entry)
            names.extend(entries)
        self._names = names

    def _files(self) -> list[Path]:
        if self._weight_map is None:
            return [self._single]
        return [self.folder / f for f in sorted(set(self._weight_map.values()))]

    def tensor_names(self) -> list[str]:
        return list(self._names)

    def location(self, name: str) -> tuple[Path, int, int]:
        """File, byte offset and byte length of a tensor's data, for copying it without decoding."""
        file, _, _, offset, length = self._entries[name]
        return file, offset, length

    def get(self, name: str) -> torch.Tensor:
        if name not in self._entries:
            raise ConversionError(f"the checkpoint has no tensor {name}.")
        file, dtype, shape, offset, length = self._entries[name]
        if dtype not in TORCH_DTYPES:
            raise ConversionError(f"{name} is stored as {dtype}; only F32, F16, BF16 and F64 can be converted.")
        buffer = bytearray(length)
        with open(file, "rb", buffering=0) as handle:
            handle.seek(offset)
            if handle.readinto(buffer) != length:
                raise ConversionError(f"{file} ended while reading {name}: the shard is truncated. Download it again.")
        return torch.frombuffer(buffer, dtype=TORCH_DTYPES[dtype]).reshape(shape)

    def tensor_info(self, name: str) -> tuple[tuple, str]:
        _, dtype, shape, _, _ = self._entries[name]
        return shape, dtype


def _read_safetensors_header(file: Path) -> dict:
    """name -> (dtype, shape, absolute data offset, byte length), checked against the file size.

    Tensors are then read with plain file reads rather than through safetensors' memory map: a mapped checkpoint's
    pages stay in the process's resident memory, which would grow to the whole model while we stream it.
    """
    truncated = ConversionError(f"{file} is truncated or corrupt (its safetensors header does not fit the file). "
                                "Download it again.")
    size = file.stat().st_size
    with open(file, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise truncated
        header_length = struct.unpack("<Q", prefix)[0]
        if 8 + header_length > size:
            raise truncated
        try:
            header = json.loads(handle.read(header_length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise truncated from None
    entries = {}
    try:
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            if 8 + header_length + end > size:
                raise truncated
            entries[name] = (info["dtype"], tuple(info["shape"]), 8 + header_length + begin, end - begin)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise truncated from None
    return entries


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

    def tensor_info(self, name: str) -> tuple[tuple, str]:
        tensor = self._state[name]
        return tuple(tensor.shape), SAFETENSORS_DTYPES[tensor.dtype]


def _read_llama_config(folder: Path) -> LlamaConfig:
    config_file = folder / "config.json"
    if not config_file.is_file():
        if is_adapter_folder(folder):
            raise ConversionError(adapter_refusal(folder, "and convert that folder"))
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
    """Open a local folder, a local `.gguf` file, `smollm2`, or a Hub repository id (see `resolve_model`)."""
    try:
        location = resolve_model(source)
        check_hub_model(location, revision)
    except ModelNotFoundError as error:
        raise ConversionError(str(error)) from None
    if location.gguf_file:
        return _open_gguf(Path(location.name_or_path) / location.gguf_file)
    if location.is_local:
        return SafetensorsSource(Path(location.name_or_path))
    return _open_hub(location.name_or_path, revision)


def _open_gguf(path: Path) -> LlamaSource:
    unreadable = f"{path} cannot be read as a GGUF model ({{}}); if it is truncated or corrupt, download it again."
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as error:
        raise ConversionError(unreadable.format(error)) from None
    _check_llama(config.model_type, getattr(config, "architectures", None), str(path))
    try:
        model = load_gguf_causal_lm(path, dtype=torch.float32)
    except UserError:  # what the file holds that a LLaMA cannot, already said in one line
        raise
    except (OSError, ValueError, struct.error) as error:  # the header was read, the tensors are cut short
        raise ConversionError(unreadable.format(error)) from None
    model.config.quantization_config = None
    del model.config.quantization_config
    return InMemorySource(model, str(path), path.parent)


# What a Hub snapshot fetches: the weights and config, and every file `side_files` copies.
HUB_PATTERNS = [
    "*.json", "*.safetensors", "README.md", *TOKENIZER_FILES, *TOKENIZER_FILE_PATTERNS,
    f"{CHAT_TEMPLATES_FOLDER}/*.jinja",
    *(f"{stem}{suffix}" for stem in LICENSE_FILE_STEMS for suffix in ("", ".*")),
    *(f"{stem.lower()}{suffix}" for stem in LICENSE_FILE_STEMS for suffix in ("", ".*")),
]


def _open_hub(repo_id: str, revision: str | None) -> LlamaSource:
    """Download the safetensors, config and tokenizer files of a Hub repository (cached), then read them locally."""
    try:
        # called through the module, where a test without the Hub puts its fake
        folder = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            # README.md: the model card, whose metadata carries the licence the converted model inherits
            allow_patterns=HUB_PATTERNS,
        )
    except Exception as error:
        raise ConversionError(f"could not fetch {repo_id} from the Hub ({type(error).__name__}: {error}).") from None
    source = SafetensorsSource(Path(folder))
    source.description = repo_id  # what the report and the model card name: the repository, not the cache folder
    return source


# Model-card metadata keys that state a licence (a Hub licence id, or `other` with a name and a link).
LICENSE_KEYS = ("license", "license_name", "license_link")


def source_license(source: LlamaSource) -> dict:
    """The source model's licence as model-card metadata ({"license": "apache-2.0"}, ...); empty when unknown.

    A converted model is a derivative of its source, so it carries the source's licence. It is read from where the
    source states it: a GGUF file's `general.license`, or a folder's (or Hub snapshot's) model card metadata.
    """
    if source.description.endswith(".gguf"):
        return _gguf_license(Path(source.description))
    if source.folder is not None:
        return card_license(source.folder / "README.md")
    return {}


def source_gguf_type(source: LlamaSource) -> str | None:
    """The GGUF file type of a GGUF source (`Q4_1`, `Q8_0`, `F16`, ...: how its weights were stored before they were
    dequantised to float32), or None for other sources or a file that does not say."""
    if not source.description.endswith(".gguf"):
        return None
    value = gguf_fields(Path(source.description)).get("general.file_type")
    try:
        from gguf import LlamaFileType  # optional (transformers' GGUF extra), needed only for a GGUF source

        name = LlamaFileType(int(value)).name
    except (ImportError, TypeError, ValueError):  # an older or unusual file: the card names the format only
        return None
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def card_license(readme: Path) -> dict:
    """The licence a model card's metadata states, as `source_license` gives it; empty when it states none."""
    if not readme.is_file():
        return {}
    try:
        metadata = metadata_load(readme) or {}
    except Exception:  # a card whose metadata does not parse states nothing we can rely on
        return {}
    found = {key: metadata[key] for key in LICENSE_KEYS if isinstance(metadata.get(key), str) and metadata[key]}
    return _as_hub_license(found["license"], found) if "license" in found else {}


def _gguf_license(path: Path) -> dict:
    value = gguf_fields(path).get("general.license")
    return _as_hub_license(value, {}) if isinstance(value, str) and value.strip() else {}


def _as_hub_license(value: str, metadata: dict) -> dict:
    """The Hub accepts licence ids (lower case, like `apache-2.0`, `llama3.2`); anything else is `other` with its name."""
    value = value.strip()
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.+\-]*", value):
        return {**metadata, "license": value.lower()}
    return {**metadata, "license": "other", "license_name": metadata.get("license_name", value)}
