"""Where metrics rows go besides metrics.jsonl: TensorBoard, Weights & Biases, MLflow (run.loggers).

MetricsLogger (metrics.py) writes a row to metrics.jsonl and hands the same cleaned row to
every sink opened here: one code path, so each sink sees exactly the jsonl's numbers. Sinks
exist on rank 0 only and get rows only at log steps, whose values the trainer has already
brought to the host, so they add no device synchronisation to a step.

A sink's package is imported when the sink opens; `require_loggers` checks at start-up,
before any rank trains, that each named package is installed.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any, Protocol

from polytrain.checkpoint.run_dir import RunDir
from polytrain.config import Config, to_dict
from polytrain.errors import ConfigError

# logger name -> (the module it imports, the pip package that brings it)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow-skinny")}
MLFLOW_PARAMS_PER_CALL = 100  # a tracking server refuses larger batches of params
# What to check when a logger's package is there but the logger does not start.
START_HINTS = {"tensorboard": "check that <run dir>/tensorboard can be written",
               "wandb": "log in (`wandb login`, WANDB_API_KEY) or set WANDB_MODE=offline",
               "mlflow": "check MLFLOW_TRACKING_URI (unset: a file store in <run dir>/mlruns)"}


class Sink(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def logger_names(cfg: Config) -> list[str]:
    """run.loggers as a list ("tensorboard,wandb" -> ["tensorboard", "wandb"])."""
    return [name for name in cfg.run.loggers.split(",") if name]


def require_loggers(cfg: Config) -> None:
    """One ConfigError line naming the pip package when a logger run.loggers names is not installed."""
    for name in logger_names(cfg):
        module, package = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"run.loggers names {name}, but the {module} package is not installed: "
                              f"pip install {package} (or remove {name} from run.loggers)")


def flat_config(cfg: Config) -> dict[str, Any]:
    """The resolved config as {"section.key": value}, what W&B's config and MLflow's params record."""
    return {f"{section}.{key}": value for section, values in to_dict(cfg).items() for key, value in values.items()}


def open_sinks(cfg: Config, run_dir: Path, resume_step: int | None, name: str) -> list[Sink]:
    """The sinks run.loggers names, each recording run `name`; call on rank 0 only.

    One that fails to start is a ConfigError naming it and what to check, so the trainer
    (which opens them inside `together`) stops every rank with that line.
    """
    opened: list[Sink] = []
    openers = {"tensorboard": lambda: TensorBoardSink(RunDir(run_dir).tensorboard, resume_step),
               "wandb": lambda: WandbSink(cfg, run_dir, name), "mlflow": lambda: MLflowSink(cfg, run_dir, name)}
    for logger in logger_names(cfg):
        try:
            opened.append(openers[logger]())
        except Exception as e:
            for sink in opened:
                sink.close()
            reason = (str(e).strip().splitlines() or [""])[0][:300]
            raise ConfigError(f"run.loggers: {logger} did not start ({type(e).__name__}: {reason}); "
                              f"{START_HINTS[logger]}") from e
    return opened


class TensorBoardSink:
    """Event files in <run dir>/tensorboard."""

    def __init__(self, log_dir: Path, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides events a crashed run wrote after the checkpoint we resume from.
        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run named run.name whose config is the resolved config; its local files go to <run dir>/wandb.

    WANDB_MODE (offline, disabled), WANDB_API_KEY and W&B's other variables are read by
    wandb itself, so the user's environment decides. Each start of the job is a new W&B run:
    W&B refuses steps lower than ones already logged, which a resumed run logs again.
    """

    def __init__(self, cfg: Config, run_dir: Path, name: str):
        import wandb

        r = cfg.run
        RunDir(run_dir).wandb.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=r.wandb_project or None, entity=r.wandb_entity or None, name=name,
                              dir=str(run_dir), config=flat_config(cfg))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowSink:
    """An MLflow run named run.name with the resolved config as params.

    The store is MLFLOW_TRACKING_URI when set, else a file store in <run dir>/mlruns (MLflow 3
    keeps file stores only when MLFLOW_ALLOW_FILE_STORE is true, which is set unless the user
    set it). The experiment is run.mlflow_experiment, else MLFLOW_EXPERIMENT_NAME, else polytrain.
    """

    def __init__(self, cfg: Config, run_dir: Path, name: str):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = RunDir(run_dir).mlruns.resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = cfg.run.mlflow_experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "polytrain"
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        params = [Param(key, str(value)) for key, value in flat_config(cfg).items()]
        for start in range(0, len(params), MLFLOW_PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[start:start + MLFLOW_PARAMS_PER_CALL])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, float(value), now_ms, step)
                                                    for key, value in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
