"""Weighted blending of several datasets into one, as Megatron blends pre-training corpora.

    blend = Blend(sizes=[len(a), len(b)], weights=[0.7, 0.3], seed=1234)
    source, index = blend.locate(i)          # blended sample i is sample `index` of dataset `source`

The blend holds `total` samples (default: as many as the datasets of positive weight together). Dataset d
gets a share of them proportional to its weight (largest remainders, so the counts sum
to `total` exactly), drawn from it in seeded random orders: a fresh permutation of the
dataset each time its samples run out, so a dataset weighted above its size repeats
every sample before any sample a third time, and one weighted below its size
contributes a fixed random subset. Samples [offset_d, offset_d + count_d) of the blend
belong to dataset d.

Blending is a pure function of (sizes, weights, seed, total): the run's
GlobalBatchSampler then orders the blend exactly as it orders one dataset, so a step's
samples stay independent of the world size and a resume continues at the exact sample.
`TokenBlend` serves token windows from several packed files this way.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from polytrain.errors import ConfigError


@dataclass(frozen=True)
class Source:
    """One dataset of a blend and its weight."""

    path: str
    weight: float = 1.0


def parse_sources(value: object, key: str) -> list[Source]:
    """Sources from a TOML list of tables [{path = "...", weight = 0.7}, ...] or a command-line
    string "PATH[:WEIGHT],PATH[:WEIGHT],..." (weight 1 when left out); `key` names the setting."""
    items: list[tuple[object, object]] = []
    if isinstance(value, str):
        for part in filter(None, (p.strip() for p in value.split(","))):
            path, sep, weight = part.rpartition(":")
            # "C:/x" or a path without a weight: the colon is part of the path.
            if not sep or not _is_number(weight):
                path, weight = part, "1"
            items.append((path, float(weight)))
    elif isinstance(value, list):
        for entry in value:
            if not isinstance(entry, dict) or "path" not in entry or set(entry) - {"path", "weight"}:
                raise ConfigError(f"{key}: each entry is a table {{path = \"...\", weight = W}}, "
                                  f"not {entry!r}")
            items.append((entry["path"], entry.get("weight", 1.0)))
    else:
        raise ConfigError(f"{key} = {value!r} is neither a list of {{path, weight}} tables nor "
                          "\"PATH:WEIGHT,...\"")
    sources = []
    for path, weight in items:
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{key}: a source path must be a non-empty string, not {path!r}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ConfigError(f"{key}: the weight of {path} must be a number, not {weight!r}")
        sources.append(Source(path, float(weight)))
    if not sources:
        raise ConfigError(f"{key} names no sources")
    check_weights([s.weight for s in sources], key)
    return sources


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_weights(weights: Sequence[float], key: str) -> None:
    """Weights must be finite, non-negative and sum to a positive number; else one line naming `key`."""
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ConfigError(f"{key}: weights {list(weights)} must be finite and >= 0")
    if sum(weights) <= 0:
        raise ConfigError(f"{key}: weights {list(weights)} must sum to a positive number")


def blend_counts(weights: Sequence[float], total: int) -> list[int]:
    """Split `total` samples by `weights`: floor of each exact share, the remainder to the largest
    fractional parts (ties to the earlier dataset). Sums to `total`."""
    scale = total / sum(weights)
    exact = [w * scale for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda d: (-(exact[d] - counts[d]), d))
    for d in by_remainder[: total - sum(counts)]:
        counts[d] += 1
    return counts


def _order_seed(seed: int, dataset: int, round_: int) -> int:
    digest = hashlib.sha256(f"polytrain-blend/{seed}/{dataset}/{round_}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class Blend:
    """Blended sample i -> (dataset, sample of that dataset); see the module docstring."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], seed: int,
                 total: int | None = None, names: Sequence[str] | None = None, key: str = "data.sources"):
        if len(sizes) != len(weights) or not sizes:
            raise ConfigError(f"{key}: {len(weights)} weights for {len(sizes)} datasets")
        check_weights(weights, key)
        names = list(names) if names is not None else [f"dataset {d}" for d in range(len(sizes))]
        for name, size, weight in zip(names, sizes, weights):
            if size <= 0 and weight > 0:
                raise ConfigError(f"{key}: {name} holds no samples; remove it or give it weight 0")
        self.sizes, self.seed = list(sizes), seed
        self.total = sum(s for s, w in zip(sizes, weights) if w > 0) if total is None else total
        if self.total <= 0:
            raise ConfigError(f"{key}: the blend would hold {self.total} samples")
        self.counts = blend_counts(weights, self.total)
        self.offsets = [0]
        for c in self.counts:
            self.offsets.append(self.offsets[-1] + c)
        self._orders: dict[tuple[int, int], list[int]] = {}

    def __len__(self) -> int:
        return self.total

    def locate(self, i: int) -> tuple[int, int]:
        """(dataset, index within it) of blended sample i."""
        if not 0 <= i < self.total:
            raise IndexError(f"sample {i} out of range for a blend of {self.total}")
        d = bisect.bisect_right(self.offsets, i) - 1
        round_, j = divmod(i - self.offsets[d], self.sizes[d])
        return d, self._order(d, round_)[j]

    def _order(self, d: int, round_: int) -> list[int]:
        """The seeded permutation of dataset d used for its `round_`-th pass."""
        if (d, round_) not in self._orders:
            gen = torch.Generator().manual_seed(_order_seed(self.seed, d, round_))
            self._orders[(d, round_)] = torch.randperm(self.sizes[d], generator=gen).tolist()
        return self._orders[(d, round_)]


class TokenBlend:
    """Token windows from several TokenDatasets blended by weight; TokenDataset's interface."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], seed: int,
                 names: Sequence[str] | None = None, key: str = "data.sources"):
        lengths = {d.seq_len for d in datasets}
        if len(lengths) != 1:
            raise ConfigError(f"{key}: the datasets have different sequence lengths {sorted(lengths)}")
        self.datasets = list(datasets)
        self.seq_len = lengths.pop()
        self.blend = Blend([len(d) for d in datasets], weights, seed, names=names, key=key)

    def __len__(self) -> int:
        return len(self.blend)

    def get_batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 (len(indices), seq_len) each, in the order of `indices`."""
        rows = [self.datasets[d].get_batch([j]) for d, j in map(self.blend.locate, indices)]
        return torch.cat([x for x, _ in rows]), torch.cat([y for _, y in rows])
