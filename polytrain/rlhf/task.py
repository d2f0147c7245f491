"""The data of an RLHF run: the user's sources (`rlhf.data`), or the built-in sorting task.

The built-in task brings two sources through the same path as a user's files: an
imperfect demonstrator's rows (step 1 only) and preference rows (split across the three
steps by `rlhf.data_split`), plus a tokenizer trained on its text and the true metric
(`task_score`), which step 3 logs beside the reward model's score so reward hacking
shows. A user's data has no true metric: `task_score` is then null.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from polytrain.data import sort_task
from polytrain.data.preference import RowSource, parse_row, read_sources
from polytrain.data.tokenizer import Tokenizer, train_bpe

Scorer = Callable[[str, str], float]
"""(prompt text of a row, response text) -> the true metric of the response."""


@dataclass(frozen=True)
class TaskData:
    """The sources of a run, and the true metric when the task has one."""

    sources: list[RowSource]
    scorer: Scorer | None = None


def builtin_sources(seed: int, n_pairs: int, n_demos: int, noise: float) -> list[RowSource]:
    """The sorting task's two sources (demonstrations, then preference pairs) for `seed`."""
    demos = sort_task.demonstration_rows(n_demos, seed, noise)
    pairs = sort_task.preference_rows(n_pairs, seed)
    return [RowSource("builtin:sort-demos", tuple(parse_row(r, f"demo {i}", "rlhf.data") for i, r in enumerate(demos))),
            RowSource("builtin:sort-pairs", tuple(parse_row(r, f"pair {i}", "rlhf.data") for i, r in enumerate(pairs)))]


def builtin_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on the task's text (the same for every seed and machine)."""
    return train_bpe(sort_task.corpus_text(2000, seed=0), vocab_size)


def task_data(paths: list[str], weights: list[float] | None, seed: int, n_pairs: int, n_demos: int,
              noise: float) -> TaskData:
    """The user's sources when `paths` is given, else the built-in task with its scorer."""
    if paths:
        return TaskData(read_sources(paths, weights))
    sources = builtin_sources(seed, n_pairs, n_demos, noise)
    if weights:
        sources = [RowSource(s.name, s.rows, w) for s, w in zip(sources, weights, strict=True)]
    return TaskData(sources, sort_task.task_score)
