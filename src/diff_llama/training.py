"""Fine-tuning DiffLlama models with the real `transformers.Trainer`, fully or with PEFT LoRA.

The recipe in Python (what `diff-llama train` runs):

```python
import peft
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments
from diff_llama.training import TokenBlocks, lora_config, optimizer_for

model = AutoModelForCausalLM.from_pretrained("my-diff-llama")
tokenizer = AutoTokenizer.from_pretrained("my-diff-llama")
model = peft.get_peft_model(model, lora_config())             # optional: LoRA on q/k/v/o, λ stays trainable
data = TokenBlocks(tokenizer, open("corpus.txt").read(), block_size=256)
trainer = Trainer(model=model, args=TrainingArguments("runs/x", max_steps=200), train_dataset=data,
                  optimizers=(optimizer_for(model, learning_rate=5e-5), None))  # λ gets its own learning rate
trainer.train()                                                # resume_from_checkpoint=True picks up the last one
```

λ is a scalar per layer made of four small vectors: at a LoRA-sized learning rate it barely moves, so it gets its
own (higher) learning rate and no weight decay. With LoRA, the λ vectors sit in `differential_lambda` modules listed
in `modules_to_save`: PEFT trains them and stores them in the adapter.
"""

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

from .corpus import read_text_file
from .errors import InputNotFoundError, Interrupted, OutputExistsError, UserError
from .model_card import RUN_RECORD, TRAINING_REPORT, duration_text, lineage, steps_text, write_training_report
from .options import FineTuneOptions, TrainingRunOptions

from .conversion.base import ATTENTION_PROJECTIONS

LAMBDA_MODULE = "differential_lambda"
MLP_PROJECTIONS = ["gate_proj", "up_proj", "down_proj"]
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".jsonl")


def text_files(folder: Path) -> list[Path]:
    """The .txt, .md, .rst and .jsonl files under `folder`, in name order, leaving out hidden ones and those in hidden
    folders (as the datasets library does): a `.venv`, `.git` or `.ipynb_checkpoints` holds no one's training text."""
    return sorted(p for p in folder.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def read_documents(path: str | Path) -> list[str | list[dict]]:
    """The training documents in a file or a folder (`text_files`): a text file is one document, and each line of a
    .jsonl file is one, either its "text" (a string) or its "messages" (a chat: a list of {"role": ..., "content":
    ...}, which `joined_text` renders with the tokenizer's chat template). Checked whole before any model is loaded:
    a bad line fails at once, naming its file and line, and a model folder given as data is refused."""
    path = Path(path)
    if not path.exists():
        raise InputNotFoundError(f"training data {path} does not exist; pass a text file or a folder of them.")
    if path.is_dir() and (path / "config.json").is_file():
        raise UserError(f"{path} is a model folder (it has a config.json), not training text; give --data a text "
                        f"file or a folder of them ({', '.join(TEXT_SUFFIXES)}).")
    files = [path] if path.is_file() else text_files(path)
    documents = []
    for file in files:
        if file.suffix == ".jsonl":
            documents += [_json_document(line, f"{file}:{number}")
                          for number, line in enumerate(read_text_file(file).splitlines(), 1)
                          if line.strip()]
        else:
            documents.append(read_text_file(file))
    if not any(d.strip() if isinstance(d, str) else d for d in documents):
        raise UserError(f"found no text in {path} (looked for {', '.join(TEXT_SUFFIXES)} files outside hidden "
                        "folders).")
    return documents


JSON_LINE_FORMS = '{"text": "..."} or {"messages": [{"role": "user", "content": "..."}, ...]}'


def _json_document(line: str, where: str) -> str | list[dict]:
    try:
        record = json.loads(line)
    except ValueError as error:
        raise UserError(f"{where} is not valid JSON ({error}); each line of a .jsonl file is one JSON object, "
                        f"{JSON_LINE_FORMS}.") from None
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return record["text"]
    messages = record.get("messages") if isinstance(record, dict) else None
    if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
        contents = [_text_content(m.get("content")) for m in messages]
        if all(isinstance(m.get("role"), str) for m in messages) and None not in contents:
            return [{**m, "content": content} for m, content in zip(messages, contents)]
    raise UserError(f"{where} has neither a \"text\" string nor a \"messages\" list of chat messages (each a "
                    f"\"role\" and a text \"content\"); each line needs one: {JSON_LINE_FORMS}.")


def _text_content(content) -> str | None:
    """A message's content as one string: a string, or OpenAI's list of text parts ({"type": "text", "text": ...}),
    joined by newlines as vLLM joins them for a text-only model; None for anything else (an image part)."""
    if isinstance(content, str):
        return content
    if (isinstance(content, list) and content
            and all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                    for part in content)):
        return "\n".join(part["text"] for part in content)
    return None


