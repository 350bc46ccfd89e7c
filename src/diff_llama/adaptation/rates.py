"""What trains, and how fast: the learning-rate schedules, the DIFF V2 second query heads' own rate, the λ
projections' parameter group, and the frozen lower layers.

What a DIFF V2 conversion adds to its source, its λ projection and the second (negative) query head of each pair,
trains at `differential_learning_rate` (warmed up over `differential_warmup_steps` if set); everything the two models
share trains at `learning_rate`. A lossless conversion starts with both heads of a pair equal and λ = 0.5: at the
base rate they barely part within a run and the model stays its source. The source has no such parameters, so the
comparison stays like for like.
"""

from __future__ import annotations

import torch

from ..errors import UserError
from .settings import AdaptationOptions


def learning_rate_factor(step: int, options: AdaptationOptions, warmup_steps: int | None = None) -> float:
    """Linear warm-up over `warmup_steps` (default: `options.warmup_steps`), then linear decay to 0 at `max_steps`."""
    warmup = options.warmup_steps if warmup_steps is None else warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (options.max_steps - step) / max(1, options.max_steps - warmup))


def differential_factor(step: int, options: AdaptationOptions) -> float:
    """The schedule of what a DIFF V2 conversion adds: its own warm-up, the same decay to 0 at `max_steps`."""
    return learning_rate_factor(step, options, options.differential_warmup_steps)


class SecondHeadRate:
    """Gives the second query head of every DIFF V2 pair `factor` times the update AdamW makes to it.

    Those heads are rows of `q_proj.weight`, one tensor with the first heads, so no param group can hold them
    alone; AdamW's update is elementwise, so scaling it after the step is the same as a learning rate of their own.
    """

    def __init__(self, model, factor: float):
        from ..modeling_diff_llama import DiffLlamaV2Attention

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


def differential_parameters(model) -> list[torch.nn.Parameter]:
    """DIFF V2's λ projections: parameters a conversion adds and its source lacks."""
    return [param for name, param in model.named_parameters() if param.requires_grad and "lambda_proj" in name]


def freeze_lower_layers(model, count: int) -> list[torch.nn.Parameter]:
    """Stop training the input embeddings and the first `count` decoder layers; returns the parameters it froze (to
    unfreeze after training). Nothing below the first trained layer then needs a gradient, so autograd runs no
    backward pass there."""
    if count == 0:
        return []
    layers = model.get_decoder().layers
    if not 0 < count < len(layers):
        raise UserError(f"--frozen-layers must be between 0 and {len(layers) - 1} (this model has {len(layers)} decoder "
                        f"layers), got {count}; set 0 to train every layer")
    modules = [model.get_input_embeddings(), *layers[:count]]
    frozen = [param for module in modules for param in module.parameters() if param.requires_grad]
    for param in frozen:
        param.requires_grad_(False)
    return frozen
