"""The attention core alone (no projections) on CPU: what each exact way of forming the differential heads costs
against one Llama SDPA call, in one run, interleaved.

- the padded one-call layout (the generic kernel's prefill), and the built-in's two d-wide calls (each map times V1,
  then times V2, as flash-style kernels must);
- the blocked kernel (`BlockedDifferentialAttention`): A1 − λ·A2 formed per block of query rows before it meets the
  2d-wide value, at several block sizes;
- with --inductor, the same blocks compiled by torch.compile (inductor), which fuses the mask, the softmax and the
  subtraction into one generated C++ loop: the best fused kernel torch itself can make, the probe behind the
  README's claim that only a hand-written fused kernel could remove those passes.

Usage: python bench/attention_core.py [--tokens 512,2048,8192] [--dtype float32] [--threads 2] [--flex] [--inductor]
Writes bench/results/attention_core[-DTYPE].md with --write.
"""

import argparse
import statistics
import sys
import time

from pathlib import Path

import torch
import torch.nn.functional as F

from diff_llama.modeling_diff_llama import BlockedDifferentialAttention


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


def _differential_block(query_rows, key, value_pairs, lambda_full):
    """One block of the blocked kernel's forward, written for the compiler: scaled query rows (batch, G, r, d) against
    the keys up to the block's last row (batch, G, c, d), causal mask, softmax, A1 − λ·A2, times the value pairs."""
    scores = torch.matmul(query_rows, key.transpose(2, 3))
    rows, columns = scores.shape[-2:]
    row = torch.arange(rows, device=scores.device)[:, None] + (columns - rows)
    scores = scores.masked_fill(torch.arange(columns, device=scores.device)[None, :] > row, float("-inf"))
    maps = torch.softmax(scores, dim=-1)
    half = maps.shape[1] // 2
    return torch.matmul(maps[:, :half] - lambda_full * maps[:, half:], value_pairs)


def blocked_by(block_function, query, key, value, lambda_full, scaling, block_rows):
    """The blocked kernel's forward loop (no mask but causal), each block computed by `block_function`."""
    half = query.shape[1] // 2
    rows = query * scaling
    pairs = torch.cat((value[:, :half], value[:, half:]), dim=-1)
    output = query.new_empty(query.shape[0], half, query.shape[2], pairs.shape[-1])
    for start in range(0, query.shape[2], block_rows):
        stop = min(start + block_rows, query.shape[2])
        output[:, :, start:stop] = block_function(rows[:, :, start:stop], key[:, :, :stop], pairs[:, :, :stop],
                                                  lambda_full)
    return output


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
    if args.inductor:
        compiled = torch.compile(_differential_block, dynamic=True)
        for rows in args.block_rows:
            variants[f"blocked, {rows} rows, inductor-compiled"] = (
                lambda rows=rows: blocked_by(compiled, q, k, v, lam, scale, rows))
    if args.flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention)
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, args.heads, tokens, tokens, device="cpu")
        variants["FlexAttention (compiled): d-wide values"] = lambda: flex(q, k, v, block_mask=mask)
        variants["FlexAttention (compiled): 2d-wide values"] = lambda: flex(q, k, pairs, block_mask=mask)
    with torch.no_grad():
        if args.inductor:  # the compiled blocks must compute what the kernel computes
            expected = BlockedDifferentialAttention.apply(q, k, v, lam, None, scale, 128, 0, True)
            for name, fn in variants.items():
                if "inductor" in name:
                    got = fn().transpose(1, 2).reshape(expected.shape)
                    difference = (got.float() - expected.float()).abs().max().item()
                    print(f"{tokens} tokens, {name}: max |difference| from the blocked kernel {difference:.1e}")
                    assert difference < (1e-4 if dtype == torch.float32 else 5e-2), difference
        return interleaved_median_ms(variants, rounds=args.rounds if tokens < 8192 else max(3, args.rounds // 2))


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "an unnamed CPU"


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
    parser.add_argument("--inductor", action="store_true",
                        help="add the blocked kernel's blocks compiled by torch.compile (compilation takes a minute)")
    parser.add_argument("--write", action="store_true", help="write bench/results/attention_core[-DTYPE].md")
    parser.add_argument("--output", help="with --write: this name under bench/results instead (without .md)")
    args = parser.parse_args()
    args.block_rows = [int(rows) for rows in args.block_rows.split(",")]
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    lines = [f"`python bench/attention_core.py {' '.join(sys.argv[1:])}` on {_cpu_name()}.", "",
             f"{args.heads} heads of {args.head_dim}, {args.dtype}, causal, {args.threads} threads, medians of "
             f"{args.rounds} interleaved rounds (3-4 at 8192 tokens); x Llama = time / Llama's core in the same run.", ""]
    for tokens in (int(t) for t in args.tokens.split(",")):
        times = core_times(tokens, args, dtype)
        baseline = times["Llama: one d-wide call"]
        lines += [f"**{tokens} tokens**", "", "| attention core | ms | x Llama |", "|---|---|---|"]
        lines += [f"| {name} | {ms:.1f} | {ms / baseline:.2f} |" for name, ms in times.items()]
        lines.append("")
        print("\n".join(lines[-len(times) - 4:]), flush=True)
    if args.write:
        suffix = "" if args.dtype == "float32" else f"-{args.dtype}"
        path = Path(__file__).parent / "results" / f"{args.output or 'attention_core' + suffix}.md"
        path.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
