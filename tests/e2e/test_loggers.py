"""A training run with every logger on: W&B (offline) and MLflow hold the rows of metrics.jsonl,
train and validation alike, under run.name, with the resolved config."""

from __future__ import annotations

import pytest

from polytrain.config.schema import all_keys
from polytrain.train.metrics import read_metrics
from tests.conftest import tiny_overrides
from tests.distributed.test_parity import train
from tests.sink_readers import jsonl_scalars, mlflow_run, wandb_history, wandb_run
from tests.unit.test_loggers import offline  # noqa: F401 (the fixture)


def test_trainer_rows_reach_wandb_and_mlflow(small_corpus, tmp_path, offline):  # noqa: F811
    pytest.importorskip("wandb", reason="the wandb package is absent: pip install polytrain[loggers]")
    pytest.importorskip("mlflow", reason="the mlflow package is absent: pip install polytrain[loggers]")
    run_dir = tmp_path / "run"
    train(tiny_overrides(small_corpus, run_dir, run__steps=3, run__eval_every=2, run__name="e2e",
                         run__loggers="wandb,mlflow"))
    rows = read_metrics(run_dir)
    expected = jsonl_scalars(rows)
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mem_gb", "peak_mem_gb"):
        assert (3, key) in expected, key
    assert {step for step, key in expected if key == "val_loss"} == {0, 2, 3}

    assert wandb_history(run_dir) == expected
    run, config = wandb_run(run_dir)
    assert run.display_name == "e2e" and set(config) == set(all_keys()) and config["run.steps"] == 3
    mlflow, metrics = mlflow_run((run_dir / "mlruns").as_uri(), "polytrain")
    assert metrics == expected
    assert mlflow.info.run_name == "e2e" and mlflow.data.params["data.seq_len"] == "64"
