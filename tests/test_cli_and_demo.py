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


def test_generate_command_streams_text(tmp_path, tokenizer, capsys):
    model = tiny_model(vocab_size=len(tokenizer))
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    assert main(["generate", str(tmp_path / "m"), "The quick brown", "--max-new-tokens", "8"]) == 0
    greedy = capsys.readouterr().out
    inputs = tokenizer("The quick brown", return_tensors="pt")
    expected = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    new_tokens = expected[0, inputs["input_ids"].shape[1] :]
    assert greedy.strip() == tokenizer.decode(new_tokens, skip_special_tokens=True).strip()
    assert main(["generate", str(tmp_path / "m"), "The quick brown", "--max-new-tokens", "8", "--temperature", "1.0"]) == 0


def test_attention_map_command_writes_pngs(tmp_path, tokenizer, capsys):
    model = tiny_model(vocab_size=len(tokenizer), num_attention_heads=6, num_key_value_heads=3)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    out = tmp_path / "maps"
    assert main(["attention-map", str(tmp_path / "m"), "--text", "The quick brown fox", "--layer", "1",
                 "--output", str(out)]) == 0
    pngs = sorted(out.glob("*.png"))
    assert [p.name for p in pngs] == ["layer1-head0.png", "layer1-head1.png", "layer1-head2.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000 for p in pngs)
    assert main(["attention-map", str(tmp_path / "m"), "--text", "x", "--layer", "7"]) == 2
    assert "--layer must be between 0 and 2" in capsys.readouterr().err


@pytest.mark.parametrize("diff_version", [1, 2])
def test_attention_maps_are_the_models_maps(tokenizer, diff_version):
    from diff_llama.attention_maps import attention_maps

    model = tiny_model(vocab_size=len(tokenizer), num_attention_heads=4, num_key_value_heads=2,
                       diff_version=diff_version)
    first, second, lam, differential, tokens = attention_maps(model, tokenizer, "The quick brown fox", layer=2)
    with torch.no_grad():
        maps = model(**tokenizer("The quick brown fox", return_tensors="pt"), output_attentions=True).attentions[2][0]
    assert first.shape[0] == second.shape[0] == differential.shape[0] == 2 and len(tokens) == maps.shape[-1]
    if diff_version == 1:  # pairs (i, i + H/2), one λ per layer
        torch.testing.assert_close(first, maps[:2])
        torch.testing.assert_close(differential, maps[:2] - lam * maps[2:])
    else:  # pairs (2i, 2i + 1), λ per query token and head
        torch.testing.assert_close(second, maps[1::2])
        assert lam.shape == (len(tokens), 2)
        torch.testing.assert_close(differential, maps[0::2] - lam.T[:, :, None] * maps[1::2])
    torch.testing.assert_close(first.sum(-1), torch.ones(first.shape[:2]))
