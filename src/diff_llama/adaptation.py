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
  autocast where the CPU has bf16 units (faster than float32 there; emulated elsewhere, and far slower: `precision`).
- What a DIFF V2 conversion adds to its source, its λ projection and the second (negative) query head of each pair,
  trains at `differential_learning_rate` (warmed up over `differential_warmup_steps` if set); everything the two
  models share trains at `learning_rate`. A lossless conversion starts with both heads of a pair equal and λ = 0.5:
  at the base rate they barely part within a run and the model stays its source. The source has no such
  parameters, so the comparison stays like for like.

`frozen_layers` keeps the embeddings and the lower decoder layers fixed, so that no backward pass runs below the first
trained layer: more steps within a CPU budget, at the price of what those layers could learn.

The training budget is counted in CPU seconds of the training steps alone (evaluations excluded), so models trained
side by side on a shared machine get comparable figures. Every `eval_every` steps a small held-out probe (evaluation
cities and filler, another seed than `diff-llama evaluate`'s default cases) records retrieval accuracy, attention to the
answer and to noise, and held-out perplexity: the curve against CPU-minutes lands in adapt.json and adapt.png.
"""

from __future__ import annotations

import copy
import functools
import json
import random
import re
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from diff_llama_cli.options import AdaptationOptions, RetrievalArguments

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
    """An endless, seeded stream of training examples: (input_ids, number of answer tokens at the end)."""

    def __init__(self, tokenizer, options: AdaptationOptions):
        self.tokenizer, self.options = tokenizer, options
        self.sentences = training_sentences()
        self.rng = random.Random(f"adapt-{options.seed}")
        self.chat = bool(getattr(tokenizer, "chat_template", None))

    def _filler(self, count: int, seed: str) -> list[str]:
        rng = random.Random(f"filler-{seed}")
        start = rng.randrange(len(self.sentences))
        return [self.sentences[(start + i) % len(self.sentences)] for i in range(count)]

    def answer_ids(self, numbers) -> list[int]:
        text = ", ".join(str(n) for n in numbers)
        if self.chat:  # the end-of-turn token closes the assistant message, as in the template
            return self.tokenizer(text + self.tokenizer.eos_token, add_special_tokens=False).input_ids
        return self.tokenizer(" " + text, add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id]

    def next(self) -> tuple[list[int], int]:
        o, rng = self.options, self.rng
        needles = rng.randint(1, o.max_needles)
        queries = rng.randint(1, min(o.max_queries, needles))
        length = rng.randint(o.min_length, o.max_length)
        if o.long_length and rng.random() < o.long_fraction:  # no extra draw without long examples: same stream
            length = rng.randint(o.max_length + 1, o.long_length)
        case = make_case(self.tokenizer, length, rng.random(), needles, queries,
                         seed=f"adapt-{o.seed}-{rng.random()}", city_pool=TRAINING_CITIES, filler=self._filler)
        answer = self.answer_ids(case.query_numbers)
        return case.input_ids + answer, len(answer)


def text_blocks(tokenizer, block: int, seed: int):
    """Endless shuffled blocks of `block` tokens of the training docstrings (held-out text excluded)."""
    from .training import TokenBlocks

    blocks = TokenBlocks(tokenizer, training_text(), block_size=block).blocks
    rng = torch.Generator().manual_seed(seed)
    while True:
        for index in torch.randperm(len(blocks), generator=rng):
            yield blocks[index]


# ---------------------------------------------------------------------------------------------------------------
# Training


def _at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits make a coarse loss


def answer_loss(model, input_ids: list[int], answer_tokens: int) -> torch.Tensor:
    """Cross-entropy of the last `answer_tokens` tokens given everything before them; the lm head only sees the
    positions that predict them."""
    ids = torch.tensor([input_ids], device=model.device)
    logits = _at_least_float32(model(input_ids=ids, logits_to_keep=answer_tokens + 1).logits[0, :-1])
    return torch.nn.functional.cross_entropy(logits, ids[0, -answer_tokens:])


def text_loss(model, block: torch.Tensor, reference=None, kl_weight: float = 0.0) -> torch.Tensor:
    ids = block[None].to(model.device)
    logits = _at_least_float32(model(input_ids=ids).logits[0, :-1])
    loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    if reference is not None and kl_weight > 0:
        with torch.no_grad():
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
        raise ValueError(f"frozen_layers must be between 0 and {len(layers) - 1} (this model has {len(layers)} decoder "
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


def probe(model, tokenizer, options: AdaptationOptions, name: str) -> dict:
    from .retrieval import evaluate_model

    # A copy in the autocast dtype rather than autocast itself: autocast would re-cast every weight at every decoding
    # step, where the copy casts them once; and `diff-llama evaluate --dtype bfloat16` evaluates exactly this way.
    dtype = _autocast_dtype(options)
    copy_ = model if dtype is None else copy.deepcopy(model).to(dtype)
    copy_.eval()
    report = evaluate_model(copy_, tokenizer, probe_options(options), name=name)
    model.train()
    summary, allocation = report["summary"], report["summary"]["allocation"] or {}
    return {"accuracy": summary["accuracy"], "accuracy_by_cell": summary["accuracy_by_cell"],
            "answer_share": allocation.get("answer_share"), "noise_share": allocation.get("noise_share"),
            "perplexity": report["perplexity"], "probe_seconds": report["seconds"]}


def _autocast_dtype(options: AdaptationOptions):
    dtype = resolve_dtype(options.autocast, "cpu")
    return None if dtype == torch.float32 else dtype


def _autocast(options: AdaptationOptions):
    dtype = _autocast_dtype(options)
    return torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None)


def check_options(options: AdaptationOptions) -> None:
    """Raise ValueError, naming the values and the fix, for options `adapt` cannot train with (checked before a model
    is loaded)."""
    if options.max_steps < 1 or options.min_length > options.max_length:
        raise ValueError("need max_steps >= 1 and min_length <= max_length")
    if options.long_length and (options.long_length <= options.max_length or not 0 < options.long_fraction <= 1):
        raise ValueError(f"long examples need long_length > max_length and 0 < long_fraction <= 1 (got long_length "
                         f"{options.long_length}, max_length {options.max_length}, long_fraction "
                         f"{options.long_fraction}); set long_length 0 to train without them")
    own_warmup = options.differential_warmup_steps
    if own_warmup is not None and not 0 <= own_warmup <= options.max_steps:
        raise ValueError(f"differential_warmup_steps must be between 0 and max_steps ({options.max_steps}), got "
                         f"{own_warmup}; leave it unset to share warmup_steps")
    if options.frozen_layers < 0:
        raise ValueError(f"frozen_layers must be 0 or more, got {options.frozen_layers}; set 0 to train every layer")
    if options.learning_rate <= 0 or options.differential_learning_rate < 0:
        raise ValueError(f"need learning_rate > 0 and differential_learning_rate >= 0 (got {options.learning_rate} "
                         f"and {options.differential_learning_rate}): the second query heads live in q_proj with the "
                         "first, so their rate is applied as a multiple of learning_rate, which must be positive; set "
                         "--learning-rate above 0 and --differential-learning-rate to 0 or more")
    _autocast_dtype(options)  # an unknown dtype


def adapt(model, tokenizer, options: AdaptationOptions, output: str | Path | None = None, name: str = "model") -> dict:
    """Train `model` in place with the recipe above; returns the history (and writes adapt.json/png to `output`)."""
    from .training import optimizer_for

    if options.threads > 0:
        torch.set_num_threads(options.threads)
    check_options(options)
    torch.manual_seed(options.seed)
    examples = RetrievalExamples(tokenizer, options)
    blocks = text_blocks(tokenizer, options.text_block, options.seed) if options.text_every else None
    reference = None
    if options.kl_weight > 0:
        reference = copy.deepcopy(model).eval().requires_grad_(False)
    model.train()
    frozen = freeze_lower_layers(model, options.frozen_layers)
    differential = differential_parameters(model)
    # torch keeps extra keys in a param group: "differential" marks the group on the differential schedule
    extra_groups = [{"params": differential, "lr": options.differential_learning_rate, "weight_decay": 0.0,
                     "differential": True}]
    optimizer = optimizer_for(model, options.learning_rate, options.lambda_learning_rate,
                              extra_groups=extra_groups if differential else [])
    second_heads = SecondHeadRate(model, 1.0)
    base_rates = [group["lr"] for group in optimizer.param_groups]
    # The dtype `auto` became on this machine, next to the options as given.
    history = {"name": name, "options": asdict(options),
               "autocast_dtype": str(_autocast_dtype(options) or torch.float32), "steps": [], "probes": []}
    cpu_seconds = 0.0

    def record_probe(step):
        history["probes"].append({"step": step, "cpu_minutes": cpu_seconds / 60,
                                  "pair_divergence": pair_divergence(model),
                                  **probe(model, tokenizer, options, f"{name} @ {step}")})
        if output is not None:
            write_history(history, output)

    try:
        record_probe(0)
        progress = tqdm(range(options.max_steps), desc=f"adapt {name}")
        for step in progress:
            started = time.process_time()
            factor, own_factor = learning_rate_factor(step, options), differential_factor(step, options)
            for group, rate in zip(optimizer.param_groups, base_rates):
                group["lr"] = rate * (own_factor if group.get("differential") else factor)
            # the second heads share q_proj with the first: their update is the shared one, rescaled to their own rate
            second_heads.factor = options.differential_learning_rate / options.learning_rate * (own_factor / factor)
            input_ids, answer_tokens = examples.next()
            with _autocast(options):
                loss = answer_loss(model, input_ids, answer_tokens)
            loss.backward()
            entry = {"step": step + 1, "tokens": len(input_ids), "answer_loss": loss.item()}
            if blocks is not None and step % options.text_every == 0:
                with _autocast(options):
                    lm = text_loss(model, next(blocks), reference, options.kl_weight)
                lm.backward()
                entry["text_loss"] = lm.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            second_heads.before_step()
            optimizer.step()
            second_heads.after_step()
            optimizer.zero_grad(set_to_none=True)
            cpu_seconds += time.process_time() - started
            entry["cpu_minutes"] = cpu_seconds / 60
            history["steps"].append(entry)
            progress.set_postfix(answer_loss=f"{entry['answer_loss']:.3f}", cpu_min=f"{cpu_seconds / 60:.1f}")
            out_of_budget = step + 1 < options.max_steps and cpu_seconds / 60 >= options.max_cpu_minutes
            done = step + 1 == options.max_steps or out_of_budget
            if done or (options.eval_every and (step + 1) % options.eval_every == 0):
                record_probe(step + 1)
            if done:
                break
    finally:  # frozen for this training only, also when it stops with an error
        model.eval()
        for param in frozen:
            param.requires_grad_(True)
    history["cpu_minutes"] = cpu_seconds / 60
    history["stopped_by_budget"] = out_of_budget
    if out_of_budget:  # the schedule decays to 0 at max_steps: stopped early, training ended at a high rate
        steps = len(history["steps"])
        warnings.warn(
            f"{name}: the CPU budget ({options.max_cpu_minutes:g} minutes) ran out after {steps} of "
            f"{options.max_steps} steps, with the learning rate at {factor:.0%} of its peak (it decays to 0 at "
            f"max_steps). For a complete schedule, set max_steps to what fits the budget, about {steps} here.",
            stacklevel=2)
    if output is not None:
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


def plot_curves(histories: list[dict], output: str | Path) -> Path:
    """PNG: probe retrieval accuracy, attention shares and perplexity, and the answer loss, against CPU-minutes."""
    from .plotting import pyplot, save_png

    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for index, history in enumerate(histories):
        color, name = f"C{index}", history["name"]
        probes = history["probes"]
        minutes = [p["cpu_minutes"] for p in probes]
        axes[0].plot(minutes, [p["accuracy"] for p in probes], "o-", color=color, label=name)
        axes[1].plot(minutes, [p["answer_share"] for p in probes], "o-", color=color, label=f"{name}: answer")
        axes[1].plot(minutes, [p["noise_share"] for p in probes], "s--", color=color, label=f"{name}: noise")
        axes[2].plot(minutes, [p["perplexity"] for p in probes], "o-", color=color, label=name)
        steps = history["steps"]
        if steps:
            axes[3].plot([s["cpu_minutes"] for s in steps], _smooth([s["answer_loss"] for s in steps]), color=color,
                         label=name)
    axes[0].set(xlabel="training CPU-minutes", ylabel="accuracy", title="held-out retrieval (probe)",
                ylim=(-0.05, 1.05))
    axes[1].set(xlabel="training CPU-minutes", ylabel="share of attention", title="attention: answer vs noise")
    axes[2].set(xlabel="training CPU-minutes", ylabel="perplexity", title="held-out perplexity")
    axes[3].set(xlabel="training CPU-minutes", ylabel="cross-entropy (20-step mean)", title="answer loss (training)")
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


def run_adapt(model_name: str, output: str, options: AdaptationOptions, name: str | None = None) -> int:
    """`diff-llama adapt MODEL OUTPUT [options]` (declared in `diff_llama_cli`)."""
    from .output_folder import check_new_output, new_output_folder
    from .resolve import load_model, save_tokenizer
    from .retrieval import display_name

    output = Path(output)
    check_new_output(output, fix="choose a new folder")
    check_options(options)
    model, tokenizer = load_model(model_name)
    release_gguf_quantizer(model)
    name = name or display_name(model_name)
    with new_output_folder(output) as folder:
        history = adapt(model, tokenizer, options, folder, name=name)
        if options.save:
            # Written to a temporary folder first, then moved: a crash never leaves a half-saved model behind.
            partial = folder / ".partial"
            model.save_pretrained(partial)
            save_tokenizer(tokenizer, partial)
            for path in partial.iterdir():
                path.replace(folder / path.name)
            partial.rmdir()
    first, last, steps = history["probes"][0], history["probes"][-1], len(history["steps"])
    print(f"{name}: {steps} step{'' if steps == 1 else 's'} in {history['cpu_minutes']:.1f} CPU-minutes; probe "
          f"accuracy {first['accuracy']:.0%} -> {last['accuracy']:.0%}, perplexity {first['perplexity']:.2f} -> "
          f"{last['perplexity']:.2f}")
    print(f"Wrote {output}")
    return 0
