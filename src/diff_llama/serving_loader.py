"""How `diff-llama serve`'s server loads a model: transformers serve's `ModelLoader`, with DiffLlama folders and LoRA
adapter folders loaded through this package (see `diff_llama.serving`).

transformers serve loads each model in a process of its own, spawned: that process unpickles the server's loader,
which is why this class lives at module level in a module of its own (unpickling it imports this package, and so
registers the Auto classes there too), apart from `diff_llama.serving`, which `diff-llama serve --help` imports
without transformers' server.
"""

from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.cli.serving.model_manager import ModelLoader
from transformers.cli.serving.utils import parse_model_id

from .configuration_diff_llama import DiffLlamaConfig
from .gguf_llama import load_gguf_causal_lm
from .resolve import adapter_base, find_model, is_adapter_folder, load_causal_lm, load_tokenizer


class DiffLlamaModelLoader(ModelLoader):
    """transformers serve's loader. A DiffLlama loads with this package's classes (transformers' own loader takes the
    class named in config.json from transformers' namespace: the built-in `diffllama`, another model), or with
    `trust_remote_code` with the code saved in its folder; its processor is its tokenizer. A LoRA adapter folder
    loads on its base, merged into it: one plain model, as fast as the base. A local GGUF file loads whole
    (`gguf_llama`: a LLaMA's biases and RoPE scaling too). Any other model loads as transformers serve loads it."""

    def load_config(self, model_id: str):
        """An adapter folder's are its base's."""
        repo = parse_model_id(model_id)[0]
        if is_adapter_folder(repo):
            return super().load_config(adapter_base(find_model(repo, adapters=True)))
        return super().load_config(model_id)

    def load_processor(self, model_id: str):
        """A DiffLlama reads text only: its tokenizer, without the image and video processor files that AutoProcessor
        asks for first (from a Hub id, a request each, and a minute of retries each offline)."""
        repo, revision, gguf_file = parse_model_id(model_id)
        if gguf_file is None and is_adapter_folder(repo):
            return load_tokenizer(repo)
        if gguf_file is None and is_diff_llama(self._config(repo, revision)):
            return AutoTokenizer.from_pretrained(repo, revision=revision, trust_remote_code=self.trust_remote_code)
        return super().load_processor(model_id)

    def _load_model(self, model_id: str, tqdm_class=None, progress_callback=None):
        repo, revision, gguf_file = parse_model_id(model_id)
        if gguf_file is None and is_adapter_folder(repo):
            return load_causal_lm(repo, dtype=self.dtype, device_map=self.device,
                                  attn_implementation=self.attn_implementation)
        if gguf_file is not None and (Path(repo) / gguf_file).is_file():
            # transformers' loader would skip a LLaMA's biases and RoPE scaling in the file (`gguf_llama`)
            quantization = self.get_quantization_config()
            return load_gguf_causal_lm(Path(repo) / gguf_file, dtype=self.dtype, device_map=self.device,
                                       attn_implementation=self.attn_implementation, tqdm_class=tqdm_class,
                                       **({"quantization_config": quantization} if quantization else {}))
        config = None if gguf_file is not None else self._config(repo, revision)
        if config is None or not is_diff_llama(config):
            return super()._load_model(model_id, tqdm_class=tqdm_class, progress_callback=progress_callback)
        kwargs = {"revision": revision, "attn_implementation": self.attn_implementation, "dtype": self.dtype,
                  "device_map": self.device, "trust_remote_code": self.trust_remote_code, "tqdm_class": tqdm_class}
        if (quantization_config := self.get_quantization_config()) is not None:
            kwargs["quantization_config"] = quantization_config
        model_class = AutoModelForCausalLM
        remote = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM")
        if self.trust_remote_code and remote:
            # The code saved with the model, even where this package is installed (the Auto classes would prefer the
            # registered package classes).
            from transformers.dynamic_module_utils import get_class_from_dynamic_module

            model_class = get_class_from_dynamic_module(remote, repo, revision=revision)
        return model_class.from_pretrained(repo, **kwargs)

    def _config(self, repo: str, revision: str | None):
        return AutoConfig.from_pretrained(repo, revision=revision, trust_remote_code=self.trust_remote_code)


def is_diff_llama(config) -> bool:
    return config.model_type == DiffLlamaConfig.model_type

