"""Entry point of the `diff-llama` command.

It lives outside the `diff_llama` package on purpose: importing `diff_llama` registers the model with transformers'
Auto classes, which imports torch (seconds). `diff-llama` and `diff-llama --help` answer from here without it; every
subcommand is parsed and run by `diff_llama.cli`.
"""

import sys

PROG = "diff-llama"
DESCRIPTION = "Differential-attention LLaMA models for Hugging Face Transformers."

# One line per subcommand, in the order of the overview; `diff_llama.cli` declares each one's options next to the
# code that runs it and takes its summary from here (a test checks that both list the same commands).
COMMANDS = {
    "convert": "convert a LLaMA (folder, .gguf file, 'smollm2' or Hub id) into a DiffLlama folder",
    "recover": "after convert: distil the source LLaMA into the converted model (KL on next-token distributions)",
    "train": "fine-tune a model on your text with transformers' Trainer, fully or with LoRA",
    "generate": "generate text with a model, streamed to the terminal",
    "attention-map": "write PNG heatmaps of A1, A2 and A1 − λA2 (or a LLaMA's softmax maps) for one layer",
    "adapt": "train a DiffLlama (or its source LLaMA, to compare) on long-context retrieval mixed with text",
    "evaluate": "multi-needle retrieval and attention allocation of any causal LM(s), plus held-out perplexity",
    "serve": "serve a model over HTTP with the OpenAI API (transformers serve, loading DiffLlama models correctly)",
    "push": "upload a model folder (weights, remote code, tokenizer, model card) to the Hugging Face Hub",
    "export-builtin": "save a DiffLlama for transformers' built-in DiffLlamaForCausalLM (even KV heads only)",
    "demo": "train a small fresh DiffLlama on offline text, save, reload and generate (about a minute on CPU)",
}


def overview() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"usage: {PROG} COMMAND [options]   ({PROG} COMMAND --help for a command's options)", "", DESCRIPTION, "",
             "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, summary in COMMANDS.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(overview(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    from diff_llama.cli import main as run

    return run(argv)


if __name__ == "__main__":
    raise SystemExit(main())
