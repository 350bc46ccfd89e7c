"""The LLaMA -> DiffLlama converter on real (small, random) LLaMA checkpoints written by transformers."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

from conftest import FAST, folder_checksum, make_llama
from diff_llama import DiffLlamaForCausalLM
from diff_llama.cli import main
from diff_llama.conversion.converter import ConversionOptions, convert_llama_to_diff_llama, diff_config_for
from diff_llama.conversion.errors import ConversionError
from diff_llama.conversion.version1 import (
    convert_attention_weights,
    expand_layout,
    split_layout,
    zero_lambda_vectors,
)
from diff_llama.evaluation import perplexity
from diff_llama.lambda_diff_llama import lambda_init_fn
from diff_llama.modeling_diff_llama import DiffLlamaAttention

# ---- the head layout, checked against LLaMA's own attention ---------------------------------------------------


def _attention_pair(layout_fn, heads, kv_heads, tie_maps=False):
    hidden = heads * 8
    config = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8,
                         max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    llama = LlamaAttention(config, layer_idx=2).double()
    if tie_maps:  # every query head and every key head identical: all softmax maps coincide
        with torch.no_grad():
            llama.q_proj.weight.copy_(llama.q_proj.weight[:8].repeat(heads, 1))
            llama.k_proj.weight.copy_(llama.k_proj.weight[:8].repeat(kv_heads, 1))
    layout = layout_fn(heads, kv_heads)
    diff_config = diff_config_for(config, layout)
    diff_config._attn_implementation = "eager"
    diff = DiffLlamaAttention(diff_config, layer_idx=2).double()
    weights = convert_attention_weights(
        llama.q_proj.weight, llama.k_proj.weight, llama.v_proj.weight, llama.o_proj.weight, layout, 8
    )
    with torch.no_grad():
        for name, tensor in weights.items():
            getattr(diff, name).weight.copy_(tensor)
        for name, vector in zero_lambda_vectors(lambda_init_fn(2), 8, dtype=torch.float64).items():
            getattr(diff.differential_lambda, name).copy_(vector)
        diff.o_proj.weight.div_(1 - diff.differential_lambda.lambda_init)
    diff.head_norm = torch.nn.Identity()  # isolate the layout from the per-head norm
    hidden = torch.randn(2, 10, config.hidden_size, dtype=torch.float64)
    rope = LlamaRotaryEmbedding(config)(hidden, torch.arange(10)[None])
    with torch.no_grad():
        return llama(hidden, rope, None)[0], diff(hidden, rope, None)[0]


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 2), (6, 1), (8, 8)])
def test_expand_layout_reproduces_llama_attention(heads, kv_heads):
    expected, got = _attention_pair(expand_layout, heads, kv_heads)
    # Llama's eager attention takes its softmax in float32, hence 1e-6 rather than float64 precision.
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 2), (8, 4)])
def test_split_layout_is_exact_when_paired_maps_coincide(heads, kv_heads):
    expected, got = _attention_pair(split_layout, heads, kv_heads, tie_maps=True)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    expected, got = _attention_pair(split_layout, heads, kv_heads, tie_maps=False)
    assert (got - expected).abs().max() > 1e-3  # in general the second map's head is lost: the reason for expand


def test_zero_lambda_is_zero_and_not_a_saddle():
    for layer in range(6):
        vectors = {k: v.clone().requires_grad_() for k, v in zero_lambda_vectors(lambda_init_fn(layer), 16).items()}
        lam = (torch.exp(vectors["lambda_q1"] @ vectors["lambda_k1"]) - torch.exp(vectors["lambda_q2"] @ vectors["lambda_k2"])
               + lambda_init_fn(layer))
        assert abs(lam.item()) < 1e-6
        lam.backward()
        assert all(v.grad.norm() > 0.1 for v in vectors.values())


def test_an_adam_step_moves_the_converted_lambda_a_little():
    """Adam moves every channel with a gradient by about lr, so λ's first step is about lr times the λ vectors' L1
    norms. Dense vectors made that ~0.2 at diff-llama train's λ learning rate (1e-2): 3 steps took SmolLM2's
    conversion from 10.78 to 11.19 held-out perplexity while the source improved to 10.37."""
    for layer in (0, 5, 29):
        vectors = {k: torch.nn.Parameter(v) for k, v in zero_lambda_vectors(lambda_init_fn(layer), 64, seed=layer).items()}
        optimizer = torch.optim.AdamW(vectors.values(), lr=1e-2, weight_decay=0.0)

        def lam():
            return (torch.exp(vectors["lambda_q1"] @ vectors["lambda_k1"])
                    - torch.exp(vectors["lambda_q2"] @ vectors["lambda_k2"]) + lambda_init_fn(layer))

        lam().backward()  # a loss with dL/dλ = 1
        optimizer.step()
        assert 1e-3 < -lam().item() < 0.035


# ---- whole conversions ---------------------------------------------------------------------------------------


def test_default_conversion_keeps_llama_quality_and_report_is_true(tmp_path, llama_dir, tokenizer):
    before = folder_checksum(llama_dir)
    out = tmp_path / "diff"
    report = convert_llama_to_diff_llama(str(llama_dir), str(out), ConversionOptions(**FAST), progress=False)
    assert folder_checksum(llama_dir) == before  # the input is never modified
    q = report.quality
    assert q["converted_perplexity"] / q["source_perplexity"] < 1.05 and q["kl_source_to_converted"] < 0.02

    # The streamed report agrees with a plain evaluation of the two saved models.
    from diff_llama.corpus import HELD_OUT_MODULES, stdlib_docstrings

    ids = tokenizer(stdlib_docstrings(HELD_OUT_MODULES), return_tensors="pt", add_special_tokens=False).input_ids[0]
    ids = ids[: 8 * 128 + 1]
    converted = AutoModelForCausalLM.from_pretrained(out)
    source = AutoModelForCausalLM.from_pretrained(llama_dir)
    assert type(converted) is DiffLlamaForCausalLM
    assert perplexity(converted, ids, window=128) == pytest.approx(q["converted_perplexity"], rel=1e-4)
    assert perplexity(source, ids, window=128) == pytest.approx(q["source_perplexity"], rel=1e-4)

    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "modeling_diff_llama.py", "configuration_diff_llama.py",
            "tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md",
            "conversion_report.json"} <= files
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary folder left behind
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "diff_llama" and "AutoModelForCausalLM" in config["auto_map"]
    assert config["num_attention_heads"] == 18 and config["num_key_value_heads"] == 6
    card = (out / "README.md").read_text()
    assert "library_name: transformers" in card and f"{q['converted_perplexity']:.2f}" in card
    assert abs(converted.get_lambdas()).max() < 1e-5  # λ starts at 0


def test_lambda_moves_after_one_optimiser_step(tmp_path, llama_dir, tokenizer):
    out = tmp_path / "diff"
    convert_llama_to_diff_llama(str(llama_dir), str(out), ConversionOptions(diff_version=1, calibration="none", evaluate=False),
                                progress=False)
    model = DiffLlamaForCausalLM.from_pretrained(out).train()
    before = model.get_lambdas().detach().clone()
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 8, return_tensors="pt").input_ids
    optimizer = torch.optim.AdamW([p for n, p in model.named_parameters() if "lambda_" in n], lr=1e-2)
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    after = model.get_lambdas().detach()
    assert before.abs().max() < 1e-5 and (after - before).abs().min() > 1e-4


@pytest.mark.parametrize("tie", [True, False])
def test_sharded_bf16_input_and_sharded_output(tmp_path, tokenizer, tie):
    src = make_llama(tmp_path / "llama", tokenizer, dtype=torch.bfloat16, max_shard_size="100KB",
                     tie_word_embeddings=tie, num_attention_heads=4, num_key_value_heads=2, head_dim=12)
    assert (src / "model.safetensors.index.json").exists()
    out = tmp_path / "diff"
    options = ConversionOptions(head_layout="split", max_shard_size=150_000, **FAST)
    report = convert_llama_to_diff_llama(str(src), str(out), options, progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).exists() for s in shards)
    tensors = {}
    for shard in shards:
        tensors.update(load_file(out / shard))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert ("lm_head.weight" in tensors) is (not tie)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.head_dim == 12 and model.config.num_attention_heads == 4
    assert model.config.tie_word_embeddings is tie
    assert report.quality["converted_perplexity"] < 10 * report.quality["source_perplexity"]


def test_rope_scaling_is_kept(tmp_path, tokenizer):
    rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
    src = make_llama(tmp_path / "llama", tokenizer, rope_parameters=rope)
    out = tmp_path / "diff"
    report = convert_llama_to_diff_llama(str(src), str(out), ConversionOptions(**FAST), progress=False)
    assert json.loads((out / "config.json").read_text())["rope_parameters"] == rope
    assert report.quality["converted_perplexity"] / report.quality["source_perplexity"] < 1.05


# ---- refusing bad input, losing nothing ------------------------------------------------------------------------


def _expect_error(tmp_path, source, match, **options):
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=match):
        convert_llama_to_diff_llama(str(source), str(out), ConversionOptions(**{**FAST, **options}), progress=False)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_not_a_llama_names_the_architecture(tmp_path, llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (llama_dir / "config.json").write_text(json.dumps(config))
    _expect_error(tmp_path, llama_dir, "MistralForCausalLM")


def test_missing_and_truncated_shards(tmp_path, tokenizer):
    src = make_llama(tmp_path / "llama", tokenizer, max_shard_size="100KB")
    shards = sorted(src.glob("model-*.safetensors"))
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) // 2])
    # named with its folder, as every other command names a file cut short
    _expect_error(tmp_path, src, f"^{re.escape(str(shards[1]))} is truncated or corrupt")
    shards[1].unlink()
    _expect_error(tmp_path, src, "names shard")


def test_shape_mismatch_and_missing_tensor(tmp_path, llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    config["intermediate_size"] = 100
    (llama_dir / "config.json").write_text(json.dumps(config))
    _expect_error(tmp_path, llama_dir, "shape")
    config["num_hidden_layers"] = 4
    config["intermediate_size"] = 144
    (llama_dir / "config.json").write_text(json.dumps(config))
    _expect_error(tmp_path, llama_dir, "lacks")


def test_a_tensor_the_config_does_not_account_for_is_refused_not_dropped(tmp_path, llama_dir):
    """A norm a LLaMA has no place for (another architecture labelled llama), or a layer past num_hidden_layers,
    would vanish from the converted model; an old checkpoint's rotary buffer holds nothing and converts."""
    from safetensors.torch import save_file

    weights = load_file(llama_dir / "model.safetensors")
    save_file({**weights, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)},
              llama_dir / "model.safetensors", metadata={"format": "pt"})
    convert_llama_to_diff_llama(str(llama_dir), str(tmp_path / "converted"), ConversionOptions(**FAST), progress=False)
    for extra in ("model.layers.0.self_attn.q_norm.weight", "model.layers.3.input_layernorm.weight"):
        save_file({**weights, extra: torch.ones(8)}, llama_dir / "model.safetensors", metadata={"format": "pt"})
        _expect_error(tmp_path, llama_dir, rf"^the checkpoint holds 1 tensor\(s\) that a LLaMA of its config.json "
                                           rf"does not have, e\.g\. {re.escape(extra)}, and the converted model would "
                                           "lose them")


