from __future__ import annotations

import math

import pytest
import torch

from polytrain.config import load_config
from polytrain.optim.builder import build_optimizer
from polytrain.optim.schedule import lr_at, set_lr


def test_warmup_then_cosine_to_min_lr():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.55)  # half way down the cosine
    assert lr_at(110, **kw) == pytest.approx(0.1)
    assert lr_at(500, **kw) == pytest.approx(0.1)
    values = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_set_lr_writes_every_group_and_weight_decay_skips_vectors():
    cfg = load_config(None, ["--train.lr", "0.5", "--train.warmup_steps", "1"])
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    opt = build_optimizer(model, cfg.train)
    assert set_lr(opt, 0, cfg) == pytest.approx(0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.5]
    decay, no_decay = opt.param_groups
    assert [p.ndim for p in decay["params"]] == [2] and decay["weight_decay"] == cfg.train.weight_decay
    assert all(p.ndim == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert not math.isnan(lr_at(0, lr=1, min_lr=0, warmup_steps=0, total_steps=0))
