"""adapt.json and adapt.png: a run's history, and its curves against training minutes."""

from __future__ import annotations

import json
from pathlib import Path


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
    """PNG: probe retrieval accuracy, attention shares and perplexity, and the answer loss, against training
    minutes."""
    from ..plotting import pyplot, save_png

    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for index, history in enumerate(histories):
        color, name = f"C{index}", history["name"]
        probes = history["probes"]
        minutes = [p["train_minutes"] for p in probes]
        axes[0].plot(minutes, [p["accuracy"] for p in probes], "o-", color=color, label=name)
        axes[1].plot(minutes, [p["answer_share"] for p in probes], "o-", color=color, label=f"{name}: answer")
        axes[1].plot(minutes, [p["noise_share"] for p in probes], "s--", color=color, label=f"{name}: noise")
        axes[2].plot(minutes, [p["perplexity"] for p in probes], "o-", color=color, label=name)
        steps = history["steps"]
        if steps:
            axes[3].plot([s["train_minutes"] for s in steps], _smooth([s["answer_loss"] for s in steps]),
                         color=color, label=name)
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
