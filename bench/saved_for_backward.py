"""Bytes that autograd keeps for backward in one training forward, storage by storage, parameters left out: Llama
against version 1 (each training kernel forced) and DIFF V2, at Llama-3.2-1B's width (hidden 2048, 32 query heads
over 8 key/value heads of 64; DIFF V2 with 64 query heads, as its conversion), one layer by default. What a training
step's peak memory grows with, counted exactly and without a GPU: the tensors saved are the same on every device
for the same kernel (on CUDA, version 1 trains on `generic`; `paired_sdpa_cpu` runs on the CPU only).

On CUDA (`--device cuda`) it also measures what the count cannot see: the memory allocated above the parameters
once the forward has run, and the peak of the forward and a backward from the decoder's output. Their gap to the
count is what the step holds besides the saved tensors (temporaries, gradients in flight). `paired_sdpa_cuda` replaces
`paired_sdpa_cpu` there. `scripts/run_cuda_checks.sh` runs it at 4,096 tokens.

Usage: python -m bench saved_for_backward [--dtype bfloat16] [--tokens 512] [--layers 1] [--device cpu] [--write]
Writes bench/results/saved_for_backward.{json,md} with --write.
"""

import argparse
import contextlib
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).parent))
import suite  # noqa: E402

WIDTH = dict(vocab_size=1024, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
             num_key_value_heads=8, head_dim=64)
MODELS = ("llama", "version 1, generic", "version 1, paired_sdpa_cpu", "version 1, paired_sdpa_cuda",
          "version 1, blocked", "diff v2")


def models_for(device: str) -> list[str]:
    """The models measured on `device`: each paired kernel only on its own device type."""
    kind = torch.device(device).type
    return [name for name in MODELS if "paired_sdpa_" not in name or name.endswith(kind)]


def build(name: str, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from diff_llama import DiffLlamaConfig, DiffLlamaForCausalLM

    torch.manual_seed(0)
    shape = {**WIDTH, "num_hidden_layers": layers}
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape))
    if name == "diff v2":
        return DiffLlamaForCausalLM(DiffLlamaConfig(**{**shape, "num_attention_heads": 64}, diff_version=2))
    return DiffLlamaForCausalLM(DiffLlamaConfig(**shape, diff_version=1, differential_kernel=name.split(", ")[1]))


@contextlib.contextmanager
def counting_rebuilt_tensors(count):
    """The model's own saved-tensor hooks (`RebuiltForBackward`, which keeps the inputs that rebuild a tensor in its
    place) active inside the counting hooks, whose presence would otherwise switch them off: `count` sees what they
    keep, a tensor or the inputs of its rebuild."""
    from diff_llama import differential_kernels as kernels

    own_pack = kernels.RebuiltForBackward._pack

    def counted_pack(self, tensor):
        packed = own_pack(self, tensor)
        for kept in [packed] if isinstance(packed, torch.Tensor) else packed[0].inputs:
            count(kept)
        return packed

    with mock.patch.object(kernels, "_saved_tensor_hooks_active", lambda: False), \
            mock.patch.object(kernels.RebuiltForBackward, "_pack", counted_pack):
        yield


def saved_storages(model, tokens: int, device: str) -> tuple[list[dict], dict]:
    """Every storage kept for backward by the decoder (not the LM head), once, with the first tensor saved from it;
    and on CUDA the bytes allocated above the parameters after the forward and at the peak of forward and backward."""
    parameters = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters and storage.data_ptr() not in saved:
            saved[storage.data_ptr()] = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                                         "bytes": storage.nbytes()}
        return tensor

    ids = torch.randint(0, WIDTH["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    with counting_rebuilt_tensors(pack), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        hidden = model.train().model(ids).last_hidden_state
    memory = {}
    if cuda:
        memory["after_forward"] = torch.cuda.memory_allocated(device) - before
        hidden.float().square().mean().backward()
        torch.cuda.synchronize(device)
        memory["peak"] = torch.cuda.max_memory_allocated(device) - before
    return list(saved.values()), memory


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--output", default="saved_for_backward", help="with --write: results name or path")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    result = {"dtype": args.dtype, "tokens": args.tokens, "layers": args.layers, "device": args.device,
              "models": {}, "memory": {}}
    for name in models_for(args.device):
        saved, memory = saved_storages(build(name, args.layers).to(args.device, dtype), args.tokens, args.device)
        result["models"][name] = saved
        if memory:
            result["memory"][name] = memory
    if args.write:
        suite.write_result("saved_for_backward", args.output, result, render)
    else:
        print(render(result))


def render(result: dict) -> str:
    models = result["models"]
    llama = sum(entry["bytes"] for entry in models["llama"])
    memory = result.get("memory") or {}
    lines = [f"Bytes kept for backward by {result['layers']} decoder layer(s) at Llama-3.2-1B's width, one sequence of "
             f"{result['tokens']} tokens, {result['dtype']}, {result['device']} (parameters left out):", ""]
    if memory:
        lines += ["| model | MiB | against Llama | allocated after forward, MiB | peak of forward and backward, MiB "
                  "| peak against Llama |", "|---|---|---|---|---|---|"]
    else:
        lines += ["| model | MiB | against Llama |", "|---|---|---|"]
    for name, entries in models.items():
        total = sum(entry["bytes"] for entry in entries)
        row = f"| {name} | {total / 2**20:.2f} | {total / llama:.3f}x |"
        if memory:
            measured = memory[name]
            row += (f" {measured['after_forward'] / 2**20:.2f} | {measured['peak'] / 2**20:.2f} | "
                    f"{measured['peak'] / memory['llama']['peak']:.3f}x |")
        lines.append(row)
    for name, entries in models.items():
        lines += ["", f"{name}, storage by storage (shape of the first tensor saved from it, dtype, MiB): " + "; ".join(
            f"{tuple(entry['shape'])} {entry['dtype']} {entry['bytes'] / 2**20:.2f}" for entry in entries)]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
