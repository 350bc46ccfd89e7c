"""Recovery after conversion: train a converted DiffLlama to match its source LLaMA by distillation.

The student is trained with the real `Trainer` on KL(source || student) over next-token distributions, on the user's
text or on text the source generates itself. A converted model starts with λ = 0 (it computes what the LLaMA
computed); a hinge penalty lifts each layer's λ to at least `lambda_floor`, so the result really subtracts a second
map instead of staying a LLaMA in disguise, and the distillation teaches the rest of the layer to live with it.
Held-out perplexity and mean |λ| are measured against training time, the time spent on evaluation excluded.
"""

import json
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import Trainer, TrainerCallback

from .errors import UserError
from .options import RecoveryOptions
from .resolve import uses_cpu_threads
from .model_card import write_model_card
from .training import (
    RunRecordInCheckpoints,
    TokenBlocks,
    TokenizerInCheckpoints,
    check_resumed_run,
    compute_arguments,
    compute_callbacks,
    joined_text,
    load_for_training,
    optimizer_for,
    read_documents,
    resume_checkpoint,
    run_record,
    save_trained,
    with_lora,
)


def distillation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                    attention_mask: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
    """Mean over (unmasked) tokens of KL(teacher || student) between the next-token distributions, in nats."""
    log_student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    per_token = (log_teacher.exp() * (log_teacher - log_student)).sum(-1)
    if attention_mask is not None:
        return (per_token * attention_mask).sum() / attention_mask.sum() * temperature**2
    return per_token.mean() * temperature**2


def lambda_floor_penalty(model, floor: float) -> torch.Tensor:
    """Sum over layers of relu(floor − λ): zero once every layer subtracts at least `floor` of its second map."""
    return torch.relu(floor - model.get_lambdas()).sum()


