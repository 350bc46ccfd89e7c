"""What converting a large LLaMA costs per layer, measured on synthetic checkpoints with real layer shapes.

A 7B/8B checkpoint does not fit this project's machines (2 shared cores, about 6 GB free), so this measures a few
layers of the real shape and reports per-layer costs; bench/results/calibration_cost.md extrapolates them (labelled
as estimates) to whole models.

For each shape: a synthetic LLaMA (bf16, random weights, N layers, a small vocabulary: embeddings are not per-layer
cost) is written, then converted in a fresh process, one torch thread, under `nice`:
- version 1 with calibration (`--calibration lstsq`, the default) on `--calibration-tokens` tokens, evaluation off:
  the time of each layer's calibration (`LayerwiseRunner.calibrate`, timed by wrapping it), and of each whole layer
  step (read, convert, build the fp32 layers, calibrate, advance the activations, write);
- DIFF V2's exact conversion (no calibration: weights streamed);
with wall time, CPU time (user + system) and peak RSS of the converting process.

Usage: python bench/calibration_cost.py [--shape llama3-8b] [--layers 2] [--calibration-tokens 2048]
Writes bench/results/calibration_cost_SHAPE_TOKENS.json (and prints it).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SHAPES = {
    # hidden, intermediate, heads, kv heads (head_dim 128): the layer shapes of the public configs
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8),
}

CHILD = r'''
import json, resource, sys, time
import torch
torch.set_num_threads(1)
from diff_llama.conversion import calibration, converter
from diff_llama.conversion.converter import ConversionOptions, convert_llama_to_diff_llama

source, output, version, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
calibrate_seconds, calibrate_cpu_seconds = [], []
original_calibrate = calibration.LayerwiseRunner.calibrate
def timed_calibrate(self, *args, **kwargs):
    started, started_cpu = time.perf_counter(), time.process_time()
    result = original_calibrate(self, *args, **kwargs)
    calibrate_seconds.append(time.perf_counter() - started)
    calibrate_cpu_seconds.append(time.process_time() - started_cpu)
    return result
calibration.LayerwiseRunner.calibrate = timed_calibrate
calibration = dict(calibration="lstsq", calibration_tokens=tokens) if version == 1 else dict(calibration="none")
options = ConversionOptions(diff_version=version, evaluate=False, seq_len=512, **calibration)
cpu = time.process_time()
started = time.perf_counter()
report = convert_llama_to_diff_llama(source, output, options, progress=False)
wall = time.perf_counter() - started
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "cpu_in_call_s": time.process_time() - cpu,
                  "peak_rss_gb": usage.ru_maxrss / 2**20, "calibrate_s": calibrate_seconds,
                  "calibrate_cpu_s": calibrate_cpu_seconds}))
'''


def make_checkpoint(folder: Path, layers: int, shape: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    import conftest  # the tests' byte-level BPE tokenizer: per-layer cost does not depend on the vocabulary

    tokenizer = conftest.tokenizer._fixture_function(None)
    config = LlamaConfig(vocab_size=len(tokenizer), num_hidden_layers=layers, tie_word_embeddings=False,
                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0, **shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0, 0.02, generator=generator)
    model.save_pretrained(folder, max_shard_size="2GB")
    tokenizer.save_pretrained(folder)
    return sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--calibration-tokens", type=int, default=2048)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as work:
        work = Path(work)
        layer_bytes = make_checkpoint(work / "llama", args.layers, SHAPES[args.shape])
        runs = {}
        for version in (2, 1):
            command = ["nice", "-n", "19", sys.executable, "-c", CHILD, str(work / "llama"), str(work / f"v{version}"),
                       str(version), str(args.calibration_tokens)]
            env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
            result = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
            runs[f"v{version}"] = json.loads(result.stdout.strip().splitlines()[-1])
    record = {"shape": args.shape, **SHAPES[args.shape], "layers": args.layers, "layer_bytes_bf16": layer_bytes,
              "calibration_tokens": args.calibration_tokens, "seq_len": 512, "threads": 1, "runs": runs,
              "load_average_after": os.getloadavg()}
    out = RESULTS / f"calibration_cost_{args.shape}_{args.calibration_tokens}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
