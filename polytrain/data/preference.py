"""RLHF data: preference and demonstration rows from several weighted sources, split across the three steps.

Row formats (DeepSpeed-Chat's `local/jsonfile`), one JSON object per line (.jsonl) or a
JSON list of objects (.json); a directory means every .json and .jsonl file below it:

    {"prompt": " Human: ... Assistant:", "chosen": " ...", "rejected": " ..."}   preference
    {"prompt": " Human: ... Assistant:", "response": " ..."}                    demonstration

A source holds one kind. Preference sources serve all three steps: step 1 (SFT) trains on
(prompt, chosen), step 2 (reward model) on the pairs, step 3 (PPO/GRPO) on the prompts.
Demonstration sources serve step 1 only (DeepSpeed-Chat's sft_only_data_path).

`data_split` "2,4,4" (DeepSpeed-Chat's): the weights are normalised, each preference
source is shuffled once by seed and cut into three disjoint parts of those shares, and
step p uses part p, so the reward model and PPO never see the rows SFT trained on.
Within a step the sources' parts are blended by the source weights (`blend.Blend`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from polytrain.data.blend import Blend, check_weights
from polytrain.errors import ConfigError

PHASES = ("sft", "reward", "ppo")
"""Step names in order; step p (1-based) takes part p of every preference source."""
PAIR_FIELDS = ("prompt", "chosen", "rejected")
DEMO_FIELDS = ("prompt", "response")


@dataclass(frozen=True)
class Row:
    """One row: a preference pair (chosen and rejected set) or a demonstration (response set)."""

    prompt: str
    chosen: str = ""
    rejected: str = ""
    response: str = ""
    where: str = field(default="", compare=False)
    """File and line (or item) the row came from, for messages."""

    @property
    def is_pair(self) -> bool:
        return not self.response


@dataclass(frozen=True)
class RowSource:
    """The rows of one source, in file order, with its name (for messages) and weight."""

    name: str
    rows: tuple[Row, ...]
    weight: float = 1.0

    @property
    def kind(self) -> str:
        """'pairs' or 'demos'."""
        return "pairs" if self.rows[0].is_pair else "demos"


def _files(path: Path, key: str) -> list[Path]:
    if not path.exists():
        raise ConfigError(f"{key}: {path} does not exist")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file())
        if not files:
            raise ConfigError(f"{key}: directory {path} holds no .json or .jsonl files")
        return files
    if path.suffix not in (".json", ".jsonl"):
        raise ConfigError(f"{key}: {path} is not a .json or .jsonl file of rows")
    return [path]


def _records(path: Path, key: str) -> list[tuple[str, object]]:
    """(where, record) for every row of one file; where = 'file line N' or 'file item N'."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{key}: {path} is not valid JSON ({e})") from None
        if not isinstance(data, list):
            raise ConfigError(f"{key}: {path} must hold a JSON list of rows")
        return [(f"{path} item {i}", r) for i, r in enumerate(data)]
    out = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                out.append((f"{path} line {lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{key}: {path} line {lineno} is not valid JSON ({e})") from None
    return out


def parse_row(record: object, where: str, key: str) -> Row:
    """One validated Row from a JSON record; ConfigError naming the row for anything amiss."""
    if not isinstance(record, dict):
        raise ConfigError(f"{key}: {where} is not a JSON object")
    fields = PAIR_FIELDS if "chosen" in record or "rejected" in record else DEMO_FIELDS
    for name in fields:
        value = record.get(name)
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key}: {where} has no non-empty string field '{name}' (a preference row "
                              f"needs {', '.join(PAIR_FIELDS)}; a demonstration row {', '.join(DEMO_FIELDS)})")
    if fields == PAIR_FIELDS:
        if record["chosen"] == record["rejected"]:
            raise ConfigError(f"{key}: {where} has chosen identical to rejected; such a pair teaches "
                              "the reward model nothing: fix or drop it")
        return Row(record["prompt"], chosen=record["chosen"], rejected=record["rejected"], where=where)
    return Row(record["prompt"], response=record["response"], where=where)


def read_source(path: str | Path, weight: float = 1.0, key: str = "rlhf.data") -> RowSource:
    """Every row of a file or directory (module docstring), validated, as one source."""
    path = Path(path)
    rows = [parse_row(record, where, key) for f in _files(path, key) for where, record in _records(f, key)]
    if not rows:
        raise ConfigError(f"{key}: {path} holds no rows")
    kinds = {r.is_pair for r in rows}
    if len(kinds) > 1:
        raise ConfigError(f"{key}: {path} mixes preference rows and demonstration rows; "
                          "put each kind in its own source")
    return RowSource(str(path), tuple(rows), weight)


