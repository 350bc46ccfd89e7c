"""Speed and memory of diff-llama (version 1 and DIFF V2) against transformers' built-in DiffLlama and Llama, in ONE run.

Same config (hidden 512, 8 heads, 4 layers, vocab 32000 unless told), dtype, threads and inputs for all models:
- `llama`: the LLaMA; `diff-llama` (version 1) and `built-in` have its shapes (plus 4 λ vectors per layer);
- `diff-llama v2`: DIFF V2 as `convert --diff-version 2` makes it from that LLaMA: 16 softmax maps over the same
  8 KV heads (the LLaMA's KV cache), o_proj from 8 heads, a λ projection;
- `llama 2x heads`: a LLaMA with those 16 query heads over 8 KV heads, the bound the issue sets for V2's prefill;
- `llama wide q`: the LLaMA, its q_proj reading V2's doubled weight and keeping half the output: what V2's extra
  weight bytes alone cost a (memory-bound) decoding step, with nothing differential computed.
Every figure is the median of interleaved repetitions (model A, B, C, A, B, C, ...):
- one attention layer alone at 2048 tokens (projections, RoPE, attention, output projection; causal, no mask);
- prefill time at 512 and 2048 tokens (batch 1, logits of the last token);
- decode tokens/s with the dynamic cache at batch 1 and 8, and with the static cache with and without torch.compile
  (batch 1; on CPU generate compiles only when forced);
- one training step (forward + backward, batch 4 x 256) time, and its peak memory: how far resident memory grows
  during the step (gradients already allocated), sampled in a fresh process per model.

Usage: python -m bench model_benchmark [--rounds 5] [--dtype float32] [--threads 2] [--skip-compile]
Writes bench/results/model.json, bench/results/model.md and bench/results/model.png.
"""

import argparse
import statistics
import subprocess
import textwrap
import sys
import time
from pathlib import Path

import torch

import suite

MODELS = ("llama", "diff-llama", "built-in", "diff-llama v2", "llama 2x heads", "diff-llama padded", "diff-llama blocked",
          "diff-llama paired", "llama wide q")
# Version 1 with one kernel forced where it applies (`model.set_differential_kernel`), to compare kernels in one run:
# "padded" = "generic" (the configured backend on the padded one-call layout; two calls when decoding), "blocked"
# (every step, decoding included), "paired" = "paired_sdpa_cpu" (CPU training only). "diff-llama" itself runs the
# automatic choice (DIFFERENTIAL_KERNEL_DISPATCH).
FORCED_KERNELS = {"diff-llama padded": "generic", "diff-llama blocked": "blocked", "diff-llama paired": "paired_sdpa_cpu"}
# The ratios the table reports: (model, baseline).
RATIOS = (("diff-llama", "llama"), ("diff-llama", "built-in"), ("diff-llama v2", "llama"),
          ("diff-llama v2", "llama 2x heads"), ("diff-llama padded", "llama"), ("diff-llama blocked", "llama"),
          ("diff-llama paired", "llama"), ("diff-llama v2", "llama wide q"), ("llama wide q", "llama"))
TWICE_THE_QUERY_HEADS = dict(num_attention_heads=16, num_key_value_heads=8, head_dim=64)
SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=8, max_position_embeddings=8192)


def build(name: str, dtype: torch.dtype):
    torch.manual_seed(0)
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    elif name == "llama 2x heads":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**{**SHAPE, **TWICE_THE_QUERY_HEADS}))
    elif name == "diff-llama" or name in FORCED_KERNELS:
        from diff_llama import DiffLlamaConfig, DiffLlamaForCausalLM

        model = DiffLlamaForCausalLM(DiffLlamaConfig(**SHAPE, differential_kernel=FORCED_KERNELS.get(name)))
    elif name == "llama wide q":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**SHAPE))
        for layer in model.model.layers:
            layer.self_attn.q_proj = WideQueryProjection(SHAPE["hidden_size"], 2 * SHAPE["hidden_size"], bias=False)
    elif name == "diff-llama v2":
        from diff_llama import DiffLlamaConfig, DiffLlamaForCausalLM

        model = DiffLlamaForCausalLM(DiffLlamaConfig(**{**SHAPE, **TWICE_THE_QUERY_HEADS}, diff_version=2))
    else:
        from transformers import DiffLlamaConfig, DiffLlamaForCausalLM

        model = DiffLlamaForCausalLM(DiffLlamaConfig(**SHAPE))
    return model.to(dtype).eval()


