"""The benchmark probes compute what they claim to time: the inductor probe's block (run eagerly here; compiling it
takes a minute) against the float64 per-head reference, and the per-round ratio range of model_benchmark."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from attention_core import _differential_block, blocked_by  # noqa: E402
from model_benchmark import round_ratio_range  # noqa: E402
from test_kernels import per_head_differential  # noqa: E402


def test_inductor_probe_block_matches_the_reference():
    generator = torch.Generator().manual_seed(0)
    batch, heads, tokens, head_dim = 2, 4, 37, 8  # several blocks of 16 rows and a partial last one
    query, key, value = (torch.randn(batch, heads, tokens, head_dim, generator=generator, dtype=torch.float64)
                         for _ in range(3))
    lam = torch.tensor(0.37, dtype=torch.float64)
    got = blocked_by(_differential_block, query, key, value, lam, head_dim**-0.5, 16).transpose(1, 2)
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril().expand(batch, tokens, tokens)
    expected = per_head_differential(query, key, value, lam, causal)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_round_ratio_range_pairs_the_rounds():
    samples = {"prefill (ms)": {"a": [2.0, 4.0, 3.0], "b": [1.0, 5.0, 3.0]}}
    assert round_ratio_range(samples, "prefill (ms)", "a", "b") == (0.8, 2.0)
    assert round_ratio_range({"one round": {"a": [1.0], "b": [2.0]}}, "one round", "a", "b") is None
    assert round_ratio_range(samples, "not measured", "a", "b") is None
