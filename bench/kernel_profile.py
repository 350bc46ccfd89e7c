"""Where the time of one attention core goes: torch.profiler over Llama's SDPA call, the padded one-call path (the
generic kernel's prefill) and the blocked kernel, (1, 8, T, 64) causal, no projections. Self CPU time by aten op,
and the number of ops each runs (under a loaded machine, every op of a multi-threaded kernel waits for its threads).

Usage: python bench/kernel_profile.py [--tokens 2048] [--dtype float32] [--threads 2] [--write]
Writes bench/results/kernel_profile[-DTYPE]-TOKENS.md with --write.
"""

import argparse
import collections
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from diff_llama.modeling_diff_llama import BLOCKED_KERNEL_ROWS, BlockedDifferentialAttention


def profile(fn, repeats):
    fn()
    with torch.profiler.profile() as prof:
        for _ in range(repeats):
            fn()
    totals, counts = collections.Counter(), collections.Counter()
    for event in prof.key_averages():
        if event.key.startswith("aten::"):
            totals[event.key] += event.self_cpu_time_total / repeats / 1000
            counts[event.key] += event.count // repeats
    return totals, counts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.tokens, 8, 64, generator=generator).to(dtype).transpose(1, 2) for _ in range(3))
    pairs = torch.cat(v.chunk(2, dim=1), dim=-1)
    pairs = torch.cat([pairs, pairs], dim=1)
    q_padded, k_padded = F.pad(q, (0, 64)), F.pad(k, (0, 64))
    lam = torch.tensor(0.3)
    variants = {
        "Llama SDPA": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "padded one call": lambda: F.scaled_dot_product_attention(q_padded, k_padded, pairs, is_causal=True),
        f"blocked ({BLOCKED_KERNEL_ROWS} rows)": lambda: BlockedDifferentialAttention.apply(
            q, k, v, lam, None, 0.125, BLOCKED_KERNEL_ROWS, 0, True),
    }
    load = os.getloadavg()[0]
    lines = [f"(1, 8, {args.tokens}, 64) {args.dtype}, causal, {args.threads} threads, "
             f"{args.repeats} calls profiled, load average {load:.1f} on {os.cpu_count()} cores. Self CPU ms per call.",
             ""]
    with torch.no_grad():
        for name, fn in variants.items():
            totals, counts = profile(fn, args.repeats)
            total = sum(totals.values())
            lines += [f"**{name}**: {total:.1f} ms per call, {sum(counts.values())} aten ops", "",
                      "| op | ms | share | calls |", "|---|---|---|---|"]
            for op, ms in totals.most_common(6):
                lines.append(f"| {op} | {ms:.1f} | {ms / total:.0%} | {counts[op]} |")
            lines.append("")
    print("\n".join(lines))
    if args.write:
        suffix = "" if args.dtype == "float32" else f"-{args.dtype}"
        (Path(__file__).parent / "results" / f"kernel_profile{suffix}-{args.tokens}.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
