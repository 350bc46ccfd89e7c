"""Would a fused DIFF V2 attention core make a V2 training step cheaper on CPU? The probe behind issue 10's "untried
lever": a V2 pair's two softmax maps meet the (shared) value once, as (A1 − λ_t·A2)·V, instead of twice inside one
SDPA call over all H query heads followed by O1 − λ_t·O2. That removes a quarter of the attention matmuls (forward:
QKᵀ for H maps, PV for H/2; SDPA does PV for all H), but the softmax and the subtraction then run as separate torch
ops over blocks of score rows, where SDPA's CPU flash kernel fuses them.

Measured here, forward + backward of the attention core alone (no projections), in one run, interleaved:
- `llama`: the source's core, one SDPA call over H/2 query heads (the x Llama baseline);
- `v2 sdpa`: what a V2 layer runs today, one SDPA call over H query heads (transformers' SDPA interface), then
  first − λ·second;
- `v2 fused`: `FusedPairAttention` below, by blocks of query rows, causal columns skipped, backward recomputing each
  block from saved row statistics (the structure of the V1 `BlockedDifferentialAttention`, with V2's per-token λ).

Before timing, both V2 cores are checked against a float64 eager reference written from the equations (output and
every gradient, λ's included); the probe refuses to time a wrong kernel.

Usage: python bench/v2_fused_probe.py [--tokens 2048 4096] [--threads 1] [--rounds 5] [--block-rows 64 128 256]
       [--write] [--name NAME]
Writes bench/results/v2_fused_probe[-NAME].md with --write.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from attention_core import _cpu_name  # bench/, next to this file
from diff_llama.modeling_diff_llama import (
    _block_buffer,
    _block_masking,
    _block_scores,
    _query_rows,
    _score_buffer,
)


def _score_blocks(query, rows_query, key, block_size):
    """Each block of query tokens in turn: (start, stop, causal scores, rows, columns), the scores written into one
    buffer per call and masked in place (no padding)."""
    group, length = query.shape[1] // key.shape[1], query.shape[2]
    masking = _block_masking(None, block_size, query.device)
    buffer = _score_buffer(query, key, block_size, group, query.dtype)
    for start in range(0, length, block_size):
        stop = min(start + block_size, length)
        yield (start, stop, *_block_scores(rows_query, key, None, masking, start, stop, 0, True, group, buffer))


def _pair_difference(maps, lam, buffer):
    """A1 − λ·A2 of every pair, (batch, G, tokens·P, columns), from the block's maps (batch, G, tokens, P, 2, columns)
    and λ (batch, G, tokens, P, 1), into a flat buffer allocated once per call."""
    batch, kv_heads, tokens, pairs, _, columns = maps.shape
    differential = _block_buffer(buffer, batch, kv_heads, tokens, pairs, columns)
    torch.addcmul(maps[..., 0, :], maps[..., 1, :], lam, value=-1, out=differential)
    return differential.view(batch, kv_heads, -1, columns)


class FusedPairAttention(torch.autograd.Function):
    """Causal DIFF V2 core, no padding: query (batch, H, T, d), key/value (batch, G, T, d), λ (batch, T, H/2) ->
    (batch, T, H/2, d), pair i = query heads 2i and 2i + 1 (both read key/value head 2i // (H/G))."""

    @staticmethod
    def forward(ctx, query, key, value, lambdas, scaling, block_size):
        batch, num_heads, length, head_dim = query.shape
        kv_heads = key.shape[1]
        group = num_heads // kv_heads
        pairs = group // 2
        rows_query = _query_rows(query, scaling, kv_heads)  # (batch, G, T·group, d), rows (token, head of group)
        key, value = key.contiguous(), value.contiguous()
        lam = lambdas.view(batch, length, kv_heads, pairs).permute(0, 2, 1, 3)[..., None]  # (batch, G, T, P, 1)
        output = query.new_empty(batch, kv_heads, length * pairs, head_dim)
        row_max = query.new_empty(batch, kv_heads, length * group, 1)
        row_sum = torch.empty_like(row_max)
        differential_buffer = query.new_empty(batch * kv_heads * min(block_size, length) * pairs * length)
        for start, stop, scores, rows, columns in _score_blocks(query, rows_query, key, block_size):
            torch.amax(scores, dim=-1, keepdim=True, out=row_max[:, :, rows])
            maps = scores.sub_(row_max[:, :, rows]).exp_()
            torch.sum(maps, dim=-1, keepdim=True, out=row_sum[:, :, rows])
            maps = maps.div_(row_sum[:, :, rows]).view(batch, kv_heads, stop - start, pairs, 2, columns)
            differential = _pair_difference(maps, lam[:, :, start:stop], differential_buffer)
            output[:, :, start * pairs : stop * pairs] = torch.matmul(differential, value[:, :, :columns])
        ctx.save_for_backward(query, key, value, lambdas, row_max, row_sum)
        ctx.settings = scaling, block_size
        # (batch, G, T·P, d) -> (batch, T, G·P, d): pair g·P + p
        return output.view(batch, kv_heads, length, pairs, head_dim).transpose(1, 2).reshape(
            batch, length, kv_heads * pairs, head_dim)

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, lambdas, row_max, row_sum = ctx.saved_tensors
        scaling, block_size = ctx.settings
        batch, num_heads, length, head_dim = query.shape
        kv_heads = key.shape[1]
        group = num_heads // kv_heads
        pairs = group // 2
        rows_query = _query_rows(query, scaling, kv_heads)
        lam = lambdas.view(batch, length, kv_heads, pairs).permute(0, 2, 1, 3)[..., None]
        grad_output = grad_output.reshape(batch, length, kv_heads, pairs, head_dim).transpose(1, 2)
        grad_output = grad_output.reshape(batch, kv_heads, length * pairs, head_dim)
        grad_rows_query = torch.empty_like(rows_query)
        grad_key = torch.zeros_like(key)
        grad_value = torch.zeros_like(value)
        grad_lambda = query.new_empty(batch, kv_heads, length, pairs)
        differential_buffer = query.new_empty(batch * kv_heads * min(block_size, length) * pairs * length)
        for start, stop, scores, rows, columns in _score_blocks(query, rows_query, key, block_size):
            maps = scores.sub_(row_max[:, :, rows]).exp_().div_(row_sum[:, :, rows])
            maps = maps.view(batch, kv_heads, stop - start, pairs, 2, columns)
            block_lambda = lam[:, :, start:stop]
            differential = _pair_difference(maps, block_lambda, differential_buffer)
            grad_block = grad_output[:, :, start * pairs : stop * pairs]
            grad_value[:, :, :columns] += torch.matmul(differential.transpose(2, 3), grad_block)
            grad_differential = torch.matmul(grad_block, value[:, :, :columns].transpose(2, 3))
            grad_differential = grad_differential.view(batch, kv_heads, stop - start, pairs, 1, columns)
            # dA1 = dD, dA2 = −λ·dD; softmax backward dS = A ∘ (dA − rowsum(dA ∘ A)); dλ = −rowsum(A2 ∘ dD).
            row_sums = (maps * grad_differential).sum(-1, keepdim=True)  # (…, 2, 1): rowsum(A_m ∘ dD)
            grad_lambda[:, :, start:stop] = -row_sums[..., 1, 0]
            grad_scores = (grad_differential - row_sums).mul_(maps)
            grad_scores[..., 1, :].mul_(-block_lambda)
            grad_scores = grad_scores.view(batch, kv_heads, -1, columns)
            grad_rows_query[:, :, rows] = torch.matmul(grad_scores, key[:, :, :columns])
            grad_key[:, :, :columns] += torch.matmul(grad_scores.transpose(2, 3), rows_query[:, :, rows])
        grad_query = (grad_rows_query * scaling).view(batch, kv_heads, length, group, head_dim).transpose(2, 3)
        grad_query = grad_query.reshape(batch, num_heads, length, head_dim)
        grad_lambda = grad_lambda.permute(0, 2, 1, 3).reshape(batch, length, kv_heads * pairs)
        return grad_query, grad_key, grad_value, grad_lambda, None, None


def reference_core(query, key, value, lambdas, scaling):
    """The equations, eagerly: A = softmax(q·kᵀ·scaling + causal mask) per query head (GQA), O = A·V, and for pair i
    O_{2i} − λ_i·O_{2i+1}: (batch, T, H/2, d)."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = query @ key.transpose(2, 3) * scaling
    length = query.shape[2]
    future = torch.ones(length, length, dtype=torch.bool, device=query.device).triu(1)
    maps = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    outputs = (maps @ value).transpose(1, 2)  # (batch, T, H, d)
    return outputs[:, :, 0::2] - lambdas[..., None] * outputs[:, :, 1::2]


def sdpa_v2_core(query, key, value, lambdas, scaling):
    """A V2 layer's core today: transformers' SDPA interface over all H query heads, then first − λ·second."""
    module = SimpleNamespace(is_causal=True, training=True, num_key_value_groups=query.shape[1] // key.shape[1])
    output, _ = sdpa_attention_forward(module, query, key, value, None, dropout=0.0, scaling=scaling)
    first, second = output.unflatten(2, (-1, 2)).unbind(-2)
    return torch.addcmul(first, lambdas[..., None], second, value=-1)


def llama_core(query, key, value, scaling):
    module = SimpleNamespace(is_causal=True, training=True, num_key_value_groups=query.shape[1] // key.shape[1])
    return sdpa_attention_forward(module, query, key, value, None, dropout=0.0, scaling=scaling)[0]


def check_against_reference(kv_heads=3, pairs_per_kv=3, block_size=16, length=50) -> float:
    """Largest |core − reference| of both V2 cores timed here (fused, SDPA) over the output and every gradient, in
    float64, with odd G and a partial last block."""
    generator = torch.Generator().manual_seed(0)
    num_heads, head_dim = 2 * pairs_per_kv * kv_heads, 8
    scaling = head_dim**-0.5

    def make(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()

    inputs = (make(2, num_heads, length, head_dim), make(2, kv_heads, length, head_dim),
              make(2, kv_heads, length, head_dim),
              torch.rand(2, length, num_heads // 2, generator=generator, dtype=torch.float64).requires_grad_())
    upstream = torch.randn(2, length, num_heads // 2, head_dim, generator=generator, dtype=torch.float64)

    def output_and_gradients(output):
        return (output, *torch.autograd.grad(output, inputs, upstream))

    reference = output_and_gradients(reference_core(*inputs, scaling))
    worst = 0.0
    for output in (FusedPairAttention.apply(*inputs, scaling, block_size), sdpa_v2_core(*inputs, scaling)):
        for got, wanted in zip(output_and_gradients(output), reference):
            worst = max(worst, (got - wanted).abs().max().item())
    return worst


def time_core(length, args) -> dict:
    """Median forward + backward ms of each core at `length` tokens, SmolLM2's V2 layout (18 maps on 3 key/value
    heads of 64), float32, interleaved rounds."""
    torch.manual_seed(0)
    batch, num_heads, kv_heads, head_dim = 1, args.heads, args.kv_heads, 64
    scaling = head_dim**-0.5

    def leaf(*shape):
        return torch.randn(*shape).requires_grad_()

    query, key, value = leaf(batch, num_heads, length, head_dim), leaf(batch, kv_heads, length, head_dim), leaf(
        batch, kv_heads, length, head_dim)
    lambdas = torch.rand(batch, length, num_heads // 2).requires_grad_()
    source_query = leaf(batch, num_heads // 2, length, head_dim)
    upstream = torch.randn(batch, length, num_heads // 2, head_dim)

    def step(make_output, inputs):
        def run():
            output = make_output()
            torch.autograd.grad(output, inputs, upstream)
        return run

    variants = {
        "llama": step(lambda: llama_core(source_query, key, value, scaling), (source_query, key, value)),
        "v2 sdpa": step(lambda: sdpa_v2_core(query, key, value, lambdas, scaling), (query, key, value, lambdas)),
    }
    for rows in args.block_rows:
        variants[f"v2 fused, {rows} rows"] = step(
            lambda rows=rows: FusedPairAttention.apply(query, key, value, lambdas, scaling, rows),
            (query, key, value, lambdas))
    for run in variants.values():
        run()
    samples = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            started = time.perf_counter()
            run()
            samples[name].append(1000 * (time.perf_counter() - started))
    return {name: (statistics.median(values), min(values), max(values)) for name, values in samples.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the adaptation bench trains on one)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block-rows", type=int, nargs="+", default=[64, 128, 256],
                        help="query tokens per block of the fused core (one variant each)")
    parser.add_argument("--heads", type=int, default=18, help="query heads H (V2 maps; the source has H/2)")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--name", default="", help="suffix of the results file")
    args = parser.parse_args()
    if args.heads % args.kv_heads or (args.heads // args.kv_heads) % 2:
        parser.error(f"--heads {args.heads} on --kv-heads {args.kv_heads}: each key/value head must serve whole pairs, "
                     "so heads / kv-heads must be an even whole number (SmolLM2's V2: 18 on 3)")
    torch.set_num_threads(args.threads)

    error = check_against_reference()
    if not error < 1e-10:
        sys.exit(f"a V2 core differs from the float64 reference by {error:.3g}: not timing a wrong kernel")
    lines = [f"`python {' '.join(sys.argv)}` on {_cpu_name()}, torch {torch.__version__}.", "",
             f"Attention core alone, forward + backward, causal, batch 1, {args.heads} V2 maps ({args.heads // 2} "
             f"pairs; the source has {args.heads // 2} heads) on {args.kv_heads} key/value heads of 64, float32, "
             f"{args.threads} thread(s), {args.rounds} interleaved rounds: median ms (min-max); x Llama = median / "
             "Llama's in the same run. Both V2 cores match a float64 eager reference to "
             f"{error:.1e} (output and gradients, odd G).", "",
             "| tokens | core | ms | x Llama | x V2 SDPA |", "|---|---|---|---|---|"]
    for length in args.tokens:
        times = time_core(length, args)
        for name, (median, low, high) in times.items():
            lines.append(f"| {length} | {name} | {median:.0f} ({low:.0f}-{high:.0f}) | "
                         f"{median / times['llama'][0]:.2f} | {median / times['v2 sdpa'][0]:.2f} |")
        print("\n".join(lines[-len(times):]), flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        path = Path(__file__).parent / "results" / f"v2_fused_probe{'-' + args.name if args.name else ''}.md"
        path.write_text(text)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
