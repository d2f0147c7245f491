"""Needle in a haystack: synthetic retrieval prompts over filler text (NeedleBench-style).

A sample is L tokens of haystack (the embedded stdlib corpus, or any corpus), with a
needle sentence that states a 5-digit pass key inserted at token floor(L' x depth / 100)
of the L' haystack tokens, followed by the question; the answer is the key:

    ... haystack ... The pass key is 48213. Remember it. 48213 is the pass key. ... haystack ...
    What is the pass key? The pass key is| 48213.

With several needles (multi-needle retrieval) each states the key of a different name, at
depth, depth + spread, ... (wrapping at 100), and the question asks for one of them.
Prompts are built from token ids (pieces encoded separately), so a prompt has exactly the
length asked for. `PasskeyDataset` turns samples into training windows whose only scored
targets are the answer's tokens; `needle_prompt` gives the evaluation's prompts.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from polytrain.data.corpus import open_corpus
from polytrain.data.tokenizer import Tokenizer

IGNORE = -100  # F.cross_entropy's ignore_index: not scored
NAMES = ("Alice", "Bruno", "Chen", "Dara", "Emeka", "Farah", "Goran", "Hana")


@dataclass(frozen=True)
class NeedlePrompt:
    """prompt: token ids (its length is the context length); answer: the key's text; answer_ids:
    the tokens a model should continue the prompt with."""

    prompt: list[int]
    answer: str
    answer_ids: list[int]


class Haystack:
    """Filler token ids: a corpus's documents, tokenized, end to end (cycled when a prompt is longer)."""

    def __init__(self, tokenizer: Tokenizer, n_tokens: int, source: str = "stdlib"):
        ids: list[int] = []
        for doc in open_corpus(source).documents():
            ids.extend(tokenizer.encode(doc.text))
            if len(ids) >= n_tokens:
                break
        if not ids:
            raise ValueError(f"haystack source {source!r} holds no text")
        self.ids = ids

    def take(self, start: int, n: int) -> list[int]:
        """n filler tokens from position `start` (modulo the haystack's length)."""
        out: list[int] = []
        start %= len(self.ids)
        while len(out) < n:
            out.extend(self.ids[start:start + n - len(out)])
            start = 0
        return out


@dataclass(frozen=True)
class Needles:
    """The facts of one sample: a key per needle, their names (None for a single needle), which is asked."""

    keys: list[str]
    names: list[str | None]
    asked: int

    @classmethod
    def draw(cls, rng: random.Random, count: int = 1) -> Needles:
        keys = [str(rng.randrange(10_000, 100_000)) for _ in range(count)]
        names = rng.sample(NAMES, count) if count > 1 else [None]
        return cls(keys, names, rng.randrange(count))

    @property
    def answer(self) -> str:
        return self.keys[self.asked]

    def answer_ids(self, tokenizer: Tokenizer) -> list[int]:
        return tokenizer.encode(f" {self.answer}.")


def needle_prompt(tokenizer: Tokenizer, haystack: Haystack, length: int, depth: float,
                  rng: random.Random, needles: int | Needles = 1) -> NeedlePrompt:
    """A prompt of exactly `length` tokens with its needle(s) at `depth` percent of the haystack.

    needles: how many to draw from rng, or the ones to use.
    """
    facts = needles if isinstance(needles, Needles) else Needles.draw(rng, needles)
    count = len(facts.keys)
    pieces = [tokenizer.encode(_needle(name, key)) for name, key in zip(facts.names, facts.keys)]
    question = tokenizer.encode(_question(facts.names[facts.asked]))
    n_hay = length - sum(map(len, pieces)) - len(question)
    if n_hay < 0:
        raise ValueError(f"a prompt of {length} tokens cannot hold its needles and question "
                         f"({length - n_hay} tokens)")
    hay = haystack.take(rng.randrange(len(haystack.ids)), n_hay)
    # NeedleBench's rule: a needle at depth d goes after floor(L * d / 100) haystack tokens;
    # further needles every 100 / count percent after it, wrapping past the end.
    depths = [depth if i == 0 else (depth + i * 100 / count) % 100 for i in range(count)]
    # Deepest first, so an insertion does not move the points before it.
    for point, i in sorted(((int(n_hay * d / 100), i) for i, d in enumerate(depths)), reverse=True):
        hay[point:point] = pieces[i]
    return NeedlePrompt(hay + question, facts.answer, facts.answer_ids(tokenizer))


def _needle(name: str | None, key: str) -> str:
    if name is None:
        return f" The pass key is {key}. Remember it. {key} is the pass key. "
    return f" The pass key of {name} is {key}. Remember it. {key} is the pass key of {name}. "


def _question(name: str | None) -> str:
    if name is None:
        return " What is the pass key? The pass key is"
    return f" What is the pass key of {name}? The pass key of {name} is"


def sample_rng(seed: int, *key) -> random.Random:
    """A generator for one sample, from (seed, key...): independent of the order samples are drawn."""
    digest = hashlib.sha256("/".join(map(str, ("polytrain-needle", seed, *key))).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


class PasskeyDataset:
    """Training windows for passkey retrieval: sample i is a prompt + answer of seq_len + 1 tokens
    at a random depth (seeded by (seed, i)).

    score "answer": only the answer's tokens are scored; "all": every next token (language
    modelling on the haystack too, from which small models learn the copying the task needs
    far sooner than from the answer alone). get_batch has TokenDataset's contract: (inputs,
    targets), int64 (B, seq_len) each, targets -100 where not scored.
    """

    def __init__(self, tokenizer: Tokenizer, seq_len: int, seed: int, n_samples: int = 1 << 20,
                 source: str = "stdlib", needles: int = 1, score: str = "answer"):
        if score not in ("answer", "all"):
            raise ValueError(f"score = {score!r}: choose 'answer' or 'all'")
        self.tokenizer, self.seq_len, self.seed, self.needles = tokenizer, seq_len, seed, needles
        self.score = score
        self.n_samples = n_samples
        self.haystack = Haystack(tokenizer, max(4 * seq_len, 1 << 16), source)

    def __len__(self) -> int:
        return self.n_samples

    def get_batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = [], []
        for i in indices:
            rng = sample_rng(self.seed, "train", int(i))
            facts = Needles.draw(rng, self.needles)
            answer = facts.answer_ids(self.tokenizer)
            sample = needle_prompt(self.tokenizer, self.haystack, self.seq_len + 1 - len(answer),
                                   rng.uniform(0, 100), rng, facts)
            window = sample.prompt + answer  # seq_len + 1 tokens
            inputs.append(window[:-1])
            scored = window[1:] if self.score == "all" else [IGNORE] * (self.seq_len - len(answer)) + answer
            targets.append(scored)
        return torch.tensor(inputs), torch.tensor(targets)
