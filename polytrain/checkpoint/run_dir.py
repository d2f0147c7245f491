"""A run directory's file names, in one place.

    runs/<name>/
        config.toml          the fully resolved config
        tokenizer.json       the tokenizer the run used
        metrics.jsonl        one JSON row per logged step (train/metrics.py)
        loss.png             the loss curve
        tensorboard/         event files (run.loggers has tensorboard)
        wandb/               W&B's local run files (run.loggers has wandb)
        mlruns/              MLflow's file store, unless MLFLOW_TRACKING_URI names another
        checkpoints/step_<N>/  sharded checkpoints (trainer_state.py)
        offload/             nvme offload files when parallel.nvme_path is empty
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from polytrain.errors import ConfigError


@dataclass(frozen=True)
class RunDir:
    """The files of one run directory (nothing is created until written)."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def config(self) -> Path:
        return self.path / "config.toml"

    @property
    def tokenizer(self) -> Path:
        return self.path / "tokenizer.json"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def plot(self) -> Path:
        return self.path / "loss.png"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def wandb(self) -> Path:
        return self.path / "wandb"

    @property
    def mlruns(self) -> Path:
        return self.path / "mlruns"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def offload(self) -> Path:
        return self.path / "offload"

    def require_config(self) -> Path:
        """config.toml, or one line saying this is not a run directory."""
        if not self.config.is_file():
            raise ConfigError(f"{self.path} is not a polytrain run directory (no config.toml)")
        return self.config
