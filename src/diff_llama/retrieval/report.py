"""A report's tables (markdown), plot (PNG) and files (retrieval.json, retrieval.md, retrieval.png)."""

from __future__ import annotations

import json
from pathlib import Path

from ..options import RetrievalArguments
from ..output_folder import make_folder
from .cases import CATEGORIES
from .statistics import paired_comparison


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def _num(value, digits=3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _paired_lines(models: list[dict], lengths: list[int], pairs: list[tuple[int, int]]) -> list[str]:
    lines = ["", "Paired on the same cases (by length and in all): cases only one of the two models got right, and the "
             "exact McNemar p-value (two-sided; small means the difference is unlikely to be chance):", "",
             "| first | second | length | both right | only first | only second | neither | p |",
             "|---|---|---|---|---|---|---|---|"]
    subsets = [(str(n), lambda c, n=n: c["length"] == n) for n in lengths]
    if len(lengths) > 1:
        subsets.append(("all", lambda c: True))
    for i, j in pairs:
        first, second = models[i], models[j]
        for label, keep in subsets:
            c = paired_comparison([x for x in first["cases"] if keep(x)], [x for x in second["cases"] if keep(x)])
            lines.append(f"| {first['name']} | {second['name']} | {label} | {c['both']} | {c['only_first']} | "
                         f"{c['only_second']} | {c['neither']} | {c['p_value']:.3f} |")
    return lines


def markdown_report(report: dict, pairs: list[tuple[int, int]] | None = None) -> str:
    """The tables of a report. `pairs` (indices into report["models"]) picks the paired comparisons; by default every
    model against the first."""
    options = report["options"]
    settings = [f"{n}x{r}" for n, r in RetrievalArguments(settings=options["settings"]).parsed_settings()]
    depths = [f"{d:g}" for d in options["depths"]]
    models = report["models"]
    lines = [
        f"Multi-needle retrieval: {options['cases_per_depth']} case(s) per (length, N x R, depth) over depths "
        f"{', '.join(d + '%' for d in depths)}; greedy, exact match of every queried number; "
        f"chat template: {'yes' if options['chat_template'] else 'no'}; seed {options['seed']}.",
        "",
        "| model | maps | held-out perplexity | accuracy | attention to answer ↑ | attention noise ↓ |",
        "|---|---|---|---|---|---|",
    ]
    for m in models:
        s = m["summary"]
        a = s["allocation"] or {}
        lines.append(f"| {m['name']} | {m['maps']} | {_num(m.get('perplexity'), 2)} | {_pct(s['accuracy'])} | "
                     f"{_num(a.get('answer_share'))} | {_num(a.get('noise_share'))} |")
    lines += ["", "Retrieval accuracy (Table 2 of the paper: N needles, R queried):", "",
              "| model | length | " + " | ".join(f"N={s.split('x')[0]}, R={s.split('x')[1]}" for s in settings)
              + " | mean |", "|---|---|" + "---|" * (len(settings) + 1)]
    for m in models:
        cells = m["summary"]["accuracy_by_cell"]
        for length in options["lengths"]:
            row = [cells.get(f"{length}/{s}") for s in settings]
            lines.append(f"| {m['name']} | {length} | " + " | ".join(_pct(v) for v in row)
                         + f" | {_pct(m['summary']['accuracy_by_length'].get(str(length)))} |")
    lines += ["", "Retrieval accuracy by depth of the answer needle:", "",
              "| model | " + " | ".join(d + "%" for d in depths) + " |", "|---|" + "---|" * len(depths)]
    for m in models:
        by_depth = m["summary"]["accuracy_by_depth"]
        lines.append(f"| {m['name']} | " + " | ".join(_pct(by_depth.get(d)) for d in depths) + " |")
    if len(models) > 1:
        lines += _paired_lines(models, options["lengths"], pairs or [(0, j) for j in range(1, len(models))])
    if any(m["summary"]["allocation"] for m in models):
        lines += ["", "Attention allocation from the answer-generating position (Table 3 of the paper), mean over "
                  "layers, heads and cases, as a share of the mean row sum: answer needle / noise (everything except "
                  "the answer needle and the question). Softmax rows sum to 1; differential rows (A1 − λ·A2) to "
                  "1 − λ.", "",
                  "| model | " + " | ".join(f"{d}% answer ↑ | {d}% noise ↓" for d in depths) + " |",
                  "|---|" + "---|" * (2 * len(depths))]
        for m in models:
            by_depth = m["summary"]["allocation_by_depth"]
            cells = []
            for d in depths:
                a = by_depth.get(d) or {}
                cells += [_num(a.get("answer_share")), _num(a.get("noise_share"))]
            lines.append(f"| {m['name']} | " + " | ".join(cells) + " |")
        lines += ["", "Raw attention mass by token class (mean over layers, heads and cases): noise = other needles "
                  "+ filler + prefix (BOS, system prompt, chat markup); total = row sum.", "",
                  "| model | answer | other needles | filler | prefix | question | total |", "|---|---|---|---|---|---|---|"]
        for m in models:
            a = m["summary"]["allocation"] or {}
            lines.append(f"| {m['name']} | " + " | ".join(_num(a.get(k)) for k in (*CATEGORIES, "total")) + " |")
        # Which part of the noise differs: the attention sink (prefix) and the filler can move in opposite directions.
        parts = ("prefix", "filler", "other_needles", "noise")
        lines += ["", "Noise by part, as shares of the row sum (the noise share above is their sum):", "",
                  "| model | " + " | ".join(k.replace("_", " ") for k in parts) + " |", "|---" * (1 + len(parts)) + "|"]
        for m in models:
            a = m["summary"]["allocation"] or {}
            lines.append(f"| {m['name']} | " + " | ".join(_num(a.get(f"{k}_share")) for k in parts) + " |")
    return "\n".join(lines) + "\n"


def plot_report(report: dict, output: str | Path) -> Path:
    """PNG: accuracy by depth, accuracy by length, attention to the answer and noise by depth."""
    from ..plotting import pyplot, save_png

    plt = pyplot()
    options = report["options"]
    depths = [f"{d:g}" for d in options["depths"]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for index, m in enumerate(report["models"]):
        color = f"C{index}"
        s = m["summary"]
        axes[0].plot([float(d) for d in depths], [s["accuracy_by_depth"].get(d) for d in depths], "o-",
                     color=color, label=m["name"])
        axes[1].plot(options["lengths"], [s["accuracy_by_length"].get(str(k)) for k in options["lengths"]], "o-",
                     color=color, label=m["name"])
        if s["allocation"]:
            by_depth = s["allocation_by_depth"]
            axes[2].plot([float(d) for d in depths], [by_depth[d]["answer_share"] for d in depths], "o-",
                         color=color, label=f"{m['name']}: answer")
            axes[2].plot([float(d) for d in depths], [by_depth[d]["noise_share"] for d in depths], "s--",
                         color=color, label=f"{m['name']}: noise")
    axes[0].set(xlabel="depth of the answer needle (%)", ylabel="accuracy", title="retrieval by depth", ylim=(-0.05, 1.05))
    axes[1].set(xlabel="context length (tokens)", ylabel="accuracy", title="retrieval by length", ylim=(-0.05, 1.05))
    axes[1].set_xscale("log", base=2)
    axes[1].set_xticks(options["lengths"], [str(k) for k in options["lengths"]])
    axes[2].set(xlabel="depth of the answer needle (%)", ylabel="share of attention (mean over layers, heads)",
                title="attention allocation")
    if not any(m["summary"]["allocation"] for m in report["models"]):
        axes[2].text(0.5, 0.5, "not measured (--no-attention)", ha="center", va="center", transform=axes[2].transAxes)
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # an empty panel gets no legend (matplotlib would warn)
            ax.legend(fontsize=7)
    return save_png(fig, output)


def write_report(report: dict, output: str | Path) -> dict:
    """Write retrieval.json, retrieval.md and retrieval.png into the folder `output`."""
    output = make_folder(output)
    (output / "retrieval.json").write_text(json.dumps(report, indent=1))
    (output / "retrieval.md").write_text(markdown_report(report))
    plot_report(report, output / "retrieval.png")
    return {"json": output / "retrieval.json", "markdown": output / "retrieval.md", "plot": output / "retrieval.png"}