class DistillationTrainer(Trainer):
    """A Trainer whose loss is KL(teacher || student) (+ the λ floor penalty), with the teacher run alongside."""

    def __init__(self, *args, teacher, lambda_floor: float = 0.0, lambda_floor_ramp_steps: int = 0,
                 lambda_floor_weight: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        # Beside the student, which the Trainer has moved to its device (a GPU where there is one).
        self.teacher = teacher.eval().requires_grad_(False).to(self.args.device)
        self.lambda_floor = lambda_floor
        self.lambda_floor_ramp_steps = lambda_floor_ramp_steps
        self.lambda_floor_weight = lambda_floor_weight

    def current_lambda_floor(self) -> float:
        """The floor rises linearly over the first `lambda_floor_ramp_steps` steps, so the rest of the model adapts
        to a growing λ instead of a sudden one."""
        ramp = min(1.0, (self.state.global_step + 1) / self.lambda_floor_ramp_steps) if self.lambda_floor_ramp_steps else 1
        return self.lambda_floor * ramp

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = {k: v for k, v in inputs.items() if k != "labels"}
        outputs = model(**inputs)
        with torch.no_grad(), self.accelerator.autocast():  # the student's mixed precision (accelerate's)
            teacher_logits = self.teacher(**inputs).logits
        loss = distillation_kl(outputs.logits, teacher_logits, inputs.get("attention_mask"))
        if self.lambda_floor > 0:
            loss = loss + self.lambda_floor_weight * lambda_floor_penalty(model, self.current_lambda_floor())
        return (loss, outputs) if return_outputs else loss


# The monitor's curve and clock, in each checkpoint-N beside the Trainer's state, so that `--resume` continues both.
MONITOR_STATE = "recover_state.json"


class RecoveryMonitor(TrainerCallback):
    """Measures held-out perplexity and mean |λ| every `eval_minutes` of training time (evaluation excluded), and
    stops training after `max_minutes` of it. Its curve and clock go into each checkpoint (`MONITOR_STATE`): a resumed
    run continues them (`resume`), so `max_minutes` is the budget of the whole run, as `--max-steps` is."""

    def __init__(self, held_out_ids: torch.Tensor, eval_minutes: float, max_minutes: float | None):
        self.held_out_ids = held_out_ids
        self.eval_seconds = eval_minutes * 60
        self.max_seconds = max_minutes * 60 if max_minutes else None
        self.curve: list[dict] = []
        self.train_seconds = 0.0
        self._since = None
        self.bar = None

    def resume(self, state: dict | None) -> None:
        """Continue the curve and the clock of `resumed_monitor_state` (None: a checkpoint written before they were
        kept there, which starts them again from its step)."""
        if state is not None:
            self.curve, self.train_seconds = state["curve"], state["train_seconds"]

    @property
    def out_of_time(self) -> bool:
        return self.max_seconds is not None and self.train_seconds >= self.max_seconds

    def measure(self, model, step: int):
        from .evaluation import perplexity

        was_training = model.training
        record = {"step": step, "train_minutes": self.train_seconds / 60,
                  "perplexity": perplexity(model, self.held_out_ids),
                  "mean_abs_lambda": model.get_lambdas().abs().mean().item()}
        model.train(was_training)
        self.curve.append(record)
        message = (f"{record['train_minutes']:.1f} min, step {step}: held-out perplexity {record['perplexity']:.2f}, "
                   f"mean |λ| {record['mean_abs_lambda']:.3f}")
        (self.bar.write if self.bar else print)(f"[recover] {message}")

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from tqdm.auto import tqdm

        if self.max_seconds:  # a time budget: the bar counts training minutes, not steps
            self.bar = tqdm(total=round(self.max_seconds / 60, 1), initial=round(self.train_seconds / 60, 1),
                            desc="recovery", unit="min", bar_format="{l_bar}{bar}| {n:.1f}/{total} min{postfix}")
        if not self.curve:
            self.measure(model, state.global_step)

    def on_step_begin(self, args, state, control, **kwargs):
        self._since = time.perf_counter()  # training time: not the checkpoints and logs written between steps

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.train_seconds += time.perf_counter() - self._since
        if self.bar:
            self.bar.n = round(min(self.train_seconds, self.max_seconds) / 60, 1)
            self.bar.set_postfix_str(f"step {state.global_step}")
        # Due at the next multiple of eval_seconds after the last measurement (a resumed run may change the interval).
        last_seconds = self.curve[-1]["train_minutes"] * 60
        due = self.train_seconds >= (math.floor(last_seconds / self.eval_seconds) + 1) * self.eval_seconds
        if self.out_of_time or due or state.global_step >= state.max_steps:
            self.measure(model, state.global_step)
        if self.out_of_time:
            control.should_training_stop = True

    def on_save(self, args, state, control, **kwargs):
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and checkpoint.is_dir():
            state_file = checkpoint / MONITOR_STATE
            state_file.write_text(json.dumps({"curve": self.curve, "train_seconds": self.train_seconds}) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar:
            self.bar.close()


def resumed_monitor_state(checkpoint: str | Path, options: RecoveryOptions) -> dict | None:
    """The curve and clock kept in `checkpoint` (None in one written before they were kept); refuses to resume a run
    whose time budget, `--minutes`, is spent already."""
    state_file = Path(checkpoint) / MONITOR_STATE
    if not state_file.is_file():
        return None
    state = json.loads(state_file.read_text())
    spent = state["train_seconds"] / 60
    if options.by_time and spent >= options.minutes:
        raise UserError(f"{checkpoint} is {spent:.3g} minutes into its run's training, and --minutes "
                        f"{options.minutes:g} is the whole run's budget; give a larger --minutes to train on.")
    return state


WARMUP_STEPS = 10


def time_decay_schedule(optimizer, monitor: RecoveryMonitor):
    """Learning rates warmed up over WARMUP_STEPS steps, then decayed linearly to 0 at the end of the monitor's time
    budget, whatever the number of steps that turns out to be."""

    def factor(step: int) -> float:
        warm_up = min(1.0, (step + 1) / WARMUP_STEPS)
        return warm_up * max(0.0, 1.0 - monitor.train_seconds / monitor.max_seconds)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def load_teacher(source: str, dtype=torch.float32):
    """The source LLaMA: a folder, a .gguf file, 'smollm2' or a Hub id (see `diff_llama.resolve.resolve_model`)."""
    from .resolve import load_causal_lm

    return load_causal_lm(source, dtype=dtype)


@torch.no_grad()
def teacher_generated_text(teacher, tokenizer, num_tokens: int, length: int = 256, batch_size: int = 8,
                           seed: int = 0) -> str:
    """Text sampled from the teacher itself (temperature 1), started from its BOS token: the source's own
    distribution, for when no text of the user's is at hand."""
    torch.manual_seed(seed)
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    texts = []
    for _ in range(math.ceil(num_tokens / (length * batch_size))):
        prompt = torch.full((batch_size, 1), start, dtype=torch.long, device=teacher.device)
        out = teacher.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=1.0,
                               top_k=0, top_p=1.0, max_new_tokens=length, min_new_tokens=length,
                               pad_token_id=tokenizer.eos_token_id)
        texts += tokenizer.batch_decode(out[:, 1:], skip_special_tokens=True)
    return "\n\n".join(texts)


def plot_recovery(curve: list[dict], source_perplexity: float, output: str | Path) -> Path:
    """PNG: held-out perplexity (left axis) and mean |λ| (right axis) against training minutes."""
    from .plotting import pyplot, save_png

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    minutes = [r["train_minutes"] for r in curve]
    perplexities = [r["perplexity"] for r in curve]
    ax.plot(minutes, perplexities, marker="o", label="converted DiffLlama")
    ax.axhline(source_perplexity, color="grey", linestyle="--", label="source LLaMA")
    ax.axhline(1.05 * source_perplexity, color="grey", linestyle=":", label="1.05 x source")
    ax.set_ylim(0.99 * min(source_perplexity, *perplexities), 1.01 * max(1.05 * source_perplexity, *perplexities))
    ax.set_xlabel("training minutes (CPU, evaluation excluded)")
    ax.set_ylabel("held-out perplexity")
    right = ax.twinx()
    right.plot(minutes, [r["mean_abs_lambda"] for r in curve], color="tab:red", marker=".", label="mean |λ|")
    right.set_ylabel("mean |λ| over layers", color="tab:red")
    right.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8)
    return save_png(fig, output, rect=(0, 0.06, 1, 1))


