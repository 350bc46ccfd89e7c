"""model_benchmark's per-round ratio range: the two models of a ratio were measured back to back in each round."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from model_benchmark import round_ratio_range  # noqa: E402

from conftest import needs_fullgraph_compile  # noqa: E402


def test_round_ratio_range_pairs_the_rounds():
    samples = {"prefill (ms)": {"a": [2.0, 4.0, 3.0], "b": [1.0, 5.0, 3.0]}}
    assert round_ratio_range(samples, "prefill (ms)", "a", "b") == (0.8, 2.0)
    assert round_ratio_range({"one round": {"a": [1.0], "b": [2.0]}}, "one round", "a", "b") is None
    assert round_ratio_range(samples, "not measured", "a", "b") is None


def test_the_fold_probe_computes_diff_v2_and_counts_fewer_ops():
    """decode_ops --fold-probe backs the claim that V2's op ceiling stays above issue 40's 6: its forwards must compute
    the shipped model's logits, or the count would be of something else."""
    import torch

    from decode_ops import FoldedQueryLambdaForward, step_ops
    from diff_llama import DiffLlamaConfig, DiffLlamaForCausalLM

    torch.manual_seed(0)
    model = DiffLlamaForCausalLM(DiffLlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=1, head_dim=8, diff_version=2)).eval()
    for layer in model.model.layers:  # λ away from its initial 0.5, different per head and token
        torch.nn.init.normal_(layer.self_attn.differential_lambda.lambda_proj.weight, std=0.5)
    ids = torch.randint(0, 64, (2, 140), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        shipped_logits, shipped_ops = model(ids).logits, sum(step_ops(model, 1).values())
    for lean in (False, True):
        for layer in model.model.layers:
            layer.self_attn.forward = FoldedQueryLambdaForward(layer.self_attn, lean)
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, shipped_logits, rtol=1e-5, atol=1e-5)
        assert sum(step_ops(model, 1).values()) < shipped_ops


@needs_fullgraph_compile
def test_the_compiled_kernel_count_reads_inductors_code():
    """decode_ops --kernels counts what inductor generated for a decoding step (seconds of C++ compilation): a Llama
    with twice the query heads runs the same kernels, DIFF V2 one more matrix product a layer (λ's), and every model
    one SDPA or its own attention products a layer."""
    import torch

    from decode_ops import compiled_kernels

    found = compiled_kernels(1, torch.float32, layers=1)["models"]
    llama, v2 = found["llama"], found["diff-llama v2"]
    assert found["llama 2x heads"] == llama
    assert v2["extern"]["extern_kernels.mm"] == llama["extern"]["extern_kernels.mm"] + 1
    assert llama["extern"]["torch.ops.aten._scaled_dot_product_flash_attention_for_cpu"] == 1
    assert llama["fused"] > 0 and v2["fused"] >= llama["fused"]


def test_storage_counter_counts_each_storage_once_while_it_lives():
    import torch

    from cuda_memory_prediction import StorageCounter

    counter = StorageCounter()
    with counter:
        first = torch.empty(1000, device="meta")  # 4,000 bytes: 4,096 as the allocator rounds it
        view = first[10:]  # a view: no new storage
        second = torch.ones(256, device="meta", dtype=torch.bfloat16)  # 512 bytes
        del first
        assert counter.current == 4096 + 512  # the view keeps the storage alive
        del view
        assert counter.current == 512 and counter.peak == 4096 + 512
    assert second.numel() == 256


def test_cuda_memory_prediction_runs_every_model_on_the_tiny_shape():
    from cuda_benchmark import SHAPES
    from cuda_memory_prediction import MODELS, predict_train_peak

    predicted = {model: predict_train_peak(model, SHAPES["tiny"], 64) for model in MODELS}
    assert all(value > 0 for value in predicted.values())
    assert predicted["diff-llama"] > predicted["llama"]


def test_cuda_memory_prediction_reproduces_the_h200_measurement():
    """The prediction's check against a GPU: the models whose training code has not changed since the H200 run of
    2026-11-27 (version 1's has) within 1% of its measured train peak memory, at both shapes."""
    from cuda_benchmark import SHAPES
    from cuda_memory_prediction import measured_figures, predict_train_peak
    from suite import RESULTS

    measured = measured_figures(RESULTS / "cuda-h200.json")
    assert measured["commit"] == "17ec6ec"
    for shape in ("llama-3.2-1b", "smollm2-135m"):
        for model in ("llama", "llama 2x heads", "diff-llama v2"):
            predicted = predict_train_peak(model, SHAPES[shape], 4096)
            assert abs(predicted / measured["medians"][shape][model] - 1) < 0.01, (shape, model, predicted)


def test_version_1_training_rebuilds_its_wide_tensors_instead_of_keeping_them():
    """Issue 40 §4, counted on the meta device as on CUDA (one layer at Llama-3.2-1B's width, 512 tokens): the step's
    peak drops by at least what the float32 pair difference, o_proj's bf16 input (both 2d wide per differential head)
    and the padded queries (2d wide per query head, less the d-wide ones now kept) take, against the same code keeping
    every tensor."""
    from unittest import mock

    import diff_llama.differential_kernels as kernels
    from cuda_benchmark import SHAPES
    from cuda_memory_prediction import predict_train_peak

    shape, tokens = {**SHAPES["llama-3.2-1b"], "num_hidden_layers": 1, "vocab_size": 512}, 512
    rebuilt = predict_train_peak("diff-llama", shape, tokens)
    with mock.patch.object(kernels, "_pair_difference", kernels._pair_difference_value), \
            mock.patch.object(kernels.RebuiltForBackward, "_pack", lambda self, tensor: tensor):
        kept = predict_train_peak("diff-llama", shape, tokens)
    heads = 2 * shape["num_attention_heads"]  # the converted version 1 layout: twice the query heads of width d
    wide = tokens * heads // 2 * 2 * shape["head_dim"]  # elements of a (tokens, h, 2d) tensor
    minimum = wide * 4 + wide * 2 + (tokens * heads * 2 * shape["head_dim"] - tokens * heads * shape["head_dim"]) * 2
    assert (kept - rebuilt) * 2**30 >= minimum, (kept, rebuilt, minimum / 2**30)