class WideQueryProjection(torch.nn.Linear):
    """A q_proj that reads twice the weight and keeps the first half of its output: V2's extra bytes, nothing else."""

    def forward(self, hidden_states):
        return super().forward(hidden_states)[..., : self.out_features // 2]


@torch.no_grad()
def prefill_seconds(model, ids):
    started = time.perf_counter()
    model(ids, logits_to_keep=1)
    return time.perf_counter() - started


@torch.no_grad()
def attention_layer_seconds(model, hidden_states):
    """One attention layer alone (projections, RoPE, attention, output projection), causal, no padding mask."""
    position_ids = torch.arange(hidden_states.shape[1])[None]
    position_embeddings = model.model.rotary_emb(hidden_states, position_ids)
    started = time.perf_counter()
    model.model.layers[0].self_attn(hidden_states=hidden_states, position_embeddings=position_embeddings,
                                    attention_mask=None)
    return time.perf_counter() - started


@torch.no_grad()
def decode_tokens_per_second(model, prompt, new_tokens, **generate_kwargs):
    started = time.perf_counter()
    model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **generate_kwargs)
    return prompt.shape[0] * new_tokens / (time.perf_counter() - started)


def training_step_seconds(model, batch):
    model.train()
    started = time.perf_counter()
    model(batch, labels=batch).loss.backward()
    elapsed = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    model.eval()
    return elapsed


# In a fresh process: the growth of resident memory during one training step, sampled every half millisecond
# (the process's all-time peak would be the model's construction, not the step).
TRAIN_MEMORY_CHILD = """
import os, sys, threading, time, torch
sys.path.insert(0, {bench!r})
from model_benchmark import build
torch.set_num_threads({threads})
page = os.sysconf("SC_PAGE_SIZE")
def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * page
model = build({name!r}, getattr(torch, {dtype!r})).train()
batch = torch.randint(0, 32000, (4, 256), generator=torch.Generator().manual_seed(1))
model(batch[:, :8], labels=batch[:, :8]).loss.backward()  # autograd warm, gradients allocated
model.zero_grad(set_to_none=False)
before, peak, running = resident(), [0], [True]
def sample():
    while running[0]:
        peak[0] = max(peak[0], resident())
        time.sleep(0.0005)
sampler = threading.Thread(target=sample)
sampler.start()
model(batch, labels=batch).loss.backward()
running[0] = False
sampler.join()
print(max(peak[0], resident()) - before)
"""