def read_sources(paths: Sequence[str], weights: Sequence[float] | None = None) -> list[RowSource]:
    """Sources for `rlhf.data` paths and `rlhf.data_weights` (default: 1 each)."""
    if not paths:
        raise ConfigError("rlhf.data names no sources")
    weights = list(weights) if weights else [1.0] * len(paths)
    if len(weights) != len(paths):
        raise ConfigError(f"rlhf.data_weights has {len(weights)} weights for {len(paths)} rlhf.data "
                          "sources; give one per source")
    check_weights(weights, "rlhf.data_weights")
    return [read_source(p, w) for p, w in zip(paths, weights)]


def parse_split(text: str) -> tuple[float, float, float]:
    """'2,4,4' -> (0.2, 0.4, 0.4); three non-negative numbers with a positive sum."""
    try:
        parts = tuple(float(x) for x in text.split(","))
    except ValueError:
        parts = ()
    if len(parts) != 3:
        raise ConfigError(f"rlhf.data_split = {text!r} must be three comma-separated numbers, "
                          "one per step (e.g. 2,4,4)")
    check_weights(parts, "rlhf.data_split")
    total = sum(parts)
    return parts[0] / total, parts[1] / total, parts[2] / total


def _shuffle_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"polytrain-rlhf-split/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def split_indices(n: int, split: Sequence[float], seed: int, name: str = "") -> list[list[int]]:
    """One seeded shuffle of range(n) cut into len(split) disjoint runs of the given shares.

    Boundaries are the rounded cumulative shares (DeepSpeed-Chat's rule), so the parts
    cover all n rows. The shuffle depends on (seed, name) only.
    """
    gen = torch.Generator().manual_seed(_shuffle_seed(seed, name))
    order = torch.randperm(n, generator=gen).tolist()
    bounds, acc = [0], 0.0
    for share in split:
        acc += share
        bounds.append(round(acc * n))
    bounds[-1] = n
    return [order[a:b] for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class PhaseData:
    """The rows one step trains on: sample i is rows[blend.locate(i)]."""

    phase: str
    sources: tuple[tuple[Row, ...], ...]
    blend: Blend
    held_out: tuple[Row, ...] = ()
    """Rows kept out of `sources` for evaluation (phase_data's hold_out), none of them trained on."""

    def __len__(self) -> int:
        return len(self.blend)

    def __getitem__(self, i: int) -> Row:
        d, j = self.blend.locate(i)
        return self.sources[d][j]


def phase_data(sources: Sequence[RowSource], split: Sequence[float], phase: str, seed: int,
               hold_out: int = 0) -> PhaseData:
    """The blended rows of step `phase` ('sft', 'reward' or 'ppo'): part p of every preference source,
    and for 'sft' every demonstration source whole; ConfigError if a source gives the step no rows.

    `hold_out`: about this many rows (at most a quarter of each part) are taken from the end of
    every part, in proportion to its size, and kept apart as `held_out` for evaluation.
    """
    p = PHASES.index(phase)
    parts, weights, names = [], [], []
    for src in sources:
        if src.kind == "demos":
            if phase != "sft":
                continue
            rows = src.rows
        else:
            rows = tuple(src.rows[i] for i in split_indices(len(src.rows), split, seed, src.name)[p])
            if not split[p]:
                continue  # a share of 0: the step takes none of this source (e.g. "0,5,5": SFT on demonstrations)
            if not rows and src.weight > 0:
                shares = ",".join(f"{s:g}" for s in split)
                raise ConfigError(f"rlhf.data: {src.name} holds {len(src.rows)} row(s) and rlhf.data_split "
                                  f"({shares}) leaves step {p + 1} ({phase}) none of them; add rows, "
                                  f"change the split or give the source weight 0")
        parts.append(rows)
        weights.append(src.weight)
        names.append(src.name)
    if not parts or sum(weights) <= 0:
        kinds = "preference rows" if phase != "sft" else "rows"
        raise ConfigError(f"rlhf.data: step {p + 1} ({phase}) needs {kinds} with a positive weight; "
                          f"the sources are {', '.join(s.name for s in sources)}")
    held: list[Row] = []
    if hold_out:
        share = min(0.25, hold_out / sum(len(r) for r in parts))
        cut = [int(len(r) * share) for r in parts]
        held = [row for r, k in zip(parts, cut) for row in r[len(r) - k:]]
        parts = [r[: len(r) - k] for r, k in zip(parts, cut)]
    blend = Blend([len(r) for r in parts], weights, seed, names=names, key="rlhf.data")
    return PhaseData(phase, tuple(parts), blend, tuple(held))
