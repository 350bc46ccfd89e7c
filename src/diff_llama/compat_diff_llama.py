# Copyright 2026 The diff-llama authors. Licensed under the Apache License, Version 2.0.
"""What differs between the transformers versions the model supports (setup.cfg's `install_requires`), in one place.

Serving engines pin older transformers than the newest, and a saved model ships this file as remote code, so the
model must run under every version of the range. Each difference is detected from the installed transformers (a
signature, a field, a name), never from its version string, and the modeling code uses only the names below.

The one that bites: newer transformers renamed the KV cache `past_key_values` -> `cache`, in forward arguments,
output fields and `create_causal_mask`. A forward that takes only the name the installed transformers does not pass
receives the cache in `**kwargs`, drops it, and generates wrong tokens after the first one without any error; so every
forward here takes `cache` and also accepts `past_key_values`, and outputs use the installed name.

Imports only torch and transformers, so that it works as remote code.
"""

import functools
import inspect

import torch

from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.utils.deprecation import deprecate_kwarg


# The name under which the installed transformers passes the KV cache between modules and returns it in outputs.
CACHE_NAME = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
_MASK_CACHE_NAME = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def accepts_past_key_values(forward):
    """Decorates a forward whose KV cache argument is `cache`, so that it also takes `past_key_values`: what older
    transformers pass (silently renamed), and a deprecated name where transformers itself uses `cache` (renamed with
    transformers' own deprecation warning)."""
    if CACHE_NAME == "cache":
        return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        if "past_key_values" in kwargs:
            past_key_values = kwargs.pop("past_key_values")
            if kwargs.get("cache") is None:
                kwargs["cache"] = past_key_values
        return forward(*args, **kwargs)

    return wrapper


def cache_kwargs(cache) -> dict:
    """`cache` as the keyword argument the installed transformers' modules expect (gradient checkpointing, for one,
    drops the cache only under that name)."""
    return {CACHE_NAME: cache}


def output_cache(outputs):
    """The KV cache of a model output, under either name."""
    return getattr(outputs, CACHE_NAME)


def causal_mask(config, inputs_embeds, attention_mask, cache, position_ids):
    """`create_causal_mask`, with the cache under the name the installed version's signature has."""
    return create_causal_mask(
        config=config,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        position_ids=position_ids,
        **{_MASK_CACHE_NAME: cache},
    )


try:
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # older transformers slice in each model's forward

    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """The positions whose logits are needed: the last `logits_to_keep` (0: all), or those a tensor indexes."""
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden_states[:, slice_indices, :]


__all__ = [
    "CACHE_NAME",
    "accepts_past_key_values",
    "cache_kwargs",
    "causal_mask",
    "output_cache",
    "slice_logits_to_keep",
]
