"""Version 1 decoding on the CPU against Llama, at a shape where the LM head does not hide the attention (issue 32).

Shape: hidden 512, 4 layers, 8 query / 4 key-value heads (head_dim 64), vocab 8192, intermediate 1408; a 128-token
prompt, 64 new tokens, greedy, dynamic cache. Models, built from one seed and measured in ONE process, rounds
interleaved (llama, v1, ..., llama, v1, ...):
- `llama`: the LLaMA;
- `v1`: version 1 with the automatic kernel choice (the one-token `decode` kernel when decoding);
- `v1 generic`: version 1 with the `generic` kernel forced (two backend calls per decoding step);
- `v2`: DIFF V2 as `convert --diff-version 2` makes it from that LLaMA (16 maps over the same 4 KV heads);
- `llama floor`: the LLaMA plus only the work version 1 cannot avoid in a decoding step: after Llama's own SDPA call,
  one subtraction first − λ·second on the attention output (the size of version 1's differential output) and the
  head norm over 2d-wide heads. No model of version 1 can decode faster than this one with the same projections;
- `v1 @REF` (with `--baseline REF`): version 1 from the remote-code files at git REF, imported as a separate package,
  so that before and after run in the same process and the same rounds.

Beside tokens/s (batch 1 and 8; each figure's best and median over the rounds, and the ratio of each to Llama's), it
records the aten ops per decoding step (`decode_ops.step_ops`), microseconds of version 1's own parts called alone on
the tensors of a real decoding step (λ lookup, kernel choice, one-token kernel against Llama's SDPA call, head norm,
subtraction), and a torch.profiler comparison of one decoding step by op (self CPU time, summed over steps).

Usage: python -m bench decode_speed [--rounds 7] [--threads 2] [--baseline REF] [--output NAME]
Writes bench/results/NAME.{json,md} (default decode_speed) through the suite's writer.
"""

import argparse
import collections
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

import torch

import suite
from decode_ops import step_ops
from diff_llama.compat_diff_llama import CACHE_NAME

SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=4096)
V2_HEADS = dict(num_attention_heads=16, num_key_value_heads=4, head_dim=64)
PROMPT, NEW_TOKENS = 128, 64
MODELS = ("llama", "v1", "v1 generic", "v2", "llama floor")
FLOOR_BACKEND = "sdpa_v1_floor"
REPO = Path(__file__).resolve().parent.parent


def _floor_attention(module, query, key, value, attention_mask, **kwargs):
    """Llama's SDPA call, then what version 1 adds and cannot avoid: A1·V − λ·A2·V over H/2 heads of width 2d (the
    same number of elements as Llama's output) and the head norm with (1 − λ_init) folded in."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    output, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    batch, length, heads, head_dim = output.shape
    pairs = output.view(batch, length, heads // 2, 2 * head_dim)
    differential = torch.addcmul(pairs, pairs, module._floor_lambda, value=-1)
    return module._floor_norm(differential).view(batch, length, heads, head_dim), weights


def _register_floor():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FLOOR_BACKEND, _floor_attention)
    AttentionMaskInterface.register(FLOOR_BACKEND, sdpa_mask)  # a custom backend without one loses padding masks


def baseline_package(ref: str):
    """The remote-code files of version 1 at git `ref`, imported as their own package (they use relative imports
    only): the model as it was, next to the working tree's, in one process."""
    from diff_llama.configuration_diff_llama import REMOTE_CODE_FILES

    folder = Path(tempfile.mkdtemp(prefix="diff_llama_baseline_")) / "diff_llama_baseline"
    folder.mkdir()
    for name in REMOTE_CODE_FILES:
        text = subprocess.run(["git", "show", f"{ref}:src/diff_llama/{name}"], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout
        (folder / name).write_text(text)
    (folder / "__init__.py").write_text("")
    spec = importlib.util.spec_from_file_location("diff_llama_baseline", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    package = importlib.util.module_from_spec(spec)
    sys.modules["diff_llama_baseline"] = package
    spec.loader.exec_module(package)
    return importlib.import_module("diff_llama_baseline.modeling_diff_llama")


def build(name: str, baseline=None):
    torch.manual_seed(0)
    if name in ("llama", "llama floor"):
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**SHAPE))
        if name == "llama floor":
            from diff_llama.lambda_diff_llama import lambda_init_fn
            from diff_llama.modeling_diff_llama import DiffLlamaHeadNorm

            _register_floor()
            model.config._attn_implementation = FLOOR_BACKEND
            for layer in model.model.layers:
                attention = layer.self_attn
                attention._floor_lambda = torch.tensor(0.3)
                attention._floor_norm = DiffLlamaHeadNorm(2 * SHAPE["head_dim"], eps=1e-5, elementwise_affine=False)
                attention._floor_norm.output_scale = 1 - lambda_init_fn(attention.layer_idx)
    elif name == "v2":
        from diff_llama import DiffLlamaConfig, DiffLlamaForCausalLM

        model = DiffLlamaForCausalLM(DiffLlamaConfig(**{**SHAPE, **V2_HEADS}, diff_version=2))
    elif name.startswith("v1 @"):
        model = baseline.DiffLlamaForCausalLM(baseline.DiffLlamaConfig(**SHAPE))
    else:
        from diff_llama import DiffLlamaConfig, DiffLlamaForCausalLM

        kernel = "generic" if name == "v1 generic" else None
        model = DiffLlamaForCausalLM(DiffLlamaConfig(**SHAPE, differential_kernel=kernel))
    return model.float().eval()


