"""Config: defaults < TOML < overrides, types, one-line errors with the fix, round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from polytrain.config import SECTIONS, Config, help_text, load_config, to_toml
from polytrain.config.schema import field_docs
from polytrain.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_defaults_resolve_the_size_preset():
    cfg = load_config()
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.vocab_size) == (192, 4, 4096)
    assert cfg.model.max_seq_len == cfg.data.seq_len
    assert cfg.run_dir == Path("runs/default")


def test_toml_then_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[train]\nlr = 1\nprecision = "bf16"\n[model]\nsize = "small"\ndim = 480\n')
    cfg = load_config(path, ["--train.lr", "0.5", "--run.tensorboard=true", "--model.n-layers", "3"])
    assert cfg.train.lr == 0.5 and isinstance(cfg.train.lr, float)
    assert cfg.train.precision == "bf16" and cfg.run.loggers == "tensorboard"  # the older key's meaning
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.ffn_dim) == (480, 3, 1024)  # rest from "small"


@pytest.mark.parametrize("args, message", [
    (["--train.lrr", "1"], "unknown key 'train.lrr'; did you mean 'train.lr'?"),
    (["--trian.lr", "1"], "did you mean 'train.lr'?"),
    (["--train.lr", "fast"], "train.lr = 'fast' is not a number"),
    (["--run.steps", "1.5"], "run.steps = '1.5' is not an integer"),
    (["--run.tensorboard", "yes"], "is not true or false"),
    (["--train.precision", "fp8"], "train.precision = 'fp8' is not one of 'fp32', 'bf16'"),
    (["--parallel.zero", "4"], "parallel.zero = 4 is not one of 0, 1, 2, 3"),
    (["--parallel.reduce_bucket_mb", "0"], "parallel.reduce_bucket_mb = 0.0 must be positive"),
    (["--parallel.reduce_bucket_auto", "true"], "parallel.reduce_bucket_auto sizes ZeRO-1/2's gradient buckets"),
    (["--train.global_batch_size", "20"], "train.global_batch_size = 20 must be a multiple of train.micro_batch_size = 8; try 16"),
    (["--model.n_kv_heads", "4"], "model.n_kv_heads = 4 must divide model.n_heads = 6"),
    (["--data.seq_len", "512", "--model.max_seq_len", "256"], "data.seq_len = 512 exceeds model.max_seq_len = 256"),
    (["--model.size", "13b"], "model.size = '13b' is not a preset of llama; choose one of tiny, small"),
    (["--run.steps"], "--run.steps needs a value"),
    (["train.lr", "1"], "unexpected argument 'train.lr'"),
])
def test_bad_values_fail_with_one_line_naming_the_key(args, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, args)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_wrong_type_in_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[run]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match="run.steps = 'ten' is not an integer"):
        load_config(path)
    path.write_text('[parallel]\nnrpoc = 2\n')
    with pytest.raises(ConfigError, match="did you mean 'parallel.nproc'"):
        load_config(path)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["--train.lr", "0.001", "--run.name", 'say "hi"', "--parallel.zero", "3"])
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg


def test_every_field_is_documented():
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        for name in cls.__dataclass_fields__:
            assert docs.get(name), f"{section}.{name} has no docstring"
    assert "--train.lr" in help_text()


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_presets_load(path):
    assert isinstance(load_config(path), Config)
