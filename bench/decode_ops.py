"""aten ops in one decoding step (one token, dynamic cache after a 128-token prompt), counted with torch.profiler:
Llama, diff-llama (version 1, automatic kernels), diff-llama v2 and transformers' built-in DiffLlama, benchmark config (hidden 512,
8 heads, 4 layers). Counts every aten event, nested ones included (what the dispatcher pays for), and the
difference per layer by op name. With --timing, also the time of one layer's attention in a decoding step
(192 to 392 cached tokens) for Llama and diff-llama, and of the parts of diff-llama's that Llama does not have,
each called alone on the same inputs: the λ lookup, the kernel choice, the one-token kernel (against Llama's
attention function), the head norm and (1 − λ_init).

Usage: python bench/decode_ops.py [--batch 1] [--dtype float32] [--timing] [--write]
Writes bench/results/decode_ops.md with --write.
"""

import argparse
import collections
import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_benchmark import SHAPE, build  # noqa: E402


def step_ops(model, batch):
    ids = torch.randint(0, 32000, (batch, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        model(token, cache=cache, use_cache=True)  # warm
        with torch.profiler.profile() as profile:
            model(token, cache=cache, use_cache=True)
    return collections.Counter(event.name for event in profile.events() if event.name.startswith("aten::"))


def _microseconds(fn, number=200, repeat=9):
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def attention_timing(batch, dtype) -> list[str]:
    """Microseconds of layer 0's attention in a decoding step, and of diff-llama's own parts called alone."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from diff_llama.modeling_diff_llama import select_differential_kernel

    rows = {}
    ids = torch.randint(0, 32000, (batch, 192), generator=torch.Generator().manual_seed(0))
    for name in ("llama", "diff-llama"):
        model = build(name, dtype)
        with torch.no_grad():
            cache = model(ids, use_cache=True).cache
            attention = model.model.layers[0].self_attn
            hidden = torch.randn(batch, 1, model.config.hidden_size, dtype=dtype)
            position = model.model.rotary_emb(hidden, torch.full((batch, 1), 192))

            def steps(count=200):
                for _ in range(count):
                    attention(hidden, position, None, cache=cache)
                cache.crop(-count)

            steps()
            rows[f"{name}: attention layer"] = min(timeit.repeat(steps, number=1, repeat=9)) / 200 * 1e6
            heads = attention.config.num_attention_heads
            query = torch.randn(batch, heads, 1, attention.head_dim, dtype=dtype)
            key, value = cache.layers[0].keys, cache.layers[0].values
            if name == "llama":
                rows["llama: attention function (SDPA)"] = _microseconds(
                    lambda: sdpa_attention_forward(attention, query, key, value, None, scaling=attention.scaling))
                continue
            lambda_full = attention._lambda(cache)
            kernel = select_differential_kernel(attention, query, key, None)
            output, _ = kernel(attention, query, key, value, None, lambda_full)
            rows["diff-llama: λ lookup"] = _microseconds(lambda: attention._lambda(cache))
            rows["diff-llama: kernel choice"] = _microseconds(lambda: select_differential_kernel(attention, query, key, None))
            rows["diff-llama: one-token kernel"] = _microseconds(
                lambda: kernel(attention, query, key, value, None, lambda_full))
            rows["diff-llama: head norm and (1 − λ_init)"] = _microseconds(lambda: torch.add(
                normed := attention.head_norm(output), normed, alpha=-attention.differential_lambda.lambda_init))
    return ["", f"One layer's attention in a decoding step, batch {batch}, µs (`--timing`; parts called alone):", "",
            "| what | µs |", "|---|---|"] + [f"| {name} | {value:.1f} |" for name, value in rows.items()]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--timing", action="store_true", help="time one layer's attention and its parts")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    counts = {name: step_ops(build(name, getattr(torch, args.dtype)), args.batch)
              for name in ("llama", "diff-llama", "diff-llama v2", "built-in")}
    layers = SHAPE["num_hidden_layers"]
    lines = [f"aten events in one decoding step, batch {args.batch}, {args.dtype}, {layers} layers "
             f"(`python bench/decode_ops.py`):", "", "| model | aten ops per step | per layer more than Llama |",
             "|---|---|---|"]
    total_llama = sum(counts["llama"].values())
    for name, counter in counts.items():
        total = sum(counter.values())
        lines.append(f"| {name} | {total} | {(total - total_llama) / layers:+.1f} |")
    for model in ("diff-llama", "diff-llama v2"):
        difference = counts[model].copy()
        difference.subtract(counts["llama"])
        lines += ["", f"{model} minus Llama, by op (whole step): " + ", ".join(
            f"{name.removeprefix('aten::')} {count:+d}" for name, count in
            sorted(difference.items(), key=lambda item: -abs(item[1])) if count)]
    if args.timing:
        lines += attention_timing(args.batch, getattr(torch, args.dtype))
    print("\n".join(lines))
    if args.write:
        (Path(__file__).parent / "results" / "decode_ops.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
