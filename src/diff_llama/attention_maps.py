"""Pictures of differential attention: A1, A2 and A1 − λ·A2 of one head, side by side (PNG). A plain LLaMA (or any
causal LM without λ) gets its softmax maps, one head per picture, for comparison."""

from pathlib import Path

import torch

from .errors import UserError
from .plotting import pyplot, save_png


@torch.no_grad()
def attention_maps(model, tokenizer, text: str, layer: int):
    """One layer's maps for `text`: A1 and A2 of every differential head (each (H/2, q, k)), λ (version 1: a scalar;
    DIFF V2: (q, H/2), per token and head), the differential maps (H/2, q, k), and the tokens. For a model without
    differential attention (no `differential_maps`): its softmax maps (H, q, k), None, None, None, the tokens. Computed
    on the model's device, returned in float32 on the CPU (for plotting)."""
    if not 0 <= layer < model.config.num_hidden_layers:
        raise UserError(f"--layer must be between 0 and {model.config.num_hidden_layers - 1}, got {layer}.")
    model.set_attn_implementation("eager")  # only eager attention returns the softmax maps
    inputs = tokenizer(text, return_tensors="pt").to(model.device)
    out = model(**inputs, output_attentions=True, output_hidden_states=True)
    tokens = tokenizer.convert_ids_to_tokens(inputs["input_ids"][0])
    if not hasattr(model, "differential_maps"):
        return out.attentions[layer][0].float().cpu(), None, None, None, tokens
    first, second = model.model.layers[layer].self_attn.pair_maps(out.attentions[layer].float())
    lam = model.differential_lambdas(out)[layer].float()
    differential = model.differential_maps(out)[layer][0]
    return (first[0].cpu(), second[0].cpu(), (lam if lam.dim() == 0 else lam[0]).cpu(), differential.float().cpu(),
            tokens)


def plot_head(first, second, lam, differential, tokens, head: int, layer: int, output: str | Path, source_maps=None):
    """Write a PNG: A1, A2, A1 − λA2 of differential head `head` (and the source LLaMA's heads if given); for a
    model without differential attention (`differential` None), the softmax map of head `head`."""
    plt = pyplot()

    if differential is None:
        if not 0 <= head < first.shape[0]:
            raise UserError(f"--head must be between 0 and {first.shape[0] - 1} (this model has {first.shape[0]} heads).")
        panels = [(first[head], f"softmax map (head {head})", "viridis", 0.0, 1.0)]
    else:
        half = first.shape[0]
        if not 0 <= head < half:
            raise UserError(f"--head must be between 0 and {half - 1} (this model has {half} differential heads).")
        limit = max(differential[head].abs().max().item(), 1e-6)
        if lam.dim() == 0:
            lam_text = f"λ = {lam.item():.3f}"
        else:  # DIFF V2: one λ per query token
            lam_text = f"λ per token {lam[:, head].min().item():.2f}–{lam[:, head].max().item():.2f}"
        panels = [
            (first[head], f"A1 of differential head {head}", "viridis", 0.0, 1.0),
            (second[head], f"A2 of differential head {head}", "viridis", 0.0, 1.0),
            (differential[head], f"A1 − λ·A2 ({lam_text})", "RdBu_r", -limit, limit),
        ]
    if source_maps is not None:
        panels.append((source_maps, "source LLaMA head", "viridis", 0.0, 1.0))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.4), squeeze=False)
    axes = axes[0]
    labels = [t.replace("Ġ", "·").replace("Ċ", "\\n") for t in tokens]
    for ax, (data, title, cmap, vmin, vmax) in zip(axes, panels):
        image = ax.imshow(data.numpy(), cmap=cmap, vmin=vmin, vmax=vmax)
        ax.set_title(title, fontsize=10)
        if len(labels) <= 40:
            ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
            ax.set_yticks(range(len(labels)), labels, fontsize=6)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        fig.colorbar(image, ax=ax, fraction=0.046)
    fig.suptitle(f"layer {layer}, {'differential ' if differential is not None else ''}head {head}")
    return save_png(fig, output, dpi=130)
