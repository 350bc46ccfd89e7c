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

With --fold-probe, the best alternatives to DIFF V2's forward, counted the same way on the same weights (each checked
to give the shipped model's logits): λ's rows folded into q_proj's product (one matrix product for the queries and λ,
weights concatenated once), and that fold with nothing kept for vLLM (no cast back, views for reshapes): how far the
issue's fold would take V2's extra ops per layer.

With --kernels, the kernels of one decoding step compiled by inductor over a static cache (the step CUDA graphs
replay on a GPU; here inductor's C++ backend, whose fusion decisions are the same scheduler's): fused kernels and
calls of extern kernels (matrix products, SDPA) per layer, for Llama, Llama with twice the query heads, DIFF V2 and
version 1, on a GQA shape (8 query heads over 2 key/value heads, 4 layers, batch 1). With CUDA graphs a one-token step
of a small model costs about as much per kernel as per byte, so this count is what DIFF V2's graphs figure reads.

Usage: python -m bench decode_ops [--batch 1] [--dtype float32] [--timing] [--products] [--fold-probe] [--kernels]
                                  [--write]
Writes bench/results/decode_ops.{json,md} with --write.
"""

import argparse
import collections
import sys
import timeit
from pathlib import Path

import torch
import torch.nn.functional as F

from diff_llama.compat_diff_llama import cache_kwargs, output_cache

sys.path.insert(0, str(Path(__file__).parent))
import suite  # noqa: E402
from model_benchmark import SHAPE, build  # noqa: E402


def step_ops(model, batch):
    ids = torch.randint(0, model.config.vocab_size, (batch, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        # The cache's name differs between transformers versions (`cache` from 5.2x, `past_key_values` before).
        cache, token = cache_kwargs(output_cache(out)), out.logits[:, -1:].argmax(-1)
        model(token, **cache, use_cache=True)  # warm
        with torch.profiler.profile() as profile:
            model(token, **cache, use_cache=True)
    return collections.Counter(event.name for event in profile.events() if event.name.startswith("aten::"))


class FoldedQueryLambdaForward:
    """DIFF V2's attention forward with λ's rows inside q_proj's product (weights concatenated once, at set-up): the
    fold issue 40 suggests. `lean` also drops what vLLM's Transformers backend needs (the unconditional cast back, the
    reshape from the input's shape) and uses views where the shipped forward reshapes. A probe, not a forward to ship:
    the fused weight is a copy (a LoRA adapter or an update on q_proj or lambda_proj would not reach it), and in
    bf16/fp16 λ's logits would come out of the model-dtype product, not float32."""

    def __init__(self, attention, lean: bool):
        self.attention, self.lean = attention, lean
        self.weight = torch.cat([attention.q_proj.weight, attention.differential_lambda.lambda_proj.weight]).detach()
        self.query_width = attention.q_proj.out_features

    def __call__(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        attention, batch_and_tokens = self.attention, hidden_states.shape[:-1]
        cache = kwargs.pop("past_key_values", None) if cache is None else cache  # its name before transformers 5.2x
        projected = F.linear(hidden_states, self.weight)
        query = projected[..., : self.query_width].view(*batch_and_tokens, -1, attention.head_dim).transpose(1, 2)
        lambdas = torch.sigmoid(projected[..., self.query_width :])
        key = attention.k_proj(hidden_states).view(*batch_and_tokens, -1, attention.head_dim).transpose(1, 2)
        value = attention.v_proj(hidden_states).view(*batch_and_tokens, -1, attention.head_dim).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
        key, value = cache.update(key, value, attention.layer_idx, kwargs=kwargs)
        attend = ALL_ATTENTION_FUNCTIONS[attention.config._attn_implementation]
        output, weights = attend(attention, query, key, value, attention_mask, dropout=0.0,
                                 scaling=attention.scaling, **kwargs)
        if self.lean:  # the interface's output is contiguous (batch, tokens, H, d)
            heads = output
        else:
            heads = output.reshape(*batch_and_tokens, -1, attention.head_dim)
        differential = torch.addcmul(heads[..., 0::2, :], lambdas.view(*lambdas.shape, 1), heads[..., 1::2, :],
                                     value=-1)
        if self.lean:
            return attention.o_proj(differential.view(*batch_and_tokens, -1)), weights
        differential = differential.to(hidden_states.dtype).reshape(*batch_and_tokens, -1)
        return attention.o_proj(differential), weights


def fold_probe(batch, dtype) -> dict:
    """Per-layer aten ops above Llama's of DIFF V2 as shipped and with each probe forward, and each probe's largest
    logit difference from the shipped model's on the same decoding step."""
    llama = sum(step_ops(build("llama", dtype), batch).values())
    model = build("diff-llama v2", dtype)
    ids = torch.randint(0, model.config.vocab_size, (batch, 129), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        shipped_logits = model(ids).logits[:, -1]
    rows = {"diff-llama v2 (shipped)": {"ops": sum(step_ops(model, batch).values()), "logit_difference": 0.0}}
    for name, lean in (("λ folded into q_proj", False), ("λ folded, nothing for vLLM, views", True)):
        for layer in model.model.layers:
            layer.self_attn.forward = FoldedQueryLambdaForward(layer.self_attn, lean)
        with torch.no_grad():
            difference = (model(ids).logits[:, -1] - shipped_logits).abs().max().item()
        rows[name] = {"ops": sum(step_ops(model, batch).values()), "logit_difference": difference}
    layers = SHAPE["num_hidden_layers"]
    for row in rows.values():
        row["per_layer_over_llama"] = (row["ops"] - llama) / layers
    return {"llama_ops": llama, "rows": rows}


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
            cache = output_cache(model(ids, use_cache=True))
            attention = model.model.layers[0].self_attn
            hidden = torch.randn(batch, 1, model.config.hidden_size, dtype=dtype)
            position = model.model.rotary_emb(hidden, torch.full((batch, 1), 192))

            def steps(count=200):
                for _ in range(count):
                    attention(hidden, position, None, **cache_kwargs(cache))
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


KERNEL_SHAPE = dict(vocab_size=512, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=256)


def compiled_kernels(batch, dtype, layers=KERNEL_SHAPE["num_hidden_layers"]) -> dict:
    """{model: {"fused": n, "extern": {name: n}}} of one decoding step compiled by inductor (see --kernels)."""
    import re

    from torch._inductor.utils import run_and_get_code
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    from diff_llama import DiffLlamaConfig, DiffLlamaForCausalLM
    from diff_llama.compat_diff_llama import CACHE_NAME

    shape = {**KERNEL_SHAPE, "num_hidden_layers": layers}
    twice = {**shape, "num_attention_heads": 2 * shape["num_attention_heads"]}
    builders = {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**shape)),
        "llama 2x heads": lambda: LlamaForCausalLM(LlamaConfig(**twice)),
        "diff-llama v2": lambda: DiffLlamaForCausalLM(DiffLlamaConfig(**twice, diff_version=2)),
        "diff-llama": lambda: DiffLlamaForCausalLM(DiffLlamaConfig(**shape, diff_version=1)),
    }
    found = {}
    for name, make in builders.items():
        torch.manual_seed(0)
        model = make().to(dtype).eval()
        model.set_attn_implementation("sdpa")
        cache = StaticCache(config=model.config, max_cache_len=64)
        prompt = torch.randint(3, 512, (batch, 16), generator=torch.Generator().manual_seed(0))

        def step(token, position):
            return model(input_ids=token, position_ids=position, use_cache=True, logits_to_keep=1,
                         **{CACHE_NAME: cache}).logits

        torch._dynamo.reset()
        with torch.no_grad():
            token = model(input_ids=prompt, use_cache=True, **{CACHE_NAME: cache}).logits[:, -1:].argmax(-1)
            position = torch.full((batch, 1), prompt.shape[1])
            _, code = run_and_get_code(torch.compile(step, fullgraph=True, dynamic=False), token, position)
        call = "\n".join(code)
        call = call[call.rindex("def call("):]
        fused = re.findall(r"\n\s+(cpp_fused_\w+)\(", call)
        extern = re.findall(r"(extern_kernels\.\w+|torch\.ops\.aten\.\w+)(?:\.default)?\(", call)  # calls only
        found[name] = {"fused": len(fused), "extern": dict(collections.Counter(extern))}
    return {"shape": shape, "models": found}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--timing", action="store_true", help="time one layer's attention and its parts")
    parser.add_argument("--products", action="store_true",
                        help="time the one-token kernel's parts in every formulation against Llama's SDPA call")
    parser.add_argument("--fold-probe", action="store_true",
                        help="count DIFF V2 with λ folded into q_proj's product, and that fold at its leanest")
    parser.add_argument("--kernels", action="store_true",
                        help="count the kernels of a decoding step compiled by inductor (minutes: C++ compilation)")
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
    if args.fold_probe:
        result["fold_probe"] = fold_probe(args.batch, dtype)
    if args.kernels:
        result["compiled_kernels"] = compiled_kernels(args.batch, dtype)
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
    if "fold_probe" in result:
        lines += ["", f"DIFF V2 and its best alternatives (`--fold-probe`), batch {batch}: aten ops per layer above "
                  "Llama's, and each forward's largest logit difference from the shipped one:", "",
                  "| forward | ops per layer over Llama | logits differ by |", "|---|---|---|"]
        lines += [f"| {name} | {row['per_layer_over_llama']:+.1f} | {row['logit_difference']:.1e} |"
                  for name, row in result["fold_probe"]["rows"].items()]
    if "compiled_kernels" in result:
        found, layers = result["compiled_kernels"]["models"], result["compiled_kernels"]["shape"]["num_hidden_layers"]
        shape = result["compiled_kernels"]["shape"]
        lines += ["", f"Kernels of one decoding step compiled by inductor (`--kernels`), batch {batch}, static cache, "
                  f"{shape['num_attention_heads']} query heads over {shape['num_key_value_heads']} key/value heads "
                  f"(DIFF V2 and llama 2x heads: twice the query heads), {layers} layers:", "",
                  "| model | fused kernels | extern calls | per layer | per layer more than Llama |",
                  "|---|---|---|---|---|"]

        def per_layer(row):
            return (row["fused"] + sum(row["extern"].values())) / layers

        for name, row in found.items():
            extern = ", ".join(f"{call.rsplit('.', 1)[-1]} {count}" for call, count in row["extern"].items())
            lines.append(f"| {name} | {row['fused']} | {sum(row['extern'].values())} ({extern}) | "
                         f"{per_layer(row):.2f} | {per_layer(row) - per_layer(found['llama']):+.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
