"""The `diff-llama` command line."""

import argparse


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
    elif args.command == "export-builtin":
        from pathlib import Path

        from .builtin_interop import export_to_builtin
        from .modeling_diff_llama import DiffLlamaForCausalLM

        if Path(args.output).exists():
            raise SystemExit(f"diff-llama: {args.output} already exists; choose a new output folder.")
        export_to_builtin(DiffLlamaForCausalLM.from_pretrained(args.source), args.output)
        print(f"Wrote {args.output}: loads with transformers.AutoModelForCausalLM (model_type 'diffllama').")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
