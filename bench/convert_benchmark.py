"""Conversion speed and memory on a synthetic sharded LLaMA of at least 2 GB (bf16).

Measures, in one run on the same files:
- the baseline: copying the checkpoint folder (shutil.copytree), after one warm-up read so both see a warm page cache;
- the conversion with calibration and evaluation off (they are measured separately by the quality report), for
  version 1's same-width layout (split) and its expand layout, and for DIFF V2's exact conversion (which never
  calibrates), each in a fresh process whose peak RSS is recorded; the time
  is taken around the conversion call and, separately, for the whole process including interpreter start-up.

Usage: python -m bench convert_benchmark [--workdir DIR] [--layers 21]
Writes bench/results/convert.{json,md}.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import suite


def make_checkpoint(folder: Path, layers: int, hidden=2048, intermediate=5632, vocab=32000, heads=16,
                    kv_heads=4) -> tuple[int, int]:
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    for param in model.parameters():
        param.data.normal_(0, 0.02, generator=generator)
    model.save_pretrained(folder, max_shard_size="500MB")
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return total, layer_bytes


# RUSAGE_CHILDREN reports the largest child so far, so each measured command runs under a fresh wrapper process
# whose only child it is.
WRAPPER = (
    "import resource, subprocess, sys, time; t = time.perf_counter(); "
    "out = subprocess.run(sys.argv[1:], check=True, capture_output=True, text=True).stdout; "
    "print(out.strip().splitlines()[-1] if out.strip() else 0, time.perf_counter() - t, "
    "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)
# The conversion inside the child, timed around the function call so that the interpreter's start-up (importing
# torch and transformers, about 4 s here, plus first-use costs paid once by converting a tiny checkpoint) is
# reported apart from the conversion itself.
CONVERT = (
    "import json, os, shutil, sys, time; from diff_llama.conversion.converter import ConversionOptions, "
    "convert_llama_to_diff_llama; "
    "options = ConversionOptions(**json.loads(sys.argv[3]), calibration='none', evaluate=False, "
    "max_shard_size=500 * 10**6); "
    "convert_llama_to_diff_llama(sys.argv[4], sys.argv[2] + '-warmup', options, progress=False); "
    "shutil.rmtree(sys.argv[2] + '-warmup'); os.sync(); "
    "t = time.perf_counter(); convert_llama_to_diff_llama(sys.argv[1], sys.argv[2], options, progress=False); "
    "print(time.perf_counter() - t)"
)


def timed_child(command: list[str]) -> tuple[float, float, int]:
    """(seconds the child reported on its last line, wall seconds of the whole child, peak RSS in bytes)."""
    result = subprocess.run([sys.executable, "-c", WRAPPER, *command], check=True, capture_output=True, text=True)
    inner, total, peak_kib = result.stdout.split()
    return float(inner), float(total), int(peak_kib) * 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", help="scratch folder (default: a temporary one, removed afterwards)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (medians are reported)")
    parser.add_argument("--layers", type=int, default=21, help="decoder layers of the synthetic LLaMA (21: 2.2 GB)")
    parser.add_argument("--output", default="convert", help="results name under bench/results, or a path (no suffix)")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="diff-llama-bench-"))
    source = workdir / "llama"
    total, layer_bytes = make_checkpoint(source, args.layers)
    tiny = workdir / "tiny-llama"
    make_checkpoint(tiny, 1, hidden=64, intermediate=128, vocab=256, heads=4, kv_heads=2)
    print(f"synthetic LLaMA: {total / 1e9:.2f} GB in {len(list(source.glob('*.safetensors')))} shards, "
          f"one layer {layer_bytes / 1e6:.0f} MB")

    for file in source.iterdir():  # warm the page cache for every contender alike
        file.read_bytes()
    variants = {"v1 split": dict(diff_version=1, head_layout="split"), "v1 expand": dict(diff_version=1, head_layout="expand"),
                "v2 (exact)": dict(diff_version=2)}
    copies, runs = [], {name: [] for name in variants}
    for _ in range(args.repeats):  # interleaved, medians reported
        os.sync()  # every contender starts with no dirty pages waiting to be written back
        started = time.perf_counter()
        shutil.copytree(source, workdir / "copy")
        copies.append(time.perf_counter() - started)
        shutil.rmtree(workdir / "copy")
        for name, options in variants.items():
            out = workdir / "diff"
            os.sync()
            inner, whole, peak = timed_child([sys.executable, "-c", CONVERT, str(source), str(out),
                                              json.dumps(options), str(tiny)])
            written = sum(f.stat().st_size for f in out.glob("*.safetensors"))
            runs[name].append((inner, whole, peak, written))
            shutil.rmtree(out)
    copy_seconds = statistics.median(copies)

    rows = []
    for variant, samples in runs.items():
        inner = statistics.median(s[0] for s in samples)
        whole = statistics.median(s[1] for s in samples)
        peak = max(s[2] for s in samples)
        rows.append({"variant": variant, "seconds": inner, "ratio_to_copy": inner / copy_seconds,
                     "command_seconds": whole, "command_ratio_to_copy": whole / copy_seconds,
                     "written_gb": samples[0][3] / 1e9, "peak_rss_gb": peak / 1e9,
                     "peak_minus_layer_gb": (peak - layer_bytes) / 1e9})

    # The baseline process memory of an interpreter with torch + transformers imported, for reference.
    _, _, import_peak = timed_child([sys.executable, "-c", "import torch, transformers, diff_llama"])
    result = {"checkpoint_gb": total / 1e9, "layer_mb": layer_bytes / 1e6, "copy_seconds": copy_seconds,
              "import_peak_rss_gb": import_peak / 1e9, "conversions": rows, "threads": torch.get_num_threads()}
    result["repeats"] = args.repeats
    suite.write_result("convert_benchmark", args.output, result, render)
    if not args.workdir:
        shutil.rmtree(workdir)


def render(result: dict) -> str:
    rows = result["conversions"]
    lines = [
        f"Synthetic LLaMA {result['checkpoint_gb']:.2f} GB (bf16, 500 MB shards, one layer {result['layer_mb']:.0f} MB); "
        f"copying the folder: {result['copy_seconds']:.1f} s. Calibration and evaluation off; medians of "
        f"{result['repeats']} interleaved runs.",
        "",
        "| conversion | conversion s | x copy | whole process s (with start-up) | x copy | written GB | peak RSS GB "
        "| peak − one layer GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['variant']} | {r['seconds']:.1f} | {r['ratio_to_copy']:.2f} | {r['command_seconds']:.1f} | "
              f"{r['command_ratio_to_copy']:.2f} | {r['written_gb']:.2f} | {r['peak_rss_gb']:.2f} | "
              f"{r['peak_minus_layer_gb']:.2f} |" for r in rows]
    lines.append(f"\nPeak RSS of a process that only imports torch, transformers and diff_llama: "
                 f"{result['import_peak_rss_gb']:.2f} GB.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
