"""The recipe's loop: the `transformers.Trainer` on the example stream with the recipe's loss, and the callback that
adds the per-step history, the held-out probes, the second heads' own learning rate, the wall-clock budget and the
state a resumed run needs. `adapt` puts them together."""

from __future__ import annotations

import copy
import functools
import tempfile
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback

from ..errors import UserError
from ..resolve import uses_cpu_threads
from .examples import AdaptationStream, collate_one
from .losses import answer_loss, text_loss
from .plots import write_history
from .probes import pair_divergence, probe
from .rates import (
    SecondHeadRate,
    differential_factor,
    differential_parameters,
    freeze_lower_layers,
    learning_rate_factor,
)
from .resume import resumed_history, write_state
from .settings import AdaptationOptions, autocast_dtype, batch_size, check_options, training_device, world_size


class AdaptationTrainer(Trainer):
    """The Trainer on `AdaptationStream`: in order (step s trains on examples s·B .. s·B + B − 1), with the recipe's
    loss. The Trainer averages the B examples' losses over the step (over accumulation and processes alike); the
    text block, one per step, is scaled by B so that it keeps the weight 1 it has in a step of one example."""

    def __init__(self, *args, batch_size: int, reference=None, kl_weight: float = 0.0, autocast=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.batch_size, self.reference, self.kl_weight, self.autocast = batch_size, reference, kl_weight, autocast
        self.records = []  # (index, tokens, answer loss, text loss or nan) of this process's items in this step

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # The Trainer reads the checkpoint's tensors by name, but `save_pretrained` writes some under other names
        # (a DiffLlama's λ under the built-in model's): the Trainer would leave those at their starting values.
        # `from_pretrained` maps every name back.
        model = self.model if model is None else model
        saved = type(model).from_pretrained(resume_from_checkpoint, dtype=model.dtype)
        model.load_state_dict(saved.state_dict())

    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids = inputs["input_ids"]
        loss = answer = answer_loss(model, ids, int(inputs["answer_tokens"]))
        text = torch.full_like(answer, float("nan"))
        if "text_ids" in inputs:
            # Only one process's example carries the step's text block: under DDP a second forward through the
            # wrapper would start collectives (its buffer broadcast) the other processes never join. Through the
            # module itself it starts none, and the backward still averages every gradient across the processes.
            module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
            text = text_loss(module, inputs["text_ids"], self.reference, self.kl_weight, self.autocast)
            loss = answer + self.batch_size * text
        values = [inputs["index"][0], torch.tensor(ids.shape[1]), answer.detach(), text.detach()]
        self.records.append(torch.stack([value.to(answer.device, torch.float64) for value in values]))
        return loss


class AdaptationMonitor(TrainerCallback):
    """What the recipe adds to the Trainer's loop: the per-step history, the held-out probes, the second heads' own
    learning rate, the wall-clock budget, and the state a resumed run needs (in every checkpoint)."""

    def __init__(self, trainer: AdaptationTrainer, tokenizer, options: AdaptationOptions, history: dict,
                 output: Path | None, probe_dtype):
        self.trainer, self.tokenizer, self.options, self.history = trainer, tokenizer, options, history
        self.output, self.probe_dtype = output, probe_dtype
        self.seconds = history.get("train_minutes", 0.0) * 60  # a resumed run goes on counting
        self.second_heads = None
        self.factor = 1.0
        self.out_of_budget = False
        self._since = None

    def record_probe(self, model, step: int):
        self.history["probes"].append({"step": step, "train_minutes": self.seconds / 60,
                                       "pair_divergence": pair_divergence(model),
                                       **probe(model, self.tokenizer, self.options,
                                               f"{self.history['name']} @ {step}", self.probe_dtype)})
        if self.output is not None and self.trainer.is_world_process_zero():
            write_history(self.history, self.output)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.second_heads = SecondHeadRate(model, 1.0)  # after the Trainer moved the model to its device
        if not self.history["probes"]:
            # Every process probes (each holds the whole model under DDP), so none waits long at the next step.
            self.record_probe(model, 0)
        self._since = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        options, step = self.options, state.global_step
        self.factor, own_factor = learning_rate_factor(step, options), differential_factor(step, options)
        # the second heads share q_proj with the first: their update is the shared one, rescaled to their own rate
        self.second_heads.factor = options.differential_learning_rate / options.learning_rate * (own_factor / self.factor)
        self.second_heads.before_step()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.second_heads.after_step()

    def _elapsed(self, device) -> float:
        """Seconds since the last mark, the longest over the processes: every process stops at the same step."""
        seconds = time.perf_counter() - self._since
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            value = torch.tensor([seconds], dtype=torch.float64, device=device)
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
            seconds = value.item()
        return seconds

    def on_step_end(self, args, state, control, model=None, **kwargs):
        trainer, options = self.trainer, self.options
        # One row per example of the step, from every process (reading them waits for the device, so the clock
        # below counts the step's work, not just its launch).
        rows = trainer.accelerator.gather(torch.stack(trainer.records).to(args.device)).double().cpu()
        trainer.records.clear()
        self.seconds += self._elapsed(args.device)
        texts = rows[:, 3][~rows[:, 3].isnan()]
        entry = {"step": state.global_step, "examples": sorted(int(i) for i in rows[:, 0]),
                 "tokens": int(rows[:, 1].sum()), "answer_loss": rows[:, 2].mean().item()}
        if len(texts):
            entry["text_loss"] = texts.sum().item()
        entry["train_minutes"] = self.seconds / 60
        self.history["steps"].append(entry)
        self.out_of_budget = state.global_step < options.max_steps and self.seconds >= options.max_seconds
        done = state.global_step >= options.max_steps or self.out_of_budget
        if done or (options.eval_every and state.global_step % options.eval_every == 0):
            self.record_probe(model, state.global_step)
        if self.out_of_budget:
            control.should_training_stop = True
        self._since = time.perf_counter()

    def on_save(self, args, state, control, **kwargs):
        # The history so far and the clock, beside the Trainer's own state: a resumed run continues both.
        if self.trainer.is_world_process_zero():
            self.history["train_minutes"] = self.seconds / 60
            write_state(self.history, Path(args.output_dir) / f"checkpoint-{state.global_step}")
        self._since = time.perf_counter()  # the time spent saving is not training time


@uses_cpu_threads
def adapt(model, tokenizer, options: AdaptationOptions, output: str | Path | None = None, name: str = "model") -> dict:
    """Train `model` in place with the recipe (see `diff_llama.adaptation`); returns the history (and writes
    adapt.json/png to `output`, and checkpoints every `save_steps` steps, from which `options.resume` continues)."""
    from transformers import TrainingArguments

    from ..training import TokenizerInCheckpoints, optimizer_for, resume_checkpoint

    check_options(options)
    if options.resume and output is None:
        raise UserError("resume needs the output folder that holds the run's checkpoint-N folders")
    checkpoint = resume_checkpoint(output, True) if options.resume else None
    device = training_device(options)
    dtype = autocast_dtype(options, device)
    size = batch_size(options)
    torch.manual_seed(options.seed)
    stream = AdaptationStream(tokenizer, options, size)
    reference = None
    if options.kl_weight > 0:
        reference = copy.deepcopy(model).eval().requires_grad_(False).to(device)
    model.train()
    frozen = freeze_lower_layers(model, options.frozen_layers)
    differential = differential_parameters(model)
    # torch keeps extra keys in a param group: "differential" marks the group on the differential schedule
    extra_groups = [{"params": differential, "lr": options.differential_learning_rate, "weight_decay": 0.0,
                     "differential": True}]
    optimizer = optimizer_for(model, options.learning_rate, options.lambda_learning_rate,
                              extra_groups=extra_groups if differential else [])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, [
        functools.partial(differential_factor if group.get("differential") else learning_rate_factor,
                          options=options) for group in optimizer.param_groups])
    # The dtype `auto` became on this device, next to the options as given.
    history = {"name": name, "options": asdict(options), "autocast_dtype": str(dtype or torch.float32),
               "device": device.type, "processes": world_size(), "batch_size": size, "steps": [], "probes": []}
    if checkpoint is not None:
        history = {**resumed_history(checkpoint, options), "device": device.type, "processes": world_size()}
    scratch = tempfile.TemporaryDirectory() if output is None else None  # the Trainer wants a folder
    args = TrainingArguments(
        output_dir=str(output) if output is not None else scratch.name, max_steps=options.max_steps,
        per_device_train_batch_size=1, gradient_accumulation_steps=size // world_size(),
        max_grad_norm=1.0, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        save_strategy="steps" if options.save_steps else "no", save_steps=options.save_steps or 500,
        save_total_limit=1, logging_strategy="no", report_to="none", seed=options.seed,
        remove_unused_columns=False, dataloader_drop_last=False, disable_tqdm=False,
        # Without an accelerator, several processes still train as one data-parallel job (over gloo).
        use_cpu=device.type == "cpu",
    )
    autocast = functools.partial(torch.autocast, device.type, dtype=dtype or torch.float32, enabled=dtype is not None)
    trainer = AdaptationTrainer(model=model, args=args, train_dataset=stream, data_collator=collate_one,
                                optimizers=(optimizer, schedule), batch_size=size, reference=reference,
                                kl_weight=options.kl_weight, autocast=autocast)
    monitor = AdaptationMonitor(trainer, tokenizer, options, history, None if output is None else Path(output), dtype)
    trainer.add_callback(monitor)
    trainer.add_callback(TokenizerInCheckpoints(tokenizer))
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
    finally:  # frozen for this training only, also when it stops with an error
        # accelerate wraps the forward in autocast for mixed precision: give the model its own forward back
        trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)
        model.eval()
        for param in frozen:
            param.requires_grad_(True)
        if scratch is not None:
            scratch.cleanup()
    history["train_minutes"] = monitor.seconds / 60
    history["stopped_by_budget"] = monitor.out_of_budget
    if monitor.out_of_budget:  # the schedule decays to 0 at max_steps: stopped early, training ended at a high rate
        steps = len(history["steps"])
        warnings.warn(
            f"{name}: the time budget ({options.max_seconds:g} seconds of training) ran out after {steps} of "
            f"{options.max_steps} steps, with the learning rate at {monitor.factor:.0%} of its peak (it decays to 0 "
            f"at max_steps). For a complete schedule, set max_steps to what fits the budget, about {steps} here.",
            stacklevel=2)
    if output is not None and trainer.is_world_process_zero():
        write_history(history, output)
    return history
