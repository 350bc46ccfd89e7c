"""`diff-llama adapt`: train a model to retrieve from long contexts, the job differential attention is for.

Distilling the source copies its attention noise along with everything else, and a lossless DIFF V2 conversion
distilled from its source gets no gradient at all. This recipe trains on the task instead, and works the same for any
causal LM, so a converted model and its source LLaMA can be trained identically and compared (`bench/adaptation.py`):

- Retrieval examples (every step): multi-needle prompts built like the evaluation's (`retrieval.make_case`), but with
  `retrieval.TRAINING_CITIES`, filler cut from the training docstrings instead of the evaluation's generated
  sentences, random lengths, needle counts and depths, and fresh random numbers. The loss is the cross-entropy of the
  answer ("1234567" or "1234567, 7654321", then the end-of-turn token) only, so the lm head is applied to those few
  positions alone (`logits_to_keep`).
- Language modelling on text (every `text_every` steps): a block of the training docstrings, the full next-token
  loss, which keeps held-out perplexity near the source's. Optionally (`kl_weight`) a KL term to the model as it was
  before training on the same block.
- AdamW (`training.optimizer_for`), linear warm-up then linear decay over `max_steps`, float32 master weights, bfloat16
  autocast where the training device computes bf16 in hardware (faster than float32 there; emulated elsewhere, and far
  slower: `precision`).
- What a DIFF V2 conversion adds to its source, its λ projection and the second (negative) query head of each pair,
  trains at `differential_learning_rate` (warmed up over `differential_warmup_steps` if set); everything the two
  models share trains at `learning_rate`. A lossless conversion starts with both heads of a pair equal and λ = 0.5:
  at the base rate they barely part within a run and the model stays its source. The source has no such
  parameters, so the comparison stays like for like.

`frozen_layers` keeps the embeddings and the lower decoder layers fixed, so that no backward pass runs below the first
trained layer: more steps within a budget, at the price of what those layers could learn.

The loop is the `transformers.Trainer`'s, so `adapt` trains wherever the Trainer does: on the CPU, on one accelerator,
or data-parallel under `accelerate launch` (DDP). The examples form one global stream indexed by position: step s
trains on examples s·B .. s·B + B − 1 (B = `batch_size`), each process taking its share of them, so the same seed
trains on the same examples whatever the device and the number of processes. The probes, the second heads' learning
rate and the time budget are Trainer callbacks; checkpoints (`save_steps`) and `resume` are the Trainer's, and a
resumed run goes on from the first example it had not trained on.

The training budget is counted in wall-clock seconds of the training steps alone (probes and checkpoints excluded).
Every `eval_every` steps a small held-out probe (evaluation cities and filler, another seed than `diff-llama
evaluate`'s default cases) records retrieval accuracy, attention to the answer and to noise, and held-out perplexity:
the curve against training minutes lands in adapt.json and adapt.png.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import random
import re
import tempfile
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback

from .errors import InputNotFoundError, UserError
from .options import AdaptationOptions, RetrievalArguments
from .precision import resolve_dtype
from .retrieval import TRAINING_CITIES, make_case


# ---------------------------------------------------------------------------------------------------------------
# Data


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@functools.lru_cache(maxsize=1)
def training_text() -> str:
    """The training docstrings, held-out text excluded: the retrieval filler and the language-modelling blocks."""
    from .corpus import HELD_OUT_MODULES, TRAINING_MODULES, stdlib_docstrings

    return stdlib_docstrings(TRAINING_MODULES, exclude=stdlib_docstrings(HELD_OUT_MODULES))


def training_sentences() -> list[str]:
    """Sentences of the training docstrings, without digits (they would compete with the needles' numbers): the
    retrieval examples' filler. The evaluation's filler is generated from a grammar and shares none of them."""
    sentences = []
    for paragraph in training_text().split("\n\n"):
        for sentence in _SENTENCE_END.split(" ".join(paragraph.split())):
            if 20 <= len(sentence) <= 300 and not re.search(r"\d", sentence) and sentence[-1] in ".!?":
                sentences.append(sentence)
    return sentences


class RetrievalExamples:
    """An endless, seeded stream of training examples: (input_ids, number of answer tokens at the end), read in order
    (`next()`) or by position (`examples[i]`, the same example as the i-th `next()`).

    Each example's random choices are drawn in sequence from one generator, as they always were (so a seed gives the
    stream it gave before); reaching example i replays the cheap draws of the examples before it, never their text."""

    def __init__(self, tokenizer, options: AdaptationOptions):
        self.tokenizer, self.options = tokenizer, options
        self.sentences = training_sentences()
        self.rng = random.Random(f"adapt-{options.seed}")
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self._draws, self._next = [], 0

    def _filler(self, count: int, seed: str) -> list[str]:
        rng = random.Random(f"filler-{seed}")
        start = rng.randrange(len(self.sentences))
        return [self.sentences[(start + i) % len(self.sentences)] for i in range(count)]

    def answer_ids(self, numbers) -> list[int]:
        text = ", ".join(str(n) for n in numbers)
        if self.chat:  # the end-of-turn token closes the assistant message, as in the template
            return self.tokenizer(text + self.tokenizer.eos_token, add_special_tokens=False).input_ids
        return self.tokenizer(" " + text, add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id]

    def _draw(self) -> tuple:
        o, rng = self.options, self.rng
        needles = rng.randint(1, o.max_needles)
        queries = rng.randint(1, min(o.max_queries, needles))
        length = rng.randint(o.min_length, o.max_length)
        if o.long_length and rng.random() < o.long_fraction:  # no extra draw without long examples: same stream
            length = rng.randint(o.max_length + 1, o.long_length)
        depth = rng.random()
        return length, depth, needles, queries, f"adapt-{o.seed}-{rng.random()}"

    def __getitem__(self, index: int) -> tuple[list[int], int]:
        while len(self._draws) <= index:
            self._draws.append(self._draw())
        length, depth, needles, queries, seed = self._draws[index]
        case = make_case(self.tokenizer, length, depth, needles, queries, seed=seed, city_pool=TRAINING_CITIES,
                         filler=self._filler)
        answer = self.answer_ids(case.query_numbers)
        return case.input_ids + answer, len(answer)

    def next(self) -> tuple[list[int], int]:
        self._next += 1
        return self[self._next - 1]


class TextBlocks:
    """Blocks of `block` tokens of the training docstrings (held-out text excluded), reshuffled every pass: block k
    of the endless sequence is `blocks[k]`."""

    def __init__(self, tokenizer, block: int, seed: int):
        from .training import TokenBlocks

        self.blocks = TokenBlocks(tokenizer, training_text(), block_size=block).blocks
        self.rng = torch.Generator().manual_seed(seed)
        self.orders = []  # one permutation per pass, drawn in sequence from `rng`

    def __getitem__(self, index: int) -> torch.Tensor:
        rounds, position = divmod(index, len(self.blocks))
        while len(self.orders) <= rounds:
            self.orders.append(torch.randperm(len(self.blocks), generator=self.rng))
        return self.blocks[self.orders[rounds][position]]


def text_blocks(tokenizer, block: int, seed: int):
    """Endless shuffled blocks of `block` tokens of the training docstrings (held-out text excluded)."""
    blocks = TextBlocks(tokenizer, block, seed)
    index = 0
    while True:
        yield blocks[index]
        index += 1


class AdaptationStream(torch.utils.data.Dataset):
    """The run's examples by position: item i is retrieval example i of step i // batch_size; the first item of every
    `text_every`-th step also carries the next language-modelling block. A sequential sampler (and accelerate's
    sharding of it across processes) hands each step's items out without building the ones a resumed run skips."""

    def __init__(self, tokenizer, options: AdaptationOptions, batch_size: int):
        self.options, self.batch_size = options, batch_size
        self.examples = RetrievalExamples(tokenizer, options)
        self.text = TextBlocks(tokenizer, options.text_block, options.seed) if options.text_every else None

    def __len__(self):
        return self.options.max_steps * self.batch_size

    def __getitem__(self, index: int) -> dict:
        step, slot = divmod(index, self.batch_size)
        input_ids, answer_tokens = self.examples[index]
        item = {"index": torch.tensor(index), "input_ids": torch.tensor(input_ids),
                "answer_tokens": torch.tensor(answer_tokens)}
        if self.text is not None and slot == 0 and step % self.options.text_every == 0:
            item["text_ids"] = self.text[step // self.options.text_every]
        return item


def collate_one(items: list[dict]) -> dict:
    """Examples differ in length: each micro-batch is one example, as a batch of one (no padding)."""
    (item,) = items
    return {key: value[None] for key, value in item.items()}


# ---------------------------------------------------------------------------------------------------------------
# Training


def _at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits make a coarse loss


def answer_loss(model, input_ids: list[int] | torch.Tensor, answer_tokens: int) -> torch.Tensor:
    """Cross-entropy of the last `answer_tokens` tokens given everything before them; the lm head only sees the
    positions that predict them. `input_ids`: a list, or a (1, length) tensor already on the model's device (a
    DDP-wrapped model has no `device`)."""
    ids = input_ids if torch.is_tensor(input_ids) else torch.tensor([input_ids], device=model.device)
    logits = _at_least_float32(model(input_ids=ids, logits_to_keep=answer_tokens + 1).logits[0, :-1])
    return torch.nn.functional.cross_entropy(logits, ids[0, -answer_tokens:])


def text_loss(model, block: torch.Tensor, reference=None, kl_weight: float = 0.0, autocast=None) -> torch.Tensor:
    """Next-token loss on a block (1-d, or (1, length) already on the device), plus `kl_weight` x KL to `reference`
    (run under `autocast`, a context manager factory: autocast of the trained model is the Trainer's, not the
    reference's)."""
    ids = block if block.dim() == 2 else block[None].to(model.device)
    logits = _at_least_float32(model(input_ids=ids).logits[0, :-1])
    loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    if reference is not None and kl_weight > 0:
        import contextlib

        with torch.no_grad(), (autocast or contextlib.nullcontext)():
            target = reference(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
        loss = loss + kl_weight * torch.nn.functional.kl_div(logits.log_softmax(-1), target, log_target=True,
                                                             reduction="batchmean")
    return loss


class SecondHeadRate:
    """Gives the second query head of every DIFF V2 pair `factor` times the update AdamW makes to it.

    Those heads are rows of `q_proj.weight`, one tensor with the first heads, so no param group can hold them
    alone; AdamW's update is elementwise, so scaling it after the step is the same as a learning rate of their own.
    """

    def __init__(self, model, factor: float):
        from .modeling_diff_llama import DiffLlamaV2Attention

        self.factor = factor
        self.rows = []  # (weight, index of its second-head rows)
        for module in model.modules():
            if isinstance(module, DiffLlamaV2Attention) and module.q_proj.weight.requires_grad:
                weight, d = module.q_proj.weight, module.head_dim
                heads = torch.arange(1, weight.shape[0] // d, 2, device=weight.device)
                self.rows.append((weight, (heads[:, None] * d + torch.arange(d, device=weight.device)).flatten()))
        self._before = []

    def before_step(self):
        if self.factor != 1:
            self._before = [weight.detach()[rows].clone() for weight, rows in self.rows]

    def after_step(self):
        with torch.no_grad():
            for (weight, rows), before in zip(self.rows, self._before):
                weight[rows] = before + self.factor * (weight[rows] - before)
        self._before = []


def freeze_lower_layers(model, count: int) -> list[torch.nn.Parameter]:
    """Stop training the input embeddings and the first `count` decoder layers; returns the parameters it froze (to
    unfreeze after training). Nothing below the first trained layer then needs a gradient, so autograd runs no
    backward pass there."""
    if count == 0:
        return []
    layers = model.get_decoder().layers
    if not 0 < count < len(layers):
        raise UserError(f"frozen_layers must be between 0 and {len(layers) - 1} (this model has {len(layers)} decoder "
                        f"layers), got {count}; set 0 to train every layer")
    modules = [model.get_input_embeddings(), *layers[:count]]
    frozen = [param for module in modules for param in module.parameters() if param.requires_grad]
    for param in frozen:
        param.requires_grad_(False)
    return frozen


def differential_parameters(model) -> list[torch.nn.Parameter]:
    """DIFF V2's λ projections: parameters a conversion adds and its source lacks."""
    return [param for name, param in model.named_parameters() if param.requires_grad and "lambda_proj" in name]


def pair_divergence(model) -> float | None:
    """Mean over DIFF V2 layers of ‖W_second − W_first‖ / ‖W_first‖ over the query heads of every pair: 0 right after
    a lossless conversion, the model then computes its source; None for other models."""
    from .modeling_diff_llama import DiffLlamaV2Attention

    values = []
    for module in model.modules():
        if isinstance(module, DiffLlamaV2Attention):
            heads = module.q_proj.weight.detach().float().view(-1, 2, module.head_dim, module.q_proj.in_features)
            values.append(((heads[:, 1] - heads[:, 0]).norm() / heads[:, 0].norm()).item())
    return sum(values) / len(values) if values else None


def learning_rate_factor(step: int, options: AdaptationOptions, warmup_steps: int | None = None) -> float:
    """Linear warm-up over `warmup_steps` (default: `options.warmup_steps`), then linear decay to 0 at `max_steps`."""
    warmup = options.warmup_steps if warmup_steps is None else warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (options.max_steps - step) / max(1, options.max_steps - warmup))


def differential_factor(step: int, options: AdaptationOptions) -> float:
    """The schedule of what a DIFF V2 conversion adds: its own warm-up, the same decay to 0 at `max_steps`."""
    return learning_rate_factor(step, options, options.differential_warmup_steps)


def probe_options(options: AdaptationOptions) -> RetrievalArguments:
    """The held-out probe: the evaluation's cities and filler, seed 1 (`diff-llama evaluate` defaults to seed 0)."""
    return RetrievalArguments(lengths=list(options.eval_lengths), settings=list(options.eval_settings),
                              cases_per_depth=options.eval_cases, seed=1, perplexity_tokens=2048, threads=0)


def probe(model, tokenizer, options: AdaptationOptions, name: str, dtype: torch.dtype | None = None) -> dict:
    """The held-out probe of `model` where it is, with its weights in `dtype` (None: as they are)."""
    from .retrieval import evaluate_model

    # A copy in the autocast dtype rather than autocast itself: autocast would re-cast every weight at every decoding
    # step, where the copy casts them once; and `diff-llama evaluate --dtype bfloat16` evaluates exactly this way.
    copy_ = model if dtype is None else copy.deepcopy(model).to(dtype)
    copy_.eval()
    report = evaluate_model(copy_, tokenizer, probe_options(options), name=name)
    model.train()
    summary, allocation = report["summary"], report["summary"]["allocation"] or {}
    return {"accuracy": summary["accuracy"], "accuracy_by_cell": summary["accuracy_by_cell"],
            "answer_share": allocation.get("answer_share"), "noise_share": allocation.get("noise_share"),
            "perplexity": report["perplexity"], "probe_seconds": report["seconds"]}


def training_device(options: AdaptationOptions) -> torch.device:
    """Where the Trainer will train: the CPU when asked or when there is no accelerator, else this process's
    accelerator (under `accelerate launch`, the one of its local rank)."""
    if options.device == "cpu" or not torch.accelerator.is_available():
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    return torch.device(accelerator.type, int(os.environ.get("LOCAL_RANK", 0)))


def _autocast_dtype(options: AdaptationOptions, device: str | torch.device = "cpu"):
    """The autocast dtype on `device` (None: no autocast): `auto` is bfloat16 only where that device computes it in
    hardware (`precision.fastest_dtype`)."""
    dtype = resolve_dtype(options.autocast, device)
    return None if dtype == torch.float32 else dtype


def budget_seconds(options: AdaptationOptions) -> float:
    """The time budget in seconds; `max_cpu_minutes`, the budget's former name and unit, still sets it."""
    return options.max_seconds if options.max_cpu_minutes is None else options.max_cpu_minutes * 60


def world_size() -> int:
    """Processes in this launch (`accelerate launch`, torchrun set WORLD_SIZE; 1 otherwise)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def batch_size(options: AdaptationOptions) -> int:
    size = world_size() if options.batch_size is None else options.batch_size
    if size < 1 or size % world_size():
        raise UserError(f"batch_size ({size}) must be a positive multiple of the number of processes "
                        f"({world_size()}): each process trains on an equal share of every step's examples; set "
                        f"--batch-size to a multiple of {world_size()}")
    return size


def check_options(options: AdaptationOptions) -> None:
    """Raise ValueError, naming the values and the fix, for options `adapt` cannot train with (checked before a model
    is loaded)."""
    if options.max_steps < 1 or options.min_length > options.max_length:
        raise UserError("need max_steps >= 1 and min_length <= max_length")
    if options.long_length and (options.long_length <= options.max_length or not 0 < options.long_fraction <= 1):
        raise UserError(f"long examples need long_length > max_length and 0 < long_fraction <= 1 (got long_length "
                        f"{options.long_length}, max_length {options.max_length}, long_fraction "
                        f"{options.long_fraction}); set long_length 0 to train without them")
    own_warmup = options.differential_warmup_steps
    if own_warmup is not None and not 0 <= own_warmup <= options.max_steps:
        raise UserError(f"differential_warmup_steps must be between 0 and max_steps ({options.max_steps}), got "
                        f"{own_warmup}; leave it unset to share warmup_steps")
    if options.frozen_layers < 0:
        raise UserError(f"frozen_layers must be 0 or more, got {options.frozen_layers}; set 0 to train every layer")
    if options.learning_rate <= 0 or options.differential_learning_rate < 0:
        raise UserError(f"need learning_rate > 0 and differential_learning_rate >= 0 (got {options.learning_rate} "
                        f"and {options.differential_learning_rate}): the second query heads live in q_proj with the "
                        "first, so their rate is applied as a multiple of learning_rate, which must be positive; set "
                        "--learning-rate above 0 and --differential-learning-rate to 0 or more")
    if not budget_seconds(options) > 0 or options.save_steps < 0:
        raise UserError(f"need max_seconds > 0 and save_steps >= 0 (got {budget_seconds(options)} and "
                        f"{options.save_steps})")
    batch_size(options)
    _autocast_dtype(options)  # an unknown dtype


# Options a resumed run may change: they do not change what it trains on or how.
RESUMABLE_CHANGES = {"max_seconds", "max_cpu_minutes", "resume", "save_steps", "threads", "device", "save",
                     "eval_every"}


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
        self.out_of_budget = state.global_step < options.max_steps and self.seconds >= budget_seconds(options)
        done = state.global_step >= options.max_steps or self.out_of_budget
        if done or (options.eval_every and state.global_step % options.eval_every == 0):
            self.record_probe(model, state.global_step)
        if self.out_of_budget:
            control.should_training_stop = True
        self._since = time.perf_counter()

    def on_save(self, args, state, control, **kwargs):
        # The history so far and the clock, beside the Trainer's own state: a resumed run continues both.
        if self.trainer.is_world_process_zero():
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            self.history["train_minutes"] = self.seconds / 60
            (folder / ADAPT_STATE).write_text(json.dumps(self.history))
        self._since = time.perf_counter()  # the time spent saving is not training time


ADAPT_STATE = "adapt_state.json"


def resumed_history(checkpoint: str, options: AdaptationOptions) -> dict:
    """The history a checkpoint holds; refuses options that would change what the resumed run trains on."""
    history = json.loads((Path(checkpoint) / ADAPT_STATE).read_text())
    before, now = history["options"], asdict(options)
    differ = {key: (before.get(key), value) for key, value in now.items()
              if key not in RESUMABLE_CHANGES and before.get(key) != value}
    if differ:
        found = ", ".join(f"{key} {old!r}, not {new!r}" for key, (old, new) in differ.items())
        raise UserError(f"--resume: {checkpoint} was trained with other options ({found}); pass the same options "
                        "(only the budget, the checkpoint and probe intervals, threads and device may change)")
    history["options"] = now
    return history


def adapt(model, tokenizer, options: AdaptationOptions, output: str | Path | None = None, name: str = "model") -> dict:
    """Train `model` in place with the recipe above; returns the history (and writes adapt.json/png to `output`, and
    checkpoints every `save_steps` steps, from which `options.resume` continues)."""
    from transformers import TrainingArguments

    from .training import optimizer_for, resume_checkpoint

    if options.threads > 0:
        torch.set_num_threads(options.threads)
    if options.max_cpu_minutes is not None:
        warnings.warn(f"max_cpu_minutes is deprecated: the budget is now wall-clock time, max_seconds; "
                      f"max_cpu_minutes {options.max_cpu_minutes:g} sets it to {budget_seconds(options):g} seconds",
                      FutureWarning, stacklevel=2)
    check_options(options)
    if options.resume and output is None:
        raise UserError("resume needs the output folder that holds the run's checkpoint-N folders")
    checkpoint = resume_checkpoint(output, True) if options.resume else None
    device = training_device(options)
    dtype = _autocast_dtype(options, device)
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
            f"{name}: the time budget ({budget_seconds(options):g} seconds of training) ran out after {steps} of "
            f"{options.max_steps} steps, with the learning rate at {monitor.factor:.0%} of its peak (it decays to 0 "
            f"at max_steps). For a complete schedule, set max_steps to what fits the budget, about {steps} here.",
            stacklevel=2)
    if output is not None and trainer.is_world_process_zero():
        write_history(history, output)
    return history


# ---------------------------------------------------------------------------------------------------------------
# Output


def write_history(history: dict, output: str | Path) -> None:
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "adapt.json").write_text(json.dumps(history, indent=1))
    plot_curves([history], output / "adapt.png")


def _smooth(values, window: int = 20):
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _minutes(entry: dict) -> float:
    return entry["train_minutes"] if "train_minutes" in entry else entry["cpu_minutes"]


def plot_curves(histories: list[dict], output: str | Path) -> Path:
    """PNG: probe retrieval accuracy, attention shares and perplexity, and the answer loss, against training
    minutes (CPU-minutes in histories written before the budget was wall-clock time)."""
    from .plotting import pyplot, save_png

    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for index, history in enumerate(histories):
        color, name = f"C{index}", history["name"]
        probes = history["probes"]
        minutes = [_minutes(p) for p in probes]
        axes[0].plot(minutes, [p["accuracy"] for p in probes], "o-", color=color, label=name)
        axes[1].plot(minutes, [p["answer_share"] for p in probes], "o-", color=color, label=f"{name}: answer")
        axes[1].plot(minutes, [p["noise_share"] for p in probes], "s--", color=color, label=f"{name}: noise")
        axes[2].plot(minutes, [p["perplexity"] for p in probes], "o-", color=color, label=name)
        steps = history["steps"]
        if steps:
            axes[3].plot([_minutes(s) for s in steps], _smooth([s["answer_loss"] for s in steps]), color=color,
                         label=name)
    axes[0].set(xlabel="training minutes", ylabel="accuracy", title="held-out retrieval (probe)",
                ylim=(-0.05, 1.05))
    axes[1].set(xlabel="training minutes", ylabel="share of attention", title="attention: answer vs noise")
    axes[2].set(xlabel="training minutes", ylabel="perplexity", title="held-out perplexity")
    axes[3].set(xlabel="training minutes", ylabel="cross-entropy (20-step mean)", title="answer loss (training)")
    axes[3].set_yscale("log")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # the first probe is written before any training step
            ax.legend(fontsize=7)
    return save_png(fig, output)


def release_gguf_quantizer(model) -> None:
    """A model loaded from a GGUF file keeps transformers' GGUF quantizer, which refuses `save_pretrained`, even when
    its weights were dequantized into ordinary tensors at load time (as they must be, to train them). Those weights
    save like any others: drop the quantizer then. Packed GGUF layers are left alone (and saving stays refused)."""
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if quantizer is None or getattr(method, "value", method) != "gguf":
        return
    if not any(type(module).__name__.startswith("Gguf") for module in model.modules()):
        quantizer.remove_quantization_config(model)


def check_adapt_output(output: Path, options: AdaptationOptions, overwrite: bool = False) -> None:
    """OUTPUT must be new or empty; or hold a run's checkpoints, with `resume`; or, with `overwrite`, be a folder of
    an earlier run that holds nothing else. Each refusal names the fix that works for the folder as it is."""
    from .output_folder import check_new_output, replace_refusal

    if options.resume and overwrite:
        raise UserError("give --resume (continue the run in OUTPUT) or --overwrite (start it over), not both.")
    checkpoints = output.is_dir() and any(output.glob("checkpoint-*"))
    if options.resume and not checkpoints:
        replaceable = output.is_dir() and replace_refusal(output) is None
        start_over = ", or pass --overwrite to start over" if replaceable else ""
        raise InputNotFoundError(f"--resume: {output} holds no checkpoint-N folder to continue from (the run finished, "
                                 f"or saved none: --save-steps); choose a new folder{start_over}.")
    if not options.resume:
        check_new_output(output, "pass --resume to continue the run it holds, or choose a new folder" if checkpoints
                         else "choose a new folder", overwrite)


def run_adapt(model_name: str, output: str, options: AdaptationOptions, name: str | None = None,
              overwrite: bool = False) -> int:
    """`diff-llama adapt MODEL OUTPUT [options]` (declared in `diff_llama_cli`). Under `accelerate launch` every
    process trains; the main one checks and writes OUTPUT. With `overwrite`, the earlier run in OUTPUT is removed
    once the model has loaded (the new one writes its checkpoints there, for --resume)."""
    from .output_folder import clear_output, write_marker
    from .resolve import load_model, save_tokenizer
    from .retrieval import display_name

    output = Path(output)
    main_process = int(os.environ.get("RANK", "0")) == 0
    if main_process:
        check_adapt_output(output, options, overwrite)
    check_options(options)
    model, tokenizer = load_model(model_name)
    release_gguf_quantizer(model)
    name = name or display_name(model_name)
    if main_process and not options.resume:
        if overwrite and output.is_dir():
            clear_output(output)
        output.mkdir(parents=True, exist_ok=True)
        write_marker(output, "adapt")  # a later --overwrite may replace the folder
    history = adapt(model, tokenizer, options, output, name=name)
    if not main_process:
        return 0
    if options.save:
        # Written to a temporary folder first, then moved: a crash never leaves a half-saved model behind.
        partial = output / ".partial"
        model.save_pretrained(partial)
        save_tokenizer(tokenizer, partial)
        for path in partial.iterdir():
            path.replace(output / path.name)
        partial.rmdir()
    first, last, steps = history["probes"][0], history["probes"][-1], len(history["steps"])
    print(f"{name}: {steps} step{'' if steps == 1 else 's'} in {history['train_minutes']:.1f} training minutes; probe "
          f"accuracy {first['accuracy']:.0%} -> {last['accuracy']:.0%}, perplexity {first['perplexity']:.2f} -> "
          f"{last['perplexity']:.2f}")
    print(f"Wrote {output}")
    return 0
