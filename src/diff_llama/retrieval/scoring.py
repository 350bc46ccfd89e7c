"""Scoring one case: the greedy answer, exact match of the queried numbers, and the attention allocation.

A case is correct when every queried number appears (as a whole digit run) in the greedy output, which stops at the
end of the answer or once R numbers of seven or more digits are out (listing many numbers earns nothing).

Attention allocation: from the answer-generating position (the prompt's last token, whose logits give the first
answer token), the attention mass on the answer needle's tokens, on the question (everything after the context) and
on the rest (noise: filler, the other needles, the prompt's prefix), averaged over layers and heads. The maps are the
ones the model applies to its values (`effective_attention_maps`): differential maps for a DiffLlama, softmax maps
for a LLaMA. Only the last query row of every layer is ever formed with eager attention: the prompt is prefilled
with the fast backend and a cache, then its last token alone is run with `output_attentions=True`, so memory stays
at (layers x heads x context) numbers whatever the context length.
"""

from __future__ import annotations

import re

import torch

from ..compat_diff_llama import cache_kwargs, output_cache  # the cache's name differs across transformers 5.x
from .cases import CATEGORIES, NOISE, NeedleCase


_COMPLETE_NUMBER = re.compile(r"\d{7,}(?=\D)")


def score_output(text: str, numbers) -> list[bool]:
    """Exact match: for each expected number, whether it appears as a whole run of digits in `text`."""
    runs = set(re.findall(r"\d+", text))
    return [str(number) in runs for number in numbers]


def effective_attention_maps(model, outputs) -> tuple[torch.Tensor, ...]:
    """The attention maps a model applies to its values, one (batch, heads, q, k) float tensor per layer, from the
    outputs of a forward pass with eager attention, `output_attentions=True` and `output_hidden_states=True`.

    This is the one place that knows which maps a model has:
    - a model with a `differential_maps(outputs)` method (a DiffLlama, V1 or V2; or
      `differential_attention_maps_from_outputs(outputs)`): the differential maps it reports;
    - an older DiffLlama V1 (model_type "diff_llama", no such method): A1 - λ·A2 per differential head;
    - anything else: the softmax maps as they are (rows sum to 1).
    """
    for method_name in ("differential_maps", "differential_attention_maps_from_outputs"):
        method = getattr(model, method_name, None)
        if callable(method):
            return tuple(m.float() for m in method(outputs))
    config = model.config
    if getattr(config, "model_type", None) == "diff_llama":
        if getattr(config, "diff_version", 1) != 1:
            raise NotImplementedError(f"no differential maps for diff_version={config.diff_version}")
        from ..modeling_diff_llama import differential_attention_maps

        return tuple(differential_attention_maps(outputs.attentions, model.get_lambdas()))
    if outputs.attentions is None or any(a is None for a in outputs.attentions):
        raise ValueError("the model returned no attention maps (it needs eager attention)")
    return tuple(a.float() for a in outputs.attentions)


def map_kind(model) -> str:
    """"softmax", or "differential (Vn)" for a DiffLlama."""
    if getattr(model.config, "model_type", None) == "diff_llama" or callable(
            getattr(model, "differential_attention_maps_from_outputs", None)):
        return f"differential (V{getattr(model.config, 'diff_version', 1)})"
    return "softmax"


def attention_allocation(maps, categories) -> dict:
    """Attention mass of the last query row on each token class, averaged over layers and heads.

    `maps`: per-layer (batch=1, heads, q, k) maps; `categories`: the class (index into CATEGORIES) of each of the k
    keys. Returns one number per class, "noise" (the sum over NOISE) and "total" (the mean row sum: 1 for softmax
    maps, 1 - λ for V1 differential maps), so that answer + noise + question == total.
    """
    rows = torch.stack([m[0, :, -1, :].double() for m in maps])  # (layers, heads, k)
    classes = torch.as_tensor(categories, device=rows.device)
    if classes.numel() != rows.shape[-1]:
        raise ValueError(f"{classes.numel()} token classes for {rows.shape[-1]} keys")
    shares = {name: rows[..., classes == code].sum(-1).mean().item() for code, name in enumerate(CATEGORIES)}
    shares["noise"] = sum(shares[name] for name in NOISE)
    shares["total"] = rows.sum(-1).mean().item()
    return shares


def _set_attention(model, implementation: str) -> None:
    if model.config._attn_implementation != implementation:
        model.set_attn_implementation(implementation)


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if value is None:
            continue
        ids.update(value if isinstance(value, (list, tuple)) else [value])
    return ids


