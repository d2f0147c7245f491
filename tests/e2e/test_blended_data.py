"""Pre-training on data.sources: two corpora blended by weight, from a TOML list of tables, resumable."""

from __future__ import annotations

import pytest

from polytrain.config import load_config
from polytrain.errors import ConfigError
from tests.conftest import tiny_overrides
from tests.distributed.test_parity import train


def _halves(small_corpus, tmp_path):
    lines = small_corpus.read_text().splitlines(keepends=True)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(lines[: len(lines) // 2]))
    b.write_text("".join(lines[len(lines) // 2:]))
    return a, b


def test_training_on_two_blended_sources(small_corpus, tmp_path):
    a, b = _halves(small_corpus, tmp_path)
    toml = tmp_path / "blend.toml"
    toml.write_text(f'[data]\nsources = [{{path = "{a}", weight = 3}}, {{path = "{b}", weight = 1}}]\n')
    overrides = [x for x in tiny_overrides(small_corpus, tmp_path / "run", run__steps=3)]
    i = overrides.index("--data.source")
    del overrides[i:i + 2]  # data.sources replaces data.source
    cfg = load_config(toml, overrides)
    assert cfg.data.sources == f"{a}:3,{b}:1"
    from polytrain.train.trainer import Trainer

    trainer = Trainer(cfg)
    counts = trainer.train_data.blend.counts
    assert counts[0] == round(0.75 * sum(counts))  # 3:1
    summary = trainer.train()
    assert summary["step"] == 3 and summary["val_loss"] < summary["first_val_loss"]
    again = load_config(tmp_path / "run" / "config.toml")  # the run's config reads back
    assert again.data.sources == cfg.data.sources
    summary = train(overrides + ["--data.sources", cfg.data.sources, "--run.steps", "4"])  # resumes
    assert summary["step"] == 4


def test_source_and_sources_together_is_one_line(small_corpus, tmp_path):
    with pytest.raises(ConfigError, match="data.source and data.sources are both set"):
        load_config(None, ["--data.source", str(small_corpus), "--data.sources", f"{small_corpus}:1"])
    toml = tmp_path / "bad.toml"
    toml.write_text('[data]\nsources = [{file = "a"}]\n')
    with pytest.raises(ConfigError, match="data.sources: each entry is a table"):
        load_config(toml)
