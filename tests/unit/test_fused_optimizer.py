"""AdamW runs torch's fused kernel on the CPU and steps like the per-tensor loop it replaces."""

from __future__ import annotations

import torch

from polytrain.config import load_config
from polytrain.optim.builder import build_optimizer, param_groups
from tests.models.test_zoo import make, run, tokens


def test_adamw_is_fused_and_equals_the_per_tensor_loop():
    cfg = load_config(None, ["--train.lr", "1e-2", "--train.weight_decay", "0.1"]).train
    fused_model, loop_model = make("llama", seed=1), make("llama", seed=1)
    fused = build_optimizer(fused_model, cfg)
    loop = torch.optim.AdamW(param_groups(loop_model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, foreach=False)
    assert fused.defaults["fused"] and not loop.defaults["fused"]
    # One step from the same weights and gradients (later steps amplify rounding through Adam's
    # normalisation of tiny second moments, whichever kernel runs them).
    for model, opt in ((fused_model, fused), (loop_model, loop)):
        run(model, tokens(2, 9)).logsumexp(-1).mean().backward()
        opt.step()
    for (name, a), b in zip(fused_model.named_parameters(), loop_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
        torch.testing.assert_close(fused.state[a]["exp_avg_sq"], loop.state[b]["exp_avg_sq"], msg=name)
    moved = [(a - b).abs().max() for a, b in zip(fused_model.parameters(), make("llama", seed=1).parameters())]
    assert min(moved) > 0  # every parameter took the steps
