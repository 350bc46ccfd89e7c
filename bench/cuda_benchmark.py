"""Speed and memory on a CUDA GPU, in ONE run: the LLaMA against its version 1 and DIFF V2 conversions (random weights
of the real shapes; speed does not depend on the values), bf16, SDPA.

Shapes: SmolLM2-135M (9 heads over 3 KV heads, 30 layers) and Llama-3.2-1B (32 over 8, 16 layers). The converted
configs come from the converter itself (`make_layout`, `diff_config_for`): version 1 with the default expand layout
(2x the attention width), DIFF V2 with twice the query heads over the LLaMA's KV heads. Models:
- `llama`; `llama 2x heads` (V2's query heads in a plain LLaMA: the bound for V2's attention);
- `diff-llama` (version 1, the automatic kernel choice), `diff-llama generic` and `diff-llama blocked` (version 1,
  that kernel forced wherever it applies, decoding included);
- `diff-llama v2`.
Figures, each the median of interleaved repetitions (A, B, C, A, B, C, ...), CUDA synchronised around each:
- one training step (forward + backward) at batch 1 x 4096, and its peak memory above the model and its gradients;
- prefill of 4096 tokens (batch 1, logits of the last token);
- greedy decoding, 64 tokens after a 512-token prompt (`--prompt-tokens`), dynamic cache, batch 1 and 16 (tokens/s).

The table also gives each model's spread over the rounds (largest / smallest sample): on a shared host, one training
step of a small model is mostly kernel launches from Python, and it varies by tens of percent from call to call; a
ratio inside that spread is not a difference.

Usage: python -m bench cuda_benchmark [--rounds 5] [--shapes smollm2-135m llama-3.2-1b] [--output DIR] [--name cuda]
                                      [--figures train prefill decode] [--models MODEL ...]
Writes NAME.json and NAME.md into DIR (default bench/results/cuda.{json,md}). On an H200, each round (and the warm-up
round before them) takes about 95 s for the SmolLM2 shape and 90 s for the 1B one, decoding most of it. `--figures
decode --models "diff-llama" "diff-llama generic"` (llama, the baseline, is always measured) times only the decoding
kernels against each other, so many more rounds fit in the same time.
"""

import argparse
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import suite
from diff_llama import DiffLlamaForCausalLM
from diff_llama.conversion.converter import ConversionOptions, diff_config_for, make_layout

SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                         tie_word_embeddings=True),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                         tie_word_embeddings=True),
}
MODELS = ("llama", "llama 2x heads", "diff-llama", "diff-llama generic", "diff-llama blocked", "diff-llama v2")
# Version 1 with one kernel forced wherever it applies; "diff-llama" itself runs the automatic choice.
FORCED_KERNELS = {"diff-llama generic": "generic", "diff-llama blocked": "blocked"}
RATIOS = (("diff-llama", "llama"), ("diff-llama generic", "llama"), ("diff-llama blocked", "llama"),
          ("diff-llama v2", "llama"), ("diff-llama v2", "llama 2x heads"), ("diff-llama", "diff-llama generic"))
FIGURE_KINDS = ("train", "prefill", "decode")
TRAIN_TOKENS, PREFILL_TOKENS, PROMPT_TOKENS, NEW_TOKENS = 4096, 4096, 512, 64


def build(name: str, shape: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    llama_config = LlamaConfig(**shape, max_position_embeddings=8192)
    if name == "llama":
        model = LlamaForCausalLM(llama_config)
    elif name == "llama 2x heads":
        model = LlamaForCausalLM(LlamaConfig(**{**shape, "num_attention_heads": 2 * shape["num_attention_heads"]},
                                             max_position_embeddings=8192))
    else:
        version = 2 if name == "diff-llama v2" else 1
        options = ConversionOptions(diff_version=version)
        config = diff_config_for(llama_config, make_layout(shape["num_attention_heads"],
                                                           shape["num_key_value_heads"], options))
        config.differential_kernel = FORCED_KERNELS.get(name)
        model = DiffLlamaForCausalLM(config)
    model.set_attn_implementation("sdpa")
    return model.to("cuda", torch.bfloat16).eval()


def timed(function) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    function()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def training_step(model, batch):
    model.train()
    model(batch, labels=batch).loss.backward()
    model.zero_grad(set_to_none=False)  # gradients stay allocated: the peak below is the step's own memory
    model.eval()


def measure(model, inputs, kinds) -> dict:
    figures = {}
    if "train" in kinds:
        training_step(model, inputs["train"])  # warm-up, gradients allocated
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        figures["train step b1x4096 (s)"] = timed(lambda: training_step(model, inputs["train"]))
        figures["train peak memory (GiB)"] = (torch.cuda.max_memory_allocated() - before) / 2**30
    with torch.no_grad():
        if "prefill" in kinds:
            figures["prefill 4096 (s)"] = timed(lambda: model(inputs["prefill"], logits_to_keep=1))
        for batch in (1, 16) if "decode" in kinds else ():
            prompt = inputs["prompt"][:batch]
            seconds = timed(lambda: model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                                   do_sample=False, pad_token_id=0))
            figures[f"decode b{batch} (tokens/s)"] = batch * NEW_TOKENS / seconds
    return figures


