"""LAMB and LARS against the papers' formulas, written out plainly here; their config keys."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from polytrain.config import load_config
from polytrain.errors import ConfigError
from polytrain.optim.builder import make_optimizer, param_groups
from polytrain.optim.lamb import Lamb
from polytrain.optim.lars import Lars

STEPS = 5


def _model() -> nn.Module:
    # Matrices (adapted, decayed) and vectors (biases, norm gains: neither), in float64
    # so the comparison below is exact up to rounding (1e-12), not fp32 noise.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.Linear(8, 3)).double()


def _grads(model: nn.Module) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(p.shape, generator=gen, dtype=p.dtype) * (i + 1) for i, p in enumerate(model.parameters())]
            for _ in range(STEPS)]


def _ratio(w_norm: float, denominator: float, clip: float) -> float:
    ratio = w_norm / denominator if w_norm > 0 and denominator > 0 else 1.0
    return min(ratio, clip) if clip > 0 else ratio


def lamb_reference(weights, grads, adapt, lr, betas, eps, wd, clip) -> list[torch.Tensor]:
    """You et al. 2019, Algorithm 2, one tensor at a time."""
    b1, b2 = betas
    w = [x.clone() for x in weights]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    for t, step_grads in enumerate(grads, start=1):
        for i, g in enumerate(step_grads):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            r = (m[i] / (1 - b1**t)) / (torch.sqrt(v[i] / (1 - b2**t)) + eps)
            if adapt[i]:
                u = r + wd * w[i]
                w[i] = w[i] - lr * _ratio(w[i].norm().item(), u.norm().item(), clip) * u
            else:
                w[i] = w[i] - lr * r
    return w


def lars_reference(weights, grads, adapt, lr, momentum, wd, clip) -> list[torch.Tensor]:
    """You et al. 2017, Algorithm 1 (trust coefficient folded into lr), one tensor at a time."""
    w = [x.clone() for x in weights]
    v = [torch.zeros_like(x) for x in w]
    for step_grads in grads:
        for i, g in enumerate(step_grads):
            if adapt[i]:
                w_norm = w[i].norm().item()
                local_lr = _ratio(w_norm, g.norm().item() + wd * w_norm, clip)
                v[i] = momentum * v[i] + lr * local_lr * (g + wd * w[i])
            else:
                v[i] = momentum * v[i] + lr * g
            w[i] = w[i] - v[i]
    return w


def _run(model: nn.Module, optimizer: torch.optim.Optimizer, grads) -> list[torch.Tensor]:
    for step_grads in grads:
        for p, g in zip(model.parameters(), step_grads):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def _adapt(model: nn.Module) -> list[bool]:
    return [p.ndim >= 2 for p in model.parameters()]


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_lamb_follows_the_paper(clip):
    model = _model()
    start, grads = [p.detach().clone() for p in model.parameters()], _grads(model)
    hyper = {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-6}
    ref = lamb_reference(start, grads, _adapt(model), **hyper, wd=0.1, clip=clip)
    got = _run(model, Lamb(param_groups(model, 0.1), **hyper, trust_clip=clip), grads)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    if clip:  # the bound really engaged: without it the result differs
        unbounded = lamb_reference(start, grads, _adapt(model), **hyper, wd=0.1, clip=0.0)
        assert max((a - b).abs().max() for a, b in zip(unbounded, got)) > 1e-4


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_lars_follows_the_paper(clip):
    model = _model()
    start, grads = [p.detach().clone() for p in model.parameters()], _grads(model)
    ref = lars_reference(start, grads, _adapt(model), lr=0.02, momentum=0.9, wd=0.01, clip=clip)
    got = _run(model, Lars(param_groups(model, 0.01), lr=0.02, momentum=0.9, trust_clip=clip), grads)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    if clip:
        unbounded = lars_reference(start, grads, _adapt(model), lr=0.02, momentum=0.9, wd=0.01, clip=0.0)
        assert max((a - b).abs().max() for a, b in zip(unbounded, got)) > 1e-4


def test_ratios_are_per_tensor_and_exclusion_is_the_group_flag():
    # Two tensors with the same gradient but weights 100x apart: per-tensor ratios move
    # them by the same relative amount, so the larger one moves 100x further.
    big, small = nn.Parameter(torch.full((4, 4), 2.0)), nn.Parameter(torch.full((4, 4), 0.02))
    gain = nn.Parameter(torch.full((4,), 2.0))
    opt = Lamb([{"params": [big, small]}, {"params": [gain], "adapt": False}], lr=0.1)
    for p in (big, small, gain):
        p.grad = torch.ones_like(p)
    opt.step()
    # Adam's first step r is 1 everywhere (||r|| = 4), so each moves lr * ||w|| / 4 = lr * w.
    assert torch.allclose(2.0 - big.detach(), torch.full((4, 4), 0.1 * 2.0), rtol=1e-5)
    assert torch.allclose(0.02 - small.detach(), torch.full((4, 4), 0.1 * 0.02), rtol=1e-4)
    # Not adapted: Adam's first step, sign(g) * lr, whatever the weight's norm.
    assert torch.allclose(2.0 - gain.detach(), torch.full((4,), 0.1), rtol=1e-5)


def test_a_zero_tensor_steps_with_ratio_one():
    w = nn.Parameter(torch.zeros(3, 3))
    w.grad = torch.full((3, 3), 0.5)
    Lars([w], lr=0.1, momentum=0.0).step()
    assert torch.allclose(w.detach(), torch.full((3, 3), -0.05))


def test_param_groups_exclude_vectors_from_adaptation_and_decay():
    groups = param_groups(_model(), 0.1)
    assert [(len(g["params"]), g["weight_decay"], g["adapt"]) for g in groups] == [(2, 0.1, True), (4, 0.0, False)]
    assert all(p.ndim >= 2 for p in groups[0]["params"]) and all(p.ndim == 1 for p in groups[1]["params"])


@pytest.mark.parametrize("name, cls", [("lamb", Lamb), ("lars", Lars)])
def test_config_selects_the_optimizer(name, cls):
    cfg = load_config(None, ["--train.optimizer", name, "--train.trust_clip", "10"]).train
    opt = make_optimizer(param_groups(_model(), cfg.weight_decay), cfg)
    assert type(opt) is cls
    assert [g["trust_clip"] for g in opt.param_groups] == [10.0, 10.0]
    assert [g["weight_decay"] for g in opt.param_groups] == [cfg.weight_decay, 0.0]


@pytest.mark.parametrize("args, message", [
    (["--train.optimizer", "lion"], "train.optimizer = 'lion' is not one of 'adamw', 'lamb', 'lars', 'sgd'"),
    (["--train.optimizer", "lamb", "--train.trust_clip", "-1"], "train.trust_clip = -1.0 must be >= 0"),
    (["--train.trust_clip", "10"], "train.trust_clip bounds LAMB/LARS trust ratios; train.optimizer = 'adamw'"),
    (["--train.optimizer", "lars", "--train.momentum", "1"], "train.momentum = 1.0 must be in [0, 1) for lars"),
    (["--train.optimizer", "lamb", "--train.beta2", "1.5"], "train.beta2 = 1.5 must be in [0, 1) for lamb"),
    (["--train.optimizer", "lamb", "--train.eps", "0"], "train.eps = 0.0 must be positive for lamb"),
    (["--train.weight_decay", "-0.1"], "train.weight_decay = -0.1 must be >= 0"),
])
def test_bad_optimizer_values_fail_at_start_up(args, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, args)
    assert message in str(err.value)
