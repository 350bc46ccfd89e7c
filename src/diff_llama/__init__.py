"""diff-llama: the Differential Transformer as a Transformers model.

Importing this package registers `DiffLlamaConfig` (model_type "diff_llama") and every model head with the
Auto classes, next to (not instead of) transformers' built-in `diffllama`.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from . import errors, modeling_diff_llama, options  # noqa: F401  (errors, options: torch-free; the command line may
# have imported them already)
from .configuration_diff_llama import DiffLlamaConfig
from .differential_kernels import DifferentialAttentionInterface
from .modeling_diff_llama import (
    DiffLlamaForCausalLM,
    DiffLlamaForQuestionAnswering,
    DiffLlamaForSequenceClassification,
    DiffLlamaForTokenClassification,
    DiffLlamaModel,
    DiffLlamaPreTrainedModel,
    differential_attention_maps,
)

__version__ = "0.1.0"

_AUTO_CLASSES = {
    AutoModel: DiffLlamaModel,
    AutoModelForCausalLM: DiffLlamaForCausalLM,
    AutoModelForSequenceClassification: DiffLlamaForSequenceClassification,
    AutoModelForTokenClassification: DiffLlamaForTokenClassification,
    AutoModelForQuestionAnswering: DiffLlamaForQuestionAnswering,
}

# exist_ok=True: transformers' built-in classes share our class names, and its mappings look configs up by name;
# registering with exist_ok makes the lookup match our classes by identity first.
AutoConfig.register(DiffLlamaConfig.model_type, DiffLlamaConfig, exist_ok=True)
DiffLlamaConfig.register_for_auto_class()
for _auto_class, _model_class in _AUTO_CLASSES.items():
    _auto_class.register(DiffLlamaConfig, _model_class, exist_ok=True)
    # Makes save_pretrained copy the modeling and configuration files next to the weights (remote code).
    _model_class.register_for_auto_class(_auto_class.__name__)

__all__ = ["DiffLlamaConfig", *modeling_diff_llama.__all__, "DifferentialAttentionInterface"]
