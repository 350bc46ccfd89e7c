"""A first, quick speed comparison (the full benchmark suite is its own issue): prefill and batch-1 decoding of
diff-llama's DiffLlamaForCausalLM, transformers' built-in DiffLlamaForCausalLM and LlamaForCausalLM, same config,
fp32, CPU threads as set, SDPA, interleaved rounds, medians.

Usage: python bench/quick_model_speed.py [--tokens 2048] [--rounds 3]
"""

import argparse
import statistics
import time

import torch
from transformers import DiffLlamaConfig as BuiltinConfig
from transformers import DiffLlamaForCausalLM as BuiltinModel
from transformers import LlamaConfig, LlamaForCausalLM

from diff_llama import DiffLlamaConfig, DiffLlamaForCausalLM


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="prefill length")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians reported)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=8192)
    models = {
        "llama": LlamaForCausalLM(LlamaConfig(**shape)).eval(),
        "diff-llama": DiffLlamaForCausalLM(DiffLlamaConfig(**shape)).eval(),
        "built-in diffllama": BuiltinModel(BuiltinConfig(**shape)).eval(),
    }
    ids = torch.randint(0, 32000, (1, args.tokens))

    @torch.no_grad()
    def prefill(model):
        started = time.perf_counter()
        model(ids, logits_to_keep=1)
        return time.perf_counter() - started

    @torch.no_grad()
    def decode(model, new_tokens=64):
        started = time.perf_counter()
        model.generate(ids[:, :128], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return new_tokens / (time.perf_counter() - started)

    for model in models.values():  # warm-up
        prefill(model)
        decode(model, 4)
    results = {name: {"prefill": [], "decode": []} for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            results[name]["prefill"].append(prefill(model))
            results[name]["decode"].append(decode(model))
    base_prefill = statistics.median(results["llama"]["prefill"])
    base_decode = statistics.median(results["llama"]["decode"])
    print(f"hidden 512, 8 heads, 4 layers, fp32, {args.threads} threads, {args.rounds} rounds (medians)")
    print(f"| model | prefill {args.tokens} ms | x Llama | decode tok/s (batch 1) | x Llama |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        p, d = statistics.median(r["prefill"]), statistics.median(r["decode"])
        print(f"| {name} | {p * 1000:.0f} | {p / base_prefill:.2f} | {d:.0f} | {d / base_decode:.2f} |")


if __name__ == "__main__":
    main()