def joined_text(documents: list[str | list[dict]], tokenizer=None, data: str | Path = "the training data") -> str:
    """The documents as one training text, chats rendered by the tokenizer's chat template (whole conversations,
    every token trained, as TRL's SFTTrainer does by default), separated by blank lines."""
    if any(not isinstance(d, str) for d in documents) and not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{data} holds chat \"messages\", but the model's tokenizer has no chat template to write "
                        "them with; give \"text\" lines instead, or a model whose tokenizer has one.")
    texts = [d if isinstance(d, str) else tokenizer.apply_chat_template(d, tokenize=False) for d in documents]
    return "\n\n".join(t for t in texts if t.strip())


def read_text(path: str | Path, tokenizer=None) -> str:
    """`read_documents(path)` as one training text (`joined_text`); a chat needs the `tokenizer`'s chat template."""
    return joined_text(read_documents(path), tokenizer, path)


class TokenBlocks(torch.utils.data.Dataset):
    """A text cut into consecutive blocks of `block_size` tokens, each a causal-LM example (labels = input_ids)."""

    def __init__(self, tokenizer, text: str, block_size: int = 256):
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
        if len(ids) < block_size:
            raise UserError(
                f"the training text has {len(ids)} tokens, fewer than one block of {block_size}; "
                "give more text or a smaller block size."
            )
        self.blocks = ids[: len(ids) // block_size * block_size].view(-1, block_size)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, index):
        return {"input_ids": self.blocks[index], "labels": self.blocks[index]}


def lora_config(rank: int = 16, alpha: int = 32, dropout: float = 0.0, include_mlp: bool = False):
    """LoRA on the attention projections (and the MLP if asked), with the λ modules trained and saved in full."""
    from peft import LoraConfig

    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=[*ATTENTION_PROJECTIONS, *(MLP_PROJECTIONS if include_mlp else [])],
        modules_to_save=[LAMBDA_MODULE],
        task_type="CAUSAL_LM",
    )


def optimizer_for(model, learning_rate: float, lambda_learning_rate: float = 1e-2, weight_decay: float = 0.0,
                  extra_groups: list[dict] = ()):
    """AdamW over the trainable parameters: λ vectors at `lambda_learning_rate` without weight decay, the rest at
    `learning_rate`. `extra_groups` are param groups (dicts with "params") that take their parameters out of the rest.
    """
    taken = {id(p) for group in extra_groups for p in group["params"]}
    lambdas, others = [], []
    for name, param in model.named_parameters():
        if param.requires_grad and id(param) not in taken:
            # version 1's λ vectors (4 per layer, in an exp) take their own rate; DIFF V2's λ projection is an
            # ordinary linear layer and trains at the base rate (its dot products span the whole hidden size)
            is_lambda_vector = f"{LAMBDA_MODULE}." in name and "lambda_proj" not in name
            (lambdas if is_lambda_vector else others).append(param)
    groups = [{"params": others, "lr": learning_rate, "weight_decay": weight_decay},
              {"params": lambdas, "lr": lambda_learning_rate, "weight_decay": 0.0}, *extra_groups]
    return torch.optim.AdamW([g for g in groups if g["params"]])


def plot_training_loss(log_history: list[dict], output: str | Path) -> Path:
    """PNG of the training loss per step from `trainer.state.log_history`."""
    from .plotting import pyplot, save_png

    entries = [e for e in log_history if "loss" in e]
    if not entries:
        raise UserError("the log history has no training loss yet.")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([e["step"] for e in entries], [e["loss"] for e in entries], marker="o")  # one point must show too
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    return save_png(fig, output)


