"""`polytrain eval needle`: single- and multi-needle retrieval over context lengths x depths.

For every (length, depth) the model reads `repeats` prompts of exactly `length` tokens
(data/needle.py: haystack from the corpus, the pass key at `depth` percent) and continues
each greedily for the answer's tokens plus two. NeedleBench's score: 100 when the gold key
appears in the continuation, else 0, averaged over the repeats. Written to the output
directory:

    needle.json   {"lengths": [...], "depths": [...], "scores": [[per depth] per length],
                   "needles": n, "repeats": r, "overall": mean}
    needle.png    the heatmap (context length across, depth down)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch.nn as nn

from polytrain.data.needle import Haystack, needle_prompt, sample_rng
from polytrain.data.tokenizer import Tokenizer
from polytrain.errors import ConfigError
from polytrain.inference.generate import generate
from polytrain.io.atomic import write_text_atomic

RESULT_FILE, PLOT_FILE = "needle.json", "needle.png"
EXTRA_TOKENS = 2
"""Tokens generated past the answer's length: room for a leading space or a split digit."""


def evaluate_needle(model: nn.Module, tokenizer: Tokenizer, lengths: Sequence[int], depths: Sequence[float], *,
                    repeats: int = 1, needles: int = 1, seed: int = 0, source: str = "stdlib",
                    batch_size: int = 4, generate_fn: Callable = generate) -> dict:
    """The score grid (module docstring). `generate_fn(model, prompts, max_new_tokens, temperature=0)`
    returns the new tokens per prompt (a cp-sharded generator can stand in for the plain one)."""
    if repeats < 1 or needles < 1:
        raise ConfigError(f"--repeats ({repeats}) and --needles ({needles}) must be at least 1")
    haystack = Haystack(tokenizer, max(lengths), source)
    scores = []
    for length in lengths:
        samples = [needle_prompt(tokenizer, haystack, length, depth, sample_rng(seed, "eval", length, depth, r),
                                 needles) for depth in depths for r in range(repeats)]
        longest = length + max(len(s.answer_ids) for s in samples) + EXTRA_TOKENS
        if longest > model.cfg.max_seq_len:
            raise ConfigError(f"--lengths {length} needs model.max_seq_len >= {longest} (prompt and answer); "
                              f"this model's is {model.cfg.max_seq_len}")
        hits = []
        for start in range(0, len(samples), batch_size):
            batch = samples[start:start + batch_size]  # equal lengths: one unpadded batch
            new = max(len(s.answer_ids) for s in batch) + EXTRA_TOKENS
            outs = generate_fn(model, [s.prompt for s in batch], new, temperature=0)
            hits += [s.answer in tokenizer.decode(out) for s, out in zip(batch, outs)]
        scores.append([100.0 * sum(hits[i * repeats:(i + 1) * repeats]) / repeats for i in range(len(depths))])
    overall = sum(map(sum, scores)) / (len(lengths) * len(depths))
    return {"lengths": list(lengths), "depths": list(depths), "scores": scores, "needles": needles,
            "repeats": repeats, "overall": overall}


def write_needle(result: dict, out_dir: str | Path, title: str = "") -> tuple[Path, Path]:
    """needle.json and needle.png in out_dir (created if missing), each written atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / RESULT_FILE, json.dumps(result, indent=1) + "\n")
    return out / RESULT_FILE, plot_needle(result, out / PLOT_FILE, title)


def plot_needle(result: dict, path: Path, title: str = "") -> Path:
    """The score heatmap: context length across, needle depth down, 0 (red) to 100 (green)."""
    from matplotlib.figure import Figure  # no pyplot: no global state or GUI backend

    lengths, depths = result["lengths"], result["depths"]
    grid = [[row[i] for row in result["scores"]] for i in range(len(depths))]  # (depth, length)
    fig = Figure(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.45 * len(depths)), dpi=100)
    ax = fig.add_subplot()
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    ax.set_xticks(range(len(lengths)), [_short(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
    for i, row in enumerate(grid):
        for j, score in enumerate(row):
            ax.text(j, i, f"{score:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(f"{title} needle retrieval, overall {result['overall']:.1f}".strip())
    fig.colorbar(image, ax=ax, label="score")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path


def _short(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n / 1000:g}k" if n % 1000 == 0 else str(n)


def parse_lengths(text: str) -> list[int]:
    """'1024,4k,16K' -> [1024, 4096, 16384] (k = 1024); ConfigError for anything else."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        scale = 1024 if item.endswith("k") else 1
        digits = item[:-1] if scale > 1 else item
        if not digits.isdigit() or int(digits) <= 0:
            raise ConfigError(f"--lengths: {item!r} is not a positive token count (e.g. 1024 or 4k)")
        out.append(int(digits) * scale)
    return out


def parse_depths(text: str) -> list[float]:
    """'0,50,100' -> [0.0, 50.0, 100.0]; each in [0, 100]."""
    try:
        depths = [float(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--depths: {text!r} is not a comma-separated list of percentages") from None
    if any(not 0 <= d <= 100 for d in depths):
        raise ConfigError(f"--depths: {text!r} has a value outside 0..100 (percent of the context)")
    return depths
