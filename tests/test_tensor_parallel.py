"""Tensor parallelism: `from_pretrained(..., tp_plan="auto")` under `torchrun --nproc_per_node 2` (gloo, CPU) computes
the unsharded model's logits, greedy tokens and training gradients for every head layout, or refuses a layout it
cannot split."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import diff_llama
from conftest import needs_torch_distributed_of_transformers, tiny_config
from diff_llama import DiffLlamaForCausalLM
from diff_llama.tensor_parallel_diff_llama import tensor_parallel_layout

TESTS = Path(__file__).parent
SRC = str(Path(diff_llama.__file__).parent.parent)

# name -> config overrides; every layout the plan distinguishes, on 2 ranks.
LAYOUTS = {
    "v1_even_g4_bias": dict(num_attention_heads=8, num_key_value_heads=4, attention_bias=True),  # k/v split as halves
    "v1_odd_g3": dict(num_attention_heads=12, num_key_value_heads=3),
    "v1_mqa_g1": dict(num_attention_heads=8, num_key_value_heads=1),
    "v2_g2": dict(num_attention_heads=8, num_key_value_heads=2, diff_version=2),
    "v2_mqa_g1": dict(num_attention_heads=8, num_key_value_heads=1, diff_version=2),
    "v1_tied_g2": dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True),  # G/2 = 1: k/v replicated
    "v1_refused_h6": dict(num_attention_heads=6, num_key_value_heads=3),  # 3 pairs cannot split over 2 ranks
}


def _save_models(folder: Path, names):
    references = {}
    input_ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    torch.save(input_ids, folder / "input_ids.pt")
    for seed, name in enumerate(names):
        torch.manual_seed(seed)
        model = DiffLlamaForCausalLM(tiny_config(**LAYOUTS[name])).eval()
        with torch.no_grad():
            for layer in model.model.layers:  # λ away from its start, so that a wrong pairing shows
                if model.config.diff_version == 2:
                    layer.self_attn.differential_lambda.lambda_proj.weight.normal_(0, 0.3)
            logits = model(input_ids).logits
            tokens = model.generate(input_ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        model.save_pretrained(folder / name)
        model.train()
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        gradients = {param_name: param.grad for param_name, param in model.named_parameters()}
        references[name] = (logits, tokens.tolist(), loss.detach(), gradients)
    return references


def _run_torchrun(folder: Path, names, remote=False):
    env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    if remote:
        env["DIFF_LLAMA_REMOTE"] = "1"
        env["PYTHONPATH"] = ""  # the package must not be importable: the folders' own code runs
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(TESTS / "tp_worker.py"),
               str(folder), *(str(folder / name) for name in names)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def _check(folder, references, results, name):
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        assert "error" not in got, got
        assert got["tp_size"] == 2
        # Every rank holds half the query rows: the model really is sharded.
        config = tiny_config(**LAYOUTS[name])
        assert got["local_q_rows"] == config.num_attention_heads * config.head_dim // 2
        logits = torch.load(folder / f"{name}.rank{rank}.logits.pt")
        torch.testing.assert_close(logits, references[name][0], atol=1e-5, rtol=0)
        assert got["tokens"] == references[name][1]
        # Training under tensor parallel: the same loss and gradients (replicated weights' partial gradients summed).
        step = torch.load(folder / f"{name}.rank{rank}.grads.pt")
        torch.testing.assert_close(step["loss"], references[name][2], atol=1e-5, rtol=0)
        assert step["gradients"].keys() == references[name][3].keys()
        for param_name, gradient in references[name][3].items():
            torch.testing.assert_close(step["gradients"][param_name], gradient, atol=1e-5, rtol=0, msg=param_name)


@needs_torch_distributed_of_transformers
def test_tensor_parallel_matches_unsharded_for_every_layout(tmp_path):
    references = _save_models(tmp_path, LAYOUTS)
    results = _run_torchrun(tmp_path, LAYOUTS)
    for name in LAYOUTS:
        if name == "v1_refused_h6":
            continue
        _check(tmp_path, references, results, name)
        assert results[0][name]["class"] == "diff_llama.modeling_diff_llama.DiffLlamaForCausalLM"
    for per_rank in results:
        error = per_rank["v1_refused_h6"]["error"]
        assert "num_attention_heads / 2 = 3 must be divisible by the TP size" in error
        assert "Use a TP size in [1, 3]" in error


@needs_torch_distributed_of_transformers
def test_tensor_parallel_as_remote_code(tmp_path):
    names = ["v1_odd_g3", "v2_g2"]
    references = _save_models(tmp_path, names)
    results = _run_torchrun(tmp_path, names, remote=True)
    for name in names:
        _check(tmp_path, references, results, name)
        assert results[0][name]["class"].startswith("transformers_modules.")


def _local_query_heads(config, tp_size, rank):
    pairs = config.num_attention_heads // 2
    local = pairs // tp_size
    if config.diff_version == 1:
        return [half * pairs + rank * local + j for half in (0, 1) for j in range(local)]
    return list(range(rank * 2 * local, (rank + 1) * 2 * local))


@pytest.mark.parametrize("diff_version", [1, 2])
def test_layout_gives_every_local_query_head_its_own_key_value_head(diff_version):
    # For every layout and TP size that splits: the key/value head a local query head reads (through the local GQA
    # grouping) is the one it reads in the unsharded model, and both maps of a pair are on the rank.
    checked = 0
    for heads in (4, 8, 12, 16):
        for kv_heads in [g for g in range(1, heads + 1) if heads % g == 0]:
            if diff_version == 2 and (heads // 2) % kv_heads:
                continue
            config = tiny_config(num_attention_heads=heads, num_key_value_heads=kv_heads, diff_version=diff_version)
            group = heads // kv_heads
            for tp_size in (2, 4):
                if (heads // 2) % tp_size:
                    with pytest.raises(ValueError, match="must be divisible by the TP size"):
                        tensor_parallel_layout(config, tp_size, 0)
                    continue
                for rank in range(tp_size):
                    layout = tensor_parallel_layout(config, tp_size, rank)
                    local = _local_query_heads(config, tp_size, rank)
                    local_group = layout["num_key_value_groups"]
                    if layout["key_value_heads"] is None:  # k/v rows split the same way as the query rows
                        kv_local = [local[i] // group for i in range(0, len(local), group)]
                        assert local_group == group
                    else:
                        kv_local = list(layout["key_value_heads"])
                    for position, head in enumerate(local):
                        assert kv_local[position // local_group] == head // group
                    if diff_version == 1:  # the local halves are the two maps of the same differential heads
                        half = len(local) // 2
                        assert [h + heads // 2 for h in local[:half]] == local[half:]
                        assert (len(local) // local_group) % 2 == 0
                    else:
                        assert local_group % 2 == 0 and local[0] % 2 == 0
                    checked += 1
    assert checked > 50


def test_config_declares_a_plan_for_each_version():
    v1 = tiny_config().base_model_tp_plan
    v2 = tiny_config(num_attention_heads=8, num_key_value_heads=2, diff_version=2).base_model_tp_plan
    assert v1["layers.*.self_attn.q_proj"] == v2["layers.*.self_attn.q_proj"] == "diff_llama_heads"
    assert v1["layers.*.self_attn.o_proj"] == "rowwise"
    assert v1["layers.*.self_attn.differential_lambda"] == "replicated_with_grad_allreduce"
    assert v2["layers.*.self_attn.differential_lambda.lambda_proj"] == "diff_llama_heads"
    assert "base_model_tp_plan" not in tiny_config().to_dict()  # not written into config.json
