"""`diff-llama convert --diff-version 2`: the exact conversion of docs/maths.md ("The exact conversion to DIFF V2"), on real (small, random)
LLaMA checkpoints written by transformers."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from diff_llama import DiffLlamaForCausalLM
from diff_llama.cli import main
from diff_llama.conversion.converter import ConversionOptions, convert_llama_to_diff_llama
from conftest import make_llama

FAST = dict(eval_tokens=1024, seq_len=128)


def _inputs(vocab, seed=0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (3, 20), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :7] = 0
    return input_ids, attention_mask


def _assert_float64_logits_match(llama, converted, vocab):
    """The two float64 models' logits on a left-padded batch (padding excluded), to the tolerance of exact maths."""
    input_ids, attention_mask = _inputs(vocab)
    real = attention_mask.bool()
    with torch.no_grad():
        expected = llama(input_ids, attention_mask=attention_mask).logits
        logits = converted(input_ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=1e-6)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 1), (8, 2), (6, 6)])
def test_converted_model_computes_the_llama_function(tmp_path, tokenizer, heads, kv_heads):
    source = make_llama(tmp_path / "llama", tokenizer, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        hidden_size=8 * heads)
    report = convert_llama_to_diff_llama(str(source), str(tmp_path / "v2"), ConversionOptions(diff_version=2, **FAST),
                                         progress=False)
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "v2").eval()
    assert isinstance(converted, DiffLlamaForCausalLM)
    assert converted.config.diff_version == 2
    assert converted.config.num_attention_heads == 2 * heads and converted.config.num_key_value_heads == kv_heads
    llama = LlamaForCausalLM.from_pretrained(source).eval()
    input_ids, attention_mask = _inputs(len(tokenizer))
    real = attention_mask.bool()
    with torch.no_grad():
        # float64 (O − 0.5·O and 2 x o_proj are exact): what is left is LlamaRMSNorm's and Llama's rotary embedding's
        # float32 internals (transformers' LLaMA drops to float32 there even in a float64 model; ours does not).
        expected = llama.double()(input_ids, attention_mask=attention_mask).logits
        logits = converted.double()(input_ids, attention_mask=attention_mask).logits
        torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=1e-6)
        expected = llama.float()(input_ids, attention_mask=attention_mask).logits
        logits = converted.float()(input_ids, attention_mask=attention_mask).logits
        assert (logits[real] - expected[real]).abs().max() < 1e-4
    quality = report.quality
    assert abs(quality["converted_perplexity"] / quality["source_perplexity"] - 1) < 1e-5
    assert quality["kl_source_to_converted"] < 1e-8


@pytest.mark.parametrize("evaluate", [True, False])
def test_a_llama_with_biases_converts_exactly(tmp_path, tokenizer, evaluate):
    """attention_bias and mlp_bias (llamafied Qwen checkpoints have them): q_proj's bias is paired with its rows, the
    others are copied, o_proj's undoubled. Biases drawn at random (a fresh LLaMA's are zeros, which any mistake would
    keep). Streamed (stored bytes gathered) and evaluated (layers built in memory) alike."""
    source = make_llama(tmp_path / "llama", tokenizer, attention_bias=True, mlp_bias=True)
    weights = load_file(source / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    biases = {name: torch.randn(tensor.shape, generator=generator) for name, tensor in weights.items()
              if name.endswith(".bias")}
    assert len(biases) == 7 * 3  # q, k, v, o, gate, up, down in each of 3 layers
    save_file({**weights, **biases}, source / "model.safetensors", metadata={"format": "pt"})
    report = convert_llama_to_diff_llama(str(source), str(tmp_path / "v2"),
                                         ConversionOptions(evaluate=evaluate, **FAST), progress=False)
    llama = LlamaForCausalLM.from_pretrained(source, dtype=torch.float64).eval()
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "v2", dtype=torch.float64).eval()
    assert converted.config.attention_bias and converted.config.mlp_bias
    assert torch.equal(converted.model.layers[1].self_attn.o_proj.bias, llama.model.layers[1].self_attn.o_proj.bias)
    _assert_float64_logits_match(llama, converted, len(tokenizer))
    if evaluate:
        assert report.quality["kl_source_to_converted"] < 1e-8


