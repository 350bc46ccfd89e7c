"""The example stream: retrieval examples and language-modelling blocks, indexed by position.

The examples form one global stream: step s trains on examples s·B .. s·B + B − 1 (B = `batch_size`), each process
taking its share of them, so the same seed trains on the same examples whatever the device and the number of
processes, and a resumed run goes on from the first example it had not trained on.
"""

from __future__ import annotations

import functools
import random
import re

import torch

from ..errors import UserError
from ..retrieval import TRAINING_CITIES, make_case
from ..retrieval.cases import NeedlesDoNotFit
from .settings import AdaptationOptions


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@functools.lru_cache(maxsize=1)
def training_text() -> str:
    """The training docstrings, held-out text excluded: the retrieval filler and the language-modelling blocks."""
    from ..corpus import HELD_OUT_MODULES, TRAINING_MODULES, stdlib_docstrings

    return stdlib_docstrings(TRAINING_MODULES, exclude=stdlib_docstrings(HELD_OUT_MODULES))


def training_sentences() -> list[str]:
    """Sentences of the training docstrings, without digits (they would compete with the needles' numbers): the
    retrieval examples' filler. The evaluation's filler is generated from a grammar and shares none of them."""
    sentences = []
    for paragraph in training_text().split("\n\n"):
        for sentence in _SENTENCE_END.split(" ".join(paragraph.split())):
            if 20 <= len(sentence) <= 300 and not re.search(r"\d", sentence) and sentence[-1] in ".!?":
                sentences.append(sentence)
    return sentences


class RetrievalExamples:
    """An endless, seeded stream of training examples: (input_ids, number of answer tokens at the end), read in order
    (`next()`) or by position (`examples[i]`, the same example as the i-th `next()`).

    Each example's random choices are drawn in sequence from one generator, as they always were (so a seed gives the
    stream it gave before); reaching example i replays the cheap draws of the examples before it, never their text."""

    def __init__(self, tokenizer, options: AdaptationOptions):
        self.tokenizer, self.options = tokenizer, options
        self.sentences = training_sentences()
        self.rng = random.Random(f"adapt-{options.seed}")
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self._draws, self._next = [], 0

    def _filler(self, count: int, seed: str) -> list[str]:
        rng = random.Random(f"filler-{seed}")
        start = rng.randrange(len(self.sentences))
        return [self.sentences[(start + i) % len(self.sentences)] for i in range(count)]

    def check_lengths(self) -> None:
        """Refuse, before any work, a --min-length too short for the most needles an example may hold (found
        otherwise at the first such example drawn, steps into training)."""
        o = self.options
        needed = []
        for seed in range(8):  # the needles' cities and numbers vary by case, and their token counts with them
            try:
                make_case(self.tokenizer, o.min_length, 0.5, o.max_needles, min(o.max_queries, o.max_needles),
                          seed=f"check-{seed}", city_pool=TRAINING_CITIES, filler=self._filler)
            except NeedlesDoNotFit as error:
                needed.append(error.needed)
        if needed:
            raise UserError(f"--min-length {o.min_length} cannot hold --max-needles {o.max_needles} needles and the "
                            f"question, which take up to {max(needed)} tokens with this tokenizer; raise --min-length "
                            f"to at least {max(needed)}, or lower --max-needles.")

    def answer_ids(self, numbers) -> list[int]:
        text = ", ".join(str(n) for n in numbers)
        if self.chat:  # the end-of-turn token closes the assistant message, as in the template
            return self.tokenizer(text + self.tokenizer.eos_token, add_special_tokens=False).input_ids
        return self.tokenizer(" " + text, add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id]

    def _draw(self) -> tuple:
        o, rng = self.options, self.rng
        needles = rng.randint(1, o.max_needles)
        queries = rng.randint(1, min(o.max_queries, needles))
        length = rng.randint(o.min_length, o.max_length)
        if o.long_length and rng.random() < o.long_fraction:  # no extra draw without long examples: same stream
            length = rng.randint(o.max_length + 1, o.long_length)
        depth = rng.random()
        return length, depth, needles, queries, f"adapt-{o.seed}-{rng.random()}"

    def __getitem__(self, index: int) -> tuple[list[int], int]:
        while len(self._draws) <= index:
            self._draws.append(self._draw())
        length, depth, needles, queries, seed = self._draws[index]
        case = make_case(self.tokenizer, length, depth, needles, queries, seed=seed, city_pool=TRAINING_CITIES,
                         filler=self._filler)
        answer = self.answer_ids(case.query_numbers)
        return case.input_ids + answer, len(answer)

    def next(self) -> tuple[list[int], int]:
        self._next += 1
        return self[self._next - 1]


class TextBlocks:
    """Blocks of `block` tokens of the training docstrings (held-out text excluded), reshuffled every pass: block k
    of the endless sequence is `blocks[k]`."""

    def __init__(self, tokenizer, block: int, seed: int):
        from ..training import TokenBlocks

        self.blocks = TokenBlocks(tokenizer, training_text(), block_size=block).blocks
        self.rng = torch.Generator().manual_seed(seed)
        self.orders = []  # one permutation per pass, drawn in sequence from `rng`

    def __getitem__(self, index: int) -> torch.Tensor:
        rounds, position = divmod(index, len(self.blocks))
        while len(self.orders) <= rounds:
            self.orders.append(torch.randperm(len(self.blocks), generator=self.rng))
        return self.blocks[self.orders[rounds][position]]


class AdaptationStream(torch.utils.data.Dataset):
    """The run's examples by position: item i is retrieval example i of step i // batch_size; the first item of every
    `text_every`-th step also carries the next language-modelling block. A sequential sampler (and accelerate's
    sharding of it across processes) hands each step's items out without building the ones a resumed run skips."""

    def __init__(self, tokenizer, options: AdaptationOptions, batch_size: int):
        self.options, self.batch_size = options, batch_size
        self.examples = RetrievalExamples(tokenizer, options)
        self.text = TextBlocks(tokenizer, options.text_block, options.seed) if options.text_every else None

    def __len__(self):
        return self.options.max_steps * self.batch_size

    def __getitem__(self, index: int) -> dict:
        step, slot = divmod(index, self.batch_size)
        input_ids, answer_tokens = self.examples[index]
        item = {"index": torch.tensor(index), "input_ids": torch.tensor(input_ids),
                "answer_tokens": torch.tensor(answer_tokens)}
        if self.text is not None and slot == 0 and step % self.options.text_every == 0:
            item["text_ids"] = self.text[step // self.options.text_every]
        return item


def collate_one(items: list[dict]) -> dict:
    """Examples differ in length: each micro-batch is one example, as a batch of one (no padding)."""
    (item,) = items
    return {key: value[None] for key, value in item.items()}
