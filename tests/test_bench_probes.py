"""model_benchmark's per-round ratio range: the two models of a ratio were measured back to back in each round."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from model_benchmark import round_ratio_range  # noqa: E402


def test_round_ratio_range_pairs_the_rounds():
    samples = {"prefill (ms)": {"a": [2.0, 4.0, 3.0], "b": [1.0, 5.0, 3.0]}}
    assert round_ratio_range(samples, "prefill (ms)", "a", "b") == (0.8, 2.0)
    assert round_ratio_range({"one round": {"a": [1.0], "b": [2.0]}}, "one round", "a", "b") is None
    assert round_ratio_range(samples, "not measured", "a", "b") is None