@uses_cpu_threads
def recover(model_path: str, options: RecoveryOptions) -> dict:
    """Distil the source LLaMA into the converted model at `model_path`; writes the recovered model (merged, with
    LoRA), its tokenizer, `recovery_report.json`, `recovery_curve.png` and a model card into `options.output`.
    Returns the report.

    `lr_schedule`: "linear" decays every learning rate to 0 over the budget (training time for `minutes`, steps for
    `max_steps`) after 10 warm-up steps, "constant" keeps it. `source` defaults to the one recorded in the model's
    `conversion_report.json`. Training text: `data` (file or folder), else `generate` tokens sampled from the source,
    else the built-in docstring corpus. Held-out perplexity is always measured on the built-in held-out docstrings,
    which no training text here contains.
    """
    from transformers import TrainingArguments

    from .corpus import HELD_OUT_MODULES, TRAINING_MODULES, stdlib_docstrings
    from .evaluation import perplexity
    from .output_folder import give_weights_the_usual_permissions

    from .resolve import ModelNotFoundError, find_model, load_config

    output_dir = Path(options.output)
    # A mistyped MODEL is named as such, not as a model without its source; its weights are read (and checked) later.
    find_model(model_path, tokenizer=True, weights=False, adapters=True)
    if getattr(load_config(model_path), "diff_version", 1) == 2:  # refused before anything heavy loads
        raise UserError(f"{model_path} is a DIFF V2 conversion, which already computes its source exactly: "
                        "distillation has nothing to recover (its gradient is zero). Fine-tune it with "
                        "`diff-llama train`.")
    source = options.source
    if source is None:
        report_path = Path(model_path) / "conversion_report.json"
        if not report_path.exists():
            raise UserError(f"{model_path} has no conversion_report.json naming its source; pass --source.")
        source = json.loads(report_path.read_text())["source"]
    try:
        find_model(source, adapters=True)
    except ModelNotFoundError as error:
        if options.source is not None:
            raise
        raise ModelNotFoundError(f"{str(error).rstrip('.')}; that is the source recorded in {report_path}: pass "
                                 "--source with where it is now.") from None
    checkpoint = resume_checkpoint(output_dir, options.resume, inputs=[model_path, source, options.data])
    monitor_state = None
    if checkpoint is not None:
        check_resumed_run(checkpoint, model_path, options)
        monitor_state = resumed_monitor_state(checkpoint, options)
    documents = read_documents(options.data) if options.data else None  # a wrong path fails before any loading
    tokenizer, student = load_for_training(model_path, options.seed)
    from .resolve import accelerator

    teacher = load_teacher(source).to(accelerator() or "cpu")  # where the Trainer will train: it samples text there
    if teacher.config.vocab_size != student.config.vocab_size:
        raise UserError(f"source vocabulary ({teacher.config.vocab_size}) differs from the model's "
                        f"({student.config.vocab_size}); --source must be the LLaMA this model was converted from.")

    held_out_text = stdlib_docstrings(HELD_OUT_MODULES)
    held_out_ids = tokenizer(held_out_text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    held_out_ids = held_out_ids[: options.eval_tokens]
    if documents is not None:
        text, text_source = joined_text(documents, tokenizer, options.data), str(options.data)
    elif options.generate:
        text, text_source = teacher_generated_text(teacher, tokenizer, options.generate), "generated by the source"
    else:
        text = stdlib_docstrings(TRAINING_MODULES, exclude=held_out_text)
        text_source = "built-in standard-library docstrings"
    dataset = TokenBlocks(tokenizer, text, options.block_size)
    source_perplexity = perplexity(teacher, held_out_ids)

    student = with_lora(student, options)
    learning_rate = options.learning_rate
    if learning_rate is None:
        learning_rate = 1e-4 if options.lora else 1e-5
    by_time = options.by_time
    steps = options.max_steps if not by_time else 10**6  # a time budget ends training through the monitor
    linear = options.lr_schedule == "linear"
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=options.batch_size,
        learning_rate=learning_rate, warmup_steps=WARMUP_STEPS,
        lr_scheduler_type="linear" if linear and not by_time else "constant_with_warmup",
        logging_steps=5, save_steps=options.save_steps, save_total_limit=1, report_to="none", seed=options.seed,
        dataloader_drop_last=True, disable_tqdm=by_time, **compute_arguments(options),
    )
    monitor = RecoveryMonitor(held_out_ids, options.eval_minutes, options.minutes if by_time else None)
    monitor.resume(monitor_state)
    optimizer = optimizer_for(student, learning_rate, options.lambda_learning_rate)
    # A time budget has no known step count: decay by the share of the training time spent (the monitor's clock).
    scheduler = time_decay_schedule(optimizer, monitor) if linear and by_time else None
    trainer = DistillationTrainer(
        model=student, args=args, train_dataset=dataset, teacher=teacher, lambda_floor=options.lambda_floor,
        lambda_floor_ramp_steps=options.lambda_floor_ramp_steps, optimizers=(optimizer, scheduler),
        callbacks=[monitor, TokenizerInCheckpoints(tokenizer),
                   RunRecordInCheckpoints(run_record(model_path, options)), *compute_callbacks(options)],
    )
    trainer.train(resume_from_checkpoint=checkpoint)

    model = save_trained(student, tokenizer, output_dir, merge=options.lora)
    final = monitor.curve[-1]
    lambdas = model.get_lambdas()
    report = {
        **{k: v for k, v in asdict(options).items() if k not in ("output", "source", "data", "generate")},
        "model": str(model_path), "source": source, "text": text_source, "training_tokens": dataset.blocks.numel(),
        "learning_rate": learning_rate, "threads": torch.get_num_threads(), "steps": trainer.state.global_step,
        "eval_tokens": len(held_out_ids), "source_perplexity": source_perplexity,
        "final_perplexity": final["perplexity"], "ratio": final["perplexity"] / source_perplexity,
        "final_mean_abs_lambda": final["mean_abs_lambda"], "lambdas": lambdas.tolist(),
        "min_lambda": lambdas.min().item(), "curve": monitor.curve,
    }
    (output_dir / "recovery_report.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_recovery(monitor.curve, source_perplexity, output_dir / "recovery_curve.png")
    conversion_report = Path(model_path) / "conversion_report.json"
    if conversion_report.exists():  # keeps the model's history together for its card
        shutil.copy(conversion_report, output_dir / "conversion_report.json")
    from .resolve import copy_license_files

    copy_license_files(model_path, output_dir)
    write_model_card(output_dir)
    give_weights_the_usual_permissions(output_dir)
    return report