def checkpoint_folders(output_dir: str | Path) -> list[Path]:
    """The Trainer's checkpoint-N folders in `output_dir`, oldest first."""
    found = [p for p in Path(output_dir).glob("checkpoint-*") if p.is_dir() and p.name[len("checkpoint-"):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len("checkpoint-"):]))


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """The checkpoint-N folders in `output_dir` that the Trainer finished writing, oldest first: it writes
    trainer_state.json last, so a checkpoint without it was interrupted while being written."""
    from transformers.trainer import TRAINER_STATE_NAME

    return [c for c in checkpoint_folders(output_dir) if Path(c, TRAINER_STATE_NAME).is_file()]


def resume_checkpoint(output_dir: str | Path, resume: bool, inputs=()) -> str | None:
    """The checkpoint to resume from. Refuses to resume from nothing, to start over silently on top of an earlier
    run's checkpoints (the Trainer would mix them up with the new run's), to write among other files, and to start
    a run inside a folder it reads (`inputs`: the model, the data)."""
    from transformers.trainer import TRAINER_STATE_NAME

    from .output_folder import check_new_output

    checkpoints = checkpoint_folders(output_dir)
    complete = complete_checkpoints(output_dir)
    last = str(complete[-1]) if complete else None
    if resume and checkpoints and str(checkpoints[-1]) != last:
        partial = checkpoints[-1]
        if last is None:
            raise InputNotFoundError(
                f"--resume: {partial} was interrupted while being written (it has no {TRAINER_STATE_NAME}) and no "
                f"earlier checkpoint is complete; remove {partial} and start without --resume, or choose a new folder."
            )
        print(f"Skipping {partial}: interrupted while being written (no {TRAINER_STATE_NAME}); resuming from "
              f"{Path(last).name}.", file=sys.stderr)
    if resume and last is None:
        raise InputNotFoundError(f"--resume: no checkpoint-N folder in {output_dir}; start without --resume.")
    if not resume and checkpoints:
        if last is None:  # what --resume refuses too: say at once what does go on
            raise OutputExistsError(
                f"{checkpoints[-1]} was cut short while being written (it has no {TRAINER_STATE_NAME}) and no "
                "checkpoint is complete; remove it and run the command again, or choose a new folder."
            )
        raise OutputExistsError(
            f"{output_dir} already holds training checkpoints; pass --resume to continue, or choose a new folder."
        )
    if last is None:
        check_new_output(output_dir, fix="choose a new folder for --output (the run would be saved among its files)",
                         offers_overwrite=False, inputs=inputs)
    return last


def how_to_continue(output_dir: str | Path, offers_overwrite: bool = False) -> str:
    """What a run interrupted while training into `output_dir` kept there, and the command that goes on from it.
    `offers_overwrite`: the command has --overwrite to start over in a folder that holds an earlier run."""
    from .output_folder import holds_files

    checkpoints, complete = checkpoint_folders(output_dir), complete_checkpoints(output_dir)
    if complete:
        step = complete[-1].name[len("checkpoint-"):]
        return f"{complete[-1]} holds the run up to step {step}: run the command again with --resume to continue"
    if checkpoints:  # what --resume refuses, and a fresh start is refused while it is there
        return f"{checkpoints[-1]} was cut short while being written and no checkpoint is complete; remove it, then " \
               "run the command again to start over"
    if not holds_files(output_dir):
        return "no checkpoint was written yet (one every --save-steps steps); run the command again to start over"
    start_over = "add --overwrite to start over" if offers_overwrite else "choose a new folder to start over"
    return f"no checkpoint was written yet (one every --save-steps steps); {start_over}"


@contextlib.contextmanager
def continuable(output_dir: str | Path, offers_overwrite: bool = False):
    """Around a run training into `output_dir`: Ctrl-C becomes `Interrupted`, whose one line says what the run
    kept and how to go on (`how_to_continue`)."""
    try:
        yield
    except KeyboardInterrupt as interrupt:
        if isinstance(interrupt, Interrupted):
            raise
        raise Interrupted(how_to_continue(output_dir, offers_overwrite)) from None


