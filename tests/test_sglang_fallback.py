"""What SGLang's Transformers backend needs from a DIFF V2 model, checked without SGLang in the default suite
(tests/test_sglang.py serves through SGLang itself, in .venv-sglang). SGLang registers its attention as "sglang",
builds the model with it, shards the linear layers by the model's tensor-parallel plan, refusing styles it does not
know, and hands each module that loads its own weights its checkpoint tensors."""

import copy

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from conftest import tiny_config, tiny_model
from diff_llama.configuration_diff_llama import ENGINE_DIFF_V2_TP_PLAN

# Transformers' own styles: the ones SGLang's backend accepts besides aliases of them.
PLAIN_STYLES = {"colwise", "rowwise", "embedding_rowwise"}


@pytest.fixture
def sglang_attention(monkeypatch):
    """The attention name SGLang registers, bound to transformers' SDPA (SGLang's own runs its paged KV cache)."""
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sglang", sdpa_attention_forward)


def test_a_diff_v2_model_built_by_sglang_has_a_plan_in_plain_styles(sglang_attention):
    model = tiny_model(diff_version=2, num_attention_heads=8, num_key_value_heads=2, attn_implementation="sglang")
    plan = model.model.tp_plan
    assert set(plan.values()) <= PLAIN_STYLES, plan
    assert {key: plan[key] for key in ENGINE_DIFF_V2_TP_PLAN} == ENGINE_DIFF_V2_TP_PLAN
    # Elsewhere, and for version 1 (two attention calls a layer, which SGLang cannot serve), the package's own styles.
    assert "diff_llama_heads" in tiny_model(diff_version=2, num_attention_heads=8, num_key_value_heads=2).model.tp_plan.values()
    version_1 = tiny_config(num_attention_heads=8, num_key_value_heads=2, attn_implementation="sglang")
    assert "diff_llama_heads" in version_1.base_model_tp_plan.values()


def _shard(linear: nn.Linear, style: str, rank: int, ranks: int) -> nn.Linear:
    """What a colwise (blocks of output rows) or rowwise (blocks of input columns) style leaves on one rank."""
    dim = 0 if style == "colwise" else 1
    weight = linear.weight.chunk(ranks, dim=dim)[rank]
    shard = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    shard.weight = nn.Parameter(weight.clone())
    return shard


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (12, 2), (4, 2)])
def test_the_sglang_plan_splits_diff_v2_attention_exactly(sglang_attention, heads, kv_heads):
    """Each rank's q/k/v/λ rows and o_proj columns as the plan says: the ranks' outputs sum to the whole layer's, so
    every differential head's map pair, its λ and its key/value heads are on one rank."""
    model = tiny_model(diff_version=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       attn_implementation="sglang", seed=1)
    attention = model.model.layers[0].self_attn
    torch.nn.init.normal_(attention.differential_lambda.lambda_proj.weight, std=0.5)  # λ varying by token and head
    hidden = torch.randn(2, 7, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    position_embeddings = model.model.rotary_emb(hidden, torch.arange(7)[None].expand(2, -1))

    with torch.no_grad():
        whole, _ = attention(hidden, position_embeddings)
        ranks, summed = 2, torch.zeros_like(whole)
        for rank in range(ranks):
            shard = copy.deepcopy(attention)
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(shard, name, _shard(getattr(attention, name), ENGINE_DIFF_V2_TP_PLAN[f"layers.*.self_attn.{name}"], rank, ranks))
            shard.differential_lambda.lambda_proj.weight = nn.Parameter(
                attention.differential_lambda.lambda_proj.weight.chunk(ranks)[rank].clone()
            )
            summed += shard(hidden, position_embeddings)[0]
    torch.testing.assert_close(summed, whole, rtol=1e-5, atol=1e-5)


def test_the_attention_loads_its_checkpoint_tensors_as_the_engines_hand_them(tmp_path):
    """SGLang's and vLLM's loaders hand a module with `load_weights` its tensors by their names on disk, where λ's
    projection is `lambda_proj`. An engine's sharded parameter carries a `weight_loader` that takes its rank's part (here
    the second half of q_proj's rows, as an engine's rank 1 would); every other parameter is copied whole."""
    from safetensors.torch import load_file

    from conftest import randomise_lambda_proj

    saved = tiny_model(diff_version=2, num_attention_heads=8, num_key_value_heads=2, seed=1)
    randomise_lambda_proj(saved)
    saved.save_pretrained(tmp_path)
    prefix = "model.layers.0.self_attn."
    on_disk = {key[len(prefix):]: tensor for key, tensor in load_file(tmp_path / "model.safetensors").items()
               if key.startswith(prefix)}
    assert "lambda_proj.weight" in on_disk

    attention = tiny_model(diff_version=2, num_attention_heads=8, num_key_value_heads=2, seed=2).model.layers[0].self_attn
    rows = attention.q_proj.weight.shape[0] // 2
    attention.q_proj.weight = nn.Parameter(torch.zeros(rows, attention.q_proj.weight.shape[1]))
    attention.q_proj.weight.weight_loader = lambda parameter, tensor: parameter.data.copy_(tensor[rows:])
    loaded = attention.load_weights(on_disk.items())

    assert loaded == {name for name, _ in attention.named_parameters()}
    expected = saved.model.layers[0].self_attn
    torch.testing.assert_close(attention.q_proj.weight, expected.q_proj.weight[rows:], rtol=0, atol=0)
    for name in ("k_proj.weight", "v_proj.weight", "o_proj.weight", "differential_lambda.lambda_proj.weight"):
        torch.testing.assert_close(attention.get_parameter(name), expected.get_parameter(name), rtol=0, atol=0)
    # vLLM's loader may hand λ's projection under its name in memory: the same place.
    attention.load_weights([("differential_lambda.lambda_proj.weight", torch.ones_like(on_disk["lambda_proj.weight"]))])
    assert bool((attention.differential_lambda.lambda_proj.weight == 1).all())

    with pytest.raises(ValueError, match="has no parameter 'differential_lambda.lambda_q1' for the checkpoint tensor "
                                         "'lambda_q1': is the checkpoint another model's"):
        attention.load_weights([("lambda_q1", torch.zeros(4))])  # version 1's λ
    with pytest.raises(ValueError, match="layer 0's attention has no parameter 'gate_proj.weight'"):
        attention.load_weights([("gate_proj.weight", torch.zeros(4))])
    with pytest.raises(ValueError, match=r"layer 0's k_proj.weight is \(\d+, \d+\) but the checkpoint tensor is \(3,\)"):
        attention.load_weights([("k_proj.weight", torch.zeros(3))])
