"""Multi-needle retrieval and attention allocation, after the Differential Transformer paper (§3.4, Tables 2 and 3).

Works for any causal LM: a plain LLaMA (folder, .gguf file or 'smollm2') as well as a DiffLlama folder.

- Retrieval: needles "The magic number for {city} is {7-digit number}." are set in generated filler text. The
  answer needle (the first queried city's) sits at a given depth of the context, N needles in all, R of them queried.
  A case is correct when every queried number appears (as a whole digit run) in the greedy output, which stops at
  the end of the answer or once R numbers of seven or more digits are out (listing many numbers earns nothing).
- Attention allocation: from the answer-generating position (the prompt's last token, whose logits give the first
  answer token), the attention mass on the answer needle's tokens, on the question (everything after the context)
  and on the rest (noise: filler, the other needles, the prompt's prefix), averaged over layers and heads. The maps
  are the ones the model applies to its values (`effective_attention_maps`): differential maps for a DiffLlama,
  softmax maps for a LLaMA. Only the last query row of every layer is ever formed with eager attention: the prompt
  is prefilled with the fast backend and a cache, then its last token alone is run with `output_attentions=True`,
  so memory stays at (layers x heads x context) numbers whatever the context length.

The filler text is generated from a small grammar (no digits, no city names), so it shares nothing with the
docstring text used for calibration, training and perplexity (`corpus.py`). `HELD_OUT_CITIES` are the evaluation's;
`TRAINING_CITIES` are disjoint from them, for training recipes that must not see the evaluation's needles.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from diff_llama_cli.options import RetrievalArguments

from .precision import resolve_dtype

HELD_OUT_CITIES = (
    "Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Nairobi", "Madrid", "Toronto", "Mumbai", "Sydney", "Berlin",
    "Santiago", "Bangkok", "Dublin", "Havana", "Vienna", "Lagos", "Seoul", "Athens", "Bogota", "Prague", "Manila",
    "Lisbon", "Moscow", "Dakar", "Quito", "Warsaw", "Hanoi", "Boston", "Chicago", "Rome", "Jakarta",
)
TRAINING_CITIES = (
    "London", "Beijing", "Delhi", "Istanbul", "Mexico City", "Karachi", "Buenos Aires", "Tehran", "Kinshasa",
    "Luanda", "Riyadh", "Baghdad", "Houston", "Phoenix", "Melbourne", "Montreal", "Hamburg", "Munich", "Milan",
    "Naples", "Kyiv", "Budapest", "Bucharest", "Stockholm", "Helsinki", "Copenhagen", "Brussels", "Zurich",
    "Geneva", "Porto", "Seville", "Valencia",
)

CATEGORIES = ("answer", "other_needles", "filler", "prefix", "question")
"""Token classes of a prompt: the answer needle, the other needles, the filler, what comes before the context (BOS,
system prompt, chat markup) and the question (everything after the context, chat markup included)."""
NOISE = ("other_needles", "filler", "prefix")  # everything except the answer and the question

_SUBJECTS = (
    "The old farmer", "A quiet student", "The baker", "Our neighbour", "The young painter", "A tired traveller",
    "The gardener", "The teacher", "A small child", "The fisherman", "The carpenter", "My grandmother", "The doctor",
    "A curious cat", "The shepherd", "The musician", "The librarian", "A patient nurse", "The potter", "The sailor",
)
_VERBS = (
    "carried", "painted", "watched", "repaired", "found", "described", "cleaned", "opened", "borrowed", "folded",
    "measured", "sketched", "noticed", "polished", "wrapped", "collected", "counted", "admired", "lifted", "moved",
)
_OBJECTS = (
    "a basket of apples", "the wooden fence", "an old wool blanket", "the broken lantern", "a bundle of letters",
    "the blue teapot", "a pile of autumn leaves", "the heavy iron gate", "a jar of honey", "the narrow staircase",
    "a loaf of warm bread", "the faded map", "a pair of leather boots", "the garden wall", "a cup of strong tea",
    "the silver spoon", "a box of candles", "the long wooden table", "a coil of rope", "the painted door",
)
_TAILS = (
    "before the rain began", "with great care", "while the children played outside", "at the end of the day",
    "without saying a word", "as the sun went down", "after a long walk", "in the early morning", "near the river",
    "by the open window", "on the way home", "under the old oak tree", "in the warm kitchen", "during the storm",
    "before anyone else woke up", "with a cheerful song", "beside the quiet pond", "at the edge of the village",
)
_PLACES = ("the valley", "the market", "the harbour", "the forest", "the meadow", "the village", "the hills",
           "the orchard", "the old mill", "the library")
_ADJECTIVES = ("calm", "cold", "bright", "quiet", "windy", "grey", "warm", "peaceful", "busy", "misty")


def filler_sentences(count: int, seed: int | str = 0) -> list[str]:
    """`count` generated English sentences, without digits or city names. The first k sentences do not depend on
    `count` (same seed, same prefix)."""
    rng = random.Random(f"filler-{seed}")
    sentences = []
    for _ in range(count):
        form = rng.random()
        if form < 0.6:
            sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."
        elif form < 0.8:
            sentence = f"It was {rng.choice(_ADJECTIVES)} and {rng.choice(_ADJECTIVES)} in {rng.choice(_PLACES)}."
        else:
            sentence = (f"{rng.choice(_SUBJECTS)} walked to {rng.choice(_PLACES)} and "
                        f"{rng.choice(_VERBS)} {rng.choice(_OBJECTS)}.")
        sentences.append(sentence)
    return sentences


def needle_sentence(city: str, number: int) -> str:
    return f"The magic number for {city} is {number}."


def question_text(cities) -> str:
    if len(cities) == 1:
        return f"What is the magic number for {cities[0]}? Answer with the number only."
    names = ", ".join(cities[:-1]) + f" and {cities[-1]}"
    return f"What are the magic numbers for {names}? Answer with the numbers only."


@dataclass
class NeedleCase:
    """One retrieval prompt, tokenized, with the class of every token (an index into CATEGORIES)."""

    length: int  # the target length in tokens (the prompt has at most this many)
    depth: float  # where the answer needle sits in the context, 0 (start) .. 1 (end)
    num_needles: int
    num_queries: int
    seed: str
    cities: list[str]  # every needle's city; the first num_queries are queried, cities[0] is the answer needle
    numbers: list[int]
    prompt: str  # the text that was tokenized (chat template applied when used)
    input_ids: list[int]
    categories: list[int]

    @property
    def query_numbers(self) -> list[int]:
        return self.numbers[: self.num_queries]

    @property
    def answer_positions(self) -> list[int]:
        return [i for i, c in enumerate(self.categories) if c == 0]


def _overlaps(start: int, end: int, span: tuple[int, int]) -> bool:
    return start < span[1] and end > span[0]


def make_case(tokenizer, length: int, depth: float, num_needles: int, num_queries: int, seed: int | str = 0,
              chat_template: bool = True, city_pool=HELD_OUT_CITIES, filler=None) -> NeedleCase:
    """Build one prompt of at most `length` tokens: filler sentences with `num_needles` needles, the answer needle
    at `depth` (a fraction of the context), then a question about the first `num_queries` needles' cities.

    `city_pool` and `filler` (a function of (count, seed) giving sentences; default: the generated evaluation filler)
    let training recipes build cases the evaluation never shows (`TRAINING_CITIES`, other text)."""
    if not 1 <= num_queries <= num_needles:
        raise ValueError(f"need 1 <= R <= N, got N={num_needles}, R={num_queries}")
    if num_needles > len(city_pool):
        raise ValueError(f"at most {len(city_pool)} needles")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(f"case-{seed}")
    cities = rng.sample(city_pool, num_needles)
    numbers = []
    while len(numbers) < num_needles:
        number = rng.randint(1_000_000, 9_999_999)
        if number not in numbers:
            numbers.append(number)
    other_fractions = [rng.random() for _ in range(num_needles - 1)]
    sentences = (filler or filler_sentences)(max(16, length // 4), f"{seed}")
    use_template = chat_template and getattr(tokenizer, "chat_template", None)
    question = question_text(cities[:num_queries])

    def build(k: int):
        # Slots 0..k: slot j comes before filler sentence j. Within a slot the answer needle goes first in the
        # first half of the context and last in the second half, so depths 0 and 1 are the very start and end.
        order = [(round(depth * k), -1 if depth < 0.5 else 1, 0)]
        order += [(round(f * k), 0, i + 1) for i, f in enumerate(other_fractions)]
        order.sort()
        pieces, needle_of_piece = [], []
        position = 0
        for j in range(k + 1):
            while position < len(order) and order[position][0] == j:
                needle = order[position][2]
                pieces.append(needle_sentence(cities[needle], numbers[needle]))
                needle_of_piece.append(needle)
                position += 1
            if j < k:
                pieces.append(sentences[j])
                needle_of_piece.append(None)
        spans, offset = {}, 0
        for piece, needle in zip(pieces, needle_of_piece):
            if needle is not None:
                spans[needle] = (offset, offset + len(piece))
            offset += len(piece) + 1
        context = " ".join(pieces)
        message = f"{context}\n\n{question}"
        if use_template:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                                   add_generation_prompt=True)
            encoding = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
        else:
            prompt = f"{message}\nAnswer:"
            encoding = tokenizer(prompt, return_offsets_mapping=True)
        return prompt, context, spans, encoding

    low, high = 0, len(sentences)
    while low < high:  # the most filler sentences that fit in `length` tokens
        middle = (low + high + 1) // 2
        if len(build(middle)[3]["input_ids"]) <= length:
            low = middle
        else:
            high = middle - 1
    prompt, context, spans, encoding = build(low)
    if len(encoding["input_ids"]) > length:
        raise ValueError(f"{length} tokens cannot hold {num_needles} needles and the question")
    start = prompt.find(context)
    if start < 0:
        raise ValueError("the chat template changed the context text; cannot locate the needles")
    end = start + len(context)
    spans = {needle: (a + start, b + start) for needle, (a, b) in spans.items()}
    categories, seen_context = [], False
    for token_start, token_end in encoding["offset_mapping"]:
        if token_end == token_start:  # a special token the tokenizer added (no text): BOS before, anything after
            category = "question" if seen_context else "prefix"
        elif _overlaps(token_start, token_end, spans[0]):
            category = "answer"
        elif any(_overlaps(token_start, token_end, span) for needle, span in spans.items() if needle):
            category = "other_needles"
        elif token_start >= end:
            category = "question"
        elif token_end > start:
            category = "filler"
        else:
            category = "prefix"
        seen_context = seen_context or category != "prefix"
        categories.append(CATEGORIES.index(category))
    return NeedleCase(length=length, depth=depth, num_needles=num_needles, num_queries=num_queries, seed=str(seed),
                      cities=cities, numbers=numbers, prompt=prompt, input_ids=list(encoding["input_ids"]),
                      categories=categories)


_COMPLETE_NUMBER = re.compile(r"\d{7,}(?=\D)")


def score_output(text: str, numbers) -> list[bool]:
    """Exact match: for each expected number, whether it appears as a whole run of digits in `text`."""
    runs = set(re.findall(r"\d+", text))
    return [str(number) in runs for number in numbers]


# ---------------------------------------------------------------------------------------------------------------
# Attention maps


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
        from .modeling_diff_llama import differential_attention_maps

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


@torch.no_grad()
def run_case(model, tokenizer, case: NeedleCase, max_new_tokens: int = 48, allocation: bool = True) -> dict:
    """Greedy answer to one case (with a cache) and, if `allocation`, the attention allocation of the position that
    generates the first answer token."""
    ids = torch.tensor([case.input_ids], device=model.device)
    backend = model.config._attn_implementation
    past = None
    if ids.shape[1] > 1:
        past = model(input_ids=ids[:, :-1], use_cache=True).cache
    shares = None
    if allocation:
        _set_attention(model, "eager")
        try:
            # Hidden states too: DIFF V2's λ is a function of each layer's input at this token.
            out = model(input_ids=ids[:, -1:], cache=past, use_cache=True, output_attentions=True,
                        output_hidden_states=True)
            shares = attention_allocation(effective_attention_maps(model, out), case.categories)
        finally:
            _set_attention(model, backend)
    else:
        out = model(input_ids=ids[:, -1:], cache=past, use_cache=True)
    stop = _eos_ids(model, tokenizer)
    generated = []
    for step in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        if token in stop:
            break
        generated.append(token)
        # The answer is the first R numbers the model states: stop once R complete 7-digit-or-longer runs are out.
        if len(_COMPLETE_NUMBER.findall(tokenizer.decode(generated, skip_special_tokens=True))) >= case.num_queries:
            break
        if step + 1 < max_new_tokens:
            out = model(input_ids=torch.tensor([[token]], device=model.device), cache=out.cache,
                        use_cache=True)
    text = tokenizer.decode(generated, skip_special_tokens=True)
    found = score_output(text, case.query_numbers)
    return {"output": text, "found": found, "correct": all(found), "allocation": shares}


# ---------------------------------------------------------------------------------------------------------------
# The evaluation


def load_model(name: str, dtype: str = "float32", device: str = "cpu"):
    """Model (dtype: a `RetrievalArguments.dtype` value) and tokenizer from a folder, a .gguf file, a Hub id, or
    'smollm2' (see `resolve.resolve_model`)."""
    import diff_llama  # noqa: F401  (registers DiffLlama with the Auto classes)

    from .resolve import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(name)
    model = load_causal_lm(name, dtype=resolve_dtype(dtype, device), attn_implementation="sdpa")
    return model.to(device).eval(), tokenizer


def display_name(name: str) -> str:
    if name == "smollm2":
        return "SmolLM2-135M-Instruct"
    return Path(name.rstrip("/")).name or name


def make_cases(tokenizer, options: RetrievalArguments) -> list[NeedleCase]:
    cases = []
    for length in options.lengths:
        for num_needles, num_queries in options.parsed_settings():
            for depth in options.depths:
                for index in range(options.cases_per_depth):
                    seed = f"{options.seed}-{length}-{num_needles}x{num_queries}-{depth:g}-{index}"
                    cases.append(make_case(tokenizer, length, depth / 100, num_needles, num_queries, seed,
                                           chat_template=options.chat_template))
    return cases


def evaluate_model(model, tokenizer, options: RetrievalArguments, name: str = "model",
                   progress_file: str | Path | None = None) -> dict:
    """Retrieval and allocation of one loaded model on the cases `options` describe, plus held-out perplexity.
    With `progress_file`, every case's result is also appended to it as one JSON line as soon as it is known."""
    cases = make_cases(tokenizer, options)
    results = []
    started = time.perf_counter()
    for case in tqdm(cases, desc=f"evaluate {name}"):
        result = run_case(model, tokenizer, case, options.max_new_tokens, options.attention)
        results.append({
            "length": case.length, "prompt_tokens": len(case.input_ids), "num_needles": case.num_needles,
            "num_queries": case.num_queries, "depth": case.depth, "seed": case.seed,
            "expected": case.query_numbers, "answer_positions": [min(case.answer_positions),
                                                                 max(case.answer_positions)],
            **result,
        })
        if progress_file is not None:
            with open(progress_file, "a") as handle:
                handle.write(json.dumps({"model": name, **results[-1]}) + "\n")
    report = {"name": name, "model_type": model.config.model_type, "maps": map_kind(model),
              "dtype": str(model.dtype).removeprefix("torch."), "seconds": round(time.perf_counter() - started, 1),
              "cases": results}
    if options.perplexity_tokens > 0:
        from .corpus import HELD_OUT_MODULES, stdlib_docstrings
        from .evaluation import perplexity

        ids = tokenizer(stdlib_docstrings(HELD_OUT_MODULES), return_tensors="pt", add_special_tokens=False)
        report["perplexity"] = perplexity(model, ids.input_ids[0][: options.perplexity_tokens])
    report["summary"] = summarize(results)
    return report


