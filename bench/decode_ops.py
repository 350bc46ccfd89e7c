"""aten ops in one decoding step (one token, dynamic cache after a 128-token prompt), counted with torch.profiler:
Llama, diff-llama (version 1, automatic kernels), diff-llama v2 and transformers' built-in DiffLlama, benchmark config (hidden 512,
8 heads, 4 layers). Counts every aten event, nested ones included (what the dispatcher pays for), and the
difference per layer by op name. With --timing, also the time of one layer's attention in a decoding step
(192 to 392 cached tokens) for Llama and diff-llama, and of the parts of diff-llama's that Llama does not have,
each called alone on the same inputs: the λ lookup, the kernel choice, the one-token kernel (against Llama's
attention function), the head norm and (1 − λ_init).

With --products, what the one-token kernel's parts cost in every formulation torch offers, against Llama's
whole fused SDPA call on the same cache: the score product (bmm, the kernel's choice; 4-D matmul; einsum;
multiply-and-sum), the softmax, and the value product (bmm on the maps stacked for both value halves, the kernel's
choice; a broadcasting 4-D matmul that stacks them implicitly; two bmm, one per value half).

Usage: python -m bench decode_ops [--batch 1] [--dtype float32] [--timing] [--products] [--write]
Writes bench/results/decode_ops.{json,md} with --write.
"""

import argparse
import collections
import sys
import timeit
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import suite  # noqa: E402
from model_benchmark import SHAPE, build  # noqa: E402


