"""Quality of the conversion options on the real SmolLM2-135M-Instruct, before any training.

Converts the model once per option set and reports held-out perplexity (source vs converted) and the mean
per-token KL(source || converted), all measured by the converter on the same 2,048 held-out tokens
(Python standard-library docstrings of modules the calibration text does not use).

Usage: python -m bench conversion_quality [--variants N]    (all 8: about 10 minutes on 2 cores)
Writes bench/results/conversion_quality.{json,md}.
"""

import argparse
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

import suite
from diff_llama.conversion.converter import ConversionOptions, convert_llama_to_diff_llama
from diff_llama.smollm2 import smollm2_gguf_path

VARIANTS = [
    ("expand, lstsq, headroom 0.01 (version 1 default)", dict()),
    ("expand, lstsq, headroom 0.1 (the default until issue 9)", dict(head_norm_headroom=0.1)),
    ("expand, lstsq, headroom 1.0", dict(head_norm_headroom=1.0)),
    ("expand, lstsq, no headroom (norm in the paper's regime)", dict(head_norm_headroom=0.0)),
    ("expand, scale only", dict(calibration="scale", head_norm_headroom=0.0)),
    ("split, lstsq, headroom 0.1", dict(head_layout="split", head_norm_headroom=0.1)),
    ("split, scale only (the spec's ~150 recipe)", dict(head_layout="split", calibration="scale", head_norm_headroom=0.0)),
    ("split, no calibration", dict(head_layout="split", calibration="none")),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", type=int, default=len(VARIANTS),
                        help="only the first N option sets (default: all %(default)s)")
    parser.add_argument("--output", default="conversion_quality",
                        help="results name under bench/results, or a path (no suffix)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="diff-llama-quality-"))
    gguf = smollm2_gguf_path()
    # Dequantize once into a Transformers folder, so that every variant reads the same float32 weights quickly.
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    del quantized.config.quantization_config
    model = LlamaForCausalLM(quantized.config)  # a plain model: transformers refuses to save GGUF-loaded ones
    model.load_state_dict(quantized.state_dict())
    model.save_pretrained(work / "source")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(work / "source")
    rows = []
    for name, overrides in VARIANTS[: args.variants]:
        options = ConversionOptions(diff_version=1, **overrides)  # every variant here is a version 1 conversion
        if options.calibration == "none":
            options.head_norm_headroom = 0.0
        report = convert_llama_to_diff_llama(str(work / "source"), str(work / "out"), options, overwrite=True,
                                             progress=False)
        q = report.quality
        rows.append({"variant": name, "options": overrides, "heads": report.num_attention_heads,
                     "source_perplexity": q["source_perplexity"], "converted_perplexity": q["converted_perplexity"],
                     "ratio": q["converted_perplexity"] / q["source_perplexity"],
                     "kl": q["kl_source_to_converted"], "seconds": report.seconds})
        print(rows[-1], flush=True)
    suite.write_result("conversion_quality", args.output, {"rows": rows}, render)


def render(result: dict) -> str:
    rows = result["rows"]
    lines = [f"SmolLM2-135M-Instruct (source perplexity {rows[0]['source_perplexity']:.2f} on 2,048 held-out tokens), "
             "before any training.", "",
             "| conversion | softmax maps | perplexity | x source | KL nats/token | seconds |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['heads']} | {r['converted_perplexity']:.2f} | {r['ratio']:.3f} | {r['kl']:.4f} "
              f"| {r['seconds']:.0f} |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
