"""bench/v2_fused_probe.py times a fused DIFF V2 core against today's SDPA one; its figures mean something only if
both compute the V2 equations. The probe checks that before timing; this runs the same check, for several layouts,
and shows the check can fail."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import v2_fused_probe  # noqa: E402


@pytest.mark.parametrize("kv_heads, pairs_per_kv, block_size, length",
                         [(3, 3, 16, 50),  # SmolLM2's layout, odd G, a partial last block
                          (1, 1, 7, 23),  # G = 1, one pair
                          (2, 2, 64, 10)])  # one block holds every token
def test_both_v2_cores_match_the_float64_equations(kv_heads, pairs_per_kv, block_size, length):
    assert v2_fused_probe.check_against_reference(kv_heads, pairs_per_kv, block_size, length) < 1e-12


def test_the_check_catches_a_wrong_lambda_gradient(monkeypatch):
    backward = v2_fused_probe.FusedPairAttention.backward

    def wrong_lambda(ctx, grad_output):
        grads = backward(ctx, grad_output)
        return (*grads[:3], -grads[3], *grads[4:])

    monkeypatch.setattr(v2_fused_probe.FusedPairAttention, "backward", staticmethod(wrong_lambda))
    assert v2_fused_probe.check_against_reference() > 1e-3


def test_the_float32_core_matches_sdpa_at_training_size():
    torch.manual_seed(0)
    query, key, value = torch.randn(1, 6, 300, 64), torch.randn(1, 1, 300, 64), torch.randn(1, 1, 300, 64)
    lambdas = torch.rand(1, 300, 3)
    fused = v2_fused_probe.FusedPairAttention.apply(query, key, value, lambdas, 0.125, 128)
    torch.testing.assert_close(fused, v2_fused_probe.sdpa_v2_core(query, key, value, lambdas, 0.125),
                               atol=2e-5, rtol=1e-4)
