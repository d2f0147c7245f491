"""A step's curves from its metrics.jsonl: one panel per quantity, drawn to a PNG.

    plot_panels(run_dir / "ppo", "reward.png", ("reward", "kl", "task_score"))

Step 2 draws accuracy and the chosen / rejected scores of its held-out pairs, step 3 the
reward-model score, the KL to the reference and the true metric of each rollout (with
the held-out evaluations as markers); step 1's loss curve is the trainer's loss.png.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from polytrain.io.atomic import atomic_path
from polytrain.train.metrics import read_metrics


def plot_panels(run_dir: Path, name: str, panels: Sequence[str | tuple[str, ...]]) -> Path:
    """Draw each panel's keys against step (a tuple shares one panel) to run_dir/name; returns the file.

    A key `k` also draws the rows' `eval_k` values as markers, when there are any.
    """
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    rows = read_metrics(run_dir)
    fig = Figure(figsize=(4 * len(panels), 3.4), dpi=100)
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        keys = (panel,) if isinstance(panel, str) else panel
        for key in keys:
            for shown, style in ((key, "-"), (f"eval_{key}", "o")):
                points = [(r["step"], r[shown]) for r in rows if r.get(shown) is not None and "step" in r]
                if points:
                    ax.plot(*zip(*points), style, label=shown, linewidth=1.2, markersize=4)
        ax.set_title(" / ".join(keys))
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(f"{Path(run_dir).parent.name}/{Path(run_dir).name}")
    fig.tight_layout()
    out = Path(run_dir) / name
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png")
    return out