def training_peak_bytes(name, dtype_name, threads):
    code = TRAIN_MEMORY_CHILD.format(bench=str(Path(__file__).parent), threads=threads, name=name, dtype=dtype_name)
    result = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return int(result.stdout.split()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-compile", action="store_true", help="leave out the compiled static-cache decode")
    parser.add_argument("--only", metavar="TEXT", help="measure only the figures whose name contains TEXT "
                        "(e.g. decode); results are printed, and written only with --output")
    parser.add_argument("--models", default=",".join(MODELS[:5]),
                        help="comma-separated subset of " + ", ".join(MODELS) + " (default: the first five)")
    parser.add_argument("--prefill-8192", action="store_true", help="add whole-model prefill at 8192 tokens")
    parser.add_argument("--output", default=None, help="results name under bench/results (default: model, or "
                        "model-bfloat16)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    args.models = [name for name in MODELS if name in args.models.split(",")]
    models = {name: build(name, dtype) for name in args.models}
    generator = torch.Generator().manual_seed(0)
    long_ids = torch.randint(0, 32000, (8, 8192), generator=generator)
    train_batch = torch.randint(0, 32000, (4, 256), generator=generator)

    from transformers import CompileConfig

    compile_config = CompileConfig(fullgraph=True)
    compile_config._compile_all_devices = True  # generate compiles a static cache on CPU only when forced
    hidden_states = torch.randn(1, 2048, SHAPE["hidden_size"], generator=generator).to(dtype)
    figures = {
        "attention layer 2048 (ms)": lambda m: 1000 * attention_layer_seconds(m, hidden_states),
        "prefill 512 (ms)": lambda m: 1000 * prefill_seconds(m, long_ids[:1, :512]),
        "prefill 2048 (ms)": lambda m: 1000 * prefill_seconds(m, long_ids[:1, :2048]),
        "decode b1 dynamic (tok/s)": lambda m: decode_tokens_per_second(m, long_ids[:1, :128], 32),
        "decode b8 dynamic (tok/s)": lambda m: decode_tokens_per_second(m, long_ids[:, :128], 32),
        "decode b1 static (tok/s)": lambda m: decode_tokens_per_second(
            m, long_ids[:1, :128], 32, cache_implementation="static"
        ),
        "train step b4x256 (ms)": lambda m: 1000 * training_step_seconds(m, train_batch),
    }
    if args.prefill_8192:
        figures["prefill 8192 (ms)"] = lambda m: 1000 * prefill_seconds(m, long_ids[:1])
    if not args.skip_compile:
        figures["decode b1 static+compile (tok/s)"] = lambda m: decode_tokens_per_second(
            m, long_ids[:1, :128], 32, cache_implementation="static", compile_config=compile_config
        )

    if args.only:
        figures = {label: measure for label, measure in figures.items() if args.only in label}
    for name, model in models.items():  # warm-up, and the one-time compilation
        for label, measure in figures.items():
            print(f"warm-up {name}: {label}", flush=True)
            measure(model)
    samples = {label: {name: [] for name in models} for label in figures}
    for round_index in range(args.rounds):
        for label, measure in figures.items():
            for name, model in models.items():
                samples[label][name].append(measure(model))
        print(f"round {round_index + 1}/{args.rounds} done", flush=True)
    results = {label: {name: statistics.median(values) for name, values in by_model.items()}
               for label, by_model in samples.items()}
    if not args.only or args.only in "train step peak memory (MB)":
        peaks = {name: training_peak_bytes(name, args.dtype, args.threads) for name in models}
        results["train step peak memory (MB)"] = {name: peak / 1e6 for name, peak in peaks.items()}
    if args.only and not args.output:
        for label, values in results.items():
            print(f"{label}: " + ", ".join(f"{name} {value:.1f}" for name, value in values.items()) + "; "
                  + ", ".join(f"{a} / {b} {_ratio_cell(values, samples, label, a, b)}" for a, b in RATIOS
                              if a in values and b in values))
        return
    write_results(results, args, samples)


def round_ratio_range(samples, label, a, b) -> tuple[float, float] | None:
    """Smallest and largest ratio a / b over the rounds: the two were measured back to back in each round, so the
    range shows how far one run's ratio can move on this machine (a shared VM moves it by several percent)."""
    if label not in samples or len(samples[label][a]) < 2:
        return None
    ratios = [x / y for x, y in zip(samples[label][a], samples[label][b])]
    return min(ratios), max(ratios)


def write_results(results, args, samples):
    name = args.output or ("model" if args.dtype == "float32" else f"model-{args.dtype}")
    config = {"shape": SHAPE, "dtype": args.dtype, "threads": args.threads, "rounds": args.rounds,
              "torch": torch.__version__, "models": args.models}
    path = suite.write_result("model_benchmark", name, {"config": config, "results": results, "samples": samples},
                              render)
    if {"llama", "diff-llama", "built-in", "diff-llama v2"} <= set(args.models):
        plot(results, path.with_suffix(".png"))


def render(result: dict) -> str:
    config, results, samples = result["config"], result["results"], result.get("samples") or {}
    shape, models = config["shape"], config.get("models") or list(next(iter(results.values())))
    ratios = [(a, b) for a, b in RATIOS if a in models and b in models]
    lines = [
        f"hidden {shape['hidden_size']}, {shape['num_attention_heads']} heads, {shape['num_hidden_layers']} layers, "
        f"{config['dtype']}, {config['threads']} threads, medians of {config['rounds']} interleaved rounds. Times: "
        "lower is better; tok/s: higher is better. A ratio is of the medians; in brackets, the smallest and largest "
        "ratio of the same two models within one round.",
        "",
        "| figure | " + " | ".join(models) + " | " + " | ".join(f"{a} / {b}" for a, b in ratios) + " |",
        "|---" * (1 + len(models) + len(ratios)) + "|",
    ]
    for label, values in results.items():
        lines.append(f"| {label} | " + " | ".join(f"{values[name]:.1f}" for name in models) + " | "
                     + " | ".join(_ratio_cell(values, samples, label, a, b) for a, b in ratios) + " |")
    return "\n".join(lines)


def _ratio_cell(values, samples, label, a, b) -> str:
    spread = round_ratio_range(samples, label, a, b)
    return f"{values[a] / values[b]:.2f}" + ("" if spread is None else f" ({spread[0]:.2f}–{spread[1]:.2f})")


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results)
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.26
    bars = (("diff-llama", "tab:blue"), ("built-in", "tab:orange"), ("diff-llama v2", "tab:green"))
    for offset, (name, colour) in zip((-width, 0, width), bars):
        ratios = [results[label][name] / results[label]["llama"] for label in labels]
        ax.bar([i + offset for i in range(len(labels))], ratios, width, label=name, color=colour)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks(range(len(labels)), [textwrap.fill(label, 14) for label in labels], fontsize=8)
    ax.set_ylabel("ratio to Llama (time/memory: lower is better; tok/s: higher)")
    ax.set_title("Differential attention on CPU: ratio to LlamaForCausalLM of the same shape")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