def load_for_training(model_path: str, seed: int):
    """Seed everything, then load tokenizer and model (float32) from any model argument (folder, Hub id, ...)."""
    from transformers import set_seed

    from .resolve import load_causal_lm, load_tokenizer, release_gguf_quantizer

    set_seed(seed)
    tokenizer, model = load_tokenizer(model_path), load_causal_lm(model_path, dtype=torch.float32)
    release_gguf_quantizer(model)  # the Trainer refuses a model marked quantized, even once dequantized
    return tokenizer, model


def base_model_reference(model_path: str) -> str:
    """How a LoRA adapter names the model it was trained on (PEFT records the model's `name_or_path` as the adapter's
    `base_model_name_or_path`), and how a run records its model and data: a local path made absolute, so that it
    means the same from any working directory; 'smollm2' or a Hub id as given (transformers' name_or_path of a GGUF
    model is its folder, which is no model)."""
    path = Path(model_path).expanduser()
    return str(path.resolve()) if path.exists() else str(model_path)


# What a resumed `train` or `recover` may change: how long it runs, how often it saves and logs, what it writes at the
# end. Anything else would change what the run trains, or (--lora) could not load its optimizer state.
RESUMABLE_CHANGES = ("max_steps", "epochs", "minutes", "save_steps", "logging_steps", "eval_minutes", "monitor",
                     "merge", "threads", "gradient_checkpointing", "compile", "compile_backend")


