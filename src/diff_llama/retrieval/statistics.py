"""Statistics over scored cases: accuracy and allocation by cell, depth and length; the paired McNemar test; and
reports of separate runs on the same cases merged into one (summaries recomputed from the cases)."""

from __future__ import annotations

import math

from ..errors import UserError
from .cases import CATEGORIES


def mean_or_none(values) -> float | None:
    """The mean of `values`; None where there are none (a cell no case fell in)."""
    values = list(values)
    return sum(values) / len(values) if values else None


def summarize(results: list[dict]) -> dict:
    """Accuracy per (length, NxR), per depth and per length; allocation per depth; overall means."""
    def group(key):
        groups = {}
        for r in results:
            groups.setdefault(key(r), []).append(r)
        return groups

    def allocation(rows):
        rows = [r["allocation"] for r in rows if r["allocation"]]
        if not rows:
            return None
        means = {k: mean_or_none(a[k] for a in rows) for k in (*CATEGORIES, "noise", "total")}
        # Shares of the row total: a differential map's rows sum to 1 - λ, so raw masses of models with different λ
        # (V2's conversion starts at λ = 0.5) are not comparable; their shares are.
        means.update({f"{k}_share": means[k] / means["total"] for k in (*CATEGORIES, "noise")})
        return means

    summary = {
        "accuracy": mean_or_none(r["correct"] for r in results),
        "accuracy_by_cell": {f"{length}/{n}x{q}": mean_or_none(r["correct"] for r in rows) for (length, n, q), rows in
                             group(lambda r: (r["length"], r["num_needles"], r["num_queries"])).items()},
        "accuracy_by_depth": {f"{d * 100:g}": mean_or_none(r["correct"] for r in rows)
                              for d, rows in group(lambda r: r["depth"]).items()},
        "accuracy_by_length": {str(k): mean_or_none(r["correct"] for r in rows)
                               for k, rows in group(lambda r: r["length"]).items()},
        "allocation": allocation(results),
        "allocation_by_depth": {f"{d * 100:g}": allocation(rows) for d, rows in group(lambda r: r["depth"]).items()},
        "allocation_by_length": {str(k): allocation(rows) for k, rows in group(lambda r: r["length"]).items()},
    }
    return summary


def paired_comparison(first_cases: list[dict], second_cases: list[dict], key: str = "seed") -> dict:
    """Two models on the same cases (`key` names each case): how many each alone got right, and the exact two-sided
    McNemar p-value (a binomial test on the cases where they disagree), the test for paired proportions."""
    if [c[key] for c in first_cases] != [c[key] for c in second_cases]:
        raise UserError("paired_comparison needs the same cases in the same order (run both with the same options)")
    pairs = [(a["correct"], b["correct"]) for a, b in zip(first_cases, second_cases)]
    only_first = sum(a and not b for a, b in pairs)
    only_second = sum(b and not a for a, b in pairs)
    disagree = only_first + only_second
    tail = sum(math.comb(disagree, k) for k in range(min(only_first, only_second) + 1)) / 2 ** disagree
    return {"cases": len(pairs), "both": sum(a and b for a, b in pairs), "only_first": only_first,
            "only_second": only_second, "neither": sum(not a and not b for a, b in pairs),
            "p_value": min(1.0, 2 * tail)}


def _check_same_cases(reports: list[dict], with_lengths: bool) -> None:
    """Raise ValueError unless the reports were run on the same cases (at the same lengths, if `with_lengths`)."""
    same = ("settings", "depths", "cases_per_depth", "seed", "max_new_tokens", "chat_template")
    same = ("lengths", *same) if with_lengths else same
    first = reports[0]["options"]
    for report in reports[1:]:
        different = [k for k in same if report["options"][k] != first[k]]
        if different:
            raise UserError(f"reports were run with different options: {', '.join(different)}")


def merge_reports(reports: list[dict]) -> dict:
    """One report with the models of several (e.g. one `diff-llama evaluate` run per model), which must have been
    run on the same cases: the same lengths, settings, depths, counts, seed and chat-template choice."""
    _check_same_cases(reports, with_lengths=True)
    first = reports[0]["options"]
    models = [dict(m) for report in reports for m in report["models"]]
    for model in models:  # summaries recomputed from the cases, so that reports of older versions merge too
        model["summary"] = summarize(model["cases"])
    return {"options": first, "models": models}


def join_lengths(reports: list[dict]) -> dict:
    """One report from runs of the same models on the same cases at different context lengths (e.g. one run per
    length, so that each can be scheduled on its own): lengths and cases concatenated, summaries recomputed, so that
    the paired tests cover every length and all of them together."""
    _check_same_cases(reports, with_lengths=False)
    first = reports[0]
    names = [m["name"] for m in first["models"]]
    for report in reports[1:]:
        if [m["name"] for m in report["models"]] != names:
            raise UserError(f"reports hold different models: {names} and {[m['name'] for m in report['models']]}")
    lengths = [n for report in reports for n in report["options"]["lengths"]]
    if len(set(lengths)) != len(lengths):
        raise UserError(f"a length appears in more than one report: {lengths}; join runs at different lengths")
    models = []
    for index, model in enumerate(first["models"]):
        joined = dict(model, cases=[c for report in reports for c in report["models"][index]["cases"]])
        joined["summary"] = summarize(joined["cases"])
        models.append(joined)
    return {"options": dict(first["options"], lengths=lengths), "models": models}
