"""Big models on small machines: a converted model loaded with `device_map="auto"` and a `max_memory` too small for it
(layers on CPU, the rest offloaded to disk) generates the same greedy tokens as the whole model in memory."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import make_llama
from diff_llama import DiffLlamaForCausalLM
from diff_llama.conversion.converter import ConversionOptions, convert_llama_to_diff_llama


def _offloaded_matches_whole(folder, input_ids, tmp_path, cpu_layers=1.5, new_tokens=12):
    whole = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert isinstance(whole, DiffLlamaForCausalLM)
    layer_bytes = sum(p.numel() * p.element_size() for p in whole.model.layers[0].parameters())
    offloaded = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, device_map="auto", max_memory={"cpu": int(layer_bytes * cpu_layers)},
        offload_folder=tmp_path / "offload",
    ).eval()
    placements = set(offloaded.hf_device_map.values())
    assert placements == {"cpu", "disk"}, offloaded.hf_device_map  # some of it really lives on disk
    with torch.no_grad():
        expected = whole.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        got = offloaded.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        torch.testing.assert_close(offloaded(input_ids).logits, whole(input_ids).logits, atol=1e-5, rtol=0)
    assert torch.equal(got, expected)
    return offloaded.hf_device_map


@pytest.mark.parametrize("diff_version", [1, 2])
def test_converted_model_with_disk_offload_generates_the_same_tokens(tmp_path, tokenizer, diff_version):
    source = make_llama(tmp_path / "llama", tokenizer, num_hidden_layers=4)
    calibration = {"calibration_tokens": 1024} if diff_version == 1 else {}  # DIFF V2 refuses version 1 options
    options = ConversionOptions(diff_version=diff_version, evaluate=False, seq_len=128, **calibration)
    convert_llama_to_diff_llama(str(source), str(tmp_path / "diff"), options, progress=False)
    input_ids = tokenizer("The quick brown fox jumps over", return_tensors="pt").input_ids
    _offloaded_matches_whole(tmp_path / "diff", input_ids, tmp_path)


@pytest.mark.slow
def test_converted_smollm2_with_disk_offload_generates_the_same_tokens(tmp_path):
    from diff_llama.smollm2 import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    # DIFF V2's lossless conversion streams the weights without calibration (seconds).
    options = ConversionOptions(diff_version=2, calibration="none", evaluate=False)
    convert_llama_to_diff_llama(str(gguf), str(tmp_path / "diff"), options, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "diff")
    input_ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    device_map = _offloaded_matches_whole(tmp_path / "diff", input_ids, tmp_path, cpu_layers=10, new_tokens=8)
    assert sum(place == "disk" for place in device_map.values()) >= 10