def _mean(values) -> float | None:
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
        means = {k: _mean(a[k] for a in rows) for k in (*CATEGORIES, "noise", "total")}
        # Shares of the row total: a differential map's rows sum to 1 - λ, so raw masses of models with different λ
        # (V2's conversion starts at λ = 0.5) are not comparable; their shares are.
        means.update({f"{k}_share": means[k] / means["total"] for k in (*CATEGORIES, "noise")})
        return means

    summary = {
        "accuracy": _mean(r["correct"] for r in results),
        "accuracy_by_cell": {f"{length}/{n}x{q}": _mean(r["correct"] for r in rows) for (length, n, q), rows in
                             group(lambda r: (r["length"], r["num_needles"], r["num_queries"])).items()},
        "accuracy_by_depth": {f"{d * 100:g}": _mean(r["correct"] for r in rows)
                              for d, rows in group(lambda r: r["depth"]).items()},
        "accuracy_by_length": {str(k): _mean(r["correct"] for r in rows)
                               for k, rows in group(lambda r: r["length"]).items()},
        "allocation": allocation(results),
        "allocation_by_depth": {f"{d * 100:g}": allocation(rows) for d, rows in group(lambda r: r["depth"]).items()},
        "allocation_by_length": {str(k): allocation(rows) for k, rows in group(lambda r: r["length"]).items()},
    }
    return summary


