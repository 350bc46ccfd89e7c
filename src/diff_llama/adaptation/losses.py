"""The recipe's losses: cross-entropy of a retrieval example's answer alone, and next-token loss on a text block
(optionally with a KL term to the model as it was before training)."""

from __future__ import annotations

import contextlib

import torch


def _at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits make a coarse loss


def answer_loss(model, input_ids: list[int] | torch.Tensor, answer_tokens: int) -> torch.Tensor:
    """Cross-entropy of the last `answer_tokens` tokens given everything before them; the lm head only sees the
    positions that predict them. `input_ids`: a list, or a (1, length) tensor already on the model's device (a
    DDP-wrapped model has no `device`)."""
    ids = input_ids if torch.is_tensor(input_ids) else torch.tensor([input_ids], device=model.device)
    logits = _at_least_float32(model(input_ids=ids, logits_to_keep=answer_tokens + 1).logits[0, :-1])
    return torch.nn.functional.cross_entropy(logits, ids[0, -answer_tokens:])


def text_loss(model, block: torch.Tensor, reference=None, kl_weight: float = 0.0, autocast=None) -> torch.Tensor:
    """Next-token loss on a block (1-d, or (1, length) already on the device), plus `kl_weight` x KL to `reference`
    (run under `autocast`, a context manager factory: autocast of the trained model is the Trainer's, not the
    reference's)."""
    ids = block if block.dim() == 2 else block[None].to(model.device)
    logits = _at_least_float32(model(input_ids=ids).logits[0, :-1])
    loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    if reference is not None and kl_weight > 0:
        with torch.no_grad(), (autocast or contextlib.nullcontext)():
            target = reference(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
        loss = loss + kl_weight * torch.nn.functional.kl_div(logits.log_softmax(-1), target, log_target=True,
                                                             reduction="batchmean")
    return loss
