"""run.loggers: the keys, the start-up check for missing packages, and each sink holding the rows
metrics.jsonl holds and the resolved config, read back through the sink's own files (offline)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from polytrain.cli import main
from polytrain.config import load_config
from polytrain.config.schema import all_keys
from polytrain.errors import ConfigError
from polytrain.train.loggers import require_loggers
from polytrain.train.metrics import MetricsLogger, read_metrics
from tests.sink_readers import jsonl_scalars, mlflow_run, tensorboard_scalars, wandb_history, wandb_run

ROWS = [
    {"step": 0, "val_loss": 6.5, "time": 0.0},
    {"step": 1, "loss": 6.25, "lr": 1e-3, "grad_norm": 1.5, "tokens_per_s": 1234.5, "mfu": 0.31,
     "mem_gb": 1.5, "peak_mem_gb": 2.0, "time": 0.5},
    {"step": 2, "loss": float("nan"), "lr": 2e-3, "grad_norm": float("inf"), "time": 1.0},
    {"step": 2, "val_loss": 5.75, "time": 1.25},
]


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """W&B offline with its config and caches in tmp; no MLflow store named by the environment."""
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT", "WANDB_ENTITY"):
        monkeypatch.delenv(name, raising=False)
    yield
    if "wandb" in sys.modules:  # W&B reads its environment once a process: the next test sets another
        sys.modules["wandb"].teardown()


def test_loggers_key_takes_a_list_or_commas_and_the_old_tensorboard_switch(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[run]\nloggers = ["wandb", "mlflow"]\n')
    assert load_config(path).run.loggers == "wandb,mlflow"
    assert load_config(None, ["--run.loggers", "tensorboard, wandb"]).run.loggers == "tensorboard,wandb"
    assert load_config(None, ["--run.tensorboard", "true"]).run.loggers == "tensorboard"
    assert load_config(None, ["--run.loggers", "wandb", "--run.tensorboard", "true"]).run.loggers == "wandb,tensorboard"
    assert load_config(None, ["--run.tensorboard", "false"]).run.loggers == ""


@pytest.mark.parametrize("value, message", [
    ("wandb,comet", "run.loggers: 'comet' is not one of tensorboard, wandb, mlflow"),
    ("wandb,wandb", "run.loggers names 'wandb' twice"),
])
def test_bad_logger_names_fail_naming_the_key(value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["--run.loggers", value])


def _hide(monkeypatch, module: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))


@pytest.mark.parametrize("logger, package", [("wandb", "wandb"), ("mlflow", "mlflow-skinny"),
                                             ("tensorboard", "tensorboard")])
def test_a_missing_package_fails_at_start_up_naming_what_to_install(monkeypatch, logger, package):
    module = "tensorboard" if logger == "tensorboard" else logger
    _hide(monkeypatch, module)
    with pytest.raises(ConfigError, match=f"run.loggers names {logger}, but .* pip install {package}"):
        require_loggers(load_config(None, ["--run.loggers", logger]))


def test_train_stops_before_any_work_when_a_logger_is_missing(monkeypatch, tmp_path, capsys):
    _hide(monkeypatch, "wandb")
    code = main(["train", "--run.loggers", "wandb", "--run.out_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "pip install wandb" in err[0]
    assert not (tmp_path / "run").exists()  # nothing was prepared, no worker started


def _log_rows(run_dir, overrides, name=None):
    cfg = load_config(None, ["--run.name", "sinks", "--train.lr", "0.0123", *overrides])
    logger = MetricsLogger(run_dir, enabled=True, cfg=cfg, name=name)
    for row in ROWS:
        logger.log(row)
    logger.close()
    return read_metrics(run_dir)


def test_every_sink_gets_the_jsonl_rows_and_the_config(offline, tmp_path):
    pytest.importorskip("wandb", reason="the wandb package is absent: pip install polytrain[loggers]")
    pytest.importorskip("mlflow", reason="the mlflow package is absent: pip install polytrain[loggers]")
    pytest.importorskip("tensorboard", reason="the tensorboard package is absent")
    rows = _log_rows(tmp_path, ["--run.loggers", "tensorboard,wandb,mlflow", "--run.wandb_project", "proj"])
    expected = jsonl_scalars(rows)
    assert (2, "loss") not in expected and expected[(2, "val_loss")] == 5.75  # nulls stay out
    assert expected[(2, "time")] == 1.25  # the later row of a step wins, in every store

    assert wandb_history(tmp_path) == expected
    run, config = wandb_run(tmp_path)
    assert (run.display_name, run.project) == ("sinks", "proj")
    assert set(config) == set(all_keys()) and config["train.lr"] == 0.0123 and config["run.name"] == "sinks"

    mlflow, metrics = mlflow_run((tmp_path / "mlruns").as_uri(), "polytrain")
    assert metrics == expected
    assert mlflow.info.run_name == "sinks" and mlflow.info.status == "FINISHED"
    params = mlflow.data.params
    assert set(params) == set(all_keys()) and params["train.lr"] == "0.0123"

    board = tensorboard_scalars(tmp_path / "tensorboard")
    assert board.keys() == expected.keys()
    assert board == {key: pytest.approx(value, rel=1e-6) for key, value in expected.items()}  # float32 events


def test_the_users_environment_picks_the_stores(offline, monkeypatch, tmp_path):
    pytest.importorskip("wandb", reason="the wandb package is absent: pip install polytrain[loggers]")
    pytest.importorskip("mlflow", reason="the mlflow package is absent: pip install polytrain[loggers]")
    elsewhere = (tmp_path / "shared-mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    monkeypatch.setenv("WANDB_MODE", "disabled")  # not offline: W&B writes nothing
    rows = _log_rows(tmp_path / "run", ["--run.loggers", "wandb,mlflow"], name="sinks/ppo")
    assert not (tmp_path / "run" / "mlruns").exists() and not list((tmp_path / "run").glob("wandb/*run-*"))
    run, metrics = mlflow_run(elsewhere, "from-env")
    assert metrics == jsonl_scalars(rows) and run.info.run_name == "sinks/ppo"


def test_only_the_enabled_rank_opens_sinks(offline, tmp_path):
    cfg = load_config(None, ["--run.loggers", "wandb,mlflow"])
    logger = MetricsLogger(tmp_path / "run", enabled=False, cfg=cfg)
    logger.log(ROWS[1])
    logger.close()
    assert not (tmp_path / "run").exists()


def test_a_logger_that_cannot_start_is_one_line_naming_it(offline, monkeypatch, tmp_path):
    pytest.importorskip("mlflow", reason="the mlflow package is absent: pip install polytrain[loggers]")
    pytest.importorskip("tensorboard", reason="the tensorboard package is absent")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://tracking")
    cfg = load_config(None, ["--run.loggers", "tensorboard,mlflow"])
    with pytest.raises(ConfigError, match=r"run.loggers: mlflow did not start \(.*\); check MLFLOW_TRACKING_URI"):
        MetricsLogger(tmp_path, enabled=True, cfg=cfg)