def test_odd_heads_with_padding_disabled(tmp_path, llama_dir):
    _expect_error(tmp_path, llama_dir, "odd number of query heads", head_layout="split", pad_odd_heads=False)


def test_existing_output_is_refused_unless_overwrite(tmp_path, llama_dir):
    out = tmp_path / "diff"
    fast = ConversionOptions(diff_version=1, calibration="none", evaluate=False)
    convert_llama_to_diff_llama(str(llama_dir), str(out), ConversionOptions(evaluate=False), progress=False)
    with pytest.raises(FileExistsError, match="pass --overwrite to replace it"):
        convert_llama_to_diff_llama(str(llama_dir), str(out), fast, progress=False)
    convert_llama_to_diff_llama(str(llama_dir), str(out), fast, overwrite=True, progress=False)  # an earlier conversion
    assert json.loads((out / "config.json").read_text())["diff_version"] == 1
    (out / "keep.txt").write_text("precious")  # ... but not with a file of the user's in it
    with pytest.raises(FileExistsError, match=r"--overwrite refused: .* \(keep.txt\)"):
        convert_llama_to_diff_llama(str(llama_dir), str(out), fast, overwrite=True, progress=False)
    assert (out / "keep.txt").read_text() == "precious" and (out / "model.safetensors").exists()