@torch.no_grad()
def tokens_per_second(model, prompt):
    started = time.perf_counter()
    model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                   min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return prompt.shape[0] * NEW_TOKENS / (time.perf_counter() - started)


def _microseconds(fn, number=300, repeat=9):
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


@torch.no_grad()
def parts_microseconds(models, batch) -> dict:
    """Version 1's own parts of a decoding step, layer 0, each called alone on the tensors of a real step after the
    prompt, against Llama's SDPA call on Llama's cache of the same length."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from diff_llama.differential_kernels import select_differential_kernel

    ids = torch.randint(0, SHAPE["vocab_size"], (batch, PROMPT), generator=torch.Generator().manual_seed(1))
    rows = {}
    for name in ("llama", "v1"):
        model = models[name]
        cache = getattr(model(ids, use_cache=True), CACHE_NAME)
        attention = model.model.layers[0].self_attn
        key, value = cache.layers[0].keys, cache.layers[0].values
        query = torch.randn(batch, SHAPE["num_attention_heads"], 1, SHAPE["head_dim"])
        if name == "llama":
            rows["llama: SDPA call"] = _microseconds(
                lambda: sdpa_attention_forward(attention, query, key, value, None, scaling=attention.scaling))
            continue
        lam = attention._lambda(cache)
        kernel = select_differential_kernel(attention, query, key, None)
        output, _ = kernel(attention, query, key, value, None, lam)
        rows["v1: λ lookup"] = _microseconds(lambda: attention._lambda(cache))
        rows["v1: kernel choice"] = _microseconds(lambda: select_differential_kernel(attention, query, key, None))
        rows["v1: one-token kernel"] = _microseconds(lambda: kernel(attention, query, key, value, None, lam))
        rows["v1: head norm (with 1 − λ_init where folded)"] = _microseconds(lambda: attention.head_norm(output))
        rows["v1: subtraction alone (addcmul, output-sized)"] = _microseconds(
            lambda: torch.addcmul(output, output, lam, value=-1))
    return rows


@torch.no_grad()
def profile_step(model, batch, steps=20) -> dict:
    """Self CPU microseconds per decoding step by aten op (and the total), over `steps` steps after the prompt."""
    ids = torch.randint(0, SHAPE["vocab_size"], (batch, PROMPT), generator=torch.Generator().manual_seed(2))
    out = model(ids, use_cache=True)
    cache, token = getattr(out, CACHE_NAME), out.logits[:, -1:].argmax(-1)
    model(token, **{CACHE_NAME: cache}, use_cache=True)
    with torch.profiler.profile() as profile:
        for _ in range(steps):
            model(token, **{CACHE_NAME: cache}, use_cache=True)
    by_op = collections.Counter()
    for event in profile.key_averages():
        by_op[event.key] += event.self_cpu_time_total / steps
    return dict(by_op)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline", metavar="REF", help="also run version 1 from the git revision REF")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--output", default="decode_speed", help="results name under bench/results, or a path")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = list(MODELS)
    baseline = None
    if args.baseline:
        baseline = baseline_package(args.baseline)
        names.insert(2, f"v1 @{args.baseline}")
    models = {name: build(name, baseline) for name in names}
    batches = [int(batch) for batch in args.batches.split(",")]
    generator = torch.Generator().manual_seed(0)
    prompts = {batch: torch.randint(0, SHAPE["vocab_size"], (batch, PROMPT), generator=generator) for batch in batches}

    def load():
        with open("/proc/loadavg") as file:
            return float(file.read().split()[0])

    loads = [load()]
    for model in models.values():  # warm every path once
        for batch in batches:
            tokens_per_second(model, prompts[batch][:, :16])
    samples = {batch: {name: [] for name in names} for batch in batches}
    for round_index in range(args.rounds):
        for batch in batches:
            for name in names:
                samples[batch][name].append(tokens_per_second(models[name], prompts[batch]))
        loads.append(load())
        print(f"round {round_index + 1}/{args.rounds}, load {loads[-1]:.2f}", flush=True)

    result = {
        "shape": SHAPE, "v2_heads": V2_HEADS, "prompt": PROMPT, "new_tokens": NEW_TOKENS, "threads": args.threads,
        "rounds": args.rounds, "load_average_1min": loads, "models": names,
        "tokens_per_second": {str(batch): samples[batch] for batch in batches},
        "aten_ops_per_step": {name: sum(step_ops(models[name], 1).values()) for name in names},
        "parts_microseconds": {str(batch): parts_microseconds(models, batch) for batch in batches},
        "profile_self_cpu_us": {name: profile_step(models[name], 1) for name in ("llama", "v1")},
    }
    suite.write_result("decode_speed", args.output, result, render)


def _summary(values):
    return max(values), statistics.median(values)


def render(result: dict) -> str:
    names = result["models"]
    shape = result["shape"]
    lines = [
        f"Decoding tokens/s, fp32, {result['threads']} threads, hidden {shape['hidden_size']}, "
        f"{shape['num_hidden_layers']} layers, {shape['num_attention_heads']}/{shape['num_key_value_heads']} heads, "
        f"vocab {shape['vocab_size']}, {result['prompt']}-token prompt, {result['new_tokens']} new tokens, greedy; "
        f"{result['rounds']} interleaved rounds, 1-minute load average "
        f"{min(result['load_average_1min']):.2f}–{max(result['load_average_1min']):.2f}.", "",
        "Best and median tokens/s, and each one's ratio to Llama's (same statistic):", "",
        "| model | " + " | ".join(f"b{batch} best | b{batch} median | b{batch} best / Llama | b{batch} median / Llama"
                                 for batch in result["tokens_per_second"]) + " |",
        "|---|" + "---|---|---|---|" * len(result["tokens_per_second"]),
    ]
    for name in names:
        cells = []
        for batch, samples in result["tokens_per_second"].items():
            best, median = _summary(samples[name])
            llama_best, llama_median = _summary(samples["llama"])
            cells += [f"{best:.1f}", f"{median:.1f}", f"{best / llama_best:.3f}x", f"{median / llama_median:.3f}x"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    ops = result["aten_ops_per_step"]
    lines += ["", "aten ops per decoding step (batch 1): " + ", ".join(f"{name} {count}" for name, count in ops.items())]
    for batch, parts in result["parts_microseconds"].items():
        lines += ["", f"Parts of one layer's decoding step, batch {batch}, called alone on a real step's tensors, µs "
                  "(best of 9 x 300):", "", "| what | µs |", "|---|---|"]
        lines += [f"| {name} | {value:.1f} |" for name, value in parts.items()]
    llama, v1 = (collections.Counter(result["profile_self_cpu_us"][name]) for name in ("llama", "v1"))
    difference = collections.Counter(v1)
    difference.subtract(llama)
    lines += ["", f"Self CPU µs per decoding step (batch 1, torch.profiler): Llama {sum(llama.values()):.0f}, "
              f"version 1 {sum(v1.values()):.0f}. The ops that differ most (version 1 minus Llama):", "",
              "| op | Llama | version 1 | difference |", "|---|---|---|---|"]
    for op, delta in sorted(difference.items(), key=lambda item: -abs(item[1]))[:15]:
        lines.append(f"| {op} | {llama.get(op, 0):.0f} | {v1.get(op, 0):.0f} | {delta:+.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