def evaluate_models(models: list[str], options: RetrievalArguments, overwrite: bool = False) -> dict:
    """Evaluate every model (folder, .gguf, Hub id or 'smollm2') in turn; write and return the report.

    `options.output` must be new or empty (an earlier evaluation there would be lost), unless `overwrite`: then the
    new report is written beside it and replaces it when complete."""
    if options.threads > 0:
        torch.set_num_threads(options.threads)
    names = options.names or [display_name(m) for m in models]
    if len(names) != len(models):
        raise ValueError(f"{len(names)} names for {len(models)} models")
    from .resolve import find_model

    for source in models:  # a missing model (or tokenizer) stops the run before its output folder is made
        find_model(source, tokenizer=True)
    from .output_folder import new_output_folder

    report = {"options": asdict(options), "models": []}
    with new_output_folder(options.output, overwrite=overwrite) as folder:
        progress_file = folder / "cases.jsonl"  # results so far, for long runs
        for source, name in zip(models, names):
            model, tokenizer = load_model(source, options.dtype, options.device)
            entry = evaluate_model(model, tokenizer, options, name, progress_file=progress_file)
            entry["source"] = source
            report["models"].append(entry)
            del model
        write_report(report, folder)
    return report


# ---------------------------------------------------------------------------------------------------------------
# Output


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def _num(value, digits=3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def paired_comparison(first_cases: list[dict], second_cases: list[dict]) -> dict:
    """Two models on the same cases: how many each alone got right, and the exact two-sided McNemar p-value (a
    binomial test on the cases where they disagree), the test for paired proportions."""
    if [c["seed"] for c in first_cases] != [c["seed"] for c in second_cases]:
        raise ValueError("paired_comparison needs the same cases in the same order (run both with the same options)")
    pairs = [(a["correct"], b["correct"]) for a, b in zip(first_cases, second_cases)]
    only_first = sum(a and not b for a, b in pairs)
    only_second = sum(b and not a for a, b in pairs)
    disagree = only_first + only_second
    tail = sum(math.comb(disagree, k) for k in range(min(only_first, only_second) + 1)) / 2 ** disagree
    return {"cases": len(pairs), "both": sum(a and b for a, b in pairs), "only_first": only_first,
            "only_second": only_second, "neither": sum(not a and not b for a, b in pairs),
            "p_value": min(1.0, 2 * tail)}


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
    from .plotting import pyplot, save_png

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
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_png(fig, output)


def write_report(report: dict, output: str | Path) -> dict:
    """Write retrieval.json, retrieval.md and retrieval.png into the folder `output`."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "retrieval.json").write_text(json.dumps(report, indent=1))
    (output / "retrieval.md").write_text(markdown_report(report))
    plot_report(report, output / "retrieval.png")
    return {"json": output / "retrieval.json", "markdown": output / "retrieval.md", "plot": output / "retrieval.png"}


def _check_same_cases(reports: list[dict], with_lengths: bool) -> None:
    """Raise ValueError unless the reports were run on the same cases (at the same lengths, if `with_lengths`)."""
    same = ("settings", "depths", "cases_per_depth", "seed", "max_new_tokens", "chat_template")
    same = ("lengths", *same) if with_lengths else same
    first = reports[0]["options"]
    for report in reports[1:]:
        different = [k for k in same if report["options"][k] != first[k]]
        if different:
            raise ValueError(f"reports were run with different options: {', '.join(different)}")


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
            raise ValueError(f"reports hold different models: {names} and {[m['name'] for m in report['models']]}")
    lengths = [n for report in reports for n in report["options"]["lengths"]]
    if len(set(lengths)) != len(lengths):
        raise ValueError(f"a length appears in more than one report: {lengths}; join runs at different lengths")
    models = []
    for index, model in enumerate(first["models"]):
        joined = dict(model, cases=[c for report in reports for c in report["models"][index]["cases"]])
        joined["summary"] = summarize(joined["cases"])
        models.append(joined)
    return {"options": dict(first["options"], lengths=lengths), "models": models}


def run_evaluate(models: list[str], options: RetrievalArguments, overwrite: bool = False) -> int:
    """`diff-llama evaluate MODEL [MODEL ...] [options]` (declared in `diff_llama_cli`)."""
    options.parsed_settings()  # a bad NxR fails before any model loads
    report = evaluate_models(models, options, overwrite=overwrite)
    print(markdown_report(report))
    print(f"Wrote {Path(options.output) / 'retrieval.json'}, retrieval.md, retrieval.png and cases.jsonl")
    return 0
