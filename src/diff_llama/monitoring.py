"""Watching a DiffLlama learn to subtract: a TrainerCallback that logs per-layer λ and statistics of the
differential attention maps, and a plot of them from the Trainer's log history."""

from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from .errors import UserError
from .plotting import pyplot


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
    # Summaries over layers: what the console shows (the per-layer values go to log_history and report_to).
    stats["diff_attn/mean_abs_lambda"] = lambdas.abs().mean().item()
    stats["diff_attn/min_lambda"] = lambdas.min().item()
    for statistic in STATISTICS[1:]:
        values = [stats[f"diff_attn/{statistic}/layer_{layer}"] for layer in range(len(maps))]
        stats[f"diff_attn/mean_{statistic}"] = sum(values) / len(values)
    return stats


STATISTICS = ("lambda", "first_token_mass", "entropy", "negative_share")
# What each panel of the plot shows, and how to read it.
EXPLANATIONS = {
    "lambda": ("λ", "how much of the second map each layer subtracts"),
    "first_token_mass": ("mean weight on token 0", "attention sink; differential attention should lower it"),
    "entropy": ("entropy of |A1 − λA2| (nats)", "lower = more focused attention"),
    "negative_share": ("share of negative weight", "0 = nothing is really subtracted"),
}


def is_per_layer(key: str) -> bool:
    return key.startswith("diff_attn/") and "/layer_" in key


def console_logs(logs: dict) -> dict:
    """The logs without the per-layer `diff_attn/...` values (4 per layer): what is worth a console line."""
    return {k: v for k, v in logs.items() if not is_per_layer(k)}


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
        """Put a new callback first in `trainer`'s callbacks, so every later one sees its figures, and make the
        console print the summaries over layers only (`log_history` and `report_to` keep every value)."""
        callback = cls(probe_ids)
        callbacks = trainer.callback_handler.callbacks
        callbacks.insert(0, callback)
        for index, existing in enumerate(callbacks):
            if type(existing) is ProgressCallback:
                callbacks[index] = _SummaryProgressCallback(max_str_len=existing.max_str_len)
            elif type(existing) is PrinterCallback:
                callbacks[index] = _SummaryPrinterCallback()
        return callback

    def on_log(self, args, state, control, model=None, logs=None, **kwargs):
        if model is None or logs is None or not hasattr(model, "differential_maps"):
            return
        stats = differential_attention_stats(model, self.probe_ids)
        logs.update(stats)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(stats)  # the Trainer stored a copy of `logs` before calling us


class _SummaryProgressCallback(ProgressCallback):
    """The progress bar's log lines without the per-layer diff_attn values."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        super().on_log(args, state, control, logs=console_logs(logs or {}), **kwargs)


class _SummaryPrinterCallback(PrinterCallback):
    """Printed log lines (disable_tqdm=True) without the per-layer diff_attn values."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        super().on_log(args, state, control, logs=console_logs(logs or {}), **kwargs)


def plot_differential_attention(log_history: list[dict], output: str | Path) -> Path:
    """PNG of λ and the map statistics per layer against the training step, from `trainer.state.log_history`: one
    panel per statistic, one line per layer coloured from first (dark) to last layer (light), with a note on how to
    read each panel."""
    plt = pyplot()

    entries = [e for e in log_history if "diff_attn/mean_abs_lambda" in e]
    if not entries:
        raise UserError("the log history has no diff_attn/ entries: train with DifferentialAttentionCallback.")
    steps = [e["step"] for e in entries]
    layers = sorted({int(k.rsplit("_", 1)[1]) for k in entries[0] if k.startswith("diff_attn/lambda/layer_")})
    colour_map = plt.get_cmap("viridis")
    norm = plt.Normalize(vmin=layers[0], vmax=max(layers[-1], layers[0] + 1))
    fig, axes = plt.subplots(1, len(STATISTICS), figsize=(4.6 * len(STATISTICS), 4.4))
    # Markers: a short run has a single log point, which a line alone would not show.
    marker = "o" if len(entries) <= 20 else None
    for ax, statistic in zip(axes, STATISTICS):
        label, reading = EXPLANATIONS[statistic]
        for layer in layers:
            ax.plot(steps, [e[f"diff_attn/{statistic}/layer_{layer}"] for e in entries], color=colour_map(norm(layer)),
                    marker=marker, markersize=3, linewidth=1)
        ax.set_title(f"{label}\n({reading})", fontsize=9)
        ax.set_xlabel("training step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if len(steps) == 1 or steps[0] == steps[-1]:
            ax.set_xlim(steps[0] - 1, steps[0] + 1)
    # A colour bar of its own, right of the panels (tight_layout cannot place one that spans several axes).
    fig.subplots_adjust(left=0.04, right=0.92, top=0.8, bottom=0.13, wspace=0.3)
    colour_bar = fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=colour_map), cax=fig.add_axes([0.94, 0.13, 0.008, 0.67]))
    colour_bar.set_label("layer")
    fig.suptitle(f"Differential attention per layer on a fixed probe text ({len(layers)} layers, "
                 f"{len(entries)} log point{'s' if len(entries) != 1 else ''})", fontsize=11)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    pyplot().close(fig)
    return output