def run_shape(shape_name: str, rounds: int, kinds, names, prompt_tokens: int = PROMPT_TOKENS) -> dict:
    shape = SHAPES[shape_name]
    generator = torch.Generator().manual_seed(1)
    inputs = {
        "train": torch.randint(3, shape["vocab_size"], (1, TRAIN_TOKENS), generator=generator),
        "prefill": torch.randint(3, shape["vocab_size"], (1, PREFILL_TOKENS), generator=generator),
        "prompt": torch.randint(3, shape["vocab_size"], (16, prompt_tokens), generator=generator),
    }
    inputs = {key: value.cuda() for key, value in inputs.items()}
    models = {name: build(name, shape) for name in names}
    for model in models.values():  # warm-up: kernels chosen, generate's caches built
        measure(model, inputs, kinds)
    samples = {name: [] for name in names}
    for _ in range(rounds):
        for name, model in models.items():
            samples[name].append(measure(model, inputs, kinds))
    del models
    torch.cuda.empty_cache()
    medians = {name: {figure: statistics.median(sample[figure] for sample in rows) for figure in rows[0]}
               for name, rows in samples.items()}
    return {"medians": medians, "samples": samples}


def ratio(medians, figure, model, baseline) -> float:
    value = medians[model][figure] / medians[baseline][figure]
    return 1 / value if "tokens/s" in figure else value  # always "time (or memory) relative to the baseline"


def spread(rows, figure) -> float:
    values = [row[figure] for row in rows]
    return max(values) / min(values)


def write(results: dict, folder: Path, name: str = "cuda") -> Path:
    """FOLDER/NAME.json with the run's metadata, and its markdown rendered from it (bench/suite.py)."""
    return suite.write_result("cuda_benchmark", Path(folder) / name, results, render)


def render(results: dict) -> str:
    lines = [f"# CUDA speed and memory ({results['device']}, torch {results['torch']}, bf16, SDPA, "
             f"{results['rounds']} round(s))", "",
             "Time or memory relative to the baseline (below 1: faster or smaller); decode ratios are inverted "
             f"tokens/s. Decoding: {NEW_TOKENS} tokens after a {results['prompt_tokens']}-token prompt. Command: "
             f"`{results['command']}`.", ""]
    for shape_name, shape_results in results["shapes"].items():
        medians = shape_results["medians"]
        figures = list(next(iter(medians.values())))
        models = [name for name in MODELS if name in medians]
        ratios = [(a, b) for a, b in RATIOS if a in medians and b in medians]
        lines += [f"## {shape_name}", "", "| figure | " + " | ".join(models) + " | "
                  + " | ".join(f"{a} / {b}" for a, b in ratios) + " |",
                  "|---" * (1 + len(models) + len(ratios)) + "|"]
        for figure in figures:
            cells = [f"{medians[name][figure]:.4g}" for name in models]
            cells += [f"{ratio(medians, figure, a, b):.2f}x" for a, b in ratios]
            lines.append(f"| {figure} | " + " | ".join(cells) + " |")
        if results["rounds"] == 1:
            lines += ["", "One round: no spread measured; read each ratio against the spreads of a run with more "
                      "rounds.", ""]
            continue
        lines += ["", "Spread over the rounds (largest / smallest sample) of each model:", "",
                  "| figure | " + " | ".join(models) + " |", "|---" * (1 + len(models)) + "|"]
        samples = shape_results["samples"]
        for figure in figures:
            lines.append(f"| {figure} | " + " | ".join(f"{spread(samples[name], figure):.2f}" for name in models)
                         + " |")
        lines.append("")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after the warm-up round (default 5)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES),
                        help="model shapes to measure (default: both)")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results"),
                        help="folder for the results (default bench/results)")
    parser.add_argument("--name", default="cuda", help="file name of the results, without .json/.md (default cuda)")
    parser.add_argument("--figures", nargs="+", default=list(FIGURE_KINDS), choices=list(FIGURE_KINDS),
                        help="what to measure: the training step with its memory, prefill, decoding (default: all)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS), metavar="MODEL",
                        help=f"models to measure, llama (the baseline) always among them; from {list(MODELS)} "
                             "(default: all)")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS,
                        help=f"prompt length before decoding (default {PROMPT_TOKENS})")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("no CUDA device: this benchmark measures the GPU paths (see bench/model_benchmark.py for CPUs)")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
               "rounds": args.rounds, "figures": args.figures, "prompt_tokens": args.prompt_tokens,
               "command": suite.COMMAND or shlex.join(["python", "bench/cuda_benchmark.py", *sys.argv[1:]]),
               "shapes": {}}
    for shape_name in args.shapes:
        names = [name for name in MODELS if name == "llama" or name in args.models]
        results["shapes"][shape_name] = run_shape(shape_name, args.rounds, args.figures, names, args.prompt_tokens)
        write(results, Path(args.output), args.name)  # after each shape, so a cut-off run keeps what it measured


if __name__ == "__main__":
    main()
