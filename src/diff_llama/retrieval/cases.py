"""Retrieval cases: needles "The magic number for {city} is {7-digit number}." set in generated filler text.

The answer needle (the first queried city's) sits at a given depth of the context, N needles in all, R of them
queried; every token of the prompt gets a class (`CATEGORIES`) so that attention can be split by class later.

The filler text is generated from a small grammar (no digits, no city names), so it shares nothing with the
docstring text used for calibration, training and perplexity (`corpus.py`). `HELD_OUT_CITIES` are the evaluation's;
`TRAINING_CITIES` are disjoint from them, for training recipes that must not see the evaluation's needles.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..errors import UserError
from ..options import RetrievalArguments


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


class NeedlesDoNotFit(UserError):
    """A prompt length too short for its needles and question, with the length they need (`needed`)."""

    def __init__(self, length: int, num_needles: int, needed: int):
        self.length, self.num_needles, self.needed = length, num_needles, needed
        needles = "1 needle" if num_needles == 1 else f"{num_needles} needles"
        super().__init__(f"{length} tokens cannot hold {needles} and the question, which take {needed}; give a "
                         "length of at least that, or fewer needles.")


def make_case(tokenizer, length: int, depth: float, num_needles: int, num_queries: int, seed: int | str = 0,
              chat_template: bool = True, city_pool=HELD_OUT_CITIES, filler=None) -> NeedleCase:
    """Build one prompt of at most `length` tokens: filler sentences with `num_needles` needles, the answer needle
    at `depth` (a fraction of the context), then a question about the first `num_queries` needles' cities.

    `city_pool` and `filler` (a function of (count, seed) giving sentences; default: the generated evaluation filler)
    let training recipes build cases the evaluation never shows (`TRAINING_CITIES`, other text)."""
    if not 1 <= num_queries <= num_needles:
        raise UserError(f"setting {num_needles}x{num_queries} queries {num_queries} of {num_needles} needles; give NxR "
                        "with 1 <= R <= N, e.g. 4x2.")
    if num_needles > len(city_pool):
        raise UserError(f"{num_needles} needles is more than the {len(city_pool)} cities to hide; give at most "
                        f"{len(city_pool)}.")
    if not 0.0 <= depth <= 1.0:
        raise UserError(f"depth {depth:g} is outside the context; give a fraction from 0 to 1 (--depths: percent "
                        "from 0 to 100).")
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
        raise NeedlesDoNotFit(length, num_needles, len(encoding["input_ids"]))
    start = prompt.find(context)
    if start < 0:
        raise UserError("the chat template changed the context text, so the needles cannot be located; pass "
                        "--no-chat-template")
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


def case_plan(options: RetrievalArguments) -> list[dict]:
    """What `make_cases` builds, case by case, without a tokenizer: each case's `make_case` arguments. Its seed names
    it, so that a share of the cases can be built (and scored) apart from the rest."""
    return [dict(length=length, depth=depth / 100, num_needles=num_needles, num_queries=num_queries,
                 seed=f"{options.seed}-{length}-{num_needles}x{num_queries}-{depth:g}-{index}")
            for length in options.lengths for num_needles, num_queries in options.parsed_settings()
            for depth in options.depths for index in range(options.cases_per_depth)]


def make_cases(tokenizer, options: RetrievalArguments) -> list[NeedleCase]:
    return [make_case(tokenizer, **case, chat_template=options.chat_template) for case in case_plan(options)]
