"""Training metrics on disk: metrics.jsonl (one JSON object per line), the same rows to
TensorBoard, W&B or MLflow (run.loggers: loggers.py), and a loss.png plot redrawn from the jsonl.

The jsonl file is the record of a run: it is flushed line by line so a crash loses nothing
already logged, and truncated to the checkpoint's step on resume so it never holds rows
from steps that are about to be re-run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from polytrain.checkpoint.run_dir import RunDir
from polytrain.config import Config
from polytrain.io.atomic import atomic_path, write_text_atomic
from polytrain.train.loggers import Sink, open_sinks

__all__ = ["MetricsLogger", "plot_loss", "read_metrics"]


def _jsonable(value: Any) -> Any:
    """NaN/inf become None (JSON has no such numbers); tensors and numpy scalars become Python."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """All rows of run_dir/metrics.jsonl; a line cut short by a crash is skipped."""
    path = RunDir(run_dir).metrics
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


class MetricsLogger:
    """Appends metric rows to run_dir/metrics.jsonl and hands each to the run.loggers sinks; a
    no-op when disabled.

    resume_step=None starts a fresh file; resume_step=k keeps only rows with step <= k.
    Only rank 0 should pass enabled=True. `cfg` names the sinks (run.loggers) and is the
    config they record, under run `name` (default run.name).
    """

    def __init__(
        self,
        run_dir: Path,
        enabled: bool = True,
        resume_step: int | None = None,
        cfg: Config | None = None,
        name: str | None = None,
    ) -> None:
        self.enabled = enabled
        self._file = None
        self._sinks: list[Sink] = []
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = RunDir(run_dir).metrics
        kept = [] if resume_step is None else [
            row for row in read_metrics(run_dir)
            if isinstance(row.get("step"), (int, float)) and row["step"] <= resume_step
        ]
        # A crash mid-rewrite leaves the old file whole.
        write_text_atomic(self.path, "".join(json.dumps(row) + "\n" for row in kept))
        self._file = open(self.path, "a", encoding="utf-8")
        if cfg is not None:
            self._sinks = open_sinks(cfg, run_dir, resume_step, name or cfg.run.name)

    def log(self, row: dict[str, Any]) -> None:
        """Append one row (must have 'step'); NaN/inf are written as null. The sinks get the
        row's numbers but 'step' (their step axis) and the nulls."""
        if self._file is None:
            return
        clean = {key: _jsonable(value) for key, value in row.items()}
        self._file.write(json.dumps(clean, allow_nan=False) + "\n")
        self._file.flush()
        scalars = {key: value for key, value in clean.items() if key != "step"
                   and isinstance(value, (int, float)) and not isinstance(value, bool)}
        for sink in self._sinks:
            sink.log(clean["step"], scalars)

    def close(self) -> None:
        """Close the jsonl file and the sinks; further log calls do nothing."""
        if self._file is not None:
            self._file.close()
            self._file = None
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            sink.close()


def plot_loss(run_dir: Path) -> Path:
    """Draw train loss (line) and validation loss (markers) from metrics.jsonl to loss.png.

    The y axis turns logarithmic when the losses span more than 10x. The file is replaced
    atomically, so a viewer never reads a half-written PNG.
    """
    # Figure without pyplot: no global state, no GUI backend, safe beside other plotting code.
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None and "step" in r]
    val = [
        (r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None and "step" in r
    ]

    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1.2)
    if val:
        ax.plot(*zip(*val), "o", label="validation", markersize=5)
    losses = [loss for _, loss in train + val]
    if losses and min(losses) > 0 and max(losses) / min(losses) > 10:
        ax.set_yscale("log")
    if not losses:
        ax.text(0.5, 0.5, "no losses logged yet", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend()
    ax.set_title(f"{run_dir.name}: loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()

    out = RunDir(run_dir).plot
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png")
    return out
