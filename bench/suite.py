"""The benchmark suite's shared parts: the registry of benchmarks, what every result records about the run, and the
one writer every benchmark saves its results with.

A result is a JSON file with a `meta` entry (the machine: CPU model and its bf16/AMX/AVX flags, GPU if any; torch,
transformers and diff-llama versions; the command line; the date) beside the benchmark's own figures. Its markdown is
rendered from that JSON, after it is written and read back, by the benchmark's `render` function, so the .md never
says anything the .json does not; `python -m bench render FILE.json` renders it again.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Callable

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"

# name (the module bench/NAME.py) -> one line on what it measures. Each module has `main()` and `render(result)`.
BENCHMARKS = {
    "adaptation": "train SmolLM2 and its DIFF V2 conversion alike (diff-llama adapt), then evaluate retrieval",
    "attention_core": "the attention core alone on CPU: each way of forming differential heads against Llama's SDPA",
    "conversion_quality": "held-out perplexity and KL of each version 1 conversion option on SmolLM2, before training",
    "convert_benchmark": "conversion time and peak memory on a synthetic 2 GB sharded LLaMA, against copying it",
    "cuda_memory_prediction": "a CUDA training step's peak memory predicted on the CPU (meta device, SDPA as on CUDA), "
                              "beside a GPU run's measurement (issue 40)",
    "cuda_benchmark": "training step, prefill and decoding speed and memory on a CUDA GPU, LLaMA against both versions",
    "cuda_retrieval": "SmolLM2 and its DIFF V2 conversion trained alike, then paired on two case generators, on a "
                      "CUDA GPU in five minutes (issue 40 §5)",
    "decode_speed": "version 1 decoding tokens/s against Llama, its generic kernel, DIFF V2 and a floor probe, with a "
                    "per-op profile of one step (issue 32)",
    "decode_ops": "aten ops in one decoding step (and with --timing/--products, what their parts cost)",
    "finetune_after_conversion": "perplexity after the same short fine-tuning of SmolLM2 and each of its conversions",
    "model_benchmark": "CPU speed and memory of both versions against the built-in DiffLlama and Llama, interleaved",
    "precision": "float32 against bfloat16 prefill and training on this CPU: what --dtype auto decides",
    "recovery": "held-out perplexity and mean |λ| against CPU minutes of `diff-llama recover`",
    "saved_for_backward": "bytes autograd keeps for backward in a training forward at Llama-3.2-1B's width, "
                          "storage by storage: Llama against each version 1 training kernel and DIFF V2 (issue 40 §4)",
    "serve_load": "diff-llama serve under 32 concurrent streams, clients that leave mid-stream and bad requests: "
                  "throughput, latency percentiles, errors by kind, server memory (issue 42)",
    "serving_throughput": "output tokens/s of 16 concurrent chat requests to vLLM and transformers servers, SmolLM2 "
                          "against its DIFF V2 conversion (issue 34)",
    "vllm_startup": "seconds to start `diff-llama serve --engine vllm` with an empty vLLM compile cache, then with "
                    "the cache the first start saved (issue 42)",
    "retrieval": "merge `diff-llama evaluate` runs into one multi-needle retrieval table with paired tests",
}

# The command line a result records: `python -m bench` sets it to its own; a script run directly records its argv.
COMMAND: str | None = None
# CPU flags worth recording: what decides bf16 and vector speed (avx2, avx512*, amx*, *bf16*, fma, neon, sve).
CPU_FLAG_PATTERN = re.compile(r"^(avx|amx|fma|f16c|neon|asimd|sve)|bf16")


def module(name: str):
    """The benchmark module `name`, from the registry."""
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}: choose one of {', '.join(BENCHMARKS)}")
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def machine(cpuinfo: str | None = None) -> dict:
    """CPU model and its bf16/AMX/AVX flags (from /proc/cpuinfo where there is one), core count, GPU name if any."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    fields = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's
    flags = (fields.get("flags") or fields.get("Features") or "").split()
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return {
        "cpu": fields.get("model name") or platform.processor() or platform.machine(),
        "cpu_flags": sorted(flag for flag in set(flags) if CPU_FLAG_PATTERN.search(flag)),
        "cores": os.cpu_count(),
        "gpu": gpu,
        "platform": platform.platform(),
    }


