"""`auto` precision: bfloat16 only where the hardware computes it (the CPU's capabilities are patched: the test
machine has one CPU)."""

import pytest
import torch

from diff_llama import precision
from diff_llama.adaptation import AdaptationOptions
from diff_llama.adaptation.settings import autocast_dtype


def with_capabilities(monkeypatch, **flags):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, **flags}, raising=False)


@pytest.mark.parametrize("flag", ["amx_bf16", "avx512_bf16", "bf16", "sve_bf16"])
def test_auto_is_bfloat16_on_a_cpu_with_bf16_units(monkeypatch, flag):
    with_capabilities(monkeypatch, **{flag: True})
    assert precision.resolve_dtype("auto") is torch.bfloat16
    assert autocast_dtype(AdaptationOptions()) is torch.bfloat16  # adapt's default autocast


def test_auto_is_float32_where_bf16_would_be_emulated(monkeypatch):
    with_capabilities(monkeypatch, avx512_bf16=False, amx_bf16=False)
    assert precision.resolve_dtype("auto") is torch.float32
    assert autocast_dtype(AdaptationOptions()) is None  # no autocast at all


def test_auto_is_float32_when_torch_cannot_say(monkeypatch):
    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    assert precision.resolve_dtype("auto", "cpu") is torch.float32


def test_named_dtypes_are_themselves_and_anything_else_is_refused():
    assert precision.resolve_dtype("bfloat16") is torch.bfloat16
    assert precision.resolve_dtype("float16") is torch.float16
    assert precision.resolve_dtype("float32") is torch.float32
    assert precision.resolve_dtype("none") is torch.float32
    assert autocast_dtype(AdaptationOptions(autocast="none")) is None
    with pytest.raises(ValueError, match="unknown dtype 'bf16': choose auto, float32, bfloat16 or float16"):
        precision.resolve_dtype("bf16")


def test_adapt_refuses_an_unknown_autocast_before_training(tokenizer):
    from conftest import tiny_model
    from diff_llama.adaptation import adapt

    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        adapt(tiny_model(vocab_size=len(tokenizer)), tokenizer, AdaptationOptions(autocast="fp8", max_steps=1))
