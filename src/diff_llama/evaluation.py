"""Quality measures shared by the demo, the converter and the benchmarks."""

import math

import torch
from tqdm.auto import tqdm


@torch.no_grad()
def perplexity(model, input_ids: torch.Tensor, window: int = 512, progress: bool = False) -> float:
    """Perplexity of a causal LM on one long token sequence, scored in consecutive non-overlapping windows."""
    model.eval()
    input_ids = input_ids.flatten()
    total_nll, total_tokens = 0.0, 0
    starts = range(0, len(input_ids) - 1, window)
    for start in tqdm(starts, desc="perplexity", disable=not progress, leave=False):
        chunk = input_ids[start : start + window + 1][None].to(model.device)
        if chunk.shape[1] < 2:
            break
        logits = model(chunk[:, :-1]).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum")
        total_nll += nll.item()
        total_tokens += chunk.shape[1] - 1
    return math.exp(total_nll / total_tokens)
