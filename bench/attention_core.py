"""The attention core alone (no projections) on CPU: what each exact way of forming A·[V1, V2] costs against one
Llama SDPA call. These timings back the README's argument that the attention-layer and prefill targets are out
of reach on CPU.

Usage: python bench/attention_core.py [--tokens 2048] [--threads 2] [--no-flex]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def interleaved_median_ms(variants: dict, rounds: int = 9) -> dict:
    """Median time of each variant over `rounds` rounds, every round running each variant once."""
    for fn in variants.values():  # warm-up (and compilation for flex)
        fn(), fn()
    samples = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            started = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - started)
    return {name: 1000 * statistics.median(values) for name, values in samples.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compilation takes a minute)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    shape = (1, args.heads, args.tokens, args.head_dim)
    q, k, v, v_other = (torch.randn(shape, generator=generator) for _ in range(4))
    pairs = torch.cat([v, v_other], dim=-1)
    q_padded, k_padded = F.pad(q, (0, args.head_dim)), F.pad(k, (0, args.head_dim))
    sdpa = F.scaled_dot_product_attention
    variants = {
        "Llama: one d-wide call": lambda: sdpa(q, k, v, is_causal=True),
        "diff-llama: q/k padded to 2d, 2d-wide values (one call)": lambda: sdpa(q_padded, k_padded, pairs, is_causal=True),
        "built-in: two d-wide calls": lambda: (sdpa(q, k, v, is_causal=True), sdpa(q, k, v_other, is_causal=True)),
        "d-wide q/k, 2d-wide values (falls off the fused kernel)": lambda: sdpa(q, k, pairs, is_causal=True),
    }
    if not args.no_flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention)
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, args.heads, args.tokens, args.tokens, device="cpu")
        variants["FlexAttention (compiled): d-wide values"] = lambda: flex(q, k, v, block_mask=mask)
        variants["FlexAttention (compiled): 2d-wide values"] = lambda: flex(q, k, pairs, block_mask=mask)
    with torch.no_grad():
        times = interleaved_median_ms(variants)
    baseline = times["Llama: one d-wide call"]
    print(f"{args.tokens} tokens, {args.heads} heads of {args.head_dim}, float32, causal, {args.threads} threads, "
          "medians of 9 interleaved rounds")
    print("| attention core | ms | x Llama |\n|---|---|---|")
    for name, ms in times.items():
        print(f"| {name} | {ms:.1f} | {ms / baseline:.2f} |")


if __name__ == "__main__":
    main()