def package_version(package: str) -> str | None:
    """The installed version of `package`, or None where it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def diff_llama_version() -> str | None:
    """The installed diff-llama's version; the GPU runs use the checkout without installing it (PYTHONPATH=src),
    so then the version of the source they import, marked as such."""
    installed = package_version("diff-llama")
    if installed is not None:
        return installed
    try:
        import diff_llama
    except ImportError:
        return None
    return f"{diff_llama.__version__} (source, not installed)"


def versions() -> dict:
    return {"python": platform.python_version(),
            **{package: package_version(package) for package in ("torch", "transformers")},
            "diff-llama": diff_llama_version()}


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def metadata(benchmark: str) -> dict:
    return {
        "benchmark": benchmark,
        "command": COMMAND or shlex.join(["python", *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "machine": machine(),
        "versions": versions(),
    }


def render_meta(meta: dict) -> str:
    m, v = meta["machine"], meta["versions"]
    flags = ", ".join(m["cpu_flags"]) or "none of avx/amx/bf16"
    return "\n".join([
        "---", "",
        f"Run `{meta['command']}` on {meta['date']} (commit {meta.get('git_commit') or 'unknown'}).",
        f"Machine: {m['cpu']} ({m['cores']} cores; flags: {flags}); GPU: {m['gpu'] or 'none'}.",
        f"Versions: torch {v['torch']}, transformers {v['transformers']}, diff-llama {v['diff-llama']}, "
        f"Python {v['python']}.",
    ])


def result_path(output: str | Path, suffix: str) -> Path:
    """`output` without its suffix: a bare name goes under bench/results."""
    output = Path(output)
    if output.parent == Path("."):
        output = RESULTS / output.name
    return output.with_name(output.name.removesuffix(".json").removesuffix(".md") + suffix)


def write_result(benchmark: str, output: str | Path, data: dict, render: Callable[[dict], str] | None = None,
                 echo: bool = True) -> Path:
    """Save `data` with the run's metadata as OUTPUT.json, then OUTPUT.md rendered from the file just written (by
    `render`, the benchmark's own `render` unless given), printed unless `echo` is false. A bare name goes under
    bench/results. Returns the JSON."""
    json_path = result_path(output, ".json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(json_path, json.dumps({"meta": metadata(benchmark), **data}, indent=1) + "\n")
    render_file(json_path, render, echo)
    return json_path


def write_atomically(path: Path, text: str):
    """Write `text` beside `path`, then rename it there: a run killed mid-write (a time limit) leaves the previous
    file whole, never half of one."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def render_file(json_path: str | Path, render: Callable[[dict], str] | None = None, echo: bool = True) -> Path:
    """(Re)write the markdown of a result JSON written by `write_result`."""
    json_path = Path(json_path)
    result = json.loads(json_path.read_text())
    if render is None and "recorded_afterwards" in result["meta"]:
        # Written before the suite, in a layout today's render may not read; its markdown is the run's own.
        raise ValueError(f"{json_path} predates the suite's result format (its meta was added afterwards): keep its "
                         f"markdown, or run `python -m bench {result['meta']['benchmark']}` again for a new result.")
    render = render or module(result["meta"]["benchmark"]).render
    markdown = render(result).rstrip("\n") + "\n\n" + render_meta(result["meta"]) + "\n"
    md_path = json_path.with_suffix(".md")
    write_atomically(md_path, markdown)
    if echo:
        print(markdown, f"\nwritten to {json_path} and {md_path.name}", sep="", flush=True)
    return md_path
