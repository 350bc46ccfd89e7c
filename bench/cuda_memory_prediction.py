"""The CUDA training step's peak memory, predicted on the CPU: the step of `cuda_benchmark` (batch 1 x 4096, bf16,
SDPA, a warm-up step first so that the gradients exist) run on PyTorch's `meta` device, where tensors have shapes and
no data, with every storage counted while it lives, as the CUDA caching allocator counts it (`max_memory_allocated`:
sizes rounded up to 512 bytes), and the peak taken above what was allocated before the step.

What is emulated: SDPA's choice on a CUDA GPU, which the meta device cannot make itself. Without a mask and in half
precision with a head width of at most 256, PyTorch's FlashAttention entry point (grouped key/value heads as they
are); otherwise its memory-efficient one. Both are the real aten ops, whose meta kernels give their outputs' shapes,
and autograd keeps what those ops keep on a GPU. Version 1's `paired_sdpa_cuda` kernel is let in where it would run on
CUDA (it checks the device type). Not counted: workspace a kernel allocates inside itself and frees before returning
(FlashAttention's backward accumulators, cuBLAS's workspace), nor the allocator's fragmentation (`reserved` memory).

Why: a GPU is lent seldom and briefly. This steers version 1's training memory (issue 40: at most 1.15x Llama's)
from the CPU, and a GPU run confirms it. Its check: the same models at commit 5a69977 against the H200's measurement
of 2026-11-27 (`bench/results/cuda-h200.json`), in the dated results page; tests/test_bench_probes.py checks the
models that have not changed since against that measurement.

Usage: python -m bench cuda_memory_prediction [--shapes llama-3.2-1b smollm2-135m] [--tokens 4096]
                                              [--measured bench/results/cuda-h200.json] [--write] [--output NAME]
"""

import argparse
import contextlib
import json
import sys
import weakref
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).parent))
import suite  # noqa: E402

ALLOCATION_ROUNDING = 512  # bytes: the CUDA caching allocator's smallest block
MODELS = ("llama", "llama 2x heads", "diff-llama v2", "diff-llama", "diff-llama paired")
FIGURE = "train peak memory (GiB)"


class StorageCounter(TorchDispatchMode):
    """Bytes of the storages that ops create, counted from creation until the storage is freed; `peak` is the most
    at any one time. A storage is counted once, whatever views of it the ops return."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor):
                self._count(tensor.untyped_storage())
        return output

    def _count(self, storage):
        key = id(storage)  # a storage's Python object lives as long as the storage does
        if key in self.live:
            return
        size = -(-storage.nbytes() // ALLOCATION_ROUNDING) * ALLOCATION_ROUNDING
        self.live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key):
        self.current -= self.live.pop(key, 0)


def cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """`scaled_dot_product_attention` as it dispatches on a CUDA GPU, for the calls these models make: FlashAttention
    without a mask in half precision (head width ≤ 256, grouped key/value heads allowed), else memory-efficient
    attention (which these models only call with as many key/value heads as query heads)."""
    width = query.shape[-1]
    if (attn_mask is None and query.dtype in (torch.float16, torch.bfloat16) and width <= 256
            and key.shape[-1] == value.shape[-1] == width):
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if key.shape[1] != query.shape[1]:
        raise NotImplementedError("memory-efficient attention with grouped key/value heads is not emulated")
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, query.requires_grad, dropout_p, is_causal, scale=scale)[0]


@contextlib.contextmanager
def as_on_cuda():
    """SDPA dispatched as on CUDA, and `paired_sdpa_cuda` taking the calls it takes there."""
    from diff_llama import differential_kernels as kernels

    paired = kernels.ALL_DIFFERENTIAL_KERNELS["paired_sdpa_cuda"]

    def supports_on_meta(module, query, key, attention_mask):
        cuda_like = mock.Mock(wraps=query, device=torch.device("cuda"), dtype=query.dtype, shape=query.shape)
        return query.device.type == "meta" and paired.supports(module, cuda_like, key, attention_mask)

    emulated = kernels.DifferentialKernel(paired.function, supports_on_meta, paired.description)
    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", cuda_sdpa), \
            mock.patch.dict(kernels.DifferentialAttentionInterface._global_mapping, {"paired_sdpa_cuda": emulated}):
        yield


def predict_train_peak(name: str, shape: dict, tokens: int) -> float:
    """GiB above the model and its gradients at the peak of one training step of `cuda_benchmark`, on meta."""
    import cuda_benchmark

    with as_on_cuda():
        model = cuda_benchmark.build(name, shape, cuda_benchmark.Plan(device="meta"))
        batch = torch.zeros((1, tokens), dtype=torch.long, device="meta")
        counter = StorageCounter()
        model.train()
        with counter:
            cuda_benchmark.forward_backward(model, batch)  # the warm-up: the gradients stay allocated
            before = counter.current
            counter.peak = counter.current
            cuda_benchmark.forward_backward(model, batch)
    return (counter.peak - before) / 2**30


def measured_figures(path: Path) -> dict:
    """{shape: {model: median GiB}} of a cuda_benchmark result, with its commit."""
    result = json.loads(path.read_text())
    medians = {}
    for shape, figures in result.get("shapes", {}).items():
        samples = figures.get("figures", {}).get("train", {}).get("samples", {})
        medians[shape] = {}
        for model, rounds in samples.items():
            values = sorted(sample[FIGURE] for sample in rounds if sample.get(FIGURE) is not None)
            if values:
                medians[shape][model] = values[len(values) // 2]
    return {"file": str(path.relative_to(suite.BENCH.parent) if path.is_absolute() and suite.BENCH.parent in path.parents
                        else path), "commit": result.get("meta", {}).get("git_commit"), "medians": medians}


def main():
    import cuda_benchmark

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["llama-3.2-1b", "smollm2-135m"],
                        choices=sorted(cuda_benchmark.SHAPES))
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--measured", default=str(suite.RESULTS / "cuda-h200.json"),
                        help="a cuda_benchmark result to set beside the prediction ('' for none)")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--output", default="cuda-memory-prediction", help="with --write: results name or path")
    args = parser.parse_args()
    result = {"tokens": args.tokens, "predicted": {}}
    for shape in args.shapes:
        result["predicted"][shape] = {
            model: predict_train_peak(model, cuda_benchmark.SHAPES[shape], args.tokens) for model in args.models}
    if args.measured and Path(args.measured).is_file():
        result["measured"] = measured_figures(Path(args.measured))
    if args.write:
        suite.write_result("cuda_memory_prediction", args.output, result, render)
    else:
        print(render(result))


def render(result: dict) -> str:
    measured = result.get("measured") or {}
    lines = [f"CUDA training peak memory predicted on the CPU (meta device): one step at batch 1 x {result['tokens']}, "
             "bf16, SDPA as on CUDA, GiB above the model and its gradients; ratios to llama's prediction."]
    if measured:
        lines.append(f"Measured: the medians of `{measured['file']}` (commit {measured['commit']}).")
    for shape, predicted in result["predicted"].items():
        truth = measured.get("medians", {}).get(shape, {})
        lines += ["", f"| {shape} | predicted (GiB) | to llama | measured (GiB) | predicted / measured |",
                  "|---|---|---|---|---|"]
        for model, value in predicted.items():
            ratio = f"{value / predicted['llama']:.3f}x" if "llama" in predicted else "–"
            seen = truth.get(model)
            lines.append(f"| {model} | {value:.3f} | {ratio} | {f'{seen:.3f}' if seen else '–'} | "
                         f"{f'{value / seen:.4f}' if seen else '–'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