def greedy_answer(model, tokenizer, input_ids: list[int], max_new_tokens: int, answered=None,
                  categories: list[int] | None = None, lookahead: bool | None = None) -> tuple[str, dict | None]:
    """The greedy continuation of `input_ids` (with a cache), stopped at an end-of-sequence token, after
    `max_new_tokens`, or once `answered(text so far)` is true; and, given the `categories` of the prompt's tokens, the
    attention allocation of the position that generates the first answer token.

    `lookahead` (default: on an accelerator) queues each step before the previous token is read back, so that the
    host prepares the next step while the device computes; the same steps run on the same inputs, so the answer is
    the same, at the price of one step computed after the last."""
    return greedy_answers(model, tokenizer, [input_ids], max_new_tokens, None if answered is None else [answered],
                          None if categories is None else [categories], lookahead)[0]


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, answered=None,
                   categories=None, lookahead: bool | None = None) -> list[tuple[str, dict | None]]:
    """`greedy_answer` for several prompts at once (`answered` and `categories`: one per prompt, or None): one batch,
    left-padded, with the positions and the mask `generate` gives it, so each row computes what it computes alone.
    A row stops as it would alone; the batch runs until every row has stopped. One prompt runs without padding or
    mask, exactly as before batches existed."""
    rows = len(prompts)
    width = max(len(ids) for ids in prompts)
    pads = [width - len(ids) for ids in prompts]
    filler = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # masked: any id does
    ids = torch.tensor([[filler] * pad + list(prompt) for pad, prompt in zip(pads, prompts)], device=model.device)
    padded = any(pads)
    if padded:
        mask = torch.tensor([[0] * pad + [1] * len(prompt) for pad, prompt in zip(pads, prompts)], device=model.device)
        mask = torch.cat([mask, mask.new_ones(rows, max_new_tokens)], dim=-1)  # the answer's tokens too
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # each row's first token at position 0, as alone

    def padding(start: int, end: int) -> dict:
        """The mask and positions of a forward over the batch's tokens start..end (none without padding)."""
        return {"attention_mask": mask[:, :end], "position_ids": positions[:, start:end]} if padded else {}

    backend = model.config._attn_implementation
    past = None
    if width > 1:  # only the cache is used: no logits over the whole prompt
        past = output_cache(model(input_ids=ids[:, :-1], use_cache=True, logits_to_keep=1, **padding(0, width - 1)))
    shares = [None] * rows
    if categories is not None:
        _set_attention(model, "eager")
        try:
            # Hidden states too: DIFF V2's λ is a function of each layer's input at this token.
            out = model(input_ids=ids[:, -1:], **cache_kwargs(past), use_cache=True, output_attentions=True,
                        output_hidden_states=True, **padding(width - 1, width))
            maps = effective_attention_maps(model, out)
            shares = [attention_allocation([m[row:row + 1, ..., pads[row]:] for m in maps], categories[row])
                      for row in range(rows)]
        finally:
            _set_attention(model, backend)
    else:
        out = model(input_ids=ids[:, -1:], **cache_kwargs(past), use_cache=True, **padding(width - 1, width))
    if lookahead is None:
        lookahead = model.device.type != "cpu"

    def step(out, next_ids, index: int):  # reads the answer's token `index`, gives the logits of the next one
        return model(input_ids=next_ids, **cache_kwargs(output_cache(out)), use_cache=True,
                     **padding(width + index, width + index + 1))

    stop = _eos_ids(model, tokenizer)
    generated = [[] for _ in range(rows)]
    running = set(range(rows))
    for index in range(max_new_tokens):
        next_ids = out.logits[:, -1:].argmax(-1)  # (rows, 1), on the model's device
        if lookahead and index + 1 < max_new_tokens:
            out = step(out, next_ids, index)
        tokens = next_ids[:, 0].tolist()  # waits for the device (under lookahead, while the next step is queued)
        for row in sorted(running):
            if tokens[row] in stop:
                running.discard(row)
                continue
            generated[row].append(tokens[row])
            if answered is not None and answered[row](tokenizer.decode(generated[row], skip_special_tokens=True)):
                running.discard(row)
        if not running:
            break
        if not lookahead and index + 1 < max_new_tokens:
            out = step(out, next_ids, index)
    return [(tokenizer.decode(tokens, skip_special_tokens=True), share) for tokens, share in zip(generated, shares)]


def run_case(model, tokenizer, case: NeedleCase, max_new_tokens: int = 48, allocation: bool = True) -> dict:
    """Greedy answer to one case (with a cache) and, if `allocation`, the attention allocation of the position that
    generates the first answer token."""
    return run_cases(model, tokenizer, [case], max_new_tokens, allocation)[0]


def run_cases(model, tokenizer, cases: list[NeedleCase], max_new_tokens: int = 48, allocation: bool = True,
              lookahead: bool | None = None) -> list[dict]:
    """`run_case` for several cases in one batch (`greedy_answers`)."""
    # The answer is the first R numbers the model states: stop once R complete 7-digit-or-longer runs are out.
    answers = greedy_answers(model, tokenizer, [case.input_ids for case in cases], max_new_tokens,
                             [_stated(case.num_queries) for case in cases],
                             [case.categories for case in cases] if allocation else None, lookahead)
    results = []
    for case, (text, shares) in zip(cases, answers):
        found = score_output(text, case.query_numbers)
        results.append({"output": text, "found": found, "correct": all(found), "allocation": shares})
    return results


def _stated(count: int):
    return lambda text: len(_COMPLETE_NUMBER.findall(text)) >= count