def compute_arguments(options: TrainingRunOptions) -> dict:
    """Where and how the Trainer computes: the accelerator where there is one, else the CPU (several processes then
    still train as one data-parallel job, over gloo, as they would over NCCL on GPUs); `options.autocast` on that
    device (`auto`: bfloat16 where it computes it in hardware, `precision.fastest_dtype`); gradient checkpointing;
    torch.compile."""
    from dataclasses import fields

    from transformers import TrainingArguments

    from .precision import resolve_dtype
    from .resolve import accelerator

    device = accelerator() or torch.device("cpu")
    dtype = resolve_dtype(options.autocast, device)
    # transformers 5.x renamed it; the old name still works there, with a FutureWarning.
    known = {field.name for field in fields(TrainingArguments)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in known else "gradient_checkpointing"
    compiled = {"torch_compile": True, "torch_compile_backend": options.compile_backend} if options.compile else {}
    # Non-reentrant, whatever the version's default: `NoGradientHookOnInputs` relies on it.
    non_reentrant = {f"{checkpointing}_kwargs": {"use_reentrant": False}} if options.gradient_checkpointing else {}
    return {"use_cpu": device.type == "cpu", "bf16": dtype == torch.bfloat16, "fp16": dtype == torch.float16,
            checkpointing: options.gradient_checkpointing, **non_reentrant, **compiled}


def compute_callbacks(options: TrainingRunOptions) -> list:
    """The callbacks that go with `compute_arguments(options)`."""
    return [NoGradientHookOnInputs()] if options.gradient_checkpointing else []


class NoGradientHookOnInputs(TrainerCallback):
    """With gradient checkpointing the Trainer has transformers hook the input embeddings to call
    `requires_grad_(True)` on their output, which reentrant checkpointing needs when the embeddings are frozen (LoRA).
    `compute_arguments` asks for non-reentrant checkpointing, which takes gradients to the weights inside a layer
    whatever its input, so the hook only costs: torch.compile cannot trace it, and a compiled LoRA step breaks into
    three graphs there. Removed once the Trainer has set checkpointing up, before the first step."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        remove = getattr(model, "disable_input_require_grads", None)  # through PEFT's wrappers to the model
        if remove is not None:
            remove()


def run_record(model_path: str, options: TrainingRunOptions) -> dict:
    """The run's options as a checkpoint records them, with the model and the data as absolute paths."""
    from dataclasses import asdict

    record = {**asdict(options), "model": base_model_reference(model_path)}
    for key in ("data", "source"):
        if record.get(key) is not None:
            record[key] = base_model_reference(record[key])
    for key in ("output", "resume"):
        record.pop(key)
    return record


class RunRecordInCheckpoints(TrainerCallback):
    """Write the run's options (`run_record`) into each checkpoint-N, for `check_resumed_run`."""

    def __init__(self, record: dict):
        self.record = record

    def on_save(self, args, state, control, **kwargs):
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and checkpoint.is_dir():
            (checkpoint / RUN_RECORD).write_text(json.dumps(self.record, indent=1) + "\n")


def _shown(value) -> str:
    """An option's value as the command line gives it: a flag on or off, an option left at its default."""
    if value is None:
        return "at its default"
    if isinstance(value, bool):
        return "on" if value else "off"
    return repr(value)


def check_resumed_run(checkpoint: str | Path, model_path: str, options: TrainingRunOptions) -> None:
    """Refuse, in one line, a --resume that would not continue the run in `checkpoint`: --lora given or left out
    unlike the run (the Trainer could not load its optimizer state), or other options, model or data than it
    recorded (an option the checkpoint's diff-llama did not have yet counts as its default)."""
    from .options import option_defaults

    checkpoint = Path(checkpoint)
    lora_run = (checkpoint / "adapter_config.json").is_file()
    if lora_run != bool(options.lora):
        raise UserError(f"--resume: {checkpoint} holds a {'LoRA' if lora_run else 'full'} training run; resume it "
                        f"{'with' if lora_run else 'without'} --lora, as it was started.")
    if not (checkpoint / RUN_RECORD).is_file():
        return  # written by a diff-llama that did not record its options: nothing more to compare
    before = {**option_defaults(type(options)), **json.loads((checkpoint / RUN_RECORD).read_text())}
    differ = {key: (before.get(key), value) for key, value in run_record(model_path, options).items()
              if key not in RESUMABLE_CHANGES and before.get(key) != value}
    if differ:
        found = ", ".join(f"{'--' + key.replace('_', '-') if key != 'model' else 'MODEL'} {_shown(old)}, not "
                          f"{_shown(new)}" for key, (old, new) in differ.items())
        may_change = ", ".join(f"--{key.replace('_', '-')}" for key in RESUMABLE_CHANGES if hasattr(options, key))
        raise UserError(f"--resume: {checkpoint} was trained with other options ({found}); pass the ones it was "
                        f"started with (only {may_change} may change), or start a new run in a new folder.")


def with_lora(model, options: TrainingRunOptions):
    """The model wrapped with LoRA adapters (λ trained in full) when `options.lora`, else the model itself."""
    if not options.lora:
        return model
    from peft import get_peft_model

    from .resolve import peft_without_its_deprecation_warning

    with peft_without_its_deprecation_warning():
        model = get_peft_model(model, lora_config(rank=options.lora_rank, include_mlp=options.lora_mlp))
    model.print_trainable_parameters()
    return model


def save_trained(model, tokenizer, output_dir: str | Path, merge: bool):
    """Save the final model (merged first if asked: a LoRA model becomes a plain one) and the tokenizer; returns the
    model that was saved."""
    if merge:
        model = model.merge_and_unload()
    from .resolve import save_tokenizer

    model.save_pretrained(output_dir)
    save_tokenizer(tokenizer, output_dir)
    return model


def merge_adapter_folder(adapter: str | os.PathLike, output: str | os.PathLike, overwrite: bool = False) -> None:
    """`diff-llama merge`: the LoRA adapter folder `adapter` (what `train --lora` writes) merged into its base model,
    λ included, and saved in `output` as one plain model folder with what `train --lora --merge` writes beside the
    weights: the tokenizer, the licence texts, the run's training report and the model card. The weights keep the
    base's dtype (train's own merge is of a float32 model). For what takes a whole model folder (vLLM, SGLang, push,
    export-builtin). With `overwrite`, an earlier merge's output there is replaced once the new one is complete."""
    from .output_folder import AtomicOutputFolder, give_weights_the_usual_permissions
    from .resolve import (adapter_base, copy_license_files, find_model, load_causal_lm, load_tokenizer,
                          release_gguf_quantizer, save_tokenizer)

    location = find_model(adapter, adapters=True)
    if not location.is_adapter:
        raise UserError(f"{adapter} is a whole model already (it has no adapter_config.json), so there is nothing to "
                        "merge: use it as it is.")
    # New, empty or (with `overwrite`) an earlier merge's; never the adapter, its base or a folder inside either.
    # Checked before the models load.
    target = AtomicOutputFolder(output, overwrite=overwrite, inputs=[adapter, adapter_base(location)], command="merge")
    model = load_causal_lm(adapter, dtype="auto")
    release_gguf_quantizer(model)  # a GGUF base's weights, dequantized as it loaded, save like any others
    tokenizer = load_tokenizer(adapter)
    report_path = Path(location.name_or_path) / TRAINING_REPORT
    report = json.loads(report_path.read_text()) if report_path.is_file() else None
    with target as folder:
        model.save_pretrained(folder)
        save_tokenizer(tokenizer, folder)
        copy_license_files(adapter, folder)
        if report is not None:
            write_training_report(folder, merged_training_report(report), location=str(output))
        elif model.config.model_type == "diff_llama":
            from .model_card import write_model_card

            write_model_card(folder, location=str(output))
    give_weights_the_usual_permissions(output)


def merged_training_report(report: dict) -> dict:
    """A `train --lora` run's training report, for its adapter once merged: what `train --lora --merge` writes."""
    if not report.get("lora") or report.get("merged"):
        return report
    rank = report["lora_rank"]
    return {**report, "merged": True,
            "summary": report["summary"].replace(lora_method(rank, merged=False), lora_method(rank, merged=True), 1)}


class TokenizerInCheckpoints(TrainerCallback):
    """Save the tokenizer into each checkpoint-N too, so that a checkpoint loads, generates, evaluates and serves on
    its own, as the final folder does."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def on_save(self, args, state, control, **kwargs):
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and checkpoint.is_dir():
            from .resolve import save_tokenizer

            save_tokenizer(self.tokenizer, checkpoint)


class LogLastStep(TrainerCallback):
    """Log at the last step too, so a run shorter than `logging_steps` still records (and plots) its loss."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_log = True


def training_report(upstream: dict, options: FineTuneOptions, state, learning_rate: float, processes: int = 1,
                    resumed: bool = False) -> dict:
    """What the model card of a fine-tuned model says of its training (`model_card.TRAINING_REPORT`): the lineage
    of the model it was trained from (`model_card.lineage`), the data by name only (a path means nothing elsewhere),
    and a sentence on the budget, the method and the logged losses; with those figures as numbers too. `processes`:
    how many data-parallel processes trained, each on its own blocks; `resumed`: whether this process continued a
    run from a checkpoint (the Trainer times only what it ran itself)."""
    losses = [entry["loss"] for entry in state.log_history if "loss" in entry]
    runtime = next((entry["train_runtime"] for entry in reversed(state.log_history) if "train_runtime" in entry), 0)
    method = lora_method(options.lora_rank, options.merge) if options.lora else "full fine-tuning"
    blocks = options.batch_size * options.gradient_accumulation * processes
    clock = duration_text(runtime / 60) + (" since the last --resume" if resumed else "")
    summary = (f"{steps_text(state.global_step)} ({state.epoch:.2f} epochs, {clock}) of {method}, "
               f"learning rate {learning_rate:g}, {blocks} blocks of {options.block_size} tokens a step")
    if losses:
        summary += f"; training loss {losses[0]:.3f} at the first logged step"
        summary += f", {losses[-1]:.3f} at the last" if len(losses) > 1 else ""
    data = Path(options.data).expanduser().resolve().name
    return {"finetuned_from": upstream, "trained_on": f"`{data}`",
            "summary": summary + ". No held-out evaluation was run after it.",
            "data": data, "steps": state.global_step, "epochs": state.epoch, "train_minutes": runtime / 60,
            "resumed": resumed, "lora": options.lora, "lora_rank": options.lora_rank if options.lora else None, "merged": options.merge,
            "learning_rate": learning_rate, "batch_size": options.batch_size,
            "gradient_accumulation": options.gradient_accumulation, "processes": processes,
            "block_size": options.block_size, "losses": losses}


def lora_method(rank: int, merged: bool) -> str:
    return f"LoRA (rank {rank}{', merged into the weights' if merged else ''})"


def train(model_path: str, options: FineTuneOptions, callbacks: tuple = ()) -> Path:
    """Fine-tune `model_path` on the text at `options.data` (the engine of `diff-llama train`); returns the output
    folder. `callbacks`: extra `TrainerCallback`s.

    Runs data-parallel when launched as several processes (`accelerate launch`, `torchrun`): over NCCL on GPUs, over
    gloo on a machine without an accelerator. FSDP (accelerate's FSDP config) needs GPUs: accelerate runs CPU
    processes as data parallel only, so an FSDP launch without an accelerator is refused rather than silently run
    as DDP.

    Writes Trainer checkpoints (`checkpoint-N`, every `save_steps`) into `options.output`, then the final model: the
    adapter with LoRA (or the merged model with `merge`), the full model otherwise, with the tokenizer, the log
    history and PNG plots of the loss and of λ / the differential maps.
    """
    from transformers import Trainer, TrainingArguments

    from .monitoring import DifferentialAttentionCallback, plot_differential_attention
    from .output_folder import give_weights_the_usual_permissions

    from .resolve import accelerator

    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and accelerator() is None:
        raise UserError(
            "FSDP was requested (accelerate's FSDP config) but this machine has no GPU or other accelerator: "
            "accelerate shards models with FSDP only on accelerators and runs CPU processes as data parallel (DDP). "
            "On CPU, launch with a DDP config (e.g. configs/accelerate/ddp.yaml); use the FSDP config on GPUs."
        )
    output_dir = Path(options.output)
    checkpoint = resume_checkpoint(output_dir, options.resume, inputs=[model_path, options.data])
    if checkpoint is not None:
        check_resumed_run(checkpoint, model_path, options)
    documents = read_documents(options.data)  # before loading the model: a wrong path or line fails at once
    upstream = lineage(model_path)  # read first: nothing after the training reads the input
    tokenizer, model = load_for_training(model_path, options.seed)
    dataset = TokenBlocks(tokenizer, joined_text(documents, tokenizer, options.data), options.block_size)
    model.name_or_path = base_model_reference(model_path)  # what an adapter saved below names as its base
    model = with_lora(model, options)
    learning_rate = options.learning_rate if options.learning_rate is not None else (2e-4 if options.lora else 5e-5)
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=options.max_steps, num_train_epochs=options.epochs,
        per_device_train_batch_size=options.batch_size, gradient_accumulation_steps=options.gradient_accumulation,
        learning_rate=learning_rate, lr_scheduler_type="cosine", warmup_steps=0.05,
        logging_steps=options.logging_steps, save_steps=options.save_steps, save_total_limit=2, report_to="none",
        seed=options.seed, **compute_arguments(options),
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset,
                      callbacks=[LogLastStep(), TokenizerInCheckpoints(tokenizer),
                                 RunRecordInCheckpoints(run_record(model_path, options)),
                                 *compute_callbacks(options), *callbacks],
                      optimizers=(optimizer_for(model, learning_rate, options.lambda_learning_rate), None))
    if options.monitor and hasattr(model, "get_lambdas"):
        DifferentialAttentionCallback.attach(trainer, dataset.blocks[0, :64])
    trainer.train(resume_from_checkpoint=checkpoint)

    if options.lora and options.merge:
        if trainer.is_world_process_zero():
            save_trained(model, tokenizer, output_dir, merge=True)
    else:
        # Every process takes part (under FSDP the full weights are gathered); the main process writes the folder.
        trainer.save_model(str(output_dir))
    if not trainer.is_world_process_zero():
        return output_dir
    from .resolve import copy_license_files, save_tokenizer

    if not (options.lora and options.merge):
        save_tokenizer(tokenizer, output_dir)
    copy_license_files(model_path, output_dir)
    history = trainer.state.log_history
    (output_dir / "training_log.json").write_text(json.dumps(history, indent=1) + "\n")
    write_training_report(output_dir, training_report(upstream, options, trainer.state, learning_rate, args.world_size,
                                                         resumed=checkpoint is not None))
    plot_training_loss(history, output_dir / "training_loss.png")
    if options.monitor and any("diff_attn/mean_abs_lambda" in e for e in history):
        plot_differential_attention(history, output_dir / "differential_attention.png")
    give_weights_the_usual_permissions(output_dir)
    return output_dir
