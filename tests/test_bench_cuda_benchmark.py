"""bench/cuda_benchmark.py runs only on a GPU, and a GPU is lent for minutes: its table must be right the first time.
These check, on the CPU, the report of a run that measured some models and figures only (--models, --figures)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import cuda_benchmark  # noqa: E402


def test_a_decode_only_report_has_the_measured_models_and_their_ratios_only(tmp_path):
    samples = {
        "llama": [{"decode b1 (tokens/s)": 100.0}, {"decode b1 (tokens/s)": 80.0}],
        "diff-llama": [{"decode b1 (tokens/s)": 50.0}, {"decode b1 (tokens/s)": 40.0}],
        "diff-llama generic": [{"decode b1 (tokens/s)": 40.0}, {"decode b1 (tokens/s)": 40.0}],
    }
    medians = {name: {"decode b1 (tokens/s)": (rows[0]["decode b1 (tokens/s)"] + rows[1]["decode b1 (tokens/s)"]) / 2}
               for name, rows in samples.items()}
    results = {"device": "test", "torch": "x", "rounds": 2, "figures": ["decode"], "prompt_tokens": 512,
               "command": "python bench/cuda_benchmark.py --figures decode", "shapes": {
                   "smollm2-135m": {"medians": medians, "samples": samples}}}
    cuda_benchmark.write(results, tmp_path, "t")
    table = (tmp_path / "t.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| figure | llama"))
    assert header.split(" | ")[1:] == ["llama", "diff-llama", "diff-llama generic", "diff-llama / llama",
                                       "diff-llama generic / llama", "diff-llama / diff-llama generic |"]
    row = next(line for line in table.splitlines() if line.startswith("| decode b1"))
    # Inverted tokens/s: 90 against 45 is 2x the time per token; 45 against 40 is 0.89x.
    assert row.split(" | ")[4:] == ["2.00x", "2.25x", "0.89x |"]
    assert "64 tokens after a 512-token prompt" in table
    spread = [line for line in table.splitlines() if line.startswith("| decode b1")][1]
    assert spread == "| decode b1 (tokens/s) | 1.25 | 1.25 | 1.00 |"
