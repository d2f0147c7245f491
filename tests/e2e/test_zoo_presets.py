"""Every zoo preset in configs/ trains with falling loss: causal LM (gpt2, internlm2), BERT's
masked LM and T5's span corruption, through the same trainer (shrunk to seconds here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from polytrain.config import load_config
from polytrain.train.trainer import Trainer
from tests.conftest import tiny_overrides

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.slow
@pytest.mark.parametrize("preset, objective", [("gpt2_tiny", "causal"), ("internlm2_tiny", "causal"),
                                               ("bert_tiny_mlm", "mlm"), ("t5_tiny_span", "span")])
def test_preset_trains_with_falling_loss(preset, objective, small_corpus, tmp_path):
    cfg = load_config(CONFIGS / f"{preset}.toml", tiny_overrides(
        small_corpus, tmp_path / "run", model__n_kv_heads=4, run__steps=16, train__lr=3e-3))
    trainer = Trainer(cfg)
    assert trainer.objective.name == objective
    summary = trainer.train()
    assert summary["val_loss"] < summary["first_val_loss"] - 0.5, summary
