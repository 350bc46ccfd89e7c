"""aten ops in one decoding step (one token, dynamic cache after a 128-token prompt), counted with torch.profiler:
Llama, diff-llama (version 1, automatic kernels), diff-llama v2 and transformers' built-in DiffLlama, benchmark config (hidden 512,
8 heads, 4 layers). Counts every aten event, nested ones included (what the dispatcher pays for), and the
difference per layer by op name.

Usage: python bench/decode_ops.py [--batch 1] [--dtype float32] [--write]
Writes bench/results/decode_ops.md with --write.
"""

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_benchmark import SHAPE, build  # noqa: E402


def step_ops(model, batch):
    ids = torch.randint(0, 32000, (batch, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        model(token, past_key_values=cache, use_cache=True)  # warm
        with torch.profiler.profile() as profile:
            model(token, past_key_values=cache, use_cache=True)
    return collections.Counter(event.name for event in profile.events() if event.name.startswith("aten::"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
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
    print("\n".join(lines))
    if args.write:
        (Path(__file__).parent / "results" / "decode_ops.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