def test_version_1_refuses_a_llama_with_biases_and_points_to_diff_v2(tmp_path, tokenizer, capsys):
    source = make_llama(tmp_path / "llama", tokenizer, attention_bias=True)
    assert main(["convert", str(source), str(tmp_path / "v1"), "--diff-version", "1"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "this LLaMA has attention or MLP biases, which version 1's conversion does not take; DIFF V2 (the default: "
        "drop --diff-version 1) converts it exactly.")
    assert not (tmp_path / "v1").exists()


@pytest.mark.parametrize("matrices,norms", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                            (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("evaluate", [True, False])
def test_a_checkpoint_stored_in_several_dtypes_converts_exactly(tmp_path, tokenizer, matrices, norms, evaluate):
    """A checkpoint whose norms are stored in another dtype than its matrices: every tensor must come out unrounded
    (the output takes the narrowest dtype that holds them all), so the conversion stays exact."""
    source = make_llama(tmp_path / "llama", tokenizer)
    weights = load_file(source / "model.safetensors")
    mixed = {name: tensor.to(norms if "norm" in name else matrices) for name, tensor in weights.items()}
    save_file(mixed, source / "model.safetensors", metadata={"format": "pt"})
    convert_llama_to_diff_llama(str(source), str(tmp_path / "v2"),
                                ConversionOptions(diff_version=2, evaluate=evaluate, **FAST), progress=False)
    wide = torch.promote_types(matrices, norms)
    assert {tensor.dtype for tensor in load_file(tmp_path / "v2" / "model.safetensors").values()} == {wide}
    llama = LlamaForCausalLM.from_pretrained(source, dtype=torch.float64).eval()
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "v2", dtype=torch.float64).eval()
    for name, tensor in mixed.items():  # loaded in float64, the source's own values
        assert torch.equal(llama.state_dict()[name], tensor.double()), name
    _assert_float64_logits_match(llama, converted, len(tokenizer))


def test_weights_follow_the_spec_and_streaming_writes_the_same_bytes(tmp_path, tokenizer):
    source = make_llama(tmp_path / "llama", tokenizer)  # H = 9, G = 3, head_dim 8
    convert_llama_to_diff_llama(str(source), str(tmp_path / "evaluated"), ConversionOptions(diff_version=2, **FAST),
                                progress=False)
    # No evaluation: nothing runs the model, the tensors are streamed (q as row-block copies of the stored bytes).
    convert_llama_to_diff_llama(str(source), str(tmp_path / "streamed"),
                                ConversionOptions(diff_version=2, evaluate=False), progress=False)
    evaluated = load_file(tmp_path / "evaluated" / "model.safetensors")
    streamed = load_file(tmp_path / "streamed" / "model.safetensors")
    assert evaluated.keys() == streamed.keys()
    for name in evaluated:
        assert torch.equal(evaluated[name], streamed[name]), name
    llama = load_file(source / "model.safetensors")
    for layer in range(3):
        p = f"model.layers.{layer}.self_attn."
        q = llama[p + "q_proj.weight"].view(9, 8, -1)
        new_q = evaluated[p + "q_proj.weight"].view(18, 8, -1)
        for j in range(9):
            assert torch.equal(new_q[2 * j], q[j]) and torch.equal(new_q[2 * j + 1], q[j])
        assert torch.equal(evaluated[p + "k_proj.weight"], llama[p + "k_proj.weight"])
        assert torch.equal(evaluated[p + "v_proj.weight"], llama[p + "v_proj.weight"])
        assert torch.equal(evaluated[p + "o_proj.weight"], 2 * llama[p + "o_proj.weight"])
        assert torch.equal(evaluated[p + "lambda_proj.weight"], torch.zeros(9, 72))
    config = json.loads((tmp_path / "streamed" / "config.json").read_text())
    assert config["diff_version"] == 2 and config["num_attention_heads"] == 18


def test_one_training_step_leaves_the_exact_start(tmp_path, tokenizer):
    """At the start the two maps of a pair receive +1 and −λ = −0.5 times the same signal, and λ a non-zero one: one
    SGD step moves both heads of every pair, differently (exactly −0.5 times), and the λ projection."""
    source = make_llama(tmp_path / "llama", tokenizer)
    convert_llama_to_diff_llama(str(source), str(tmp_path / "v2"), ConversionOptions(diff_version=2, evaluate=False),
                                progress=False)
    model = DiffLlamaForCausalLM.from_pretrained(tmp_path / "v2", dtype=torch.float64).train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    input_ids, _ = _inputs(len(tokenizer))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    model(input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    for layer in range(3):
        attention = model.model.layers[layer].self_attn
        delta_q = (attention.q_proj.weight - before[f"model.layers.{layer}.self_attn.q_proj.weight"]).view(9, 2, 8, -1)
        assert (delta_q[:, 0].flatten(1).norm(dim=1) > 0).all() and (delta_q[:, 1].flatten(1).norm(dim=1) > 0).all()
        torch.testing.assert_close(delta_q[:, 1], -0.5 * delta_q[:, 0], rtol=1e-9, atol=1e-15)
        lambda_proj = attention.differential_lambda.lambda_proj.weight
        assert (lambda_proj != 0).any(axis=1).all()  # every differential head's λ moves


def test_command_line_and_remote_code(tmp_path, tokenizer, capsys):
    source = make_llama(tmp_path / "llama", tokenizer)
    out = tmp_path / "v2"
    assert main(["convert", str(source), str(out), "--diff-version", "2", "--eval-tokens", "1024"]) == 0
    printed = capsys.readouterr().out
    assert "DIFF V2, exact" in printed and "(1.000x)" in printed
    assert (out / "modeling_diff_llama.py").is_file()
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["options"]["diff_version"] == 2 and report["layers"] == []


def test_fine_tunes_like_its_source_and_recover_refuses(tmp_path, tokenizer):
    """The default `diff-llama train` (full and LoRA) improves the exact conversion as much as its source (within
    1.05x of the source's held-out perplexity after the same steps)."""
    from conftest import SAMPLE_TEXT
    from diff_llama.evaluation import perplexity
    from diff_llama.recovery import RecoveryOptions, recover
    from diff_llama.training import FineTuneOptions, train

    source = make_llama(tmp_path / "llama", tokenizer)
    convert_llama_to_diff_llama(str(source), str(tmp_path / "v2"), ConversionOptions(diff_version=2, evaluate=False),
                                progress=False)
    data = tmp_path / "train.txt"
    data.write_text(SAMPLE_TEXT * 4)
    held_out = tokenizer(SAMPLE_TEXT[::-1] + SAMPLE_TEXT, return_tensors="pt").input_ids
    for lora in (False, True):
        results = {}
        for name in ("llama", "v2"):
            output = train(str(tmp_path / name), FineTuneOptions(
                data=str(data), output=str(tmp_path / f"{name}-{lora}"), lora=lora, merge=lora, max_steps=6,
                batch_size=4, block_size=32, learning_rate=1e-3, logging_steps=2, monitor=False))
            results[name] = perplexity(AutoModelForCausalLM.from_pretrained(output), held_out, window=64)
        before = perplexity(AutoModelForCausalLM.from_pretrained(source), held_out, window=64)
        assert results["llama"] < 0.9 * before  # the training moved the source
        assert results["v2"] <= 1.05 * results["llama"], (lora, before, results)
    # recover refuses from the config alone, before it loads anything or makes its output (weights unreadable here)
    (tmp_path / "v2" / "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(ValueError, match="DIFF V2"):
        recover(str(tmp_path / "v2"), RecoveryOptions(output=str(tmp_path / "recovered"), source=str(source),
                                                      max_steps=1))
    assert not (tmp_path / "recovered").exists()


def test_diff_v2_is_the_default_and_refuses_version_1_options(tmp_path, tokenizer, capsys):
    source = make_llama(tmp_path / "llama", tokenizer)
    assert ConversionOptions().diff_version == 2
    capsys.readouterr()  # forget the setup's output (progress bars)
    assert main(["convert", str(source), str(tmp_path / "split"), "--head-layout", "split",
                 "--calibration-tokens", "512"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--head-layout, --calibration-tokens only apply to a version 1" in err
    assert "--diff-version 1" in err and not (tmp_path / "split").exists()
    # `--calibration none` says what DIFF V2 does anyway, so it is accepted
    assert main(["convert", str(source), str(tmp_path / "v2"), "--calibration", "none", "--no-evaluate"]) == 0
    assert json.loads((tmp_path / "v2" / "config.json").read_text())["diff_version"] == 2


@pytest.mark.parametrize("options, says", [
    (["--seq-len", "0"], "--seq-len must be 1 or more tokens, not 0."),
    (["--max-shard-size", "12XB"], "--max-shard-size '12XB' is not a size: give a number with a unit, such as 500MB"),
    (["--max-shard-size", "0"], "--max-shard-size '0' is not a size"),
    (["--diff-version", "1", "--head-norm-headroom", "-1"], "--head-norm-headroom must be 0 (keep rms_norm_eps) or"),
])
def test_convert_refuses_an_option_out_of_range_before_reading_the_source(tmp_path, tokenizer, capsys, options, says):
    """Each of these failed inside the conversion with a traceback, or (a negative headroom) made a worse model
    without a word."""
    source = make_llama(tmp_path / "llama", tokenizer)
    capsys.readouterr()
    assert main(["convert", str(source), str(tmp_path / "out"), *options]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and says in err, err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["llama"]
