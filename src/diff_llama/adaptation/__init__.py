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
- What a DIFF V2 conversion adds to its source, its λ projection and the second query head of each pair, trains at
  `differential_learning_rate`; everything the two models share trains at `learning_rate`.

`frozen_layers` keeps the embeddings and the lower decoder layers fixed, so that no backward pass runs below the first
trained layer: more steps within a budget, at the price of what those layers could learn.

The loop is the `transformers.Trainer`'s, so `adapt` trains wherever the Trainer does: on the CPU, on one accelerator,
or data-parallel under `accelerate launch` (DDP). The training budget is counted in wall-clock seconds of the training
steps alone (probes and checkpoints excluded). Every `eval_every` steps a small held-out probe records retrieval
accuracy, attention to the answer and to noise, and held-out perplexity: the curve against training minutes lands in
adapt.json and adapt.png.

One module per concern, in the order a run goes through them:
- `settings`: the training device, autocast dtype and batch over the processes; the checks of the options;
- `examples`: the example stream (retrieval examples and text blocks), indexed by position;
- `losses`: the answer's cross-entropy and the text blocks' next-token loss (and KL);
- `rates`: the learning-rate schedules, the second query heads' own rate, the frozen lower layers;
- `probes`: the held-out probe and the pairs' divergence;
- `trainer`: the Trainer, its callback (history, probes, budget), and `adapt`, which puts everything together;
- `resume`: the state in every checkpoint, and the options a resumed run may change;
- `plots`: adapt.json and adapt.png;
- `command`: `diff-llama adapt` (`run_adapt`).
"""

from .command import run_adapt
from .examples import RetrievalExamples, TextBlocks, training_sentences
from .losses import answer_loss, text_loss
from .plots import plot_curves
from .probes import pair_divergence
from .rates import (
    SecondHeadRate,
    differential_factor,
    differential_parameters,
    freeze_lower_layers,
    learning_rate_factor,
)
from .settings import AdaptationOptions, check_options
from .trainer import adapt

__all__ = [
    "AdaptationOptions", "RetrievalExamples", "SecondHeadRate", "TextBlocks", "adapt", "answer_loss", "check_options",
    "differential_factor", "differential_parameters", "freeze_lower_layers", "learning_rate_factor",
    "pair_divergence", "plot_curves", "run_adapt", "text_loss", "training_sentences",
]
