"""The held-out probe recorded during training: retrieval accuracy, attention to the answer and to noise, held-out
perplexity (the evaluation's cities and filler, another seed than `diff-llama evaluate`'s default cases), and how far
the DIFF V2 pairs' query heads have parted."""

from __future__ import annotations

import copy

import torch

from ..options import RetrievalArguments

from .settings import AdaptationOptions


def probe_options(options: AdaptationOptions) -> RetrievalArguments:
    """The held-out probe: the evaluation's cities and filler, seed 1 (`diff-llama evaluate` defaults to seed 0)."""
    return RetrievalArguments(lengths=list(options.eval_lengths), settings=list(options.eval_settings),
                              cases_per_depth=options.eval_cases, seed=1, perplexity_tokens=2048, threads=0)


def probe(model, tokenizer, options: AdaptationOptions, name: str, dtype: torch.dtype | None = None) -> dict:
    """The held-out probe of `model` where it is, with its weights in `dtype` (None: as they are)."""
    from ..retrieval import evaluate_model

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


def pair_divergence(model) -> float | None:
    """Mean over DIFF V2 layers of ‖W_second − W_first‖ / ‖W_first‖ over the query heads of every pair: 0 right after
    a lossless conversion, the model then computes its source; None for other models."""
    from ..modeling_diff_llama import DiffLlamaV2Attention

    values = []
    for module in model.modules():
        if isinstance(module, DiffLlamaV2Attention):
            heads = module.q_proj.weight.detach().float().view(-1, 2, module.head_dim, module.q_proj.in_features)
            values.append(((heads[:, 1] - heads[:, 0]).norm() / heads[:, 0].norm()).item())
    return sum(values) / len(values) if values else None
