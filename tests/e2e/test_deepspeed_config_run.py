"""`polytrain train --deepspeed_config ds_config.json` trains as the equivalent native config does."""

from __future__ import annotations

import json

import pytest

from polytrain.cli import main
from tests.conftest import tiny_overrides
from tests.distributed.test_parity import assert_same_trajectory, train, train_rows

pytestmark = pytest.mark.slow

DS_CONFIG = {
    "train_batch_size": 8,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                              "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3,
                                                  "warmup_num_steps": 4, "warmup_type": "linear"}},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 1},
    "flops_profiler": {"enabled": False, "profile_step": 3},
}


def without_ds_keys(overrides: list[str]) -> list[str]:
    """Drop the overrides the ds_config supplies (command-line overrides would win over it)."""
    supplied = {"--train.lr", "--train.micro_batch_size", "--train.global_batch_size", "--train.warmup_steps"}
    pairs = zip(overrides[::2], overrides[1::2])
    return [item for key, value in pairs if key not in supplied for item in (key, value)]


def test_deepspeed_config_maps_onto_the_trainer(small_corpus, tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(DS_CONFIG))
    ds_dir, native_dir = tmp_path / "ds", tmp_path / "native"
    assert main(["train", "--deepspeed_config", str(path), *without_ds_keys(tiny_overrides(small_corpus, ds_dir, run__steps=6))]) == 0
    # micro-batch 4 = 8 / (2 accumulation x 1 rank); WarmupLR = linear warmup from 0, then constant.
    train(tiny_overrides(small_corpus, native_dir, run__steps=6, train__micro_batch_size=4,
                         train__lr=2e-3, train__lr_schedule="ds_warmup", train__warmup_steps=4,
                         train__warmup_type="linear", train__beta2=0.95, parallel__zero=1))
    assert_same_trajectory(train_rows(native_dir), train_rows(ds_dir), 1e-6, "ds_config run")
    assert "micro_batch_size = 4" in (ds_dir / "config.toml").read_text()


def test_unsupported_keys_are_named_once(small_corpus, tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({**DS_CONFIG, "flops_profiler": {"enabled": True}}))
    assert main(["train", "--deepspeed_config", str(path), *tiny_overrides(small_corpus, tmp_path / "r", run__steps=1)]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "flops_profiler" in warnings[0]


def test_contradictory_deepspeed_config(tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({**DS_CONFIG, "fp16": {"enabled": True}, "bf16": {"enabled": True}}))
    assert main(["train", "--deepspeed_config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "fp16" in err[0] and "bf16" in err[0]
