"""The attention core alone (no projections) on CPU: what each exact way of forming the differential heads costs
against one Llama SDPA call, in one run, interleaved.

- the padded one-call layout (the generic kernel's prefill), and the built-in's two d-wide calls (each map times V1,
  then times V2, as flash-style kernels must);
- the blocked kernel (`BlockedDifferentialAttention`): A1 − λ·A2 formed per block of query rows before it meets the
  2d-wide value, at several block sizes;
- with --flex, FlexAttention (compiled) with d-wide and 2d-wide values.

(The --inductor probe, the blocks compiled by torch.compile, answered its question and was retired; its result stays
in bench/results/attention_core-inductor-epyc.md.)

Usage: python -m bench attention_core [--tokens 512,2048,8192] [--dtype float32] [--threads 2] [--flex] [--write]
Writes bench/results/attention_core[-DTYPE].{json,md} with --write.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import suite
from diff_llama.differential_kernels import BlockedDifferentialAttention


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


def core_times(tokens, args, dtype):
    generator = torch.Generator().manual_seed(0)
    # (batch, seq, heads, d) transposed, as the attention layer hands them over.
    q, k, v, v_other = (torch.randn(1, tokens, args.heads, args.head_dim, generator=generator).to(dtype).transpose(1, 2)
                        for _ in range(4))
    pairs = torch.cat([v, v_other], dim=-1)
    q_padded, k_padded = F.pad(q, (0, args.head_dim)), F.pad(k, (0, args.head_dim))
    # The blocked kernel reads q, k, v as they are: maps i and i + H/2 pair up, value pair (v_i, v_(i + H/2)).
    lam = torch.tensor(0.3)
    sdpa = F.scaled_dot_product_attention
    scale = args.head_dim**-0.5
    variants = {
        "Llama: one d-wide call": lambda: sdpa(q, k, v, is_causal=True),
        "padded one call (generic kernel)": lambda: sdpa(q_padded, k_padded, pairs, is_causal=True),
        "two d-wide calls (built-in)": lambda: (sdpa(q, k, v, is_causal=True), sdpa(q, k, v_other, is_causal=True)),
    }
    for rows in args.block_rows:
        variants[f"blocked, {rows} rows"] = (
            lambda rows=rows: BlockedDifferentialAttention.apply(q, k, v, lam, None, scale, rows, 0, True))
    if args.flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention)
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, args.heads, tokens, tokens, device="cpu")
        variants["FlexAttention (compiled): d-wide values"] = lambda: flex(q, k, v, block_mask=mask)
        variants["FlexAttention (compiled): 2d-wide values"] = lambda: flex(q, k, pairs, block_mask=mask)
    with torch.no_grad():
        return interleaved_median_ms(variants, rounds=args.rounds if tokens < 8192 else max(3, args.rounds // 2))


def render(result: dict) -> str:
    c = result["config"]
    lines = [f"{c['heads']} heads of {c['head_dim']}, {c['dtype']}, causal, {c['threads']} threads, medians of "
             f"{c['rounds']} interleaved rounds (3-4 at 8192 tokens); x Llama = time / Llama's core in the same run.",
             ""]
    for tokens, times in result["tokens"].items():
        baseline = times["Llama: one d-wide call"]
        lines += [f"**{tokens} tokens**", "", "| attention core | ms | x Llama |", "|---|---|---|"]
        lines += [f"| {name} | {ms:.1f} | {ms / baseline:.2f} |" for name, ms in times.items()]
        lines.append("")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="512,2048,8192")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--block-rows", default="32,64,128")
    parser.add_argument("--flex", action="store_true", help="add FlexAttention (its compilation takes a minute)")
    parser.add_argument("--write", action="store_true", help="write bench/results/attention_core[-DTYPE].{json,md}")
    parser.add_argument("--output", help="with --write: this name under bench/results instead (without a suffix)")
    args = parser.parse_args()
    args.block_rows = [int(rows) for rows in args.block_rows.split(",")]
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    result = {"config": {"heads": args.heads, "head_dim": args.head_dim, "dtype": args.dtype, "threads": args.threads,
                         "rounds": args.rounds, "block_rows": args.block_rows}, "tokens": {}}
    for tokens in (int(t) for t in args.tokens.split(",")):
        result["tokens"][str(tokens)] = times = core_times(tokens, args, dtype)
        print(f"{tokens} tokens: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in times.items()), flush=True)
    if args.write:
        suffix = "" if args.dtype == "float32" else f"-{args.dtype}"
        suite.write_result("attention_core", args.output or "attention_core" + suffix, result, render)
    else:
        print(render(result))


if __name__ == "__main__":
    main()
