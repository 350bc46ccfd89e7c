"""Watching a DiffLlama learn to subtract: a TrainerCallback that logs per-layer λ and statistics of the
differential attention maps, and a plot of them from the Trainer's log history."""

from pathlib import Path

import torch
from transformers import TrainerCallback

from .plotting import pyplot, save_png


@torch.no_grad()
def differential_attention_stats(model, probe_ids: torch.Tensor) -> dict:
    """Per-layer statistics of the differential maps M = A1 − λ·A2 on a fixed probe batch:

    - `first_token_mass`: mean weight M puts on the first token (attention sinks: Diff Transformer should lower it);
    - `entropy`: mean entropy of |M| normalised per row (how spread the attention is);
    - `negative_share`: share of |M|'s total mass carried by negative entries (how much is really subtracted).
    """
    previous = model.config._attn_implementation
    was_training = model.training
    model.eval()
    model.set_attn_implementation("eager")  # only eager returns the softmax maps
    try:
        out = model(probe_ids.to(model.device), output_attentions=True, output_hidden_states=True)
        maps = model.differential_maps(out)
        # version 1: λ per layer; DIFF V2: λ per token and head, summarised by its mean over the probe
        lambdas = torch.stack([lam.float().mean() for lam in model.differential_lambdas(out)])
    finally:
        model.set_attn_implementation(previous)
        model.train(was_training)
    stats = {}
    for layer, layer_maps in enumerate(maps):
        magnitude = layer_maps.abs()
        rows = magnitude / magnitude.sum(-1, keepdim=True).clamp_min(1e-12)
        entropy = -(rows * rows.clamp_min(1e-12).log()).sum(-1)
        stats[f"diff_attn/lambda/layer_{layer}"] = lambdas[layer].item()
        stats[f"diff_attn/first_token_mass/layer_{layer}"] = layer_maps[..., 0].mean().item()
        stats[f"diff_attn/entropy/layer_{layer}"] = entropy.mean().item()
        stats[f"diff_attn/negative_share/layer_{layer}"] = (
            layer_maps.clamp_max(0).abs().sum() / magnitude.sum().clamp_min(1e-12)
        ).item()
    stats["diff_attn/mean_abs_lambda"] = lambdas.abs().mean().item()
    return stats


class DifferentialAttentionCallback(TrainerCallback):
    """Adds λ and differential-map statistics (see `differential_attention_stats`) to every Trainer log: the console,
    `trainer.state.log_history` and every `report_to` integration.

    The Trainer calls the `report_to` integrations before the callbacks it is given, so attach this one in front:

    ```python
    probe = tokenizer("A short, fixed text to watch.", return_tensors="pt").input_ids
    trainer = Trainer(model=model, args=args, train_dataset=data)
    DifferentialAttentionCallback.attach(trainer, probe)
    ```
    """

    def __init__(self, probe_ids: torch.Tensor):
        self.probe_ids = probe_ids if probe_ids.dim() == 2 else probe_ids[None]

    @classmethod
    def attach(cls, trainer, probe_ids: torch.Tensor) -> "DifferentialAttentionCallback":
        """Put a new callback first in `trainer`'s callbacks, so every later one sees its figures."""
        callback = cls(probe_ids)
        trainer.callback_handler.callbacks.insert(0, callback)
        return callback

    def on_log(self, args, state, control, model=None, logs=None, **kwargs):
        if model is None or logs is None or not hasattr(model, "differential_maps"):
            return
        stats = differential_attention_stats(model, self.probe_ids)
        logs.update(stats)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(stats)  # the Trainer stored a copy of `logs` before calling us


def plot_differential_attention(log_history: list[dict], output: str | Path) -> Path:
    """PNG of λ and the map statistics per layer against the training step, from `trainer.state.log_history`."""
    plt = pyplot()

    entries = [e for e in log_history if "diff_attn/mean_abs_lambda" in e]
    if not entries:
        raise ValueError("the log history has no diff_attn/ entries: train with DifferentialAttentionCallback.")
    steps = [e["step"] for e in entries]
    layers = sorted({int(k.rsplit("_", 1)[1]) for k in entries[0] if k.startswith("diff_attn/lambda/layer_")})
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    colours = plt.cm.viridis([i / max(1, len(layers) - 1) for i in range(len(layers))])
    for ax, statistic in zip(axes, ("lambda", "first_token_mass", "entropy", "negative_share")):
        for layer, colour in zip(layers, colours):
            ax.plot(steps, [e[f"diff_attn/{statistic}/layer_{layer}"] for e in entries], color=colour,
                    label=f"layer {layer}" if statistic == "lambda" else None)
        ax.set_title(statistic.replace("_", " "))
        ax.set_xlabel("step")
    axes[0].legend(fontsize=6, ncol=2)
    return save_png(fig, output, dpi=120)
