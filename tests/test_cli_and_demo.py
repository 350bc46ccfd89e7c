import math
import subprocess
import sys

import pytest
import torch
import transformers

from conftest import tiny_model
from diff_llama.cli import main
from diff_llama.evaluation import perplexity


def test_perplexity_matches_direct_cross_entropy():
    model = tiny_model()
    ids = torch.randint(3, 128, (50,))
    with torch.no_grad():
        logits = model(ids[None, :-1]).logits[0]
    expected = math.exp(torch.nn.functional.cross_entropy(logits, ids[1:]).item())
    assert perplexity(model, ids, window=64) == pytest.approx(expected, rel=1e-5)
    # Windows score every token once: shorter windows lose context, so the value changes but stays finite.
    assert math.isfinite(perplexity(model, ids, window=7))


def test_demo_trains_saves_and_generates(tmp_path):
    from diff_llama.demo import run_demo

    result = run_demo(tmp_path / "demo", steps=25, seq_len=64, batch_size=4)
    assert result["perplexity_after"] < result["perplexity_before"]
    assert result["generated"].startswith("Return a new list")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "demo")
    assert reloaded.config.num_key_value_heads == 3


def test_export_builtin_command(tmp_path, capsys):
    tiny_model(num_attention_heads=8, num_key_value_heads=2).save_pretrained(tmp_path / "ours")
    assert main(["export-builtin", str(tmp_path / "ours"), str(tmp_path / "builtin")]) == 0
    assert type(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "builtin")) is transformers.DiffLlamaForCausalLM
    with pytest.raises(SystemExit, match="already exists"):
        main(["export-builtin", str(tmp_path / "ours"), str(tmp_path / "builtin")])


def test_console_help_lists_commands():
    result = subprocess.run([sys.executable, "-m", "diff_llama.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "demo" in result.stdout and "export-builtin" in result.stdout