def test_cli_reports_errors_in_one_line(tmp_path, llama_dir, capsys):
    assert main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.endswith("nowhere: no such folder (and not a Hub repository id of the form owner/name).")


def test_a_source_without_tokenizer_is_refused_but_a_broken_tokenizer_is_not_called_missing(tmp_path, llama_dir, capsys):
    """Only a source with no tokenizer files is "without a tokenizer"; a tokenizer that is there and fails to load
    reports its own error (it is not a user error the converter judged: the command shows its traceback)."""
    tokenizer_files = [f for f in llama_dir.iterdir() if f.name.startswith(("tokenizer", "special_tokens"))]
    assert tokenizer_files
    for file in tokenizer_files:
        file.unlink()
    out = tmp_path / "diff"
    for options, says in [  # the flags named are exactly those that leave the tokenizer unneeded
        (ConversionOptions(), "which evaluation needs; add the tokenizer files or pass --no-evaluate."),
        (ConversionOptions(diff_version=1), "which calibration and evaluation need; add the tokenizer files or pass "
                                            "--calibration none --no-evaluate."),
        (ConversionOptions(diff_version=1, evaluate=False), "which calibration needs; add the tokenizer files or "
                                                            "pass --calibration none."),
    ]:
        with pytest.raises(ConversionError, match="has no tokenizer, " + re.escape(says) + "$"):
            convert_llama_to_diff_llama(str(llama_dir), str(out), options, progress=False)
        assert not out.exists()

    (llama_dir / "tokenizer.json").write_text("{not json")
    with pytest.raises(json.JSONDecodeError):
        convert_llama_to_diff_llama(str(llama_dir), str(out), ConversionOptions(), progress=False)
    capsys.readouterr()
    assert main(["convert", str(llama_dir), str(out)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "JSONDecodeError" in err and "has no tokenizer" not in err
    assert not out.exists()


def test_killed_conversion_leaves_no_output_and_the_rerun_cleans_up(tmp_path, tokenizer, capsys):
    src = make_llama(tmp_path / "llama", tokenizer, num_hidden_layers=12, hidden_size=144, intermediate_size=288)
    out = tmp_path / "diff"
    process = subprocess.Popen(
        [sys.executable, "-m", "diff_llama.cli", "convert", str(src), str(out), "--max-shard-size", "200KB",
         "--diff-version", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    deadline = time.time() + 300  # calibration comes first: minutes on a busy 2-core machine
    while time.time() < deadline and not list(tmp_path.glob(".diff.partial-*/model-*")):
        time.sleep(0.02)
    assert list(tmp_path.glob(".diff.partial-*/model-*")), "the conversion never started writing"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not out.exists()
    # the rerun removes the killed run's hidden folder, and says so
    partial = next(tmp_path.glob(".diff.partial-*"))
    assert main(["convert", str(src), str(out), "--no-evaluate"]) == 0
    assert f"Removed {partial.name} from {tmp_path}" in capsys.readouterr().err
    assert not list(tmp_path.glob(".diff.*")) and (out / "model.safetensors").exists()


def test_hub_id_goes_through_snapshot_download(tmp_path, llama_dir, monkeypatch):
    """The Hub is unreachable here: snapshot_download is replaced by a fake that serves a local folder (and the
    repository is in the cache, as offline mode requires)."""
    import huggingface_hub
    from fake_hub import cache_repo

    cache_repo(tmp_path / "hub-cache", "someone/tiny-llama", llama_dir)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None):
        calls.append((repo_id, revision, tuple(allow_patterns)))
        return str(llama_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    report = convert_llama_to_diff_llama("someone/tiny-llama", str(tmp_path / "diff"),
                                         ConversionOptions(diff_version=1, calibration="none", evaluate=False), progress=False)
    assert calls and calls[0][0] == "someone/tiny-llama" and "*.safetensors" in calls[0][2]
    assert report.num_attention_heads == 18
    # the report and the card name the repository, not the cache folder it was read from
    assert report.source == "someone/tiny-llama"
    card = (tmp_path / "diff" / "README.md").read_text()
    assert "base_model: someone/tiny-llama" in card and "the LLaMA [`someone/tiny-llama`](https://huggingface.co/" in card


def test_quantized_dtype_is_refused(tmp_path, llama_dir):
    from safetensors.torch import save_file

    tensors = load_file(llama_dir / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"].to(torch.int8)
    save_file(tensors, llama_dir / "model.safetensors", metadata={"format": "pt"})
    _expect_error(tmp_path, llama_dir, "I8")


@pytest.mark.parametrize("option", ["--calibration-text", "--eval-text"])
def test_a_text_file_that_is_not_text_is_one_line_and_writes_nothing(tmp_path, llama_dir, capsys, option):
    text = tmp_path / "scan.pdf.txt"
    text.write_bytes(b"%PDF-1.7\n\xe2\x28\xa1 binary")
    capsys.readouterr()
    out = tmp_path / "diff"
    assert main(["convert", str(llama_dir), str(out), "--diff-version", "1", option, str(text)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"diff-llama convert: error: {text} is not UTF-8 text (byte 9: invalid "
                   "continuation byte); give a text file, or convert it to UTF-8.")
    assert not out.exists()


@pytest.mark.parametrize("argv,says", [
    (["--eval-tokens", "256"], "one eval sequence takes 513 tokens (--seq-len 512) and --eval-tokens is 256: raise it "
                               "to 513 or more, or lower --seq-len"),
    (["--diff-version", "1", "--calibration-tokens", "100", "--seq-len", "128"],
     "one calibration sequence takes 128 tokens (--seq-len 128) and --calibration-tokens is 100: raise it to 128 or "
     "more, or lower --seq-len"),
    (["--eval-text", "SHORT"], "one eval sequence takes 513 tokens (--seq-len 512) and the eval text has 3: give a "
                               "longer --eval-text, or lower --seq-len"),
])
def test_too_few_tokens_for_one_sequence_names_the_option_to_change(tmp_path, llama_dir, capsys, argv, says):
    short = tmp_path / "short.txt"
    short.write_text("abc")  # the test tokenizer: one token a character
    argv = [str(short) if arg == "SHORT" else arg for arg in argv]
    capsys.readouterr()
    out = tmp_path / "diff"
    assert main(["convert", str(llama_dir), str(out), *argv]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"diff-llama convert: error: {says}"
    assert not out.exists()


def test_paper_lambda_start_and_user_calibration_text(tmp_path, llama_dir, tokenizer):
    text = tmp_path / "calibration.txt"
    text.write_text("Attention is all you need, said the transformer to the recurrent network. " * 200)
    out = tmp_path / "diff"
    options = ConversionOptions(lambda_start="paper", calibration_text=str(text), **FAST)
    report = convert_llama_to_diff_llama(str(llama_dir), str(out), options, progress=False)
    model = DiffLlamaForCausalLM.from_pretrained(out)
    # The paper's start: each layer's four vectors drawn from N(0, lambda_std_dev) with the seed + layer.
    for layer, decoder_layer in enumerate(model.model.layers):
        generator = torch.Generator().manual_seed(layer)  # options.seed is 0
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            expected = torch.randn(model.config.head_dim, generator=generator) * model.config.lambda_std_dev
            torch.testing.assert_close(getattr(decoder_layer.self_attn.differential_lambda, name), expected)
    init = torch.tensor([lambda_init_fn(layer) for layer in range(3)])
    assert (model.get_lambdas() - init).abs().max() < 0.2  # exp(q1·k1) − exp(q2·k2) ≈ 0 for small vectors
    assert json.loads((out / "conversion_report.json").read_text())["options"]["calibration_text"] == str(text)
    # The reported quality is that of the saved model (here far from the source: the paper's λ is not 0).
    from diff_llama.corpus import HELD_OUT_MODULES, stdlib_docstrings

    ids = tokenizer(stdlib_docstrings(HELD_OUT_MODULES), return_tensors="pt", add_special_tokens=False).input_ids[0]
    measured = perplexity(model, ids[: 8 * 128 + 1], window=128)
    assert measured == pytest.approx(report.quality["converted_perplexity"], rel=1e-4)


@pytest.mark.parametrize("layout", ["expand", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streaming_path_writes_the_same_tensors_as_the_in_memory_path(tmp_path, tokenizer, layout, dtype):
    """Without calibration the converter copies stored bytes; with evaluation on it decodes every tensor. Both
    must write identical checkpoints."""
    src = make_llama(tmp_path / "llama", tokenizer, dtype=dtype, max_shard_size="60KB")
    common = dict(head_layout=layout, calibration="none", **FAST)
    convert_llama_to_diff_llama(str(src), str(tmp_path / "fast"), ConversionOptions(evaluate=False, **common),
                                progress=False)
    convert_llama_to_diff_llama(str(src), str(tmp_path / "slow"), ConversionOptions(evaluate=True, **common),
                                progress=False)
    fast = DiffLlamaForCausalLM.from_pretrained(tmp_path / "fast").state_dict()
    slow = DiffLlamaForCausalLM.from_pretrained(tmp_path / "slow").state_dict()
    assert fast.keys() == slow.keys()
    for name in fast:
        assert torch.equal(fast[name], slow[name]), name


def test_converted_tokenizer_loads_as_a_plain_tokenizer_without_prompts(tmp_path, llama_dir, tokenizer):
    """`save_pretrained` of a tokenizer loaded offline records `local_files_only` and `is_local`; they must not travel
    with the model (a Hub copy could then never download). Without diff-llama, AutoTokenizer reads config.json first,
    which needs the config's code: with trust_remote_code=True it loads without a prompt or a warning."""
    config_file = llama_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "local_files_only": True, "is_local": True}))
    out = tmp_path / "diff"
    convert_llama_to_diff_llama(str(llama_dir), str(out), ConversionOptions(diff_version=1, calibration="none", evaluate=False),
                                progress=False)
    saved = json.loads((out / "tokenizer_config.json").read_text())
    assert "local_files_only" not in saved and "is_local" not in saved

    script = (
        "import sys; sys.modules['diff_llama'] = None\n"
        "from transformers import AutoTokenizer\n"
        f"tokenizer = AutoTokenizer.from_pretrained({str(out)!r}, trust_remote_code=True)\n"
        "print(type(tokenizer).__module__, tokenizer('The quick brown fox').input_ids)\n"
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                            stdin=subprocess.DEVNULL, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Do you wish" not in result.stdout + result.stderr and "model of type" not in result.stderr
    module, ids = result.stdout.strip().split(" ", 1)
    assert module.startswith("transformers.") and ids == str(tokenizer("The quick brown fox").input_ids)


@pytest.mark.parametrize("tie,biases", [(True, {}), (False, {}), (False, dict(attention_bias=True)),
                                        (True, dict(mlp_bias=True, attention_bias=True))])
def test_the_converters_schema_is_the_models_own(tie, biases):
    """The converter writes tensors from its own schema; it must be exactly what the models' state dicts hold, for the
    LLaMA and for each version (checkpoint names: λ vectors as `self_attn.lambda_q1`, ...), biases included."""
    from transformers import LlamaForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from diff_llama.conversion.base import checkpoint_schema
    from diff_llama.conversion.version1 import DiffV1Conversion, expand_layout
    from diff_llama.conversion.version2 import DiffV2Conversion

    config = LlamaConfig(vocab_size=64, hidden_size=36, intermediate_size=40, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, tie_word_embeddings=tie, **biases)
    v1_config, v2_config = diff_config_for(config, expand_layout(3, 1)), diff_config_for(config, None)
    with torch.device("meta"):
        llama, v1, v2 = LlamaForCausalLM(config), DiffLlamaForCausalLM(v1_config), DiffLlamaForCausalLM(v2_config)

    def stored(model):
        state = revert_weight_conversion(model, model.state_dict())
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight")
        return {name: tuple(tensor.shape) for name, tensor in state.items()}

    assert checkpoint_schema(config) == stored(llama)
    assert checkpoint_schema(v1_config, DiffV1Conversion.added_tensors) == stored(v1)
    assert checkpoint_schema(v2_config, DiffV2Conversion.added_tensors) == stored(v2)
    assert any(name.endswith(".bias") for name in stored(v2)) == bool(biases)


def test_progress_counts_layers_with_an_eta(tmp_path, llama_dir, capsys):
    convert_llama_to_diff_llama(str(llama_dir), str(tmp_path / "diff"), ConversionOptions(**FAST))
    err = capsys.readouterr().err
    assert "converting and calibrating" in err and "3/3" in err and "layer" in err  # tqdm prints the ETA with it
    assert "B/s" not in err  # not a byte counter, which crawls during calibration
