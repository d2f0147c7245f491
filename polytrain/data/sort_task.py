"""The built-in RLHF task: sort a list of distinct digits. A program knows the right answer.

    prompt    " Human: sort 3 1 4 1 5 Assistant:"
    response  " 1 1 3 4 5"

Rows come in DeepSpeed-Chat's formats (prompts already carry " Human: ... Assistant:",
responses start with a space), so the task runs through the same data path as a user's
files. Each seed gives the same rows on every machine.

- preference rows {prompt, chosen, rejected}: chosen is the sorted list; rejected is a
  typical mistake: two neighbours swapped, a digit dropped or repeated, a digit the
  prompt lacks inserted in order, or a digit replaced by another that keeps the list in
  order where one exists. The last two leave the list increasing, so only the prompt
  shows them wrong: a reward model that ignores the prompt is hacked by sorted nonsense.
- demonstration rows {prompt, response} (SFT only): an imperfect demonstrator that makes
  one of those mistakes in a share `noise` of its answers, so that imitation alone
  leaves room for the reward model and step 3 to improve on.

`task_score(prompt, response)` is the true metric: 1.0 for exactly the sorted digits, else 0.0.
"""

from __future__ import annotations

import random
import re

PROMPT = " Human: sort {digits} Assistant:"
_PROMPT_RE = re.compile(r"sort((?: \d)+) Assistant:\s*$")
MISTAKES = ("swap", "drop", "repeat", "replace", "insert")


def _format(digits: list[int]) -> str:
    return "".join(f" {d}" for d in digits)


def prompt_for(digits: list[int]) -> str:
    """The prompt asking to sort `digits`."""
    return PROMPT.format(digits=_format(digits).strip())


def answer_for(prompt: str) -> list[int] | None:
    """The sorted digits a prompt asks for; None when the text is not one of this task's prompts."""
    match = _PROMPT_RE.search(prompt)
    return sorted(int(d) for d in match.group(1).split()) if match else None


def task_score(prompt: str, response: str) -> float:
    """1.0 when `response` is exactly the prompt's digits in ascending order (spaces between them,
    surrounding whitespace ignored), else 0.0."""
    want = answer_for(prompt)
    if want is None:
        raise ValueError(f"not a sorting prompt: {prompt!r}")
    return float(response.strip() == _format(want).strip())


def mistake(answer: list[int], rng: random.Random) -> list[int]:
    """A wrong answer close to `answer` (sorted): one of MISTAKES, never equal to it."""
    while True:
        kind = rng.choice(MISTAKES)
        out = list(answer)
        i = rng.randrange(len(out))
        if kind == "swap":
            pairs = [j for j in range(len(out) - 1) if out[j] != out[j + 1]]
            if not pairs:
                continue
            j = rng.choice(pairs)
            out[j], out[j + 1] = out[j + 1], out[j]
        elif kind == "drop" and len(out) > 1:
            del out[i]
        elif kind == "repeat":
            out.insert(i, out[i])
        elif kind == "replace":
            # Prefer a digit that keeps the list sorted: then only the prompt tells it is wrong.
            low, high = (out[i - 1] if i else 0), (out[i + 1] if i + 1 < len(out) else 9)
            keeps_order = [d for d in range(low, high + 1) if d != out[i]]
            out[i] = rng.choice(keeps_order or [d for d in range(10) if d != out[i]])
        elif kind == "insert":
            # A digit the prompt does not hold, in its sorted place: still increasing.
            absent = [d for d in range(10) if d not in out]
            if not absent:
                continue
            d = rng.choice(absent)
            out = sorted(out + [d])
        if out != answer:
            return out


def _digits(rng: random.Random, min_len: int, max_len: int) -> list[int]:
    # Distinct digits: a right answer is then strictly increasing and made of the prompt's digits,
    # which a small reward model can check; with repeats it must count, and a policy finds its
    # miscounts (reward hacking) before it finds the answers.
    return rng.sample(range(10), rng.randint(min_len, max_len))


def preference_rows(n: int, seed: int, min_len: int = 3, max_len: int = 6) -> list[dict[str, str]]:
    """`n` rows {prompt, chosen, rejected}: the sorted digits against a near miss."""
    rng = random.Random(f"sort-pairs/{seed}")
    rows = []
    for _ in range(n):
        digits = _digits(rng, min_len, max_len)
        answer = sorted(digits)
        rows.append({"prompt": prompt_for(digits), "chosen": _format(answer),
                     "rejected": _format(mistake(answer, rng))})
    return rows


def demonstration_rows(n: int, seed: int, noise: float = 0.3, min_len: int = 3,
                       max_len: int = 6) -> list[dict[str, str]]:
    """`n` rows {prompt, response} from a demonstrator that errs in a share `noise` of them."""
    if not 0 <= noise < 1:
        raise ValueError(f"noise = {noise} must be in [0, 1)")
    rng = random.Random(f"sort-demos/{seed}")
    rows = []
    for _ in range(n):
        digits = _digits(rng, min_len, max_len)
        answer = sorted(digits)
        shown = mistake(answer, rng) if rng.random() < noise else answer
        rows.append({"prompt": prompt_for(digits), "response": _format(shown)})
    return rows


def corpus_text(n: int, seed: int) -> list[str]:
    """Texts covering every token the task uses, for training a tokenizer on it."""
    return [row["prompt"] + row["chosen"] + "\n" + row["prompt"] + row["rejected"]
            for row in preference_rows(n, seed)]
