# Copyright 2026 The diff-llama authors. Licensed under the Apache License, Version 2.0.
"""What differs between the transformers versions the model supports (setup.cfg's `install_requires`), in one place.

Serving engines pin older transformers than the newest, and a saved model ships this file as remote code, so the
model must run under every version of the range. Each difference is detected from the installed transformers (a
signature, a field, a name), never from its version string, and the modeling code uses only the names below.

The one that bites: newer transformers renamed the KV cache `past_key_values` -> `cache`, in forward arguments and
output fields. A forward that takes only the name the installed transformers does not pass receives the cache in
`**kwargs`, drops it, and generates wrong tokens after the first one without any error; so every forward of the model
takes both names, and outputs use the installed name (the layer, model and heads are the installed Llama's).

Imports only transformers, so that it works as remote code.
"""

import functools
import inspect

from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.utils.deprecation import deprecate_kwarg


# The name under which the installed transformers passes the KV cache between modules and returns it in outputs.
CACHE_NAME = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def accepts_either_cache_name(forward):
    """Decorates a forward so that it takes the KV cache under both names: its own (from its signature) and the other,
    renamed to its own. Where transformers itself says `cache`, `past_key_values` is renamed with transformers' own
    deprecation warning, as Llama's forwards do; elsewhere silently. Serves the attention forwards (`cache`); the model
    classes call Llama's inherited forwards through `with_installed_cache_name`."""
    own = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
    if own == CACHE_NAME == "cache":
        return reachable_by_qualname(deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward))
    other = "past_key_values" if own == "cache" else "cache"

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        if other in kwargs:
            cache = kwargs.pop(other)
            if kwargs.get(own) is None:
                kwargs[own] = cache
        return forward(*args, **kwargs)

    return reachable_by_qualname(wrapper)


def with_installed_cache_name(kwargs: dict) -> dict:
    """A forward's keyword arguments with a KV cache passed as `cache` renamed to the installed transformers' name,
    for Llama's inherited forwards on older transformers. Where the installed name is `cache`, Llama's own forward
    renames `past_key_values` itself, with its deprecation warning."""
    if CACHE_NAME != "cache" and "cache" in kwargs:
        kwargs = dict(kwargs)
        cache = kwargs.pop("cache")
        if kwargs.get(CACHE_NAME) is None:
            kwargs[CACHE_NAME] = cache
    return kwargs


def reachable_by_qualname(wrapper):
    """`functools.wraps` gives the wrapped function's name to its wrapper, so both claim one class attribute. torch's
    AOT compile (vLLM's compile cache) pickles functions by module and qualname, and refuses one that its qualname
    does not lead to; each function inside a chain of wrappers is reachable as `<qualname>.__wrapped__`, so it is
    named that. Returns `wrapper`."""
    outer = wrapper
    while (inner := getattr(outer, "__wrapped__", None)) is not None:
        if inner.__qualname__ == wrapper.__qualname__ and "<locals>" not in inner.__qualname__:
            inner.__qualname__ = outer.__qualname__ + ".__wrapped__"
        outer = inner
    return wrapper


def cache_kwargs(cache) -> dict:
    """`cache` as the keyword argument the installed transformers' modules expect (gradient checkpointing, for one,
    drops the cache only under that name)."""
    return {CACHE_NAME: cache}


def output_cache(outputs):
    """The KV cache of a model output, under either name."""
    return getattr(outputs, CACHE_NAME)


__all__ = [
    "CACHE_NAME",
    "accepts_either_cache_name",
    "cache_kwargs",
    "with_installed_cache_name",
    "output_cache",
    "reachable_by_qualname",
]