def step_ops(model, batch):
    ids = torch.randint(0, model.config.vocab_size, (batch, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        model(token, cache=cache, use_cache=True)  # warm
        with torch.profiler.profile() as profile:
            model(token, cache=cache, use_cache=True)
    return collections.Counter(event.name for event in profile.events() if event.name.startswith("aten::"))


def _microseconds(fn, number=200, repeat=9):
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def attention_timing(batch, dtype) -> dict:
    """Microseconds of layer 0's attention in a decoding step, and of diff-llama's own parts called alone."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from diff_llama.differential_kernels import select_differential_kernel

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
    return rows


def product_timing(batch, dtype) -> dict:
    """µs of the one-token kernel's parts in each formulation, and of Llama's fused SDPA call, 192 cached tokens."""
    from diff_llama.differential_kernels import differential_decode_attention

    heads, kv_heads, head_dim = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], 64
    group, length = heads // kv_heads, 192
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(batch, heads, 1, head_dim, generator=generator).to(dtype)
    key, value = (torch.randn(batch, kv_heads, length, head_dim, generator=generator).to(dtype) for _ in range(2))
    lam = torch.tensor(0.3)
    rows = query.reshape(batch * kv_heads, group, head_dim)
    keys = key.reshape(batch * kv_heads, length, head_dim)
    values = value.reshape(batch * kv_heads, length, head_dim)
    maps = torch.softmax(torch.bmm(rows, keys.transpose(1, 2)), -1)  # (batch * G, group, T)
    by_half = maps.view(batch, 2, kv_heads // 2, group, length)
    stacked = by_half.transpose(1, 2).unsqueeze(1).expand(batch, 2, kv_heads // 2, 2, group, length).contiguous()
    value_halves = value.view(batch, 2, kv_heads // 2, length, head_dim)
    candidates = {
        "Llama: the whole SDPA call (scores, softmax, values)": lambda: F.scaled_dot_product_attention(
            query, key, value, enable_gqa=group > 1),  # transformers passes enable_gqa only when needed
        "diff-llama: the whole one-token kernel": lambda: differential_decode_attention(
            query, key, value, None, head_dim**-0.5, lam),
        "scores: bmm (the kernel's)": lambda: torch.bmm(rows, keys.transpose(1, 2)),
        "scores: 4-D matmul": lambda: torch.matmul(query.view(batch, kv_heads, group, head_dim), key.transpose(2, 3)),
        "scores: einsum": lambda: torch.einsum("bgqd,bgtd->bgqt", query.view(batch, kv_heads, group, head_dim), key),
        "scores: multiply and sum": lambda: (key * query.view(batch, kv_heads, group, head_dim)).sum(-1),
        "softmax": lambda: torch.softmax(maps, -1),
        "values: bmm on the stacked maps (the kernel's)": lambda: torch.bmm(
            stacked.view(batch * kv_heads, 2 * group, length), values),
        "values: broadcasting 4-D matmul (stacks implicitly)": lambda: torch.matmul(
            by_half.transpose(1, 2).reshape(batch, 1, kv_heads // 2, 2 * group, length), value_halves),
        "values: two bmm, one per value half": lambda: [torch.bmm(
            by_half.transpose(1, 2).reshape(batch * kv_heads // 2, 2 * group, length),
            value_halves[:, half].reshape(batch * kv_heads // 2, length, head_dim)) for half in range(2)],
    }
    # Same products, whatever the formulation (else the timing compares different work).
    scores = candidates["scores: bmm (the kernel's)"]().view(-1)
    same = [(scores, candidates[name]().reshape(-1))
            for name in ("scores: 4-D matmul", "scores: einsum", "scores: multiply and sum")]
    products = candidates["values: bmm on the stacked maps (the kernel's)"]()
    products = products.view(batch, 2, kv_heads // 2, 2, group, -1)
    same.append((products, candidates["values: broadcasting 4-D matmul (stacks implicitly)"]().view_as(products)))
    same += [(products[:, half], candidates["values: two bmm, one per value half"]()[half].view_as(products[:, half]))
             for half in range(2)]
    assert all(torch.allclose(a.float(), b.float(), atol=1e-4, rtol=1e-3) for a, b in same)
    timings = {name: _microseconds(fn, number=500) for name, fn in candidates.items()}
    return {"cached_tokens": length, "heads": heads, "kv_heads": kv_heads, "microseconds": timings}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--timing", action="store_true", help="time one layer's attention and its parts")
    parser.add_argument("--products", action="store_true",
                        help="time the one-token kernel's parts in every formulation against Llama's SDPA call")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--output", default="decode_ops", help="with --write: results name or path (no suffix)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    dtype = getattr(torch, args.dtype)
    counts = {name: dict(step_ops(build(name, dtype), args.batch))
              for name in ("llama", "diff-llama", "diff-llama v2", "built-in")}
    result = {"batch": args.batch, "dtype": args.dtype, "layers": SHAPE["num_hidden_layers"], "aten_ops": counts}
    if args.timing:
        result["attention_microseconds"] = attention_timing(args.batch, dtype)
    if args.products:
        result["products"] = product_timing(args.batch, dtype)
    if args.write:
        suite.write_result("decode_ops", args.output, result, render)
    else:
        print(render(result))


def render(result: dict) -> str:
    counts, layers, batch = result["aten_ops"], result["layers"], result["batch"]
    lines = [f"aten events in one decoding step, batch {batch}, {result['dtype']}, {layers} layers:", "",
             "| model | aten ops per step | per layer more than Llama |", "|---|---|---|"]
    total_llama = sum(counts["llama"].values())
    for name, counter in counts.items():
        total = sum(counter.values())
        lines.append(f"| {name} | {total} | {(total - total_llama) / layers:+.1f} |")
    for model in ("diff-llama", "diff-llama v2"):
        difference = collections.Counter(counts[model])
        difference.subtract(counts["llama"])
        lines += ["", f"{model} minus Llama, by op (whole step): " + ", ".join(
            f"{name.removeprefix('aten::')} {count:+d}" for name, count in
            sorted(difference.items(), key=lambda item: -abs(item[1])) if count)]
    if "attention_microseconds" in result:
        lines += ["", f"One layer's attention in a decoding step, batch {batch}, µs (`--timing`; parts called alone):",
                  "", "| what | µs |", "|---|---|"]
        lines += [f"| {name} | {value:.1f} |" for name, value in result["attention_microseconds"].items()]
    if "products" in result:
        p = result["products"]
        lines += ["", f"The one-token kernel's parts in each formulation, batch {batch}, {p['cached_tokens']} cached "
                  f"tokens, {p['heads']} query heads over {p['kv_heads']} key/value heads, µs (`--products`; each "
                  "called alone, best of 9 x 500):", "", "| what | µs |", "|---|---|"]
        lines += [f"| {name} | {value:.1f} |" for name, value in p["microseconds"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
