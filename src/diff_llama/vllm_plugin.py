"""vLLM plugin: lets `vllm serve` and `vllm.LLM` load DiffLlama folders from the installed package.

vLLM calls `register` in every process it starts (entry point group `vllm.general_plugins`, declared in setup.cfg),
before it reads a model's config. Importing `diff_llama` registers `diff_llama` with transformers' Auto classes, which
is all vLLM's Transformers backend needs: it builds the model with `AutoModel.from_config`, and DIFF V2's attention
makes one call through transformers' attention interface, which vLLM replaces with its own paged attention.
Without the package, a converted folder still loads in vLLM as remote code (`--trust-remote-code`).

Version 1 cannot be served this way: its attention makes one backend call per value half (see
`differential_kernels.py`), and vLLM refuses such a layer ("does not dispatch through the Transformers attention
interface"). `diff-llama serve --engine vllm` refuses it before starting the engine.
"""


def register() -> None:
    import diff_llama  # noqa: F401  (registration with the Auto classes happens on import)
